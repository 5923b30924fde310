"""The release-qualification report: one or more results stores merged by cell fingerprint,
judged once, and written as ``qualification.md`` (a GitHub job summary), ``qualification.html``
(one self-contained page), ``qualification.json`` (schema: ``report/qualification.schema.json``),
the plots and every cell's JUnit files, under ``reports/<id>/``. Reads only the stores.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from dsmatrix.execute.engine_tests import outcome_from_dict
from dsmatrix.execute.step_time import NO_REGRESSION, REGRESSION, STEP, kind_of, margin_certified_by
from dsmatrix.infra.errors import ConfigError, ResultsError
from dsmatrix.infra.results import load_run, write_json
from dsmatrix.judge.verdict import ERROR, FIXED, INTERRUPTED, is_behaviour, test_state
from dsmatrix.report.plots import leak_plot, ratio_plot

REPORT_SCHEMA = "dsmatrix-qualification/1"
SCHEMA_FILE = Path(__file__).parent / "qualification.schema.json"
QUALIFIED, NOT_QUALIFIED, CORRECT_ONLY = "QUALIFIED", "NOT QUALIFIED", "CORRECT, THROUGHPUT NOT SHOWN"
HEADLINES = (QUALIFIED, CORRECT_ONLY, NOT_QUALIFIED)  # best first: --require X passes for X and better
RULE = (
    "QUALIFIED when the merged runs cover what was planned (with --tier: every cell the tier plans finished in one of the merged "
    "runs; otherwise every run completed or, for a run that records its plan, each planned cell finished in one of them), "
    "every non-excluded cell is `fixed` and every cell's throughput is `no-regression` (by the throughput rule below); "
    "NOT QUALIFIED when a run is incomplete, a cell is not `fixed` or a throughput regression "
    "is decided; otherwise CORRECT, THROUGHPUT NOT SHOWN, naming the cells whose throughput was not measured or not decided"
)
BUILDS = ("stock", "patched")


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


def _unfinished(sources: Sequence[Source], cells: list[dict[str, Any]], plan: TierPlan | None = None) -> list[str]:
    """Why the runs do not cover what was planned. With a tier ``plan``: each cell it plans finished in
    some merged run. Otherwise each run: one that records its plan is covered when each planned cell
    finished in some merged run; one that does not (older stores) must be complete."""
    finished = _finished(cells)
    if plan:
        missing = [p["label"] for p in plan.cells if p["id"] not in finished]
        if not missing:
            return []
        return [f"tier {plan.tier}: {len(missing)} of {len(plan.cells)} planned cell(s) never finished ({', '.join(missing)})"]
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
    return reasons


def _test_grid(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per test id: its bug (or ``control``) and the stock/patched outcome in every cell."""
    bugs: dict[str, str] = {}
    for cell in cells:
        for build in cell.get("builds", {}).values():
            for test_id, outcome in build.get("tests", {}).items():
                bugs.setdefault(test_id, outcome.get("bug", ""))
    rows = []
    for test_id, bug in sorted(bugs.items(), key=lambda item: (item[1] == "", item[1], item[0])):
        outcomes = {}
        for cell in cells:
            builds = cell.get("builds", {})
            results = {b: builds.get(b, {}).get("tests", {}).get(test_id, {}) for b in BUILDS}
            pair = {b: results[b].get("outcome", "absent") for b in BUILDS}
            state = test_state(outcome_from_dict(results["stock"]), outcome_from_dict(results["patched"]))
            outcomes[cell["cell"]["id"]] = {**pair, "state": state}
        rows.append({"test": test_id, "bug": bug or "control", "outcomes": outcomes})
    return rows


def _environment(cell: dict[str, Any]) -> dict[str, Any]:
    host = cell.get("host", {})
    builds = cell.get("builds", {})
    return {
        "host": "image " + cell["image"]["tag"] if cell.get("image") else "runner",
        "architecture": host.get("machine", ""),
        "platform": host.get("platform", cell["cell"].get("platform", "linux/amd64")),
        "cpu_model": host.get("cpu_model", ""),
        "cpu_count": host.get("cpu_count"),
        "cpu_features": host.get("cpu_features", []),
        "bf16": bool(host.get("bf16")),
        "emulated": bool(host.get("emulated")),
        "emulator": host.get("emulator"),
        "kernel": host.get("kernel", ""),
        "os_image": host.get("os_image", ""),
        "builds": {
            b: {
                "installed": builds.get(b, {}).get("installed", {}),
                "wheel": builds.get(b, {}).get("wheel", ""),
                "freeze": builds.get(b, {}).get("freeze", []),
            }
            for b in BUILDS
            if b in builds
        },
    }


def _throughput(cell: dict[str, Any]) -> dict[str, Any] | None:
    bench = cell.get("benchmarks")
    if not bench:
        return None
    keys = ("verdict", "reason", "rule", "rounds", "margin", "comparisons", "calibration", "calibration_verdict", "certifiable_margin")
    keys += ("leak", "time_verdict", "decided_by", "stopped", "max_rounds", "minutes", "rounds_duration_s", "duration_s", "instructions")
    out = {k: bench[k] for k in keys if k in bench}
    if "calibration" in bench and "certifiable_margin" not in bench:  # results written before it was recorded
        out["certifiable_margin"] = margin_certified_by(c["high"] for c in bench["calibration"] if kind_of(c["benchmark"]) == STEP)
    out.setdefault("time_verdict", bench["verdict"] if "comparisons" in bench else None)
    return out


def _by_build(cell: dict[str, Any], keep: Any, value: Any) -> dict[str, list[dict[str, Any]]]:
    """Per build, the tests ``keep`` selects, with ``value`` of each (a message, the observations)."""
    builds = cell.get("builds", {})
    return {b: [{"test": t, "value": value(o)} for t, o in builds[b].get("tests", {}).items() if keep(o)] for b in BUILDS if b in builds}


def _observations(result: dict[str, Any]) -> dict[str, Any]:
    """A test's recorded figures; a recorded behaviour listing is summarised by its length."""
    shown: dict[str, Any] = {}
    if result.get("bug_observed") is not None:
        shown["bug_observed"] = result["bug_observed"]
    for key, value in result.get("properties", {}).items():
        if is_behaviour(key):
            steps = json.loads(value) if isinstance(value, str) else value
            shown[key] = f"{sum(len(s) for s in steps)} gather/release events over {len(steps)} steps"
        else:
            shown[key] = value
    return shown


OWN_TEST_KEYS = ("stock", "patched", "regressions", "failing_on_both", "fixed", "set", "paths", "missing_paths", "skipped")


def _evidence(cell: dict[str, Any]) -> dict[str, Any] | None:
    """What the skip-gpu-test label asks for, per cell: where the change came from, every changed
    hunk with the tests that executed it, each bug's stock failure and patched pass, and DeepSpeed's
    own tests on both builds."""
    coverage = cell.get("change_coverage")
    if not coverage:
        return None
    builds = cell.get("builds", {})
    stock, patched = builds.get("stock", {}).get("tests", {}), builds.get("patched", {}).get("tests", {})
    bugs = []
    for test_id in sorted(stock):
        before, after = stock[test_id], patched.get(test_id, {})
        if before.get("bug") and before.get("outcome") != "skipped":
            observed = before.get("bug_observed")
            bugs.append(
                {
                    "bug": before["bug"],
                    "test": test_id,
                    "stock": before.get("outcome"),
                    "stock_observed": json.dumps(observed) if observed is not None and not isinstance(observed, str) else observed or "",
                    "patched": after.get("outcome", "absent"),
                }
            )
    own = cell.get("deepspeed_tests") or {}
    git = cell["cell"].get("git") or {}
    pr = cell.get("patch", {}).get("pr", "")
    return {
        "git": git,
        "change": f"PR diff {pr.replace('..', ' .. ')}" if pr else f"{cell.get('patch', {}).get('source', '')}",
        "coverage": coverage,
        "complete": coverage.get("changed_lines", 0) == coverage.get("executed_lines", -1),
        "bugs": bugs,
        "own_tests": {k: own[k] for k in OWN_TEST_KEYS if k in own},
    }


def _cell_entry(cell: dict[str, Any]) -> dict[str, Any]:
    c, builds = cell["cell"], cell.get("builds", {})
    return {
        "evidence": _evidence(cell),
        "id": c["id"],
        "label": c["label"],
        "platform": c.get("platform", "linux/amd64"),
        "python": c["python"],
        "torch": c["torch"],
        "deepspeed": c["deepspeed"],
        "verdict": cell["verdict"],
        "reasons": cell.get("reasons", []),
        "error_kind": cell.get("error_kind"),
        "source": cell["source"],
        "fingerprint": cell.get("fingerprint", ""),
        "timings": cell.get("timings", {}),
        "throughput": _throughput(cell),
        "environment": _environment(cell),
        "reused_from": cell.get("reused_from"),
        "failures": _by_build(cell, lambda t: t.get("outcome") in ("failed", "error"), lambda t: t.get("message", "")),
        "observations": _by_build(cell, lambda t: bool(t.get("properties") or t.get("bug_observed")), _observations),
        "junit": [f"junit/{cell['source']['run_id']}/{Path(p).name}" for b in BUILDS for p in builds.get(b, {}).get("junit", [])],
    }


def headline(sources: Sequence[Source], cells: list[dict[str, Any]], plan: TierPlan | None = None) -> tuple[str, list[str], str]:
    """(headline, reasons, summary) by ``RULE``: what failed, else what was not shown, else qualified."""
    reasons = _unfinished(sources, cells, plan)
    if not cells:
        reasons.append("no cell ran")
    reasons += [f"{c['cell']['label']}: {c['verdict']}" for c in cells if c["verdict"] != FIXED]
    throughput = {c["cell"]["label"]: (c.get("benchmarks") or {}).get("verdict") or "not measured" for c in cells}
    regressions = [label for label, verdict in throughput.items() if verdict == REGRESSION]
    reasons += [f"{label}: throughput regression ({_decided_by(cells, label)})" for label in regressions]
    if reasons:
        return NOT_QUALIFIED, reasons, f"{len(reasons)} problem(s): " + "; ".join(reasons)
    missing = {label: verdict for label, verdict in throughput.items() if verdict != NO_REGRESSION}
    if missing:
        groups: dict[str, list[str]] = {}
        for label, verdict in missing.items():
            groups.setdefault("not measured" if verdict.startswith("not") else f"not decided ({verdict})", []).append(label)
        parts = [f"{what} in {len(labels)} cell(s)" for what, labels in groups.items()]
        return (
            CORRECT_ONLY,
            [f"{label}: throughput {verdict}" for label, verdict in missing.items()],
            "correct everywhere; throughput " + ", ".join(parts),
        )
    by = sorted({_decided_by(cells, label) for label in throughput})
    return QUALIFIED, [], f"correct everywhere; no throughput regression in any cell (decided by {' and '.join(by)})"


def _decided_by(cells: list[dict[str, Any]], label: str) -> str:
    bench = next(c.get("benchmarks") or {} for c in cells if c["cell"]["label"] == label)
    return bench.get("decided_by") or "step time"


def passes(verdict: str, required: str) -> bool:
    """Whether headline ``verdict`` is at least ``required`` (``qualified`` or ``correct``)."""
    wanted = {"qualified": QUALIFIED, "correct": CORRECT_ONLY}[required]
    return HEADLINES.index(verdict) <= HEADLINES.index(wanted)


def report_id(sources: Sequence[Source]) -> str:
    """The run id for one run; for a merge, a digest of the merged run ids."""
    ids = sorted(s.summary["run_id"] for s in sources)
    return ids[0] if len(ids) == 1 else "merged-" + hashlib.sha256(" ".join(ids).encode()).hexdigest()[:12]


def _tier_coverage(cells: list[dict[str, Any]], plan: TierPlan | None) -> dict[str, Any] | None:
    """How much of the tier's plan finished (``report --tier``), else None."""
    if not plan:
        return None
    finished = _finished(cells)
    missing = [p["label"] for p in plan.cells if p["id"] not in finished]
    planned, excluded = len(plan.cells), len(plan.excluded)
    return {"tier": plan.tier, "planned": planned, "finished": planned - len(missing), "missing": missing, "excluded": excluded}


def build_report(
    sources: Sequence[Source], cells: list[dict[str, Any]], excluded: list[dict[str, Any]], plan: TierPlan | None = None
) -> dict[str, Any]:
    """The report's content, once, from ``merge(sources, plan)``: what the JSON holds and both templates render."""
    verdict, reasons, summary = headline(sources, cells, plan)
    entries = [_cell_entry(c) for c in cells]
    counts: dict[str, int] = {}
    for cell in cells:
        counts[cell["verdict"]] = counts.get(cell["verdict"], 0) + 1
    first = sources[0].summary
    return {
        "schema": REPORT_SCHEMA,
        "id": report_id(sources),
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "verdict": verdict,
        "verdict_reasons": reasons,
        "verdict_summary": summary,
        "rule": RULE,
        "throughput_rule": next((c["benchmarks"]["headline_rule"] for c in cells if (c.get("benchmarks") or {}).get("headline_rule")), ""),
        "patch": first["patch"],
        "runtime": first.get("runtime", {}),
        "sources": [
            {
                "run_id": s.summary["run_id"],
                "root": str(s.root),
                "status": s.summary.get("status", ""),
                "tier": s.summary.get("tier", ""),
                "driver": s.summary.get("host", {}),
            }
            for s in sources
        ],
        "coverage": _tier_coverage(cells, plan),
        "counts": counts,
        "cells": entries,
        "tests": _test_grid(cells),
        "excluded": [{"id": e["cell"]["id"], "label": e["cell"]["label"], "rule": e["rule"], "reason": e["reason"]} for e in excluded],
        "errors": [{"id": c["id"], "label": c["label"], "message": "; ".join(c["reasons"])} for c in entries if c["verdict"] == ERROR],
        "plots": {},
    }


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


def write_report(stores: Sequence[Path], output: Path, plan: TierPlan | None = None) -> Path:
    """Write ``<output>/<id>/qualification.{md,html,json}``, the plots and the JUnit files; with a tier
    ``plan``, coverage is judged by it."""
    sources = [load_source(p) for p in stores]
    cells, excluded = merge(sources, plan)
    report = build_report(sources, cells, excluded, plan)
    target = output / report["id"]
    target.mkdir(parents=True, exist_ok=True)
    images = {}
    for name, paths in (("leak", leak_plot(cells, target)), ("step-time-ratios", ratio_plot(cells, target))):
        if paths:
            report["plots"][name] = {"png": paths[0].name, "svg": paths[1].name}
            images[name] = "data:image/png;base64," + base64.b64encode(paths[0].read_bytes()).decode()
    _copy_junit(sources, report, target)
    write_json(target / "qualification.json", report)
    (target / "qualification.md").write_text(render_markdown(report))
    (target / "qualification.html").write_text(render_html(report, images))
    return target


def load_report(path: Path) -> dict[str, Any]:
    return json.loads((path / "qualification.json").read_text())
