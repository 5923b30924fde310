"""Rendering: the report's content through its two templates (Markdown for the job summary, one HTML page)."""

from __future__ import annotations

from typing import Any

import jinja2

OUTCOME = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "skipped": "skip", "absent": "–"}


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} µs"


def _templates() -> tuple[jinja2.Template, jinja2.Template]:
    loader = jinja2.PackageLoader("dsmatrix.report", "templates")
    options: dict[str, Any] = {"undefined": jinja2.StrictUndefined, "trim_blocks": True, "lstrip_blocks": True}
    options["keep_trailing_newline"] = True
    templates = []
    for name, autoescape in (("qualification.md.j2", False), ("qualification.html.j2", True)):
        env = jinja2.Environment(loader=loader, autoescape=autoescape, **options)
        env.filters.update(outcome=lambda o: OUTCOME.get(o, o), duration=_duration, basename=lambda p: str(p).rsplit("/", 1)[-1])
        templates.append(env.get_template(name))
    return templates[0], templates[1]


def render_markdown(report: dict[str, Any]) -> str:
    return _templates()[0].render(report=report)


def render_html(report: dict[str, Any], images: dict[str, str] | None = None) -> str:
    """The self-contained page; ``images`` maps plot names to data URIs."""
    return _templates()[1].render(report=report, images=images or {})
