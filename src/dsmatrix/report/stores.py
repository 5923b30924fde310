"""The results stores a report reads: each run loaded, merged by cell fingerprint, and what the merged runs
leave unfinished of what was planned (computed once, for the headline and the coverage table)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsmatrix.infra.errors import ConfigError, ResultsError
from dsmatrix.infra.results import load_run
from dsmatrix.judge.verdict import INTERRUPTED


@dataclass(frozen=True)
class Source:
    """One results run that feeds the report (a run folder, or a store's ``latest``)."""

    root: Path
    summary: dict[str, Any]
    cells: list[dict[str, Any]]


@dataclass(frozen=True)
class TierPlan:
    """What a tier plans on the matrix (``dsmatrix report --tier``), as run summaries record it: a report
    over runs in parts is judged by whether every planned cell finished in one of them."""

    tier: str
    cells: list[dict[str, Any]]
    excluded: list[dict[str, Any]]


def load_source(path: Path) -> Source:
    """A run folder, or a results store: its ``latest`` run, or its newest run where ``latest``
    did not survive the trip (a CI artifact keeps no symlinks)."""
    if not path.exists():
        raise ResultsError(f"{path}: no such results store or run")
    root = path
    if not (path / "summary.json").is_file():
        runs = sorted(p.parent for p in path.glob("*/summary.json") if p.parent.name != "latest")
        root = path / "latest" if (path / "latest" / "summary.json").is_file() else (runs[-1] if runs else path)
    summary, cells = load_run(root)
    return Source(root.resolve(), summary, cells)


def merge(sources: Sequence[Source], plan: TierPlan | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Cells keyed by fingerprint (the newest result of a fingerprint wins), each tagged with the
    run it came from; then one result per cell (its versions, platform, host and runtime axes): the
    newest that finished, so a later run's result supersedes an ``interrupted`` one whatever the suite
    version. Excluded cells are united by cell id. Stores that tested different patches cannot make
    one report. With a tier ``plan``, its exclusions are listed too.
    """
    patches = {s.summary["patch"]["sha256"]: s for s in sources}
    if len(patches) > 1:
        named = ", ".join(f"{s.root} ({sha[:12]})" for sha, s in patches.items())
        raise ConfigError(f"the stores tested different patches, one report cannot judge them together: {named}")
    by_print: dict[str, dict[str, Any]] = {}
    for source in sources:
        for cell in source.cells:
            tagged = {**cell, "source": {"run_id": source.summary["run_id"], "root": str(source.root)}}
            tagged.setdefault("runtime", source.summary.get("runtime"))  # an interrupted cell's record has only its run's
            key = cell.get("fingerprint") or f"{source.root}:{cell['cell']['id']}"
            if key not in by_print or _newness(tagged) > _newness(by_print[key]):
                by_print[key] = tagged
    by_cell: dict[str, dict[str, Any]] = {}
    for cell in by_print.values():
        key = _cell_key(cell)
        if key not in by_cell or _precedence(cell) > _precedence(by_cell[key]):
            by_cell[key] = cell
    cells = sorted(by_cell.values(), key=lambda c: (c["cell"].get("platform", "linux/amd64"), c["cell"]["id"]))
    ran = {c["cell"]["id"] for c in cells}
    excluded: dict[str, dict[str, Any]] = {}
    entries = [e for s in sources for e in s.summary.get("excluded", [])] + (plan.excluded if plan else [])
    for entry in entries:
        if entry["cell"]["id"] not in ran:
            excluded.setdefault(entry["cell"]["id"], entry)
    return cells, sorted(excluded.values(), key=lambda e: e["cell"]["id"])


def _cell_key(cell: dict[str, Any]) -> str:
    """What one row of the report is: the cell's values (label aside), where it ran, its runtime axes."""
    values = {k: v for k, v in cell["cell"].items() if k != "label"}
    where = (cell.get("image") or {}).get("tag", "runner")
    return json.dumps([values, where, cell.get("runtime")], sort_keys=True)


def _newness(cell: dict[str, Any]) -> tuple[str, str]:
    """When the result was made, then the run that recorded it: a later run that reused a result
    (and benchmarked it anew) records it again with the same ``finished_at``, and wins."""
    return cell.get("finished_at", ""), cell["source"]["run_id"]


def _precedence(cell: dict[str, Any]) -> tuple[bool, tuple[str, str]]:
    """Finished before ``interrupted``, then newest."""
    return cell["verdict"] != INTERRUPTED, _newness(cell)


def _finished(cells: list[dict[str, Any]]) -> set[str]:
    return {c["cell"]["id"] for c in cells if c["verdict"] != INTERRUPTED}


@dataclass(frozen=True)
class Coverage:
    """What the merged runs leave unfinished of what was planned: the reasons (none when covered)
    and, with a tier plan, its table (planned, finished, missing, excluded)."""

    reasons: list[str]
    tier: dict[str, Any] | None


def coverage(sources: Sequence[Source], cells: list[dict[str, Any]], plan: TierPlan | None = None) -> Coverage:
    """With a tier ``plan``: each cell it plans finished in some merged run. Otherwise each run: one
    that records its plan is covered when each planned cell finished in some merged run; one that
    does not (older stores) must be complete."""
    finished = _finished(cells)
    if plan:
        missing = [p["label"] for p in plan.cells if p["id"] not in finished]
        planned = len(plan.cells)
        table = {
            "tier": plan.tier,
            "planned": planned,
            "finished": planned - len(missing),
            "missing": missing,
            "excluded": len(plan.excluded),
        }
        reasons = (
            [f"tier {plan.tier}: {len(missing)} of {planned} planned cell(s) never finished ({', '.join(missing)})"] if missing else []
        )
        return Coverage(reasons, table)
    reasons: list[str] = []
    for source in sources:
        summary = source.summary
        if "planned" not in summary:
            if summary.get("status") != "complete":
                reasons.append(f"run {summary['run_id']} is {summary.get('status')}, not complete")
            continue
        missing = [p["label"] for p in summary["planned"] if p["id"] not in finished]
        if missing:
            status = summary.get("status")
            reasons.append(f"run {summary['run_id']} is {status}: {len(missing)} planned cell(s) never finished ({', '.join(missing)})")
    return Coverage(reasons, None)


def report_id(sources: Sequence[Source]) -> str:
    """The run id for one run; for a merge, a digest of the merged run ids."""
    ids = sorted(s.summary["run_id"] for s in sources)
    return ids[0] if len(ids) == 1 else "merged-" + hashlib.sha256(" ".join(ids).encode()).hexdigest()[:12]
