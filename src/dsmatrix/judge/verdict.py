"""Cell verdicts from the same engine tests run on the stock and the patched build (pure).

- ``fixed``: the patched build passes every applicable test, behaves as stock in every
  reference test, AND the stock build shows every applicable bug (each bug is really seen,
  and really gone).
- ``not-fixed``: a test fails (or errors) on the patched build (a bug test, or a control or
  reference test that stock passes), or the patched build gathers or releases differently from
  stock where stock is right (``reference`` tests).
- ``undetected``: a bug test passes on stock: the test cannot see the bug in this cell.
- ``error``: install, build or run failure, a stock failure that is not the bug (a harness
  assertion, an exception), or results that cannot be compared.
- ``interrupted``: the run was stopped before the cell finished (never reused).

Evidence discipline: a stock bug test counts as "the bug was seen" only when it failed (a test
failure, not a pytest error) through ``bug_observed`` (it recorded the measured figures); any
other stock failure is not evidence. ``test_state`` applies the same rule to one test, for the
report's grid. Throughput states are ``judge.throughput``'s; the headline is ``judge.headline``'s.
A test is applicable when it was not skipped. Skips must agree between the builds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from dsmatrix.judge.outcomes import TestOutcome
from dsmatrix.judge.throughput import REGRESSION

FIXED, NOT_FIXED, UNDETECTED, ERROR, INTERRUPTED = "fixed", "not-fixed", "undetected", "error", "interrupted"
VERDICTS = (FIXED, NOT_FIXED, UNDETECTED, ERROR, INTERRUPTED)
TEST_STATES = ("fixed", "ok", "broken", "differs", "harness", "unseen", "skipped", "absent")
BEHAVIOUR = "behaviour"  # the property a reference test records its gathers and releases in
HARNESS = "harness:"  # how an engine test's own checks (of the scenario, not of the bug) begin their message


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reasons: tuple[str, ...]


def is_behaviour(key: str) -> bool:
    """Whether a test property (``behaviour``, or ``rank<N>.behaviour`` merged over ranks) is a
    recorded behaviour listing."""
    return key.split(".")[-1] == BEHAVIOUR


def behaviour_difference(stock: TestOutcome, patched: TestOutcome) -> str:
    """Empty when both builds recorded the same behaviour; else what differs, as behaviour: the
    parameters gathered per step, the peak resident numel, and the first differing event (which
    submodule, which parameter, at which step)."""
    keys = sorted(k for k in set(stock.properties) | set(patched.properties) if is_behaviour(k))
    if not keys:
        return "no behaviour recorded"
    for key in keys:
        ours, theirs = _listing(patched.properties.get(key)), _listing(stock.properties.get(key))
        if ours == theirs:
            continue
        prefix = key[: -len(BEHAVIOUR)]  # ``rank<N>.`` where ranks were merged
        where = f"{prefix[:-1]}: " if prefix else ""
        figures = [
            f"{label} {_figure(patched, prefix + name)}, stock {_figure(stock, prefix + name)}"
            for name, label in (("gathers_per_step", "patched gathers per step"), ("peak_numel_per_step", "peak resident numel per step"))
            if _figure(patched, prefix + name) != _figure(stock, prefix + name)
        ]
        for a, b in zip(ours, theirs, strict=False):
            if a != b:
                first = f"first difference: patched {a!r}, stock {b!r}"
                break
        else:
            first = f"patched {len(ours)} events, stock {len(theirs)}"
        return where + "; ".join([*figures, first])
    return ""


def _figure(outcome: TestOutcome, key: str) -> str:
    value = outcome.properties.get(key)
    try:
        value = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        pass
    return " ".join(str(v) for v in value) if isinstance(value, list) else str(value)


def _listing(value: object) -> list[str]:
    """A recorded behaviour as one line per event, ``step N: ...`` (the recorded steps from 1,
    each ending with its peak resident numel)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return [value]
    if not isinstance(value, list):
        return [repr(value)]
    return [f"step {n + 1}: {line}" for n, step in enumerate(value) for line in (step if isinstance(step, list) else [step])]


def is_evidence(stock: TestOutcome) -> bool:
    """A stock bug test that saw the bug: it failed through ``bug_observed``."""
    return bool(stock.bug) and stock.outcome == "failed" and bool(stock.observed)


def test_state(stock: TestOutcome | None, patched: TestOutcome | None) -> str:
    """What one test's stock/patched pair says (one of ``TEST_STATES``): ``fixed`` (bug seen on
    stock, gone on patched), ``ok`` (a control or reference test passing on both, behaviour as
    stock), ``broken`` (patched fails, or a control fails on stock), ``differs`` (patched gathers
    or releases differently from stock), ``harness`` (stock failed without observing the bug: not
    evidence), ``unseen`` (a bug test passing on stock), ``skipped``, ``absent``."""
    if stock is None or patched is None:
        return "absent"
    if patched.outcome in ("failed", "error"):
        return "broken"
    if "skipped" in (stock.outcome, patched.outcome):
        return "skipped"
    if not stock.bug:
        if stock.outcome != "passed":
            return "broken"
        if stock.reference and behaviour_difference(stock, patched) not in ("", "no behaviour recorded"):
            return "differs"
        return "ok"
    if stock.outcome == "passed":
        return "unseen"
    return "fixed" if is_evidence(stock) else "harness"


test_state.__test__ = False  # type: ignore[attr-defined]  # not a pytest test


def cell_verdict(stock: Mapping[str, TestOutcome], patched: Mapping[str, TestOutcome]) -> Verdict:
    """Compare one cell's two test runs."""
    if set(stock) != set(patched):
        only = sorted(set(stock) ^ set(patched))
        return Verdict(ERROR, (f"the builds ran different tests: {', '.join(only[:5])}",))
    skew = [t for t in stock if (stock[t].outcome == "skipped") != (patched[t].outcome == "skipped")]
    if skew:
        return Verdict(ERROR, tuple(f"{t}: skipped on one build only" for t in sorted(skew)))
    both_errored = [t for t in sorted(stock) if stock[t].outcome == patched[t].outcome == "error"]
    if both_errored:
        first = both_errored[0]
        return Verdict(ERROR, (f"{len(both_errored)} test(s) errored on both builds, e.g. {first}: {stock[first].message}",))
    applicable = [t for t in sorted(stock) if stock[t].outcome != "skipped"]
    bug_tests = [t for t in applicable if stock[t].bug]
    if not bug_tests:
        return Verdict(ERROR, ("no applicable bug test ran",))
    references = [t for t in applicable if stock[t].reference == "stock"]
    # a control or reference test that stock fails too is not the patch's doing: stock is not right there (an error below)
    broken = [t for t in applicable if patched[t].outcome in ("failed", "error") and (stock[t].bug or stock[t].outcome == "passed")]
    compared = [t for t in references if stock[t].outcome == "passed" and _comparable(patched[t])]
    differing = [(t, d) for t in compared if (d := behaviour_difference(stock[t], patched[t]))]
    if broken or differing:  # what the engine does differently comes first, then the tests it broke
        differs = tuple(f"patched behaves differently from stock where stock is right: {t}: {d}" for t, d in differing)
        return Verdict(NOT_FIXED, differs + tuple(_patched_failure(t, patched[t]) for t in broken))
    controls = [t for t in applicable if not stock[t].bug and stock[t].outcome != "passed"]
    if controls:
        return Verdict(
            ERROR, tuple(f"stock {stock[t].outcome} a control test (the observers may be blind): {t}: {stock[t].message}" for t in controls)
        )
    not_evidence = [t for t in bug_tests if stock[t].outcome != "passed" and not is_evidence(stock[t])]
    if not_evidence:
        return Verdict(
            ERROR,
            tuple(
                f"stock {stock[t].outcome} for a reason other than the bug (not evidence): {t}: {stock[t].message}" for t in not_evidence
            ),
        )
    unseen = [t for t in bug_tests if stock[t].outcome == "passed"]
    if unseen:
        return Verdict(UNDETECTED, tuple(f"bug test passed on stock ({stock[t].bug}): {t}" for t in unseen))
    seen = ", ".join(sorted({stock[t].bug for t in bug_tests}))
    summary = (
        f"stock shows the bug in all {len(bug_tests)} applicable bug tests ({seen}); patched passes all {len(applicable)} "
        f"applicable tests and behaves as stock in {len(references)} reference test(s)"
    )
    return Verdict(FIXED, (summary,))


def _comparable(patched: TestOutcome) -> bool:
    """A reference test whose patched run passed, or failed after recording its behaviour."""
    return patched.outcome == "passed" or any(is_behaviour(k) for k in patched.properties)


def _patched_failure(test: str, outcome: TestOutcome) -> str:
    if outcome.observed:
        kind = "the bug is still seen"
    elif HARNESS in outcome.message:
        kind = "not the bug: a harness check of the test, which stock passes, fails on patched"
    else:
        kind = "not the bug: the patched build broke the test"
    return f"patched {outcome.outcome}: {test}: {outcome.message} ({kind})"


def with_deepspeed_tests(verdict: Verdict, comparison: Mapping[str, object]) -> Verdict:
    """The engine-test verdict with DeepSpeed's own tests (``deepspeed_tests.compare``) added: a test
    that passes on stock and fails on patched makes a ``fixed`` or ``undetected`` cell
    ``not-fixed``, naming it; tests failing on both builds are listed, not blamed on the fix."""
    regressions = list(comparison.get("regressions") or [])  # type: ignore[call-overload]
    broke = tuple(f"DeepSpeed's own test passes on stock, fails on patched: {r['test']}: {r['message']}" for r in regressions)
    counts = {build: comparison.get(build) or {} for build in ("stock", "patched")}
    ran = "; ".join(f"{build} {_counted(c)}" for build, c in counts.items())  # type: ignore[arg-type]
    summary = f"DeepSpeed's own tests: {ran}; {len(regressions)} broken by the change"
    both = list(comparison.get("failing_on_both") or [])  # type: ignore[call-overload]
    if both:
        summary += f", {len(both)} failing on both builds (not the change's doing)"
    if broke and verdict.verdict in (FIXED, UNDETECTED):
        return Verdict(NOT_FIXED, broke + (summary,))
    return Verdict(verdict.verdict, verdict.reasons + broke + (summary,))


def _counted(counts: Mapping[str, int]) -> str:
    failed = counts.get("failed", 0) + counts.get("error", 0)
    return f"{counts.get('passed', 0)} passed, {failed} failed, {counts.get('skipped', 0)} skipped"


def exit_code(verdicts: list[str]) -> int:
    """0 only when every selected cell is fixed."""
    return 0 if verdicts and all(v == FIXED for v in verdicts) else 1


INTERRUPTED_EXIT = 130  # a run stopped by SIGINT or SIGTERM, as a shell reports Ctrl-C


def run_exit_status(verdicts: list[str], throughput: Iterable[str], interrupted: bool) -> int:
    """A run's exit status: ``INTERRUPTED_EXIT`` when it was stopped; else 0 only when every selected
    cell is fixed and no cell's throughput regression was decided (``throughput``: each cell's verdict)."""
    if interrupted:
        return INTERRUPTED_EXIT
    return exit_code(verdicts) or (1 if REGRESSION in set(throughput) else 0)
