"""The release-qualification report: one or more results stores merged by cell fingerprint,
judged once, and written as ``qualification.md`` (a GitHub job summary, summary first),
``summary.md`` (its headline, counts, cells table and failures, what ``dsmatrix report`` prints),
``evidence.md`` (the skip-gpu-test evidence, for pasting into the PR, when a cell measured it),
``qualification.html`` (one self-contained page, with the per-test grid and the environments),
``qualification.json`` (schema: ``report/qualification.schema.json``), the plots, every cell's
JUnit files and pytest-benchmark JSON, under ``reports/<id>/``. Reads only the stores.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsmatrix.infra.results import write_json
from dsmatrix.report.content import build_report
from dsmatrix.report.plots import leak_plot, left_out, ratio_plot
from dsmatrix.report.render import render_html, render_markdown
from dsmatrix.report.stores import Source, TierPlan, load_source, merge

SCHEMA_FILE = Path(__file__).parent / "qualification.schema.json"


def _copy_junit(sources: Sequence[Source], report: dict[str, Any], target: Path) -> None:
    """Each cell's JUnit files (a reused cell's live in the run that produced them)."""
    roots = {s.summary["run_id"]: s.root for s in sources}
    for cell in report["cells"]:
        root = roots[cell["source"]["run_id"]]
        runs = [root] + ([root.parent / cell["reused_from"]] if cell["reused_from"] else [])
        for name in cell["junit"]:
            found = [run / "raw" / Path(name).name for run in runs if (run / "raw" / Path(name).name).is_file()]
            if found:
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(found[0], target / name)


def _copy_benchmark_json(sources: Sequence[Source], report: dict[str, Any], target: Path) -> None:
    """Each benchmarked cell's pytest-benchmark JSON (one file per build, every round in it)."""
    roots = {s.summary["run_id"]: s.root for s in sources}
    for cell in report["cells"]:
        root = roots[cell["source"]["run_id"]]
        for name in (cell.get("throughput") or {}).get("files", []):
            found = root / "bench" / Path(name).name
            if found.is_file():
                (target / "bench").mkdir(parents=True, exist_ok=True)
                shutil.copy2(found, target / "bench" / found.name)


def write_report(stores: Sequence[Path], output: Path, plan: TierPlan | None = None) -> Path:
    """Write ``<output>/<id>/qualification.{md,html,json}``, the plots and the JUnit files; with a tier
    ``plan``, coverage is judged by it."""
    sources = [load_source(p) for p in stores]
    cells, excluded = merge(sources, plan)
    report = build_report(sources, cells, excluded, plan)
    target = output / report["id"]
    target.mkdir(parents=True, exist_ok=True)
    images = {}
    report["figures_left_out"] = left_out()
    drawn = [] if report["figures_left_out"] else [("leak", leak_plot(cells, target)), ("step-time-ratios", ratio_plot(cells, target))]
    for name, paths in drawn:
        if paths:
            report["plots"][name] = {"png": paths[0].name, "svg": paths[1].name}
            images[name] = "data:image/png;base64," + base64.b64encode(paths[0].read_bytes()).decode()
    _copy_junit(sources, report, target)
    _copy_benchmark_json(sources, report, target)
    write_json(target / "qualification.json", report)
    (target / "qualification.md").write_text(render_markdown(report))
    (target / "summary.md").write_text(render_markdown(report, "summary"))
    if any(c["evidence"] for c in report["cells"]):
        (target / "evidence.md").write_text(render_markdown(report, "evidence"))
    (target / "qualification.html").write_text(render_html(report, images))
    return target


def load_report(path: Path) -> dict[str, Any]:
    return json.loads((path / "qualification.json").read_text())
