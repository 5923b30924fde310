"""Bad input: one clear line on stderr naming the problem, the error's own exit code, and nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import FIXTURES, run_cli

COORDINATOR = "deepspeed/runtime/zero/partitioned_param_coordinator.py"


def check_one_line_error(tmp_path: Path, *args: str, expect: str, code: int = 2) -> None:
    results = tmp_path / "results"
    proc = run_cli("matrix", "--results", str(results), *args, cwd=tmp_path, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("dsmatrix: error: "), proc.stderr
    assert expect in lines[0], lines[0]
    assert not results.exists(), "bad input must not leave a results folder"


def test_malformed_matrix_file(tmp_path: Path) -> None:
    bad = tmp_path / "matrix.toml"
    bad.write_text('[axes]\npython = ["3.11"\n')
    check_one_line_error(tmp_path, "--matrix", str(bad), expect=f"{bad}: not valid TOML")


def test_missing_interpreter(tmp_path: Path) -> None:
    args = ("--python", "3.99", "--torch", "2.9.1", "--deepspeed", "0.19.8")
    check_one_line_error(tmp_path, *args, expect="Python 3.99: no interpreter found", code=5)


def test_selection_that_only_hits_excluded_cells(tmp_path: Path) -> None:
    check_one_line_error(tmp_path, "--python", "3.12", expect="leaves no cell to run (2 excluded by torch-2.13.0+cpu-is-cp311-only)")


def test_unknown_torch_version(tmp_path: Path) -> None:
    check_one_line_error(
        tmp_path, "--torch", "9.9.9", "--deepspeed", "0.19.8", expect="torch==9.9.9 for Python 3.11: not installable here", code=4
    )


def test_unknown_deepspeed_version(tmp_path: Path) -> None:
    check_one_line_error(tmp_path, "--deepspeed", "0.19.99", expect="DeepSpeed 0.19.99: sdist not downloadable", code=4)


def test_deepspeed_version_without_a_diff(tmp_path: Path) -> None:
    check_one_line_error(tmp_path, "--deepspeed", "0.13.1", expect="DeepSpeed 0.13.1: no diff covers it", code=6)


def test_patch_that_does_not_apply(tmp_path: Path) -> None:
    candidate = FIXTURES / "panel" / "no-clear-on-invalidation" / "deepspeed-0.19.3-and-later.diff"  # has the 0.19.3+ union hunk
    check_one_line_error(
        tmp_path,
        "--patch",
        str(candidate),
        "--deepspeed",
        "0.19.2",
        expect=f"DeepSpeed 0.19.2: deepspeed-0.19.3-and-later.diff does not apply: {COORDINATOR} hunk #",
        code=7,
    )


def test_missing_patch(tmp_path: Path) -> None:
    check_one_line_error(tmp_path, "--patch", "no/such/patch.diff", expect="neither a diff file nor a folder", code=6)


@pytest.mark.parametrize(
    "args",
    [
        ["--tier", "weekly"],
        ["--dtype", "fp16"],
        ["--bench", "--max-rounds", "2"],
        ["--bench", "--bench-minutes", "0"],
        ["--bench", "--instructions-margin", "-0.01"],
        ["--platform", "linux/s390x"],
    ],
)
def test_bad_options(tmp_path: Path, args: list[str]) -> None:
    check_one_line_error(tmp_path, *args, expect="")


def test_plan_lists_cells_without_running(tmp_path: Path) -> None:
    proc = run_cli("matrix", "--plan", "--results", str(tmp_path / "results"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "matrix(py3.11, torch2.13.0+cpu, ds0.19.2)" in proc.stdout
    assert "matrix(py3.11, torch2.13.0+cpu, ds0.19.8)" in proc.stdout
    assert not (tmp_path / "results").exists()
