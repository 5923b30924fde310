"""A cell's throughput verdict, from its two metrics (``judge.instructions``, ``judge.step_time``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

UNMEASURED = "not measured"  # a cell that ran no benchmark
NO_REGRESSION, REGRESSION, INCONCLUSIVE, NOT_MEASURED = "no-regression", "regression", "inconclusive", "not-measured"

HEADLINE_RULE = (
    "a cell's throughput is decided on the training step by executed instructions where valgrind counts them "
    "(near-deterministic: margin {instructions:.1%}, A/A within {tolerance:.2%}), else by step time (margin {time:.1%}, "
    "A/A calibration no-regression); a regression decided by either metric fails the cell (by step time unless its A/A "
    "calibration is itself a regression): instructions do not see time spent waiting"
)

STEP, RELEASE_PATH = "step", "release-path"


def kind_of(benchmark: str) -> str:
    """``step`` for the training-step benchmark (judged), ``release-path`` for the micro-benchmark."""
    return RELEASE_PATH if benchmark.startswith("test_release_path") else STEP


def cell_throughput(time_verdict: str, calibration_verdict: str, instructions: Mapping[str, Any] | None) -> tuple[str, str]:
    """(verdict, decided by) of a cell's throughput, by ``HEADLINE_RULE``.

    Instructions decide where they were counted with a passing calibration; step time decides
    otherwise (its A/A calibration ``no-regression``). A regression decided by either metric is a
    regression: by instructions with their calibration passing, by step time unless its A/A
    calibration itself came out a regression. Instruction counts cannot see time spent waiting.
    """
    counted = instructions is not None and instructions.get("verdict") in (NO_REGRESSION, REGRESSION, INCONCLUSIVE)
    instructions_ok = counted and instructions.get("calibration") == "pass"
    time_ok = calibration_verdict == NO_REGRESSION
    # a decided step-time regression stands unless the A/A itself came out a regression (a biased bench)
    time_regression = time_verdict == REGRESSION and calibration_verdict != REGRESSION
    if instructions_ok and instructions["verdict"] == REGRESSION:
        return REGRESSION, "instructions"
    if time_regression:
        return REGRESSION, "step time"
    if counted:
        return (instructions["verdict"] if instructions_ok else INCONCLUSIVE), "instructions"
    if time_verdict == NOT_MEASURED:
        return NOT_MEASURED, ""
    return (time_verdict if time_ok else INCONCLUSIVE), "step time"


def margin_certified_by(highs: Iterable[float]) -> float | None:
    """The margin A/A upper bounds ``highs`` certify (None without a finite bound)."""
    finite = [h for h in highs if math.isfinite(h)]
    return round(max(0.0, max(finite) - 1), 4) if finite else None


def cell_throughputs(cells: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Each cell result's throughput verdict by label (``not measured`` without benchmarks): what the
    headline and a run's exit status both judge."""
    return {c["cell"]["label"]: (c.get("benchmarks") or {}).get("verdict") or UNMEASURED for c in cells}
