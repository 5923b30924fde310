"""The report's content, built once from the merged cells: what the JSON holds and both templates render."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsmatrix.judge.headline import RULE, VERDICT_CODES, headline
from dsmatrix.judge.outcomes import outcome_from_dict
from dsmatrix.judge.throughput import STEP, kind_of, margin_certified_by
from dsmatrix.judge.verdict import ERROR, is_behaviour, test_state
from dsmatrix.report.stores import Source, TierPlan, coverage, report_id

REPORT_SCHEMA = "dsmatrix-qualification/1"

BUILDS = ("stock", "patched")


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
    keys += ("lanes",)
    out = {k: bench[k] for k in keys if k in bench}
    if "calibration" in bench and "certifiable_margin" not in bench:  # results written before it was recorded
        out["certifiable_margin"] = margin_certified_by(c["high"] for c in bench["calibration"] if kind_of(c["benchmark"]) == STEP)
    out.setdefault("time_verdict", bench["verdict"] if "comparisons" in bench else None)
    # the merged per-build pytest-benchmark JSON (older runs kept one file per round: not copied)
    out["files"] = [f"bench/{Path(f).name}" for f in bench.get("files", []) if not re.search(r"-r\d+-", Path(f).name)]
    out["worst"] = _worst(out)
    return out


def _worst(bench: dict[str, Any]) -> dict[str, Any]:
    """The cell's line in the summary table: of its training-step benchmarks, the step-time comparison
    with the highest upper bound and the highest instruction ratio."""
    times = [c for c in bench.get("comparisons", []) if kind_of(c["benchmark"]) == STEP]
    counts = [c for c in (bench.get("instructions") or {}).get("comparisons", []) if kind_of(c["benchmark"]) == STEP]
    step = max(times, key=lambda c: c["high"], default=None)
    count = max(counts, key=lambda c: c["ratio"], default=None)
    return {
        "step_time": {k: step[k] for k in ("benchmark", "ratio", "low", "high", "verdict")} if step else None,
        "instructions": {k: count[k] for k in ("benchmark", "ratio", "verdict")} if count else None,
        "of": max(len(times), len(counts)),
    }


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


DEEPSPEED_TESTS_KEYS = ("stock", "patched", "regressions", "failing_on_both", "fixed", "set", "paths", "missing_paths", "skipped")


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
        "change": f"PR diff {pr.replace('..', ' .. ')}" if pr else Path(cell.get("patch", {}).get("source", "")).name,
        "coverage": coverage,
        "complete": coverage.get("changed_lines", 0) == coverage.get("executed_lines", -1),
        "bugs": bugs,
        "deepspeed_tests": {k: own[k] for k in DEEPSPEED_TESTS_KEYS if k in own},
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
        "source": {"run_id": cell["source"]["run_id"]},  # which run, never the folder it was read from
        "fingerprint": cell.get("fingerprint", ""),
        "timings": cell.get("timings", {}),
        "throughput": _throughput(cell),
        "environment": _environment(cell),
        "reused_from": cell.get("reused_from"),
        "failures": _by_build(cell, lambda t: t.get("outcome") in ("failed", "error"), lambda t: t.get("message", "")),
        "observations": _by_build(cell, lambda t: bool(t.get("properties") or t.get("bug_observed")), _observations),
        "junit": [f"junit/{cell['source']['run_id']}/{Path(p).name}" for b in BUILDS for p in builds.get(b, {}).get("junit", [])],
    }


def build_report(
    sources: Sequence[Source], cells: list[dict[str, Any]], excluded: list[dict[str, Any]], plan: TierPlan | None = None
) -> dict[str, Any]:
    """The report's content, once, from ``merge(sources, plan)``: what the JSON holds and both templates render."""
    covered = coverage(sources, cells, plan)
    verdict, reasons, summary = headline(covered.reasons, cells)
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
        "verdict_code": VERDICT_CODES[verdict],
        "verdict_reasons": reasons,
        "verdict_summary": summary,
        "rule": RULE,
        "throughput_rule": next((c["benchmarks"]["headline_rule"] for c in cells if (c.get("benchmarks") or {}).get("headline_rule")), ""),
        "patch": first["patch"],
        "runtime": first.get("runtime", {}),
        "sources": [
            {
                "run_id": s.summary["run_id"],
                "status": s.summary.get("status", ""),
                "tier": s.summary.get("tier", ""),
                "driver": s.summary.get("host", {}),
            }
            for s in sources
        ],
        "coverage": covered.tier,
        "counts": counts,
        "cells": entries,
        "tests": _test_grid(cells),
        "excluded": [{"id": e["cell"]["id"], "label": e["cell"]["label"], "rule": e["rule"], "reason": e["reason"]} for e in excluded],
        "errors": [{"id": c["id"], "label": c["label"], "message": "; ".join(c["reasons"])} for c in entries if c["verdict"] == ERROR],
        "plots": {},
        "figures_left_out": None,  # why no plot was drawn (write_report says)
    }
