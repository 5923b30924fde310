"""DeepSpeed's own tests compared across builds, their verdict, and the changed lines of a diff (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsmatrix.execute.change_coverage import Hunk, changed_hunks, measure, summary_line
from dsmatrix.execute.deepspeed_tests import copy_tests, load_selection, set_names
from dsmatrix.infra.errors import ConfigError
from dsmatrix.judge.deepspeed_tests import compare
from dsmatrix.judge.outcomes import TestOutcome
from dsmatrix.judge.verdict import FIXED, NOT_FIXED, UNDETECTED, Verdict, with_deepspeed_tests

DIFF = """\
--- a/deepspeed/runtime/zero/partitioned_param_coordinator.py
+++ b/deepspeed/runtime/zero/partitioned_param_coordinator.py
@@ -10,2 +10,3 @@ class PartitionedParameterCoordinator:
     def release(self):
-        return self.cache[key]
+        # a comment counts only if coverage.py calls it a statement
+        return frozenset(self.cache[key])
--- a/tests/unit/test_new.py
+++ b/tests/unit/test_new.py
@@ -0,0 +1,2 @@
+def test_new():
+    pass
--- a/csrc/op.cpp
+++ b/csrc/op.cpp
@@ -1 +1 @@
-int x;
+int y;
"""


def outcomes(**states: str) -> dict[str, TestOutcome]:
    return {name: TestOutcome(state, message=f"{name} {state}") for name, state in states.items()}


def test_a_test_broken_by_the_change_is_named_and_failures_on_both_are_not_blamed() -> None:
    stock = outcomes(a="passed", b="failed", c="passed", d="failed", e="skipped")
    patched = outcomes(a="failed", b="failed", c="passed", d="passed", e="skipped")
    result = compare(stock, patched)
    assert [r["test"] for r in result["regressions"]] == ["a"]
    assert [r["test"] for r in result["failing_on_both"]] == ["b"]
    assert [r["test"] for r in result["fixed"]] == ["d"]
    assert result["stock"] == {"passed": 2, "failed": 2, "error": 0, "skipped": 1}
    gone = compare(outcomes(a="passed"), {})
    assert gone["regressions"] == [{"test": "a", "message": "not run on patched"}]


@pytest.mark.parametrize("engine", [FIXED, UNDETECTED])
def test_a_regression_in_deepspeeds_tests_makes_the_cell_not_fixed(engine: str) -> None:
    comparison = compare(outcomes(a="passed", b="failed"), outcomes(a="error", b="failed"))
    verdict = with_deepspeed_tests(Verdict(engine, ("engine summary",)), comparison)
    assert verdict.verdict == NOT_FIXED
    assert verdict.reasons[0] == "DeepSpeed's own test passes on stock, fails on patched: a: a error"
    assert "1 failing on both builds (not the change's doing)" in verdict.reasons[-1]
    clean = with_deepspeed_tests(Verdict(FIXED, ("engine summary",)), compare(outcomes(a="passed"), outcomes(a="passed")))
    summary = "DeepSpeed's own tests: stock 1 passed, 0 failed, 0 skipped; patched 1 passed, 0 failed, 0 skipped; 0 broken by the change"
    assert clean == Verdict(FIXED, ("engine summary", summary))


def test_changed_lines_are_the_added_lines_of_deepspeeds_python_files() -> None:
    hunks, other = changed_hunks(DIFF)
    (hunk,) = hunks
    assert hunk.file == "deepspeed/runtime/zero/partitioned_param_coordinator.py"
    assert hunk.added == (11, 12) and hunk.header.startswith("@@ -10,2 +10,3 @@")
    assert other == ["tests/unit/test_new.py", "csrc/op.cpp"]
    assert summary_line({"executed_lines": 1, "changed_lines": 2, "missing": [{"file": hunk.file, "line": 12}]}) == (
        "changed lines executed 1/2; never executed: partitioned_param_coordinator.py:12"
    )


def test_an_unreadable_process_data_file_is_named_and_the_rest_counted(tmp_path: Path) -> None:
    """A rank killed while writing its data leaves a file coverage.py cannot read: named, not a raw warning."""
    import warnings

    from coverage import CoverageData

    module = tmp_path / "site" / "deepspeed" / "changed.py"
    module.parent.mkdir(parents=True)
    module.write_text("a = 1\nb = 2\nc = 3\n")
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    good = CoverageData(basename=str(data_dir / ".coverage.vm.pid1.good"))
    good.add_lines({str(module): [1, 2]})
    good.write()
    (data_dir / ".coverage.vm.pid2.torn").write_bytes(b"")  # what a process ended mid-write leaves
    hunk = Hunk("deepspeed/changed.py", "@@ -1,1 +1,3 @@", (2, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no raw CoverageWarning reaches the run's output
        measured = measure(data_dir, tmp_path / "site", [hunk], [])
    assert measured["unreadable_data_files"] == [".coverage.vm.pid2.torn"] and measured["processes"] == 1
    assert (measured["executed_lines"], measured["changed_lines"]) == (1, 2)
    assert summary_line(measured) == (
        "changed lines executed 1/2; never executed: changed.py:3; 1 process data file(s) unreadable, not counted"
    )


def test_the_bundled_sets_and_a_source_without_tests(tmp_path: Path) -> None:
    assert set_names() == ["core", "quick", "full"]
    core = load_selection("core")
    assert core.paths and all(p.startswith("unit/") for p in core.paths)
    with pytest.raises(ConfigError, match="--deepspeed-tests nightly: not a set of .*selection.toml"):
        load_selection("nightly")
    (tmp_path / "sdist").mkdir()
    assert copy_tests(tmp_path / "sdist", tmp_path / "copy", core)[0] is None  # a release sdist has no tests/unit
    older = tmp_path / "older" / "tests" / "unit" / "runtime" / "zero"
    older.mkdir(parents=True)
    (older / "test_unwrap_model.py").write_text("")
    copied, narrowed, missing = copy_tests(tmp_path / "older", tmp_path / "copy", core)
    assert copied == tmp_path / "copy" / "tests" and narrowed.paths == ("unit/runtime/zero/test_unwrap_model.py",)
    assert len(missing) == len(core.paths) - 1


def test_branches_of_the_touched_functions_count_only_in_tests_compared_with_stock(tmp_path: Path) -> None:
    """A branch taken only in a test not compared with stock is not evidence; untouched functions are not listed."""
    from coverage import CoverageData

    from dsmatrix.execute.change_coverage import touched_functions

    source = (
        "def decide(x):\n    if x > 0:\n        return 1\n    return 0\n\n\ndef other(y):\n    if y:\n        return 1\n    return 2\n"
        "\n\ndef guarded(z):\n    if z is None:\n        raise ValueError(z)\n    return z\n"
    )
    module = tmp_path / "site" / "deepspeed" / "changed.py"
    module.parent.mkdir(parents=True)
    module.write_text(source)
    diff = (
        "--- a/deepspeed/changed.py\n+++ b/deepspeed/changed.py\n@@ -1,4 +1,4 @@\n"
        " def decide(x):\n     if x > 0:\n-        return 2\n+        return 1\n     return 0\n"
        "@@ -15,2 +15,2 @@\n         raise ValueError(z)\n-    return 0\n+    return z\n"
    )
    hunks, _ = changed_hunks(diff)
    assert hunks[0].span == (3, 3) and touched_functions(source, [hunks[0].span]) == ["decide"]
    assert touched_functions(source, [hunks[1].span]) == ["guarded"]
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    data = CoverageData(basename=str(data_dir / ".coverage.vm.pid1.x"))
    compared_arcs = [(-1, 2), (2, 3), (3, -1), (-13, 14), (14, 16), (16, -13)]
    for context, arcs in (("engine|test_mod.test_compared", compared_arcs), ("engine|test_mod.test_other", [(-1, 2), (2, 4), (4, -1)])):
        data.set_context(context)
        data.add_arcs({str(module): arcs})
    data.write()
    measured = measure(data_dir, tmp_path / "site", hunks, [], compared=["test_mod.test_compared"])
    branches = measured["branches"]
    assert (branches["taken"], branches["total"]) == (2, 3)
    assert branches["functions"] == [{"file": "deepspeed/changed.py", "function": "decide", "taken": 1, "total": 2},
                                     {"file": "deepspeed/changed.py", "function": "guarded", "taken": 1, "total": 1}]  # fmt: skip
    assert [(b["from"], b["to"]) for b in branches["guards_not_raised"]] == [(14, 15)]
    assert [(b["from"], b["to"], b["text"]) for b in branches["not_taken"]] == [(2, 4, "if x > 0:")]
    assert summary_line(measured).endswith(
        "; branches of the changed functions taken in tests compared with stock 2/3 (not taken: changed.py:2->4), "
        "1 guard(s) never raised: changed.py:14"
    )
    removal = "--- a/deepspeed/changed.py\n+++ b/deepspeed/changed.py\n@@ -7,3 +7,2 @@\n-@decorated\n def other(y):\n     if y:\n"
    (only_removed,) = changed_hunks(removal)[0]
    assert only_removed.added == () and touched_functions(source, [only_removed.span]) == ["other"]
