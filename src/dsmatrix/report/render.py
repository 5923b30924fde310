"""Rendering: the report's content through its templates (Markdown for the job summary and the PR, one
HTML page). Markdown escapes every value (``report.markdown``); HTML autoescapes."""

from __future__ import annotations

from functools import cache
from typing import Any

import jinja2

from dsmatrix.report import markdown

OUTCOME = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "skipped": "skip", "absent": "–"}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} µs"


@cache
def _environment(for_markdown: bool) -> jinja2.Environment:
    options: dict[str, Any] = {"undefined": jinja2.StrictUndefined, "trim_blocks": True, "lstrip_blocks": True}
    options["keep_trailing_newline"] = True
    if for_markdown:
        options["finalize"] = markdown.escape_text
    env = jinja2.Environment(loader=jinja2.PackageLoader("dsmatrix.report", "templates"), autoescape=not for_markdown, **options)
    env.filters.update(outcome=lambda o: OUTCOME.get(o, o), duration=_duration, basename=lambda p: str(p).rsplit("/", 1)[-1])
    if for_markdown:
        env.filters.update(code=markdown.code, code_in_table=markdown.code_in_table, link=markdown.link, toml_string=markdown.toml_string)
    return env


def render_markdown(report: dict[str, Any], template: str = "qualification") -> str:
    """``qualification.md`` (everything but the per-test grid and the environment listings), or its
    ``summary`` (headline, counts, the cells table, the failures) or its ``evidence`` section."""
    return _environment(True).get_template(f"{template}.md.j2").render(report=report)


def render_html(report: dict[str, Any], images: dict[str, str] | None = None) -> str:
    """The self-contained page; ``images`` maps plot names to data URIs."""
    return _environment(False).get_template("qualification.html.j2").render(report=report, images=images or {})
