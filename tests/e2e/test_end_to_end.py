"""The tool as a user installs it (the ``installed`` fixture: a wheel in a fresh virtual
environment, its dependencies from the package index), run from a folder outside the checkout, and
real cells on DeepSpeed 0.19.8 (and 0.19.2): the bundled fix comes out ``fixed`` with every bug seen
on stock, and resumed; the installed tool plans with its bundled matrix, and a wheel missing that
file fails in one line; an interrupted run keeps its finished cells (all in the landing gate); two
ranks (acceptance). One file, so one worker: the missing-matrix test briefly breaks the installed
wheel the others use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, run_cli, run_outside, tagged_processes

from dsmatrix.infra.hosts import native_platform
from dsmatrix.plan.matrix import load_matrix

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _warm(warm_cache: Path) -> None:
    """Cold set-up (sdists, builder) before the test, not inside its duration."""


CELL = "py3.11-torch2.13.0+cpu-ds0.19.8"


def cell_result(results: Path) -> dict:
    return json.loads((results / "latest" / "cells" / f"{CELL}.json").read_text())


BUNDLED_PATCH = (
    "import sys; from dsmatrix.build.patches import load_patch_set; from dsmatrix.infra.locations import default_patch; "
    "p = load_patch_set(default_patch(None)); print(p.source.name, p.sha256, p.source.is_relative_to(sys.prefix))"
)


@pytest.mark.gate
def test_bundled_fix_is_fixed_with_every_bug_seen_on_stock(installed: Path, tmp_path: Path) -> None:
    """The installed tool, from a folder outside the checkout: its bundled matrix, fix and engine tests."""
    command = [str(installed / "dsmatrix"), "matrix", "--deepspeed", "0.19.8", "--no-bench", "--results", str(tmp_path / "results")]
    proc = run_outside(command, cwd=tmp_path, timeout=3600)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = cell_result(tmp_path / "results")
    assert result["verdict"] == "fixed"
    stock, patched = result["builds"]["stock"]["tests"], result["builds"]["patched"]["tests"]
    failing_on_stock = {}
    for test_id, outcome in stock.items():
        if outcome.get("bug") and outcome["outcome"] == "failed":
            failing_on_stock.setdefault(outcome["bug"], []).append(test_id)
    assert {bug: len(ids) for bug, ids in failing_on_stock.items()} == {"lifecycle": 4, "retrace": 12, "recompute": 2}
    assert all(stock[t].get("bug_observed") for ids in failing_on_stock.values() for t in ids), "a stock failure without evidence"
    assert all(o["outcome"] in ("passed", "skipped") for o in patched.values())
    # the figures the verdict rests on, as the cell JSON records them
    lifecycle = next(t for t in stock if t.startswith("test_lifecycle::"))
    assert stock[lifecycle]["bug_observed"]["surviving_coordinators"] == [1, 2, 3]
    assert patched[lifecycle]["properties"]["surviving_parameters"] == [0, 0, 0]
    recompute = next(t for t in stock if t.startswith("test_recompute::") and stock[t]["outcome"] == "failed")
    figures = stock[recompute]["bug_observed"]
    assert figures["gathers_per_step_unfrozen"][-1] > figures["gathers_per_step_never_frozen"][-1]
    references = [t for t in stock if t.startswith("test_stock_equivalence::")]
    assert len(references) == 36 and all(stock[t]["reference"] == "stock" for t in references)  # 9 settings x dtype x checkpointing
    assert all(stock[t]["properties"]["behaviour"] == patched[t]["properties"]["behaviour"] for t in references)
    # every decision branch of the functions the fix touches, taken in a scenario compared with stock
    branches = result["change_coverage"]["branches"]
    assert branches["taken"] == branches["total"] > 20 and not branches["not_taken"], branches
    assert f"branches of the changed functions taken in tests compared with stock {branches['total']}/{branches['total']}" in proc.stdout
    assert result["builds"]["patched"]["installed"]["deepspeed"].startswith("0.19.8+patched.")
    assert result["builds"]["patched"]["build_info"]["patch_sha256"] == result["patch"]["sha256"]
    bundled = run_outside([str(installed / "python"), "-c", BUNDLED_PATCH], cwd=tmp_path).stdout.split()
    # the record names the patch by its name and sha256 (no path of the machine): the installed package's own
    assert bundled == [result["patch"]["source"], result["patch"]["sha256"], "True"], "the fix must come from the installed package"
    assert "set-up" in proc.stdout and "tests" in proc.stdout
    summary = json.loads((tmp_path / "results" / "latest" / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["cells"][0]["verdict"] == "fixed"
    assert all((tmp_path / "results" / "latest" / junit).is_file() for junit in result["builds"]["stock"]["junit"])
    again = run_outside(command, cwd=tmp_path)
    assert again.returncode == 0 and "(1 already done)" in again.stdout and "running ..." not in again.stdout


@pytest.mark.gate
def test_installed_wheel_plans_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    plan = run_outside([str(installed / "dsmatrix"), "matrix", "--plan", "--json"], cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    default = load_matrix(REPO / "matrix" / "matrix.toml").tier("default").on(native_platform())
    assert {c["deepspeed"] for c in json.loads(plan.stdout)["include"]} == set(default.values["deepspeed"])


@pytest.mark.gate
def test_wheel_missing_its_matrix_fails_in_one_line(installed: Path, tmp_path: Path) -> None:
    """Breaking the wheel's data (what the scheduled workflow's plan step once hit) is one clear line."""
    site = run_outside([str(installed / "python"), "-c", "import dsmatrix, os; print(os.path.dirname(dsmatrix.__file__))"], cwd=tmp_path)
    bundled = Path(site.stdout.strip()) / "bundled" / "matrix" / "matrix.toml"
    assert bundled.is_file()
    bundled.unlink()  # unlink only: never edit a file an installer may have hardlinked
    try:
        proc = run_outside([str(installed / "dsmatrix"), "matrix", "--plan"], cwd=tmp_path)
    finally:
        bundled.write_bytes((REPO / "matrix" / "matrix.toml").read_bytes())  # a new file, for the other tests
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "matrix.toml" in line and "not found" in line


def test_two_ranks_see_every_bug(tmp_path: Path) -> None:
    """World size 2: one pytest per rank on one gloo rendezvous, outcomes merged per test."""
    args = ("--deepspeed", "0.19.8", "--world-size", "2", "--dtype", "fp32", "--checkpointing", "on", "--no-bench")
    proc = run_cli("matrix", *args, "--results", str(tmp_path / "results"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = cell_result(tmp_path / "results")
    stock = result["builds"]["stock"]["tests"]
    assert result["verdict"] == "fixed" and all(test_id.endswith("@ws2") for test_id in stock)
    assert {o["bug"] for o in stock.values() if o.get("bug") and o["outcome"] == "failed"} == {"lifecycle", "retrace", "recompute"}
    lifecycle = next(o for t, o in result["builds"]["patched"]["tests"].items() if t.startswith("test_lifecycle::"))
    assert lifecycle["properties"]["rank0.surviving_coordinators"] == lifecycle["properties"]["rank1.surviving_coordinators"] == [0, 0, 0]
    assert len(result["builds"]["stock"]["junit"]) == len(result["builds"]["stock"]["logs"]) == 2


@pytest.mark.gate
def test_interrupted_run_keeps_finished_cells(tmp_path: Path) -> None:
    """SIGTERM a two-cell run (``--jobs 2``: both cells at once) once its first cell is recorded: that
    cell survives `fixed`, the other is recorded `interrupted` with its children stopped, and a
    re-run runs only that one."""
    import os
    import signal
    import subprocess
    import sys
    import time

    results = tmp_path / "results"
    selection = ["--dtype", "fp32", "--checkpointing", "off", "--no-bench"]
    command = [sys.executable, "-m", "dsmatrix", "matrix", *selection, "--results", str(results)]
    tag = {"DSMATRIX_TEST_TAG": f"interrupted-{os.getpid()}-{time.time_ns()}"}  # inherited by every process the run starts
    env = {**os.environ, **tag}
    proc = subprocess.Popen([*command, "--jobs", "2"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    summary_path = results / "latest" / "summary.json"
    deadline = time.monotonic() + 1800
    while time.monotonic() < deadline and proc.poll() is None:
        if summary_path.is_file() and json.loads(summary_path.read_text())["cells"]:
            break
        time.sleep(0.02)  # on a warm cache the two cells finish within a second of each other
    assert proc.poll() is None, "the run ended before it could be interrupted: " + proc.communicate()[1]
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "2 cell(s) here, 2 at a time" in stdout
    assert "interrupted; 1 finished cell(s) kept" in stderr
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "interrupted"
    verdicts = {c["id"]: c["verdict"] for c in summary["cells"]}
    assert sorted(verdicts) == ["py3.11-torch2.13.0+cpu-ds0.19.2", "py3.11-torch2.13.0+cpu-ds0.19.8"]
    assert sorted(verdicts.values()) == ["fixed", "interrupted"] and summary["cells"][0]["verdict"] == "fixed"
    assert sorted(p["id"] for p in summary["planned"]) == sorted(verdicts), "the run records its plan for a merged report"
    assert not tagged_processes(tag), f"a child of the run survived: {tagged_processes(tag)}"
    assert json.loads((results / "latest" / summary["cells"][0]["file"]).read_text())["verdict"] == "fixed"
    assert not [p for p in results.rglob("*") if p.name.endswith(".tmp")]

    # Re-running the same command completes only the missing cell.
    rerun = run_cli(*command[3:], cwd=tmp_path)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "(1 already done)" in rerun.stdout
    assert f"reused the result of run {summary['run_id']}" in rerun.stdout
    started = [line for line in rerun.stdout.splitlines() if line.endswith(": running ...")]  # not the heartbeats ("running ... 10 s")
    assert len(started) == 1, started
    summary = json.loads(summary_path.read_text())
    assert summary["status"] == "complete" and [c["verdict"] for c in summary["cells"]] == ["fixed", "fixed"]
