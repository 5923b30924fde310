"""The suite's own tests: pure logic without DeepSpeed, plus CLI bad-input checks and one
end-to-end cell (marked ``e2e``) on real DeepSpeed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"


@pytest.fixture
def repo() -> Path:
    return REPO


def run_cli(*args: str, cwd: Path, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    """Run ``python -m dsmatrix`` as a user would (fresh process, real arguments)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "dsmatrix", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def run_outside(command: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a command as a user's shell would, without this test process's virtual environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**env, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="session")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tool as a user installs it: the wheel built from this checkout in a fresh venv; returns its bin folder."""
    root = tmp_path_factory.mktemp("installed")
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", str(REPO), "-w", str(root / "dist")]
    built = run_outside(command, cwd=root, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = (root / "dist").glob("dsmatrix-*.whl")
    venv = root / "venv"
    assert run_outside([sys.executable, "-m", "venv", str(venv)], cwd=root).returncode == 0
    install = run_outside([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)], cwd=root, timeout=900)
    assert install.returncode == 0, install.stderr
    return venv / "bin"


# ``nox -s tests`` runs the real cells two at a time, a file per worker (``-n 2 --dist loadfile``:
# a file's tests keep their order and their module fixtures). The images' file goes first: it is
# the longest (the arm64 base built under qemu, mostly one core and the disk), so the other worker
# takes the CPU-bound cells beside it. In turn, in a fresh CI run here, the images took 728 s and
# the other files 1411 s.
FIRST = "test_images_e2e.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The images' tests first; the rest keep their order (a stable sort)."""
    items.sort(key=lambda item: item.path.name != FIRST)
