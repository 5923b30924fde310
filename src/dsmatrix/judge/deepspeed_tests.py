"""DeepSpeed's own tests, stock against patched: which the change broke, which fail on both."""

from __future__ import annotations

from collections.abc import Mapping

from dsmatrix.judge.outcomes import TestOutcome


def counts(outcomes: Mapping[str, TestOutcome]) -> dict[str, int]:
    found = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for outcome in outcomes.values():
        found[outcome.outcome] = found.get(outcome.outcome, 0) + 1
    return found


def compare(stock: Mapping[str, TestOutcome], patched: Mapping[str, TestOutcome]) -> dict[str, object]:
    """Stock against patched: ``regressions`` pass on stock and fail (or vanish) on patched — the
    change broke them; ``failing_on_both`` are not the change's doing; ``fixed`` fail on stock
    and pass on patched (tests that show the bug)."""
    bad = ("failed", "error")
    regressions, both, fixed = [], [], []
    for test_id in sorted(set(stock) | set(patched)):
        before, after = stock.get(test_id), patched.get(test_id)
        if before is not None and before.outcome == "passed" and (after is None or after.outcome in bad):
            regressions.append({"test": test_id, "message": after.message if after else "not run on patched"})
        elif before is not None and after is not None and before.outcome in bad and after.outcome in bad:
            both.append({"test": test_id, "stock": before.message, "patched": after.message})
        elif before is not None and after is not None and before.outcome in bad and after.outcome == "passed":
            fixed.append({"test": test_id, "stock": before.message})
    return {"stock": counts(stock), "patched": counts(patched), "regressions": regressions, "failing_on_both": both, "fixed": fixed}
