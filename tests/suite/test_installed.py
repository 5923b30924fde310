"""The tool as a user installs it: a wheel in a fresh virtual environment, run from a folder
outside the checkout, plans and runs a default-tier cell; a wheel missing a data file fails in one
line naming it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO


def _run(command: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**env, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel built from this checkout; returns its bin folder."""
    root = tmp_path_factory.mktemp("installed")
    built = _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", str(REPO), "-w", str(root / "dist")], cwd=root, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = (root / "dist").glob("dsmatrix-*.whl")
    venv = root / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], cwd=root).returncode == 0
    install = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)], cwd=root, timeout=900)
    assert install.returncode == 0, install.stderr
    return venv / "bin"


@pytest.mark.e2e
def test_installed_wheel_plans_and_runs_a_cell_outside_the_checkout(installed: Path, tmp_path: Path) -> None:
    plan = _run([str(installed / "dsmatrix"), "matrix", "--plan", "--json"], cwd=tmp_path)
    assert plan.returncode == 0, plan.stderr
    cells = json.loads(plan.stdout)["include"]
    assert {c["deepspeed"] for c in cells} == {"0.19.2", "0.19.8"}

    proc = _run([str(installed / "dsmatrix"), "matrix", "--deepspeed", "0.19.8", "--results", "results"], cwd=tmp_path, timeout=3000)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (cell_file,) = {p.resolve() for p in (tmp_path / "results").glob("*/cells/*.json")}
    cell = json.loads(cell_file.read_text())
    assert cell["verdict"] == "fixed", cell["reasons"]
    ran = set(cell["builds"]["patched"]["tests"])
    assert any(t.startswith("test_lifecycle::") for t in ran) and any(t.startswith("test_retrace::") for t in ran)
    assert cell["patch"]["source"].startswith(str(installed.parent)), "the fix must come from the installed package"


def test_wheel_missing_its_matrix_fails_in_one_line(installed: Path, tmp_path: Path) -> None:
    """Breaking the wheel's data (what the scheduled workflow's plan step once hit) is one clear line."""
    site = _run([str(installed / "python"), "-c", "import dsmatrix, os; print(os.path.dirname(dsmatrix.__file__))"], cwd=tmp_path)
    bundled = Path(site.stdout.strip()) / "bundled" / "matrix" / "matrix.toml"
    assert bundled.is_file()
    bundled.unlink()  # unlink only: never edit a file an installer may have hardlinked
    try:
        proc = _run([str(installed / "dsmatrix"), "matrix", "--plan"], cwd=tmp_path)
    finally:
        bundled.write_bytes((REPO / "matrix" / "matrix.toml").read_bytes())  # a new file, for the other test
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "matrix.toml" in line and "not found" in line
