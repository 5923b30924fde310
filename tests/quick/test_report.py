"""The release-qualification report: fixture stores in, Markdown / HTML / JSON out."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest
from helpers import REPO
from stores import ARM_FIXED, ERRORED, EXCLUDED, FIXED, NOT_FIXED, PATCH, benchmarks, cell, outcome, pair, store

from dsmatrix.cli import main
from dsmatrix.infra.errors import ConfigError, ResultsError
from dsmatrix.infra.hosts import native_platform
from dsmatrix.plan.cells import plan_cells
from dsmatrix.plan.matrix import load_matrix
from dsmatrix.report.content import BUILDS, build_report
from dsmatrix.report.qualification import SCHEMA_FILE, load_report, write_report
from dsmatrix.report.render import render_markdown
from dsmatrix.report.stores import TierPlan, load_source, merge

EARLIER, LATER = 1_796_000_000.0, 1_796_000_001.0  # two runs' start, a second apart: their ids order them


def validate(report: dict) -> None:
    jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text())).validate(report)


def test_schema_is_a_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(json.loads(SCHEMA_FILE.read_text()))


def test_fixed_not_fixed_excluded_and_error_cells_render_in_all_three_formats(tmp_path: Path) -> None:
    run = store(tmp_path / "results", [FIXED, NOT_FIXED, ERRORED], excluded=[EXCLUDED])
    target = write_report([tmp_path / "results"], tmp_path / "reports")
    assert target == tmp_path / "reports" / run.id
    report = load_report(target)
    validate(report)
    assert report["verdict"] == "NOT QUALIFIED"
    assert report["counts"] == {"fixed": 1, "not-fixed": 1, "error": 1}
    assert "matrix(py3.11, torch2.13.0+cpu, ds0.19.7): not-fixed" in report["verdict_reasons"]
    assert [e["rule"] for e in report["excluded"]] == ["torch-2.4-has-no-cp313"]
    assert report["errors"][0]["message"].endswith("install torch: no solution")
    states = {c: o["state"] for row in report["tests"] if row["bug"] == "retrace" for c, o in row["outcomes"].items()}
    assert states == {"py3.11-torch2.13.0+cpu-ds0.19.6": "absent", "py3.11-torch2.13.0+cpu-ds0.19.7": "broken",
                      "py3.11-torch2.13.0+cpu-ds0.19.8": "fixed"}  # fmt: skip
    fixed = next(c for c in report["cells"] if c["verdict"] == "fixed")
    assert fixed["environment"]["builds"]["patched"]["freeze"][0] == "deepspeed==0.19.8+zfix.ab"
    assert fixed["environment"]["bf16"] and "avx512_bf16" in fixed["environment"]["cpu_features"]
    for name in fixed["junit"]:
        assert (target / name).is_file(), f"JUnit file {name} copied next to the report"

    md = (target / "qualification.md").read_text()
    assert "## ❌ NOT QUALIFIED" in md
    for row in ("| **fixed** | no-regression |", "| **not-fixed** | not measured |", "| **error** | not measured |"):
        assert row in md
    assert md.index("## ❌ NOT QUALIFIED") < md.index("| cell | verdict |") < md.index("## Failures (2 cell(s))") < md.index("Rule:")
    assert "| **fixed** | no-regression | 0.995 [0.980, 1.010] no-regression | 1.00040 no-regression |" in md
    assert "  - patched `test_retrace::t[fp32]@ws1`: release decisions differ" in md
    assert "| retrace |" not in md and "pip freeze (" not in md, "the per-test grid and the environments are in the HTML and JSON"
    assert (target / "summary.md").read_text() == md[: len((target / "summary.md").read_text())], "the summary opens the report"
    assert "| matrix(py3.13, torch2.4.1, ds0.19.8) | `torch-2.4-has-no-cp313` | torch 2.4.1 publishes no CPython 3.13 wheels |" in md
    assert "- **matrix(py3.11, torch2.13.0+cpu, ds0.19.6)**: error: matrix(py3.11, torch2.13.0+cpu, ds0.19.6) stock: install torch" in md
    assert 'when = { python = "==3.11", torch = "==2.13.0+cpu", deepspeed = "==0.19.6" }' in md
    assert "| stock | +64 MB over 3 | 3 | 12 | 3 |" in md and "[leak-rss.png](leak-rss.png)" in md
    assert "30.00 ms / 29.85 ms" in md
    assert "A/A calibration `no-regression`, whose upper bounds certify no-regression at margins >= 1.2% (this run: 2%)" in md

    html = (target / "qualification.html").read_text()
    assert '<div id="verdict" class="verdict NOT-QUALIFIED">NOT QUALIFIED</div>' in html
    assert "test_retrace::t[fp32]@ws1" in html and "deepspeed==0.19.8+zfix.ab" in html
    assert 'class="o s-fixed"' in html and 'class="o s-broken"' in html and "torch-2.4-has-no-cp313" in html
    assert "<link" not in html and "<script" not in html, "one self-contained page: no external resources"
    assert html.count("data:image/png;base64,") == 2, "both plots embedded"
    for plot in ("leak-rss.png", "leak-rss.svg", "step-time-ratios.png", "step-time-ratios.svg"):
        assert (target / plot).stat().st_size > 1000


def test_without_the_plots_extra_the_report_says_its_figures_were_left_out(tmp_path: Path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """matplotlib is the ``plots`` extra: without it the report is whole but for its figures, and
    says so in the report and in one line on stderr."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    store(tmp_path / "results", [FIXED, NOT_FIXED])
    assert main(["report", str(tmp_path / "results"), "--output", str(tmp_path / "reports")]) == 0
    (target,) = (tmp_path / "reports").iterdir()
    report = load_report(target)
    validate(report)
    assert report["plots"] == {} and "matplotlib is not installed" in report["figures_left_out"]
    assert not list(target.glob("*.png")) and "data:image/png" not in (target / "qualification.html").read_text()
    assert "- figures left out: matplotlib is not installed" in (target / "qualification.md").read_text()
    assert capsys.readouterr().err == f"dsmatrix: {report['figures_left_out']}\n"


def test_markup_in_results_is_escaped_in_html(tmp_path: Path) -> None:
    nasty = cell("0.19.5", "error", ["<script>alert(1)</script> & friends"], error_kind="RunError")
    store(tmp_path / "results", [FIXED, nasty])
    html = (write_report([tmp_path / "results"], tmp_path / "reports") / "qualification.html").read_text()
    assert "<script>alert(1)</script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt; &amp; friends" in html


FORGED = "boom\n## FAKE HEADING: QUALIFIED"
UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")


def _blocks(markdown: str) -> list[str]:
    """What a line of ``markdown`` opens: a heading's text or a table row's cell count (``|`` unescaped)."""
    opened = []
    for line in markdown.splitlines():
        if re.match(r" {0,3}#{1,6}(\s|$)", line):
            opened.append(line)
        elif line.startswith("|"):
            opened.append(f"{len(UNESCAPED_PIPE.findall(line))} cells")
    return opened


def test_text_from_results_cannot_steer_the_markdown(tmp_path: Path) -> None:
    """A failure message, a test id, a reason, an exclusion and what a bug test observed carry a forged
    heading, HTML, backticks, pipes and newlines: each renders as its text, in the report, its summary,
    the evidence for the PR and what ``dsmatrix report`` prints; no heading or table row appears."""
    test_id = "test_x[`a|b`]"
    tests = {"stock": {test_id: {**outcome("failed", "retrace", "x"), "bug_observed": FORGED + " | <b>"}},
             "patched": {test_id: outcome("failed", "retrace", FORGED + " <img src=x onerror=alert(1)> | `)")}}  # fmt: skip
    hunk = {"file": "deepspeed/x.py", "header": "@@ -1 +1 @@ |", "lines": 1, "executed": 1, "missing": [], "tests": [test_id]}
    coverage = {"changed_lines": 1, "executed_lines": 1, "missing": [], "hunks": [hunk], "not_measured": []}
    forged = cell("0.19.5", "not-fixed", [FORGED, "<script>x</script>"], tests, change_coverage=coverage)
    excluded = {**EXCLUDED, "reason": FORGED + " | extra cell"}
    clean = cell("0.19.5", "not-fixed", ["plain"], {b: {test_id.replace("`", ""): outcome("failed", "retrace", "plain")} for b in BUILDS})
    store(tmp_path / "forged", [forged], excluded=[excluded])
    clean["change_coverage"] = {**coverage, "hunks": [{**hunk, "header": "@@ -1 +1 @@"}]}
    store(tmp_path / "clean", [clean], excluded=[EXCLUDED])
    written = {}
    for name in ("forged", "clean"):
        target = write_report([tmp_path / name], tmp_path / f"{name}-reports")
        written[name] = {f: (target / f).read_text() for f in ("qualification.md", "summary.md", "evidence.md")}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["report", str(tmp_path / "forged"), "--output", str(tmp_path / "again")])
    written["forged"]["printed"] = printed.getvalue()
    written["clean"]["printed"] = written["clean"]["summary.md"]
    for name, text in written["forged"].items():
        assert _blocks(text) == _blocks(written["clean"][name]), f"{name}: the forged text opened a heading or a table cell"
        assert "FAKE HEADING" in text and not re.search(r"(?<!\\)<(img|script|b>)", text), name
    assert "\\#\\# FAKE HEADING: QUALIFIED \\<img src=x onerror=alert(1)\\> \\| \\`)" in written["forged"]["qualification.md"]
    assert "``test_x[`a|b`]``" in written["forged"]["summary.md"] and "``test_x[`a\\|b`]``" in written["forged"]["evidence.md"]


def test_all_fixed_is_qualified_and_a_throughput_regression_is_not(tmp_path: Path) -> None:
    store(tmp_path / "good", [FIXED], excluded=[EXCLUDED])
    report = load_report(write_report([tmp_path / "good"], tmp_path / "reports"))
    assert report["verdict"] == "QUALIFIED" and report["verdict_reasons"] == []
    slow = {**FIXED, "benchmarks": benchmarks("regression", ratio=1.10)}
    store(tmp_path / "slow", [slow])
    report = load_report(write_report([tmp_path / "slow"], tmp_path / "reports"))
    assert report["verdict"] == "NOT QUALIFIED"
    assert report["verdict_reasons"] == ["matrix(py3.11, torch2.13.0+cpu, ds0.19.8): throughput regression (step time)"]


def test_the_headline_says_what_was_proven(tmp_path: Path) -> None:
    """QUALIFIED needs no-regression by the throughput rule in every cell; a cell whose throughput
    was not decided (or not measured) leaves a distinct headline naming it; a regression decided by
    instructions alone fails it."""
    cases = {
        "counted": ({**FIXED, "benchmarks": benchmarks("inconclusive", counted="no-regression")}, "QUALIFIED"),
        "time-only": ({**FIXED, "benchmarks": benchmarks("inconclusive", counted=None)}, "CORRECT, THROUGHPUT NOT SHOWN"),
        "unmeasured": ({k: v for k, v in FIXED.items() if k != "benchmarks"}, "CORRECT, THROUGHPUT NOT SHOWN"),
        "counted-slower": ({**FIXED, "benchmarks": benchmarks("no-regression", counted="regression")}, "NOT QUALIFIED"),
    }
    for name, (result, headline) in cases.items():
        if name == "counted-slower":
            result["benchmarks"]["verdict"] = "regression"  # as cell_throughput decides it (tested in test_bench_rule)
        store(tmp_path / name, [result])
        target = write_report([tmp_path / name], tmp_path / "reports")
        report = load_report(target)
        validate(report)
        assert report["verdict"] == headline, (name, report["verdict_reasons"])
    report = load_report(write_report([tmp_path / "time-only"], tmp_path / "reports"))
    assert report["verdict_summary"] == "correct everywhere; throughput not decided (inconclusive) in 1 cell(s)"
    assert report["verdict_reasons"] == ["matrix(py3.11, torch2.13.0+cpu, ds0.19.8): throughput inconclusive"]
    target = write_report([tmp_path / "counted"], tmp_path / "reports")
    md, html = (target / "qualification.md").read_text(), (target / "qualification.html").read_text()
    for text in (md, html):
        assert "decided by instructions" in text and "Throughput rule: a cell&#39;s throughput" in text.replace("'", "&#39;")
        assert "Executed instructions (valgrind-3.19.0 callgrind, mean of 5 counted steps or calls per process)" in text
        assert "after 6 round(s) of at most 45" in text and "stopped: decided" in text
    assert "| `test_train_step[fp32-ckpt-off]` | 65,000,000 | 65,026,000 | 1.00040 | 1.00002 | no-regression |" in md
    assert "| `test_release_path[fp32-ckpt-off]` | 800,000 | 840,000 | 1.05000 | 1.00012 | reported, not judged |" in md
    assert "## ✅ QUALIFIED" in md and "**correct everywhere; no throughput regression in any cell (decided by instructions).**" in md


@pytest.mark.parametrize(("store_of", "require", "code"), [("counted", "qualified", 0), ("time-only", "qualified", 1),
                                                           ("time-only", "correct", 0), ("slow", "correct", 1)])  # fmt: skip
def test_report_gates_with_require(tmp_path: Path, store_of: str, require: str, code: int) -> None:
    from dsmatrix.cli import main

    results = {"counted": FIXED, "time-only": {**FIXED, "benchmarks": benchmarks("inconclusive", counted=None)},
               "slow": {**FIXED, "benchmarks": benchmarks("regression", ratio=1.1)}}  # fmt: skip
    store(tmp_path / store_of, [results[store_of]])
    assert main(["report", str(tmp_path / store_of), "--output", str(tmp_path / "reports"), "--require", require]) == code
    assert main(["report", str(tmp_path / store_of), "--output", str(tmp_path / "reports")]) == 0, "no gate unless asked"


def test_an_interrupted_run_does_not_qualify(tmp_path: Path) -> None:
    run = store(tmp_path / "results", [FIXED], status="interrupted")
    report = load_report(write_report([tmp_path / "results"], tmp_path / "reports"))
    assert report["verdict"] == "NOT QUALIFIED" and report["verdict_reasons"] == [f"run {run.id} is interrupted, not complete"]


@pytest.mark.parametrize("order", ["parts in order", "parts reversed"])
def test_a_later_part_supersedes_an_interrupted_cell_whatever_the_suite_version(tmp_path: Path, order: str) -> None:
    """The nightly tier in parts: part 1 was stopped with one cell running; part 2, from a newer suite
    (another fingerprint), finished it. One report covers both, each cell once, every plan covered.
    As in a real store, only the finished record carries the runtime axes; the interrupted one has its run's."""
    done = cell("0.19.2", "fixed", ["part 1"])
    stopped = cell("0.19.8", "interrupted", ["interrupted"], fingerprint="fp-old", finished_at="2026-11-30T11:00:00Z")
    rerun = cell("0.19.8", "fixed", ["part 2"], fingerprint="fp-new", finished_at="2026-11-30T12:00:00Z", runtime={"dtype": ["fp32"]})
    first = store(tmp_path / "part1", [done, stopped], status="interrupted", planned=[done["cell"], stopped["cell"]])
    second = store(tmp_path / "part2", [rerun], planned=[rerun["cell"]])
    parts = [tmp_path / "part1", tmp_path / "part2"]
    report = load_report(write_report(parts if order == "parts in order" else parts[::-1], tmp_path / "reports"))
    assert [(c["id"], c["verdict"], c["source"]["run_id"]) for c in report["cells"]] == [
        ("py3.11-torch2.13.0+cpu-ds0.19.2", "fixed", first.id),
        ("py3.11-torch2.13.0+cpu-ds0.19.8", "fixed", second.id),
    ]
    assert report["verdict"] == "CORRECT, THROUGHPUT NOT SHOWN", report["verdict_reasons"]


def test_a_planned_cell_that_never_finished_anywhere_is_named(tmp_path: Path) -> None:
    done = cell("0.19.2", "fixed", ["ran"])
    stopped = cell("0.19.8", "interrupted", ["interrupted"])
    never = cell("0.18.9", "fixed", [])["cell"]
    run = store(tmp_path / "results", [done, stopped], status="interrupted", planned=[done["cell"], stopped["cell"], never])
    report = load_report(write_report([tmp_path / "results"], tmp_path / "reports"))
    labels = f"{stopped['cell']['label']}, {never['label']}"
    assert report["verdict"] == "NOT QUALIFIED"
    assert report["verdict_reasons"][0] == f"run {run.id} is interrupted: 2 planned cell(s) never finished ({labels})"


def test_a_tier_run_in_parts_is_judged_by_the_tier_plan_not_by_each_part(tmp_path: Path) -> None:
    """An older part was interrupted and records no plan; a later part ran what it missed. With the
    tier's plan the merge is covered, its exclusions are listed, and the coverage line says so."""
    first, second = cell("0.19.2", "fixed", ["ran"]), cell("0.19.8", "interrupted", ["interrupted"])
    store(tmp_path / "part1", [first, second], status="interrupted")
    store(tmp_path / "part2", [{**cell("0.19.8", "fixed", ["ran again"]), "finished_at": "2026-12-03T12:00:00Z"}])
    stores = [tmp_path / "part1", tmp_path / "part2"]
    assert load_report(write_report(stores, tmp_path / "without"))["verdict"] == "NOT QUALIFIED", "without a plan, part 1 is incomplete"
    plan = TierPlan("nightly", [first["cell"], second["cell"]], [EXCLUDED])
    target = write_report(stores, tmp_path / "with", plan)
    report = load_report(target)
    validate(report)
    assert report["verdict"] == "CORRECT, THROUGHPUT NOT SHOWN", report["verdict_reasons"]
    assert report["coverage"] == {"tier": "nightly", "planned": 2, "finished": 2, "missing": [], "excluded": 1}
    assert [e["id"] for e in report["excluded"]] == [EXCLUDED["cell"]["id"]], "the tier's exclusions are listed though no part ran them"
    line = "- Coverage of tier `nightly`: 2 of 2 planned cell(s) finished, 1 excluded by a rule"
    assert line in (target / "qualification.md").read_text().splitlines()
    assert 'id="coverage"' in (target / "qualification.html").read_text()


def test_a_tier_cell_no_part_finished_is_named(tmp_path: Path) -> None:
    done = cell("0.19.2", "fixed", ["ran"])
    never = cell("0.18.9", "fixed", [])["cell"]
    store(tmp_path / "results", [done])
    report = load_report(write_report([tmp_path / "results"], tmp_path / "reports", TierPlan("nightly", [done["cell"], never], [])))
    validate(report)
    assert report["verdict"] == "NOT QUALIFIED"
    assert report["verdict_reasons"][0] == f"tier nightly: 1 of 2 planned cell(s) never finished ({never['label']})"
    assert report["coverage"]["missing"] == [never["label"]]


def test_report_tier_plans_from_the_matrix_and_matrix_alone_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store(tmp_path / "results", [FIXED])
    assert main(["report", str(tmp_path / "results"), "--output", str(tmp_path / "reports"), "--tier", "nightly"]) == 0
    report = load_report(next((tmp_path / "reports").iterdir()))
    matrix = load_matrix(REPO / "matrix" / "matrix.toml")
    planned = len(plan_cells(matrix, matrix.tier("nightly"), {}, [native_platform()]).cells)  # the plan, not a restated count
    assert planned > 1 and report["coverage"]["planned"] == planned and report["coverage"]["finished"] == 1, report["coverage"]
    assert report["verdict_reasons"][0].startswith(f"tier nightly: {planned - 1} of {planned} planned cell(s) never finished (")
    assert main(["report", str(tmp_path / "results"), "--output", str(tmp_path / "reports"), "--matrix", "matrix/matrix.toml"]) == 2
    assert "give --tier as well" in capsys.readouterr().err


@pytest.mark.parametrize("reverse", [False, True], ids=["parts in order", "parts reversed"])
def test_a_later_run_that_benchmarked_a_reused_result_wins(tmp_path: Path, reverse: bool) -> None:
    """`nox -s bench` over a store reuses a finished cell and benchmarks it: the same result (same
    fingerprint, same finished_at) recorded again, now with its benchmarks."""
    plain = {key: value for key, value in FIXED.items() if key != "benchmarks"}
    first = store(tmp_path / "part", [plain], at=EARLIER)
    store(tmp_path / "bench", [{**FIXED, "reused_from": first.id}], at=LATER)  # run ids are made to the second
    stores = [tmp_path / "part", tmp_path / "bench"]
    report = load_report(write_report(stores[::-1] if reverse else stores, tmp_path / "reports"))
    (row,) = report["cells"]
    assert row["throughput"] is not None and report["verdict"] == "QUALIFIED", report["verdict_reasons"]


def test_two_stores_from_different_runners_merge_into_one_report(tmp_path: Path) -> None:
    """What the scheduled workflow's report job does with the artifacts of an x86 and an ARM runner."""
    x86 = store(tmp_path / "artifacts" / "x86", [FIXED], excluded=[EXCLUDED])
    arm = store(tmp_path / "artifacts" / "arm", [ARM_FIXED], excluded=[EXCLUDED])
    rerun = store(tmp_path / "artifacts" / "x86-rerun", [{**FIXED, "finished_at": "2026-11-30T12:00:00Z", "reasons": ["newer"]}])
    target = write_report([tmp_path / "artifacts" / n for n in ("x86", "arm", "x86-rerun")], tmp_path / "reports")
    report = load_report(target)
    validate(report)
    assert target.name.startswith("merged-") and len(report["sources"]) == 3
    assert [c["id"] for c in report["cells"]] == ["py3.11-torch2.13.0+cpu-ds0.19.8", "py3.11-torch2.9.1-ds0.19.8-arm64"]
    x86_cell = report["cells"][0]
    assert x86_cell["reasons"] == ["newer"] and x86_cell["source"]["run_id"] == rerun.id, "same fingerprint: the newest result wins"
    assert report["cells"][1]["source"]["run_id"] == arm.id and report["cells"][1]["environment"]["architecture"] == "aarch64"
    assert len(report["excluded"]) == 1 and report["verdict"] == "CORRECT, THROUGHPUT NOT SHOWN", "the arm cell was not benchmarked"
    assert report["verdict_summary"] == "correct everywhere; throughput not measured in 1 cell(s)"
    md = (target / "qualification.md").read_text()
    assert x86.id not in [c["source"]["run_id"] for c in report["cells"]] and f"`{x86.id}`" in md, "every merged run is named"


def test_stores_of_different_patches_are_refused_in_one_line(tmp_path: Path) -> None:
    store(tmp_path / "a", [FIXED])
    store(tmp_path / "b", [FIXED], patch={**PATCH, "sha256": "cd" * 32})
    with pytest.raises(ConfigError, match="different patches") as info:
        write_report([tmp_path / "a", tmp_path / "b"], tmp_path / "reports")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_a_store_without_results_is_one_line(tmp_path: Path, make: str) -> None:
    if make == "empty":
        (tmp_path / "results").mkdir()
    with pytest.raises(ResultsError, match="results"):
        write_report([tmp_path / "results"], tmp_path / "reports")


def test_report_from_a_run_folder_or_the_store(tmp_path: Path) -> None:
    run = store(tmp_path / "results", [cell("0.19.8", "fixed", ["ok"], pair("failed", "passed"))])
    by_store = load_report(write_report([tmp_path / "results"], tmp_path / "r1"))
    by_run = load_report(write_report([run.root], tmp_path / "r2"))
    assert by_store["cells"] == by_run["cells"]
    shutil.rmtree(tmp_path / "r1")


def test_a_store_whose_latest_link_was_lost_uses_its_newest_run(tmp_path: Path) -> None:
    """upload-artifact keeps no symlinks: a downloaded store has run folders but no ``latest``."""
    store(tmp_path / "results", [NOT_FIXED], at=EARLIER)
    newest = store(tmp_path / "results", [FIXED], at=LATER)  # run ids are ordered by their UTC second
    (tmp_path / "results" / "latest").unlink()
    report = load_report(write_report([tmp_path / "results"], tmp_path / "reports"))
    assert report["sources"][0]["run_id"] == newest.id and report["verdict"] == "QUALIFIED"


def test_the_evidence_section_lists_the_branches_compared_with_stock(tmp_path: Path) -> None:
    branches = {
        "compared_tests": ["test_static_graph_behaves_as_stock"],
        "functions": [{"file": "deepspeed/runtime/zero/c.py", "function": "C.__params_to_release", "taken": 2, "total": 2},
                      {"file": "deepspeed/runtime/zero/c.py", "function": "C.release_sub_module", "taken": 9, "total": 10}],
        "taken": 11, "total": 12,
        "not_taken": [{"file": "deepspeed/runtime/zero/c.py", "function": "C.release_sub_module", "from": 520, "to": 521,
                       "text": "if not free_data:"}],
        "guards_not_raised": [{"file": "deepspeed/runtime/zero/c.py", "function": "C.compute", "from": 648, "to": 649,
                               "text": "if not self.is_complete_trace():"}],
    }  # fmt: skip
    coverage = {"changed_lines": 3, "executed_lines": 3, "missing": [], "hunks": [], "not_measured": [], "branches": branches}
    store(tmp_path / "results", [{**FIXED, "change_coverage": coverage}])
    target = write_report([tmp_path / "results"], tmp_path / "reports")
    validate(load_report(target))
    md = (target / "qualification.md").read_text()
    assert "**11/12 branches, each compared with stock** (`C.__params_to_release` 2/2, `C.release_sub_module` 9/10)" in md
    assert "not taken: `c.py:520->521` (`if not free_data:`)" in md
    assert "guards never raised (a branch into `raise`, not counted): `c.py:648` (`if not self.is_complete_trace():`)" in md
    html = (target / "qualification.html").read_text()
    assert "<strong>11/12 branches, each compared with stock</strong>" in html and "c.py:520-&gt;521" in html


def test_the_step_summary_of_a_90_cell_release_tier_stays_under_githubs_limit(tmp_path: Path) -> None:
    """GitHub refuses a job summary over 1 MiB. The release tier plans 90 cells: a synthetic store
    of 90 copies of the nightly tier's largest real cell (benchmarked, with evidence) stays under it."""
    largest = max((REPO / "docs" / "nightly" / "results").glob("*/cells/*.json"), key=lambda p: p.stat().st_size)
    real = json.loads(largest.read_text())
    cells = []
    for i in range(90):
        ids = {"id": f"{real['cell']['id']}-{i}", "label": f"{real['cell']['label'][:-1]}, copy {i})"}
        cells.append({**real, "cell": {**real["cell"], **ids}, "fingerprint": f"fp-{i}", "benchmarks": FIXED["benchmarks"]})
    store(tmp_path / "release", cells)
    sources = [load_source(tmp_path / "release")]
    merged, excluded = merge(sources)
    summary = render_markdown(build_report(sources, merged, excluded)).encode()  # what write_report writes, without the plots
    assert len(summary) < 1024 * 1024, f"qualification.md is {len(summary) / 2**20:.2f} MiB"
    assert summary.count(b"\n### ") >= 3 * 90, "every cell's throughput, evidence and details are in it"


FORGERIES = {
    "run id": lambda summary, cell: summary.update(run_id="../../escaped"),
    "cell file": lambda summary, cell: summary["cells"][0].update(file="../../../outside.json"),
    "cell id": lambda summary, cell: cell["cell"].update(id="../x"),
    "JUnit file": lambda summary, cell: cell["builds"]["stock"]["junit"].append("raw/../../../../outside.xml"),
    "reused_from run id": lambda summary, cell: cell.update(reused_from="../../.."),
    "benchmark file": lambda summary, cell: cell["benchmarks"].update(files=["bench/../../outside.json"]),
    "builds or benchmarks": lambda summary, cell: cell.update(builds=["-rf"]),
}


@pytest.mark.parametrize("forged", FORGERIES)
def test_a_forged_store_is_refused_and_nothing_is_written_outside_the_output(
    tmp_path: Path, forged: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every name of a store that a report turns into a path is checked on load: a forged one is a
    one-line error naming it, the results error's exit code, and the report writes nothing anywhere."""
    run = store(tmp_path / "store" / "results", [{**FIXED, "benchmarks": {**FIXED["benchmarks"], "files": ["bench/x-stock.json"]}}])
    summary_file, cell_file = run.root / "summary.json", next((run.root / "cells").glob("*.json"))
    summary, record = json.loads(summary_file.read_text()), json.loads(cell_file.read_text())
    (tmp_path / "outside.json").write_text(cell_file.read_text())  # what a forged cell file would point at
    FORGERIES[forged](summary, record)
    summary_file.write_text(json.dumps(summary))
    cell_file.write_text(json.dumps(record))
    before = sorted(tmp_path.rglob("*"))
    assert main(["report", str(run.root), "--output", str(tmp_path / "store" / "reports")]) == ResultsError.exit_code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and forged in err and "forged" in err, err
    assert sorted(tmp_path.rglob("*")) == before, "nothing written"


def test_the_committed_nightly_evidence_names_no_machine() -> None:
    """docs/nightly's stores and report, as committed: no absolute path of a machine's folders, no
    host name where JUnit and pytest-benchmark record one; the step summary under GitHub's 1 MiB."""
    nightly = REPO / "docs" / "nightly"
    machine = re.compile(r"/(tmp|root|work|home|Users|opt|usr|var)/|hostname=\"(?!runner\")|\"node\": \"(?!runner\")")
    kinds = (".json", ".xml", ".md", ".html", ".log")
    evidence = [p for p in nightly.rglob("*") if p.is_file() and p.suffix in kinds and p.name != "README.md"]
    named = [str(p.relative_to(nightly)) for p in evidence if machine.search(p.read_text(errors="replace"))]
    assert not named, named
    (report,) = (nightly / "report").glob("*/qualification.md")
    assert report.stat().st_size < 1024 * 1024


def test_the_names_a_git_pr_cell_writes_are_names_a_store_may_hold(tmp_path: Path) -> None:
    """A PR-mode cell's id holds two refs made file-safe (``refs_pull_7_head``) joined by ``..``: its
    record, JUnit and benchmark names load (acceptance run 9 refused them once)."""
    pr_id = "py3.11-torch2.13.0+cpu-ds0.19.6-pr.master.603932982e..refs_pull_7_head.b6e127eb54"
    record = {**FIXED, "cell": {**FIXED["cell"], "id": pr_id}}
    record["builds"] = {b: {**v, "junit": [f"raw/{pr_id}-{b}-ws1-rank0.xml"]} for b, v in FIXED["builds"].items()}
    record["benchmarks"] = {**FIXED["benchmarks"], "files": [f"bench/{pr_id}-bench-stock.json"]}
    store(tmp_path / "results", [record])
    assert load_report(write_report([tmp_path / "results"], tmp_path / "reports"))["cells"][0]["id"] == pr_id
