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


# The real cells in two lanes under ``-n 2 --dist loadgroup`` (``nox -s tests``), each in order:
# the images built from nothing (docker, the arm64 base under qemu: mostly one core and the disk),
# then the git sources; beside them the other cells. Run in turn in a fresh CI run here, the two
# lanes took about the same (images 728 s + git 330 s; bench, faults and end to end 1077 s). The
# images go first: with the git sources first, both lanes were CPU-bound together and the images
# then ran alone with a core idle.
LANE_OF_FILE = {"test_images_e2e.py": "lane-1", "test_git_sources_e2e.py": "lane-1"}
FIRST = "test_images_e2e.py"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put every real cell but the panel's (which runs on its own, two at a time) in its lane; the
    images' tests first."""
    items.sort(key=lambda item: item.path.name != FIRST)  # stable: the rest keep their order
    for item in items:
        if item.get_closest_marker("panel") or not (item.get_closest_marker("e2e") or item.get_closest_marker("faults")):
            continue
        item.add_marker(pytest.mark.xdist_group(LANE_OF_FILE.get(item.path.name, "lane-2")))
