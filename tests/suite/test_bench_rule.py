"""The throughput decision rule on synthetic rounds (no DeepSpeed, no timing)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dsmatrix.bench import INCONCLUSIVE, NO_REGRESSION, NOT_MEASURED, REGRESSION, compare, decide, throughput_verdict


def rounds(center: float, spread: float, n: int, seed: int) -> list[float]:
    return list(center * (1 + np.random.default_rng(seed).normal(0, spread, n)))


def test_same_speed_is_no_regression() -> None:
    c = compare("step", rounds(0.100, 0.003, 8, 1), rounds(0.100, 0.003, 8, 2))
    assert c.verdict == NO_REGRESSION and c.low < 1 < c.high and c.high <= 1.02


def test_five_percent_slower_is_a_regression() -> None:
    c = compare("step", rounds(0.100, 0.003, 8, 1), rounds(0.105, 0.003, 8, 2))
    assert c.verdict == REGRESSION and c.low > 1.02 and math.isclose(c.ratio, 1.05, abs_tol=0.01)


def test_noise_is_inconclusive_and_says_how_many_rounds_would_decide() -> None:
    c = compare("step", rounds(0.100, 0.05, 6, 1), rounds(0.102, 0.05, 6, 2))
    assert c.verdict == INCONCLUSIVE and c.low <= 1.02 < c.high, c
    assert c.rounds_to_decide is not None and c.rounds_to_decide > 6


@pytest.mark.parametrize(
    ("low", "high", "verdict"),
    [(0.97, 1.02, NO_REGRESSION), (1.021, 1.05, REGRESSION), (0.99, 1.03, INCONCLUSIVE), (1.0, 1.021, INCONCLUSIVE)],
)
def test_rule_boundaries(low: float, high: float, verdict: str) -> None:
    assert decide((low + high) / 2, low, high, 0.02, 6)[0] == verdict


def test_cell_verdict_is_the_worst_benchmark() -> None:
    same = compare("a", rounds(0.100, 0.003, 8, 1), rounds(0.100, 0.003, 8, 2))
    slower = compare("b", rounds(0.100, 0.003, 8, 1), rounds(0.110, 0.003, 8, 2))
    assert throughput_verdict([same, slower]) == REGRESSION
    assert throughput_verdict([same]) == NO_REGRESSION and throughput_verdict([]) == NOT_MEASURED
