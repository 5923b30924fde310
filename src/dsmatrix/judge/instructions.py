"""The executed-instructions decision rule on the counts ``execute.instructions`` took.

Per benchmark, each process's mean count over its counted steps (or calls); the ratio
patched/stock; the A/A deviation ``u = |again/stock - 1|`` of the same run is the measurement's
uncertainty. ``no-regression`` when ``ratio * (1 + u) <= 1 + margin`` (default 0.5%),
``regression`` when ``ratio * (1 - u) > 1 + margin``, otherwise ``inconclusive``. The
calibration passes when ``u <= 0.25%`` for every step benchmark: counts differ from process to
process by up to about 0.1% here (object addresses decide hash-table probes in CPython and
DeepSpeed's sets of parameters), more counted steps do not shrink that, and 0.25% keeps a
decision possible at the 0.5% margin. A cell is judged on its step benchmarks; the release path
is reported beside them (it magnifies the code the fix changes, which a different, correct fix
may well write more slowly per call at no cost per step).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from dsmatrix.judge.throughput import INCONCLUSIVE, NO_REGRESSION, NOT_MEASURED, REGRESSION, STEP, kind_of

PASS, FAIL = "pass", "fail"

DEFAULT_MARGIN = 0.005

CALIBRATION_TOLERANCE = 0.0025

RULE = (
    "per benchmark, the mean instructions per step (or release-path call) of the stock, patched and stock-again "
    "processes under callgrind; u = |stock again / stock - 1|: no-regression if patched/stock x (1 + u) <= {limit:g}, "
    "regression if patched/stock x (1 - u) > {limit:g}, else inconclusive; calibration passes if u <= {tolerance:g} "
    "on every step benchmark; judged on the training step"
)

BUILDS = (("stock", "stock"), ("patched", "patched"), ("stock-again", "stock"))


def decide(ratio: float, uncertainty: float, margin: float) -> str:
    """The rule for one benchmark: its ratio, widened both ways by the A/A deviation."""
    limit = 1 + margin
    if ratio * (1 + uncertainty) <= limit:
        return NO_REGRESSION
    if ratio * (1 - uncertainty) > limit:
        return REGRESSION
    return INCONCLUSIVE


def compare(name: str, counts: Mapping[str, Sequence[int]], margin: float = DEFAULT_MARGIN) -> dict[str, Any]:
    """One benchmark: per-build means, ratio, A/A deviation and verdict."""
    stock, patched, again = (statistics.fmean(counts[label]) for label, _ in BUILDS)
    ratio, aa = patched / stock, again / stock
    uncertainty = abs(aa - 1)
    return {
        "benchmark": name,
        "kind": kind_of(name),
        "stock": stock,
        "patched": patched,
        "stock_again": again,
        "ratio": ratio,
        "aa": aa,
        "uncertainty": uncertainty,
        "spread": {label: (max(counts[label]) - min(counts[label])) / statistics.fmean(counts[label]) for label, _ in BUILDS},
        "verdict": decide(ratio, uncertainty, margin),
    }


def verdict_of(comparisons: Sequence[Mapping[str, Any]], tolerance: float = CALIBRATION_TOLERANCE) -> tuple[str, str]:
    """(verdict, calibration) of a cell: the worst step verdict; ``inconclusive`` when the A/A
    deviation of a step benchmark exceeds the tolerance (the counts are not as repeatable as the rule needs)."""
    steps = [c for c in comparisons if c["kind"] == STEP]
    if not steps:
        return NOT_MEASURED, FAIL
    calibration = PASS if all(c["uncertainty"] <= tolerance for c in steps) else FAIL
    verdicts = {c["verdict"] for c in steps}
    if REGRESSION in verdicts:
        return REGRESSION, calibration
    if calibration == FAIL or INCONCLUSIVE in verdicts:
        return INCONCLUSIVE, calibration
    return NO_REGRESSION, calibration
