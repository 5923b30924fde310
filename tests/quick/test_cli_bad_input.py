"""Bad input: one clear line on stderr naming the problem, the error's own exit code, and nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import as_root, check_one_line_error, run_cli

COORDINATOR = "deepspeed/runtime/zero/partitioned_param_coordinator.py"


def test_malformed_matrix_file(tmp_path: Path) -> None:
    bad = tmp_path / "matrix.toml"
    bad.write_text('[axes]\npython = ["3.11"\n')
    check_one_line_error(tmp_path, "--matrix", str(bad), expect=f"{bad}: not valid TOML")


def test_missing_interpreter(tmp_path: Path) -> None:
    args = ("--python", "3.99", "--torch", "2.9.1", "--deepspeed", "0.19.8")
    check_one_line_error(tmp_path, *args, expect="Python 3.99: no interpreter found", code=5)


def test_selection_that_only_hits_excluded_cells(tmp_path: Path) -> None:
    check_one_line_error(tmp_path, "--python", "3.12", expect="leaves no cell to run (2 excluded by torch-2.13.0+cpu-is-cp311-only)")


def test_missing_patch(tmp_path: Path) -> None:
    check_one_line_error(tmp_path, "--patch", "no/such/patch.diff", expect="neither a diff file nor a folder", code=6)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tier", "weekly"], "matrix.toml: no tier 'weekly' (tiers: default, smoke, "),
        (["--dtype", "fp16"], "--dtype: 'fp16' is not one of fp32, bf16"),
        (["--deepspeed", "1" * 5000], f"--deepspeed: '{'1' * 40}... (5000 characters)' is not a version"),  # beyond int() itself
        (["--bench", "--max-rounds", "2"], "--max-rounds 2: the sequential rule needs at least 3 rounds"),
        (["--bench", "--bench-minutes", "0"], "--bench-minutes 0.0: must be positive"),
        (["--bench", "--instructions-margin", "-0.01"], "--instructions-margin -0.01: must be positive"),
        (["--platform", "linux/s390x"], "--platform: 'linux/s390x' is not a platform (linux/amd64, linux/arm64)"),
        (["--jobs", "0"], "--jobs 0: must be a whole number of at least 1, or auto"),
    ],
)
def test_bad_options(tmp_path: Path, args: list[str], message: str) -> None:
    check_one_line_error(tmp_path, *args, expect=message)


def test_a_malformed_cpu_index_setting_is_named_before_anything_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSMATRIX_TORCH_CPU_INDEX", "--index-url=https://elsewhere")
    check_one_line_error(tmp_path, "--deepspeed", "0.19.8", expect="DSMATRIX_TORCH_CPU_INDEX: '--index-url=https://elsewhere' is not one")
    assert not (tmp_path / "results").exists()


def test_plan_lists_cells_without_running(tmp_path: Path) -> None:
    proc = run_cli("matrix", "--plan", "--results", str(tmp_path / "results"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "matrix(py3.11, torch2.13.0+cpu, ds0.19.2)" in proc.stdout
    assert "matrix(py3.11, torch2.13.0+cpu, ds0.19.8)" in proc.stdout
    assert not (tmp_path / "results").exists()


def test_unknown_cell_lists_the_tiers_cells(tmp_path: Path) -> None:
    check_one_line_error(
        tmp_path,
        "--cell",
        "py3.11-torch2.13.0+cpu-ds0.99.0",
        expect="--cell py3.11-torch2.13.0+cpu-ds0.99.0: not a cell of tier default on linux/amd64 (its cells: py3.11-torch2.13.0",
    )


def test_fresh_and_rerun_failed_together(tmp_path: Path) -> None:
    check_one_line_error(tmp_path, "--fresh", "--rerun-failed", expect="--fresh and --rerun-failed: choose one")


def test_malformed_matrix_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "matrix.toml"
    good = (Path(__file__).parents[2] / "matrix" / "matrix.toml").read_text()
    bad.write_text(good.replace('dtype = ["fp32", "bf16"]', 'dtype = ["fp32", "fp16"]', 1))
    line = next(n for n, text in enumerate(bad.read_text().splitlines(), 1) if text.startswith("dtype ="))
    check_one_line_error(tmp_path, "--matrix", str(bad), expect=f"{bad}:{line}: axes.dtype.1: 'fp16' is not one of ['fp32', 'bf16']")


@pytest.mark.parametrize("damage", ["truncated", "foreign"])
def test_report_on_a_damaged_results_file(tmp_path: Path, damage: str) -> None:
    """A results store whose summary was cut short, or is some other tool's JSON: one line, exit 9."""
    run = tmp_path / "results" / "20261201-000000-abcd"
    run.mkdir(parents=True)
    summary = run / "summary.json"
    summary.write_text('{"schema": 1, "run_id": "x", "cells": [' if damage == "truncated" else '{"name": "not ours"}')
    proc = run_cli("report", str(tmp_path / "results"), "--output", str(tmp_path / "reports"), cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 9 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"dsmatrix: error: {summary}: "), lines[0]
    assert ("truncated or not JSON" if damage == "truncated" else "not a dsmatrix result") in lines[0]


def test_malformed_project_matrix_keeps_every_nox_session_usable(tmp_path: Path) -> None:
    """A broken matrix/matrix.toml: `nox -l` lists the sessions (none per cell) and says why in one line, no traceback."""
    import shutil
    import subprocess
    import sys

    checkout = Path(__file__).parents[2]
    copy = tmp_path / "checkout"
    shutil.copytree(checkout, copy, ignore=shutil.ignore_patterns(".nox", ".git", "results", "reports", "act-run", "__pycache__"))
    (copy / "matrix" / "matrix.toml").write_text('[axes]\npython = ["3.11"\n')
    proc = subprocess.run([sys.executable, "-m", "nox", "-l"], cwd=copy, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("noxfile: error:")]
    assert len(errors) == 1 and "not valid TOML" in errors[0] and "(no per-cell sessions listed)" in errors[0], proc.stderr
    sessions = [line.split()[1] for line in proc.stdout.splitlines() if line[:2] in ("* ", "- ")]
    assert {"tests", "lint", "matrix"} <= set(sessions) and not any(s.startswith("matrix(") for s in sessions), sessions


def test_no_disk(tmp_path: Path) -> None:
    """A cache on a 2 MiB filesystem: refused up front with the estimate, exit 8, nothing downloaded."""
    import os
    import subprocess

    root = as_root()  # mounting a small tmpfs needs root
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run([*root, "mount", "-t", "tmpfs", "-o", f"size=2m,uid={os.geteuid()},gid={os.getegid()}", "tmpfs", str(small)], check=True)
    try:
        check_one_line_error(tmp_path, "--cache-dir", str(small), expect=f"{small}: even one torch set at a time", code=8)
        off = ("--cache-dir", str(small), "--low-disk", "off")
        check_one_line_error(tmp_path, *off, expect=f"{small}: the selected cells need about", code=8)
        assert not (small / "sdists").exists()
    finally:
        subprocess.run([*root, "umount", str(small)], check=True)


def test_missing_prerequisites_are_named_one_line_each_before_any_download(tmp_path: Path) -> None:
    """No g++ and a patch that is not GNU's: both named, with how to get them, before the inputs
    are checked (nothing downloaded, nothing written)."""
    import os
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "patch").write_text("#!/bin/sh\necho 'patch 2.5.9 (BSD)'\n")
    (bin_dir / "patch").chmod(0o755)
    env = {**os.environ, "PATH": str(bin_dir)}  # the interpreters come from pyenv's folder
    command = [sys.executable, "-m", "dsmatrix", "matrix", "--deepspeed", "0.19.8", "--results", str(tmp_path / "results")]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == [
        "dsmatrix: error: g++ (DeepSpeed compiles its CPU comm op with it when the tests start): apt-get install g++",
        "dsmatrix: error: GNU patch (applies the fix's diffs; found: patch 2.5.9 (BSD)): apt-get install patch",
    ]
    assert "checking the inputs: torch" not in proc.stdout and not (tmp_path / "results").exists()


def test_missing_python_headers_name_the_debian_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsmatrix.execute import preflight

    monkeypatch.setattr(preflight, "headers_missing", lambda interpreter: "/usr/include/python3.11")
    (line,) = [m for m in preflight.missing_prerequisites(["3.11"]) if "headers" in m]
    assert line == "Python 3.11's headers (Python.h in /usr/include/python3.11, for the same compile): apt-get install python3.11-dev"


def test_a_git_source_without_git_says_so(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PATH": str(tmp_path)}
    command = [sys.executable, "-m", "dsmatrix", "matrix", "--deepspeed", "git:https://example.invalid/DeepSpeed@master", "--plan"]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (3, "dsmatrix: error: git (DeepSpeed from git, --deepspeed git:...): apt-get install git\n")
