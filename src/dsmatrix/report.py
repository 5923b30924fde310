"""Render a results run as a Markdown release-qualification report (reads only the store)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from dsmatrix.plots import leak_plot, ratio_plot
from dsmatrix.results import load_run
from dsmatrix.verdict import FIXED

SYMBOL = {"passed": "pass", "failed": "FAIL", "error": "ERROR", "skipped": "skip"}


def _test_rows(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per test id: its bug label and stock/patched outcome in every cell."""
    ids: dict[str, str] = {}
    for cell in cells:
        for build in cell.get("builds", {}).values():
            for test_id, outcome in build.get("tests", {}).items():
                ids.setdefault(test_id, outcome.get("bug", ""))
    rows = []
    for test_id, bug in sorted(ids.items(), key=lambda item: (item[1] == "", item[0])):
        outcomes = []
        for cell in cells:
            builds = cell.get("builds", {})
            pair = [SYMBOL.get(builds.get(b, {}).get("tests", {}).get(test_id, {}).get("outcome", ""), "–") for b in ("stock", "patched")]
            outcomes.append(" / ".join(pair))
        rows.append({"id": test_id, "bug": bug or "control", "outcomes": outcomes})
    return rows


def render_markdown(summary: dict[str, Any], cells: list[dict[str, Any]], plots: dict[str, str] | None = None) -> str:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("dsmatrix", "templates"),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    qualified = bool(cells) and summary.get("status") == "complete" and all(c["verdict"] == FIXED for c in cells)
    template = env.get_template("report.md.j2")
    return template.render(summary=summary, cells=cells, qualified=qualified, tests=_test_rows(cells), plots=plots or {})


def write_report(run_path: Path, output: Path) -> Path:
    """Write ``<output>/<run-id>/qualification.md`` for the run at ``run_path``."""
    summary, cells = load_run(run_path)
    target = output / summary["run_id"] / "qualification.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    plots = {}
    for name, paths in (("RSS over lifecycles", leak_plot(cells, target.parent)), ("step-time ratios", ratio_plot(cells, target.parent))):
        if paths:
            plots[name] = paths[0].name
    target.write_text(render_markdown(summary, cells, plots))
    return target
