"""The qualification report: stores merged, rendered as Markdown, HTML and JSON, with plots."""
