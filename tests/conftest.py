"""The suite's own tests: ``quick/`` needs nothing downloaded (pure logic, CLI bad input, the report in
a browser); ``e2e/`` runs cells on real DeepSpeed (markers ``e2e``, ``panel``, ``faults``, ``docker``,
``network``), its tests also marked ``gate`` being the landing gate's real part (``nox -s tests``),
the rest the acceptance session's (``nox -s acceptance``); ``workflows/`` runs the GitHub workflows
under act. Helpers are in ``helpers.py``."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from deepspeed_repo import git
from filelock import FileLock
from helpers import REPO, run_outside, shared_folder, source_hash, warm


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def installed(request: pytest.FixtureRequest) -> Path:
    """The tool as a user installs it: the wheel built from this checkout in a fresh venv; returns its bin folder.

    Built once per source hash, under a lock, in pytest's cache folder: both xdist workers and later
    runs of the same code take the same one."""
    root = shared_folder(request, f"installed-{source_hash()[:16]}")
    done = root / "complete"
    with FileLock(f"{root}.lock"):
        if not done.is_file():
            shutil.rmtree(root / "dist", ignore_errors=True)
            shutil.rmtree(root / "venv", ignore_errors=True)
            command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", str(REPO), "-w", str(root / "dist")]
            built = run_outside(command, cwd=root, timeout=600)
            assert built.returncode == 0, built.stderr
            (wheel,) = (root / "dist").glob("dsmatrix-*.whl")
            venv = root / "venv"
            assert run_outside([sys.executable, "-m", "venv", str(venv)], cwd=root).returncode == 0
            install = run_outside([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(wheel)], cwd=root, timeout=900)
            assert install.returncode == 0, install.stderr
            done.touch()
    return root / "venv" / "bin"


@pytest.fixture(scope="session")
def warm_cache(request: pytest.FixtureRequest) -> Path:
    """The suite's default cache warmed once for every real test of a run (both xdist workers wait for
    the one that warms it), so that their durations are their own work."""
    from dsmatrix.infra.cache import default_root

    root = default_root()
    with FileLock(str(shared_folder(request, "warm-up")) + ".lock"):
        took = warm(root)
    print(f"warm-up: sdists and builder environment in {root.name}/ ready after {took:.0f} s")
    return root


# The real cells run two at a time, a file per worker (``-n 2 --dist loadfile``: a file's tests keep
# their order and their module fixtures; xdist deals the first files out in turn). The longest files
# go first, so they start on different workers: the images' (the arm64 base and a cell under qemu,
# mostly one core and the disk) in the acceptance session; in the gate the end-to-end cells and the
# panel, with the short files after them.
FIRST = ("test_images.py", "test_end_to_end.py", "test_panel.py")


REAL_MARKERS = ("e2e", "panel", "faults", "docker", "network", "gate")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first, in FIRST's order; the rest keep their order (a stable sort). A test
    in ``quick/`` marked as real work is a collection error: the folder is the gate's promise."""
    misplaced = [i.nodeid for i in items if i.path.parent.name == "quick" and any(i.get_closest_marker(m) for m in REAL_MARKERS)]
    if misplaced:
        raise pytest.UsageError(f"tests/quick holds quick tests only; these are marked as real work: {', '.join(misplaced)}")
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))


@pytest.fixture
def fake_repo(tmp_path: Path) -> Path:
    """A tiny repository shaped like DeepSpeed's: master (0.19.6), a tag, a branch that changes a file, a PR ref."""
    repo = tmp_path / "DeepSpeed"
    (repo / "deepspeed").mkdir(parents=True)
    (repo / "version.txt").write_text("0.19.6\n")
    (repo / "deepspeed" / "coordinator.py").write_text("def release():\n    return 1\n")
    git(repo, "init", "-q", "-b", "master")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    git(repo, "tag", "v0.19.6")
    git(repo, "checkout", "-qb", "fix")
    (repo / "deepspeed" / "coordinator.py").write_text("def release():\n    cache = {}\n    return cache\n")
    git(repo, "commit", "-qam", "fix")
    git(repo, "update-ref", "refs/pull/7/head", "fix")
    git(repo, "checkout", "-q", "master")
    return repo
