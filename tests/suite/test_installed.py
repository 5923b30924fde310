"""The tool as a user installs it (the ``installed`` fixture: a wheel in a fresh virtual
environment), run from a folder outside the checkout: it plans with its bundled matrix, and a wheel
missing that file fails in one line naming it. test_end_to_end runs a cell with it."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import REPO, run_outside

from dsmatrix.hosts import native_platform
from dsmatrix.matrix import load_matrix


def test_installed_wheel_plans_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    plan = run_outside([str(installed / "dsmatrix"), "matrix", "--plan", "--json"], cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    default = load_matrix(REPO / "matrix" / "matrix.toml").tier("default").on(native_platform())
    assert {c["deepspeed"] for c in json.loads(plan.stdout)["include"]} == set(default.values["deepspeed"])


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
