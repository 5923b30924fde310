from __future__ import annotations

from dsmatrix.judge.outcomes import TestOutcome
from dsmatrix.judge.verdict import cell_verdict, exit_code

BUGS = {"t::lifecycle": "lifecycle", "t::retrace": "retrace", "t::recompute": "recompute"}


def outcomes(**overrides: str) -> dict[str, TestOutcome]:
    """A stock-like run: every bug test failing, the control passing, unless overridden."""
    result = {test: TestOutcome("failed", bug=bug, message="bug seen", observed='{"figure": 1}') for test, bug in BUGS.items()}
    result["t::control"] = TestOutcome("passed")
    for name, outcome in overrides.items():
        test = f"t::{name}"
        result[test] = TestOutcome(outcome, bug=BUGS.get(test, ""), message=f"{name} {outcome}")
    return result


PATCHED_OK = {"lifecycle": "passed", "retrace": "passed", "recompute": "passed"}


def test_fixed_when_stock_fails_every_bug_test_and_patched_passes() -> None:
    verdict = cell_verdict(outcomes(), outcomes(**PATCHED_OK))
    assert verdict.verdict == "fixed"
    assert "lifecycle, recompute, retrace" in verdict.reasons[0]


def test_a_stock_failure_that_did_not_observe_the_bug_is_error_not_evidence() -> None:
    stock = outcomes()
    stock["t::retrace"] = TestOutcome("failed", bug="retrace", message="AssertionError: harness: no release observed")
    verdict = cell_verdict(stock, outcomes(**PATCHED_OK))
    assert verdict.verdict == "error"
    assert verdict.reasons == (
        "stock failed for a reason other than the bug (not evidence): t::retrace: AssertionError: harness: no release observed",
    )
    stock["t::retrace"] = TestOutcome("error", bug="retrace", message="RuntimeError in fixture")
    assert cell_verdict(stock, outcomes(**PATCHED_OK)).verdict == "error"


def test_patched_failure_says_whether_the_bug_was_seen() -> None:
    patched = outcomes(**PATCHED_OK)
    patched["t::lifecycle"] = TestOutcome("failed", bug="lifecycle", message="alive", observed='{"surviving_coordinators": [1, 1, 1]}')
    verdict = cell_verdict(outcomes(), patched)
    assert verdict.verdict == "not-fixed" and verdict.reasons[0].endswith("(the bug is still seen)")


def _reference(listing: str, outcome: str = "passed") -> TestOutcome:
    return TestOutcome(outcome, reference="stock", properties={"behaviour": listing})


def test_reference_tests_compare_patched_behaviour_with_stock() -> None:
    same = '[["fetch a fwd +a.w","release a fwd -a.w"]]'
    stock, patched = outcomes(), outcomes(**PATCHED_OK)
    stock["t::equivalence"] = _reference(same)
    patched["t::equivalence"] = _reference(same)
    fixed = cell_verdict(stock, patched)
    assert fixed.verdict == "fixed" and "1 reference test(s)" in fixed.reasons[0]
    patched["t::equivalence"] = _reference('[["fetch a fwd +a.w","release a fwd"]]')
    verdict = cell_verdict(stock, patched)
    assert verdict.verdict == "not-fixed"
    assert verdict.reasons == (
        "patched behaves differently from stock where stock is right: t::equivalence: "
        "first difference: patched 'step 1: release a fwd', stock 'step 1: release a fwd -a.w'",
    )
    stock["t::equivalence"] = _reference(same, outcome="failed")
    assert cell_verdict(stock, patched).verdict == "error"


def test_a_difference_from_stock_is_named_as_behaviour_before_any_broken_test() -> None:
    """Gathers per step, peak resident numel and the first differing event (which parameter, at
    which step); a harness check failing on patched only is reported as what it is."""
    stock, patched = outcomes(), outcomes(**PATCHED_OK)
    stock["t::equivalence"] = TestOutcome(
        "passed", reference="stock", properties={"behaviour": '[["fetch a fwd +a.w","release a fwd -a.w","peak 272"]]',
                                                 "gathers_per_step": "[1]", "peak_numel_per_step": "[272]"},
    )  # fmt: skip
    patched["t::equivalence"] = TestOutcome(
        "failed", reference="stock", message="AssertionError: harness: a step gathered or released nothing",
        properties={"behaviour": '[["fetch a fwd +a.b,a.w","release a fwd -a.b,a.w","peak 288"]]',
                    "gathers_per_step": "[2]", "peak_numel_per_step": "[288]"},
    )  # fmt: skip
    verdict = cell_verdict(stock, patched)
    assert verdict.verdict == "not-fixed"
    assert verdict.reasons[0] == (
        "patched behaves differently from stock where stock is right: t::equivalence: patched gathers per step 2, stock 1; "
        "peak resident numel per step 288, stock 272; "
        "first difference: patched 'step 1: fetch a fwd +a.b,a.w', stock 'step 1: fetch a fwd +a.w'"
    )
    assert verdict.reasons[1].endswith("(not the bug: a harness check of the test, which stock passes, fails on patched)")


def test_rank_evidence_needs_every_failing_rank_to_have_seen_the_bug() -> None:
    from dsmatrix.judge.outcomes import merge_ranks

    seen = TestOutcome("failed", bug="retrace", message="differs", observed="{}")
    harness = TestOutcome("failed", bug="retrace", message="harness")
    assert merge_ranks([{"t::a": seen}, {"t::a": seen}])["t::a"].observed
    assert not merge_ranks([{"t::a": seen}, {"t::a": harness}])["t::a"].observed


def test_not_fixed_names_the_failing_patched_test() -> None:
    verdict = cell_verdict(outcomes(), outcomes(**{**PATCHED_OK, "retrace": "failed"}))
    assert verdict.verdict == "not-fixed"
    assert verdict.reasons == ("patched failed: t::retrace: retrace failed (not the bug: the patched build broke the test)",)


def test_undetected_when_a_bug_test_passes_on_stock() -> None:
    verdict = cell_verdict(outcomes(lifecycle="passed"), outcomes(**PATCHED_OK))
    assert verdict.verdict == "undetected"
    assert "t::lifecycle" in verdict.reasons[0]


def test_skipped_tests_are_not_applicable() -> None:
    stock = outcomes(recompute="skipped")
    patched = outcomes(**{**PATCHED_OK, "recompute": "skipped"})
    assert cell_verdict(stock, patched).verdict == "fixed"


def test_errors_and_mismatches() -> None:
    assert cell_verdict(outcomes(recompute="skipped"), outcomes(**PATCHED_OK)).verdict == "error"
    assert cell_verdict(outcomes(), {}).verdict == "error"
    assert cell_verdict(outcomes(control="failed"), outcomes(**PATCHED_OK)).verdict == "error"
    assert cell_verdict(outcomes(retrace="error"), outcomes(**PATCHED_OK)).verdict == "error"
    both = cell_verdict(outcomes(control="error"), outcomes(**{**PATCHED_OK, "control": "error"}))
    assert both.verdict == "error" and both.reasons == ("1 test(s) errored on both builds, e.g. t::control: control error",)
    only_controls = {"t::control": TestOutcome("passed")}
    assert cell_verdict(only_controls, only_controls).verdict == "error"


def test_not_fixed_wins_over_undetected() -> None:
    verdict = cell_verdict(outcomes(lifecycle="passed"), outcomes(**{**PATCHED_OK, "control": "error"}))
    assert verdict.verdict == "not-fixed"


def test_exit_code_only_zero_when_all_fixed() -> None:
    assert exit_code(["fixed", "fixed"]) == 0
    assert exit_code(["fixed", "undetected"]) == 1
    assert exit_code([]) == 1


def test_ranks_merge_to_the_worst_outcome_and_name_the_rank() -> None:
    from dsmatrix.judge.outcomes import merge_ranks

    rank0 = {"t::a": TestOutcome("passed", bug="retrace"), "t::b": TestOutcome("skipped", message="n/a"), "t::c": TestOutcome("passed")}
    rank1 = {"t::a": TestOutcome("failed", bug="retrace", message="differs"), "t::b": TestOutcome("skipped", message="n/a")}
    merged = merge_ranks([rank0, rank1])
    assert merged["t::a"].outcome == "failed" and merged["t::a"].message == "rank 1: differs" and merged["t::a"].bug == "retrace"
    assert merged["t::b"].outcome == "skipped"
    assert merged["t::c"].outcome == "error" and "not run on rank(s) [1]" in merged["t::c"].message
    mixed = merge_ranks([{"t::d": TestOutcome("skipped")}, {"t::d": TestOutcome("passed")}])
    assert mixed["t::d"].outcome == "error"


def test_a_stock_error_is_never_evidence_in_the_verdict_nor_in_the_grid() -> None:
    """A pytest error (fixture, teardown) after the figures were recorded is not a clean observation:
    the cell is `error` and the report's grid shows `harness`, never `fixed` (one rule, in verdict.py)."""
    from dsmatrix.judge.verdict import test_state

    stock = outcomes()
    stock["t::retrace"] = TestOutcome("error", bug="retrace", message="teardown failed", observed='{"figure": 1}')
    patched = outcomes(**PATCHED_OK)
    assert cell_verdict(stock, patched).verdict == "error"
    assert test_state(stock["t::retrace"], patched["t::retrace"]) == "harness"
    assert test_state(stock["t::lifecycle"], patched["t::lifecycle"]) == "fixed"
    assert test_state(stock["t::control"], patched["t::control"]) == "ok"
    assert test_state(stock["t::lifecycle"], None) == "absent"
    assert test_state(stock["t::lifecycle"], TestOutcome("failed", bug="lifecycle")) == "broken"


def test_the_report_grid_reads_its_states_from_verdict(tmp_path) -> None:
    """The stored outcome dicts read back give the same state as the outcomes they were made from."""
    from dsmatrix.judge.outcomes import outcome_dict, outcome_from_dict
    from dsmatrix.judge.verdict import test_state

    stock, patched = outcomes(), outcomes(**PATCHED_OK)
    for test in stock:
        again = test_state(outcome_from_dict(outcome_dict(stock[test])), outcome_from_dict(outcome_dict(patched[test])))
        assert again == test_state(stock[test], patched[test])


def test_a_control_test_failing_on_both_builds_is_stocks_problem_not_the_patchs() -> None:
    """Both builds fail a control or reference test alike (DeepSpeed itself cannot run the setting
    here): stock is not right there, so the cell is an error naming stock, never a broken patch."""
    verdict = cell_verdict(outcomes(control="failed"), outcomes(**{**PATCHED_OK, "control": "failed"}))
    assert verdict.verdict == "error"
    assert verdict.reasons == ("stock failed a control test (the observers may be blind): t::control: control failed",)
    patched_only = cell_verdict(outcomes(), outcomes(**{**PATCHED_OK, "control": "failed"}))
    assert patched_only.verdict == "not-fixed", "stock passes it: the patch broke it"
