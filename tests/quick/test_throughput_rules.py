"""The throughput decision rules on synthetic rounds and counts (no DeepSpeed, no timing)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from dsmatrix.judge.step_time import compare, decide, throughput_verdict
from dsmatrix.judge.throughput import INCONCLUSIVE, NO_REGRESSION, NOT_MEASURED, REGRESSION, RELEASE_PATH, STEP


def rounds(center: float, spread: float, n: int, seed: int) -> list[float]:
    return list(center * (1 + np.random.default_rng(seed).normal(0, spread, n)))


def test_same_speed_is_no_regression() -> None:
    c = compare("step", rounds(0.100, 0.003, 8, 1), rounds(0.100, 0.003, 8, 2))
    assert c.verdict == NO_REGRESSION and c.low < 1 < c.high and c.high <= 1.02


def test_five_percent_slower_is_a_regression() -> None:
    c = compare("step", rounds(0.100, 0.003, 8, 1), rounds(0.105, 0.003, 8, 2))
    assert c.verdict == REGRESSION and c.low > 1.02 and math.isclose(c.ratio, 1.05, abs_tol=0.01)


def test_noise_is_inconclusive() -> None:
    c = compare("step", rounds(0.100, 0.05, 6, 1), rounds(0.102, 0.05, 6, 2))
    assert c.verdict == INCONCLUSIVE and c.low <= 1.02 < c.high, c


@pytest.mark.parametrize(
    ("low", "high", "verdict"),
    [(0.97, 1.02, NO_REGRESSION), (1.021, 1.05, REGRESSION), (0.99, 1.03, INCONCLUSIVE), (1.0, 1.021, INCONCLUSIVE)],
)
def test_rule_boundaries(low: float, high: float, verdict: str) -> None:
    assert decide(low, high, 0.02) == verdict


def test_machine_drift_between_rounds_cancels_within_each_round() -> None:
    """Rounds 30% apart (the machine got slower) but patched == stock within every round: the
    per-round ratio sees no difference, a ratio of pooled medians would see noise."""
    drift = [1.0, 1.3, 0.9, 1.2, 1.0, 1.25]
    stock = [0.100 * d for d in drift]
    patched = [s * (1 + e) for s, e in zip(stock, np.random.default_rng(3).normal(0, 0.004, len(stock)), strict=True)]
    c = compare("test_train_step[fp32-ckpt-off]", stock, patched)
    assert c.verdict == NO_REGRESSION and c.width < 0.04, c


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
    from dsmatrix.judge.step_time import certifiable_margin

    tight = compare("test_train_step[a]", rounds(0.100, 0.003, 8, 1), rounds(0.100, 0.003, 8, 2))
    loose = compare("test_train_step[b]", rounds(0.100, 0.03, 8, 1), rounds(0.100, 0.03, 8, 2))
    micro = compare("test_release_path[a]", rounds(0.100, 0.2, 8, 1), rounds(0.100, 0.2, 8, 2))
    assert certifiable_margin([tight, loose, micro]) == round(loose.high - 1, 4) > tight.high - 1
    assert certifiable_margin([micro]) is None


def test_the_sequential_interval_keeps_its_coverage_under_repeated_looks() -> None:
    """Look after every third round up to 48 and stop at the first decision, as run_rounds does:
    over 200 simulated A/A runs with a true ratio of exactly the margin's edge (1.02), the rule
    may call no-regression (a wrong decision) in at most 5% of them; a fixed-size 95% t interval
    looked at this often would be wrong far more often."""
    from dsmatrix.judge.step_time import ratio_interval

    rng = np.random.default_rng(7)
    wrong = 0
    for _ in range(200):
        stock = list(np.full(48, 0.1))
        patched = list(0.1 * 1.02 * np.exp(rng.normal(0, 0.02, 48)))
        for n in range(3, 49, 3):
            _, low, high = ratio_interval(stock[:n], patched[:n])
            if decide(low, high, 0.02) != INCONCLUSIVE:
                wrong += decide(low, high, 0.02) == NO_REGRESSION
                break
    assert wrong / 200 <= 0.05, wrong


SAVVI_FIGURES = Path(__file__).parents[1] / "fixtures" / "step_time" / "savvi-figures.json"


def test_the_confidence_sequence_gives_savvis_figures_on_recorded_rounds() -> None:
    """The numpy t confidence sequence against savvi 0.3.1's LinearRegression (p=1), recorded on the
    log ratios of real benchmark runs (two nightly cells, three acceptance runs), after every round."""
    import json

    from dsmatrix.judge.confidence_sequence import mean_confidence_sequence

    recorded = json.loads(SAVVI_FIGURES.read_text())
    assert len(recorded["series"]) >= 20
    for series in recorded["series"]:
        logs = series["log_ratios"]
        for n, expected in enumerate(series["savvi"], start=1):
            low, high = mean_confidence_sequence(logs[:n], recorded["recorded_with"]["alpha"])
            want = [-math.inf if expected[0] is None else expected[0], math.inf if expected[1] is None else expected[1]]
            assert [low, high] == pytest.approx(want, rel=1e-9, abs=1e-12), f"{series['origin']}, after {n} round(s)"


def test_the_cell_verdict_uses_instructions_and_any_decided_regression() -> None:
    from dsmatrix.judge.throughput import cell_throughput

    counted = {"verdict": NO_REGRESSION, "calibration": "pass"}
    assert cell_throughput(INCONCLUSIVE, NO_REGRESSION, counted) == (NO_REGRESSION, "instructions")
    assert cell_throughput(REGRESSION, NO_REGRESSION, counted) == (REGRESSION, "step time"), "a decided time regression fails"
    assert cell_throughput(REGRESSION, REGRESSION, counted) == (NO_REGRESSION, "instructions"), "a biased bench does not decide"
    assert cell_throughput(REGRESSION, INCONCLUSIVE, counted) == (REGRESSION, "step time"), "waiting: instructions cannot see it"
    assert cell_throughput(NO_REGRESSION, NO_REGRESSION, {"verdict": REGRESSION, "calibration": "pass"}) == (REGRESSION, "instructions")
    assert cell_throughput(NO_REGRESSION, NO_REGRESSION, {"verdict": NO_REGRESSION, "calibration": "fail"}) == (
        INCONCLUSIVE,
        "instructions",
    )
    unavailable = {"verdict": NOT_MEASURED, "reason": "valgrind is not installed here"}
    assert cell_throughput(NO_REGRESSION, NO_REGRESSION, unavailable) == (NO_REGRESSION, "step time")
    assert cell_throughput(INCONCLUSIVE, NO_REGRESSION, None) == (INCONCLUSIVE, "step time")
    assert cell_throughput(NO_REGRESSION, INCONCLUSIVE, None) == (INCONCLUSIVE, "step time"), "time needs its A/A"


def counts(center: int, spread: float, seed: int) -> list[int]:
    return [int(center * (1 + e)) for e in np.random.default_rng(seed).normal(0, spread, 5)]


def test_instruction_rule_widens_the_ratio_by_the_a_a_deviation() -> None:
    from dsmatrix.execute import instructions

    same = instructions.compare("test_train_step[x]", {"stock": counts(65_000_000, 2e-4, 1), "patched": counts(65_030_000, 2e-4, 2),
                                                      "stock-again": counts(65_000_000, 2e-4, 3)})  # fmt: skip
    assert same["verdict"] == NO_REGRESSION and same["uncertainty"] < 0.001
    slower = instructions.compare("test_train_step[x]", {"stock": [100] * 5, "patched": [101] * 5, "stock-again": [100] * 5})
    assert slower["verdict"] == REGRESSION and slower["ratio"] == 1.01, "one percent more instructions is past the 0.5% margin"
    edge = instructions.compare("test_train_step[x]", {"stock": [1000] * 5, "patched": [1004] * 5, "stock-again": [1002] * 5})
    assert edge["verdict"] == INCONCLUSIVE, "1.004 widened by 0.2% straddles 1.005"
    release = instructions.compare("test_release_path[x]", {"stock": [100] * 5, "patched": [130] * 5, "stock-again": [100] * 5})
    assert instructions.verdict_of([same, release]) == (NO_REGRESSION, "pass"), "the release path is reported, not judged"
    assert instructions.verdict_of([same, slower]) == (REGRESSION, "pass")
    noisy = instructions.compare("test_train_step[y]", {"stock": [1000] * 5, "patched": [1000] * 5, "stock-again": [1003] * 5})
    assert instructions.verdict_of([same, noisy]) == (INCONCLUSIVE, "fail"), "A/A beyond 0.25%: counts not repeatable enough"


def test_callgrind_dumps_are_read_by_their_labels(tmp_path: Path) -> None:
    from dsmatrix.execute.instructions import read_intervals
    from dsmatrix.infra.errors import RunError

    def dump(name: str, trigger: str, total: int) -> None:
        header = "version: 1\ncreator: callgrind-3.19.0\npart: 1\ndesc: I1 cache: \ndesc: Timerange: Basic block 0 - 9\n"
        (tmp_path / name).write_text(f"{header}desc: Trigger: {trigger}\nevents: Ir\nsummary: {total}\ntotals: {total}\n")

    for index, (label, total) in enumerate([("test_train_step[a]", 100), ("test_train_step[a]", 102), ("test_release_path[a]", 7)], 1):
        dump(f"stock.{index}", f"Client Request: {label}", total)
    dump("stock", "Program termination", 42)  # the program's end: not counted
    dump("stock-again.1", "Client Request: test_train_step[a]", 1)  # another build's file
    assert read_intervals(tmp_path / "stock") == {"test_train_step[a]": [100, 102], "test_release_path[a]": [7]}
    (tmp_path / "stock.4").write_text("garbage\n")
    with pytest.raises(RunError, match="not a labelled callgrind dump"):
        read_intervals(tmp_path / "stock")
