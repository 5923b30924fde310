"""Cell verdicts from the same engine tests run on the stock and the patched build (pure).

- ``fixed``: the patched build passes every applicable test AND the stock build fails every
  applicable bug test (each bug is really seen, and really gone).
- ``not-fixed``: a test fails (or errors) on the patched build.
- ``undetected``: a bug test passes on stock: the test cannot see the bug in this cell.
- ``error``: install, build or run failure, or results that cannot be compared.

A test is applicable when it was not skipped. Skips must agree between the builds.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dsmatrix.run import TestOutcome

FIXED, NOT_FIXED, UNDETECTED, ERROR = "fixed", "not-fixed", "undetected", "error"
VERDICTS = (FIXED, NOT_FIXED, UNDETECTED, ERROR)


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reasons: tuple[str, ...]


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
    broken = [t for t in applicable if patched[t].outcome in ("failed", "error")]
    if broken:
        return Verdict(NOT_FIXED, tuple(f"patched {patched[t].outcome}: {t}: {patched[t].message}" for t in broken))
    controls = [t for t in applicable if not stock[t].bug and stock[t].outcome != "passed"]
    if controls:
        return Verdict(
            ERROR, tuple(f"stock {stock[t].outcome} a control test (the observers may be blind): {t}: {stock[t].message}" for t in controls)
        )
    stock_errors = [t for t in bug_tests if stock[t].outcome == "error"]
    if stock_errors:
        return Verdict(ERROR, tuple(f"stock errored (not a bug failure): {t}: {stock[t].message}" for t in stock_errors))
    unseen = [t for t in bug_tests if stock[t].outcome == "passed"]
    if unseen:
        return Verdict(UNDETECTED, tuple(f"bug test passed on stock ({stock[t].bug}): {t}" for t in unseen))
    seen = ", ".join(sorted({stock[t].bug for t in bug_tests}))
    summary = f"stock fails all {len(bug_tests)} applicable bug tests ({seen}); patched passes all {len(applicable)} applicable tests"
    return Verdict(FIXED, (summary,))


def exit_code(verdicts: list[str]) -> int:
    """0 only when every selected cell is fixed."""
    return 0 if verdicts and all(v == FIXED for v in verdicts) else 1
