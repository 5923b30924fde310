"""The throughput decision rule on synthetic rounds (no DeepSpeed, no timing)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dsmatrix.bench import INCONCLUSIVE, NO_REGRESSION, NOT_MEASURED, REGRESSION, RELEASE_PATH, STEP, compare, decide, throughput_verdict


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


def test_machine_drift_between_rounds_cancels_within_each_round() -> None:
    """Rounds 30% apart (the machine got slower) but patched == stock within every round: the
    per-round ratio sees no difference, a ratio of pooled medians would see noise."""
    drift = [1.0, 1.3, 0.9, 1.2, 1.0, 1.25]
    stock = [0.100 * d for d in drift]
    patched = [s * (1 + e) for s, e in zip(stock, np.random.default_rng(3).normal(0, 0.004, len(stock)), strict=True)]
    c = compare("test_train_step[fp32-ckpt-off]", stock, patched)
    assert c.verdict == NO_REGRESSION and c.width < 0.01, c


def test_cell_verdict_is_the_worst_step_benchmark() -> None:
    same = compare("test_train_step[a]", rounds(0.100, 0.003, 8, 1), rounds(0.100, 0.003, 8, 2))
    slower = compare("test_train_step[b]", rounds(0.100, 0.003, 8, 1), rounds(0.110, 0.003, 8, 2))
    assert (same.kind, slower.kind) == (STEP, STEP)
    assert throughput_verdict([same, slower]) == REGRESSION
    assert throughput_verdict([same]) == NO_REGRESSION and throughput_verdict([]) == NOT_MEASURED


def test_release_path_is_reported_but_does_not_judge_the_cell() -> None:
    step = compare("test_train_step[fp32-ckpt-off]", rounds(0.100, 0.003, 8, 1), rounds(0.100, 0.003, 8, 2))
    micro = compare("test_release_path[fp32-ckpt-off]", rounds(80e-6, 0.003, 8, 1), rounds(84e-6, 0.003, 8, 2))
    assert micro.kind == RELEASE_PATH and micro.verdict == REGRESSION
    assert math.isclose(micro.patched_s - micro.stock_s, 4e-6, rel_tol=0.3)
    assert throughput_verdict([step, micro]) == NO_REGRESSION


def test_the_certifiable_margin_is_the_widest_a_a_step_upper_bound() -> None:
    from dsmatrix.bench import certifiable_margin

    tight = compare("test_train_step[a]", rounds(0.100, 0.003, 8, 1), rounds(0.100, 0.003, 8, 2))
    loose = compare("test_train_step[b]", rounds(0.100, 0.03, 8, 1), rounds(0.100, 0.03, 8, 2))
    micro = compare("test_release_path[a]", rounds(0.100, 0.2, 8, 1), rounds(0.100, 0.2, 8, 2))
    assert certifiable_margin([tight, loose, micro]) == round(loose.high - 1, 4) > tight.high - 1
    assert certifiable_margin([micro]) is None
