"""The headline of a qualification report, by one stated rule, from the merged cells."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dsmatrix.judge.throughput import NO_REGRESSION, REGRESSION, cell_throughputs
from dsmatrix.judge.verdict import FIXED

QUALIFIED, NOT_QUALIFIED, CORRECT_ONLY = "QUALIFIED", "NOT QUALIFIED", "CORRECT, THROUGHPUT NOT SHOWN"

HEADLINES = (QUALIFIED, CORRECT_ONLY, NOT_QUALIFIED)  # best first: --require X passes for X and better
# what a program reads beside the display text
VERDICT_CODES = {QUALIFIED: "qualified", CORRECT_ONLY: "correct-throughput-not-shown", NOT_QUALIFIED: "not-qualified"}

RULE = (
    "QUALIFIED when the merged runs cover what was planned (with --tier: every cell the tier plans finished in one of the merged "
    "runs; otherwise every run completed or, for a run that records its plan, each planned cell finished in one of them), "
    "every non-excluded cell is fixed and every cell's throughput is no-regression (by the throughput rule below); "
    "NOT QUALIFIED when a run is incomplete, a cell is not fixed or a throughput regression "
    "is decided; otherwise CORRECT, THROUGHPUT NOT SHOWN, naming the cells whose throughput was not measured or not decided"
)


def headline(unfinished: Sequence[str], cells: list[dict[str, Any]]) -> tuple[str, list[str], str]:
    """(headline, reasons, summary) by ``RULE``: what failed, else what was not shown, else qualified.
    ``unfinished``: why the merged runs do not cover what was planned (``report.stores.coverage``)."""
    reasons = list(unfinished)
    if not cells:
        reasons.append("no cell ran")
    reasons += [f"{c['cell']['label']}: {c['verdict']}" for c in cells if c["verdict"] != FIXED]
    throughput = cell_throughputs(cells)
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
