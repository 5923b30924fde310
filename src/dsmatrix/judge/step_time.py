"""The step-time decision rule (sequential, anytime-valid) on the rounds ``execute.step_time`` measured.

Per round, the log of the ratio patched / stock of the two processes' medians. After every
third round (each build has then taken each turn position equally often) the rule looks at an
anytime-valid 95% confidence sequence for the mean log ratio: the t confidence sequence of
Lindon et al. (2024) (``judge.confidence_sequence``), intersected over the rounds so far. Its coverage holds
however many times it is looked at, so stopping as soon as it decides keeps the stated error
rate (5% per comparison). ``no-regression`` when the upper bound of the ratio is <= 1 + margin
(default 3.5%), ``regression`` when the lower bound is > 1 + margin, otherwise ``inconclusive``.
The A/A calibration (stock vs stock again, same rounds) must come out ``no-regression``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from dsmatrix.judge.confidence_sequence import mean_confidence_sequence
from dsmatrix.judge.throughput import INCONCLUSIVE, NO_REGRESSION, NOT_MEASURED, REGRESSION, STEP, kind_of, margin_certified_by

DEFAULT_MARGIN = 0.035

CONFIDENCE = 0.95

RULE = (
    "per round, log(patched/stock) of the two processes' median step times (their steps interleaved one by one); "
    "after every third round, an anytime-valid {confidence:.0%} confidence sequence for the ratio (Lindon et al. t "
    "confidence sequence): no-regression if its upper bound <= {limit:g}, regression if its lower bound > {limit:g}, "
    "else inconclusive; rounds go on until every step comparison and its A/A calibration is decided, or the cap"
)


@dataclass(frozen=True)
class Comparison:
    """One benchmark's patched/stock (or A/A) ratio, its interval and the rule's verdict."""

    benchmark: str
    kind: str
    rounds: int
    ratio: float
    low: float
    high: float
    margin: float
    verdict: str
    stock_s: float  # median over rounds of the per-process medians
    patched_s: float

    @property
    def width(self) -> float:
        return self.high - self.low

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "width": self.width}


def ratio_interval(stock: Sequence[float], patched: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean over rounds of the per-round ratio patched/stock, with its anytime-valid interval.

    ``stock[i]`` and ``patched[i]`` are the median step times of round ``i``'s two processes,
    whose steps ran interleaved; so each round's ratio is free of whatever the machine did
    between rounds. The interval is the t confidence sequence for the mean log ratio, intersected
    over all rounds so far (infinite until there are three).
    """
    logs = [math.log(b / a) for a, b in zip(stock, patched, strict=True)]
    low, high = mean_confidence_sequence(logs, 1 - CONFIDENCE)
    return math.exp(statistics.fmean(logs)), math.exp(low), math.exp(high)  # exp(-inf) = 0, exp(inf) = inf


def decide(low: float, high: float, margin: float) -> str:
    """The decision rule on one interval."""
    limit = 1 + margin
    if high <= limit:
        return NO_REGRESSION
    if low > limit:
        return REGRESSION
    return INCONCLUSIVE


def compare(name: str, stock: Sequence[float], patched: Sequence[float], margin: float = DEFAULT_MARGIN) -> Comparison:
    ratio, low, high = ratio_interval(stock, patched)
    verdict = decide(low, high, margin)
    medians = statistics.median(stock), statistics.median(patched)
    return Comparison(name, kind_of(name), len(stock), ratio, low, high, margin, verdict, *medians)


def throughput_verdict(comparisons: Sequence[Comparison]) -> str:
    """One metric's verdict for a cell: the worst over its step benchmarks."""
    verdicts = {c.verdict for c in comparisons if c.kind == STEP}
    for verdict in (REGRESSION, INCONCLUSIVE):
        if verdict in verdicts:
            return verdict
    return NO_REGRESSION if verdicts else NOT_MEASURED


def certifiable_margin(calibration: Sequence[Comparison]) -> float | None:
    """The smallest margin at which every A/A step comparison of this run is ``no-regression``:
    what this machine can certify with this many rounds (the A/A upper bounds, as a margin)."""
    return margin_certified_by(c.high for c in calibration if c.kind == STEP)


def decided(comparisons: Sequence[Comparison]) -> bool:
    return all(c.verdict != INCONCLUSIVE for c in comparisons if c.kind == STEP)
