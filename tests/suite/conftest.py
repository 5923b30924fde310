"""The suite's own tests. Quick ones (pure logic, CLI bad input, the report in a browser) need
nothing downloaded; the real ones run cells on real DeepSpeed, marked ``e2e``, ``panel``,
``faults``, ``docker`` or ``network``. Those also marked ``gate`` are the landing gate's real part
(``nox -s tests``); the rest run in the acceptance session (``nox -s acceptance``)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
# What a wheel of this checkout is built from (pyproject.toml maps these folders into the package).
WHEEL_SOURCES = ("pyproject.toml", "src", "matrix", "patches", "containers")


def strict() -> bool:
    """CI (``CI`` set) and the acceptance session: a missing tool is a failure, never a skip."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false") or os.environ.get("DSMATRIX_ACCEPTANCE") == "1"


def require(present: object, what: str) -> None:
    """A test's tool: skipped with ``what`` on a developer's machine, failed naming it under CI or in the acceptance session."""
    if present:
        return
    if strict():
        pytest.fail(f"missing: {what} (with CI set and in the acceptance session a missing tool fails the test)", pytrace=False)
    pytest.skip(f"missing: {what}")


def as_root() -> list[str]:
    """The prefix that runs a command as root here: none as root, ``sudo -n`` where that works; else the test needs root."""
    if os.geteuid() == 0:
        return []
    sudo = shutil.which("sudo")
    if sudo and subprocess.run([sudo, "-n", "true"], capture_output=True).returncode == 0:
        return [sudo, "-n"]
    require(False, "root (or passwordless sudo)")
    return []


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


def tagged_processes(tag: dict[str, str]) -> list[int]:
    """The processes whose environment carries ``tag`` (one NAME=value a test gave the run it started, which
    every descendant inherits): what a run left behind, never another process of the machine."""
    ((name, value),) = tag.items()
    wanted = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and wanted in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return [pid for pid in found if pid != os.getpid()]


def source_hash() -> str:
    """sha256 of every file a wheel of this checkout is built from: the installed tool's identity."""
    digest = hashlib.sha256()
    for top in WHEEL_SOURCES:
        path = REPO / top
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        for file in files:
            digest.update(str(file.relative_to(REPO)).encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def shared_folder(request: pytest.FixtureRequest, name: str) -> Path:
    """A folder every xdist worker of a run, and later runs, see: in pytest's cache (``.pytest_cache``),
    or with the cache provider off in the run's temporary root."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        return cache.mkdir(name)
    folder = request.getfixturevalue("tmp_path_factory").getbasetemp().parent / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


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


DEFAULT_CELL = ("3.11", "2.13.0+cpu", "0.19.8")  # the cell the real tests run on (0.19.2 beside it in two-cell runs)


def warm(cache_root: Path, versions: tuple[str, ...] = ("0.19.8", "0.19.2")) -> float:
    """The sdists of ``versions`` and the default cell's builder environment in the cache at
    ``cache_root``: the cold set-up a real test would otherwise pay inside its own duration. Returns
    the seconds it took (about none when they are there)."""
    import time

    from dsmatrix.build.wheels import builder_environment, fetch_sdist
    from dsmatrix.infra.cache import Cache
    from dsmatrix.plan.cells import Cell

    started = time.monotonic()
    cache = Cache(cache_root)
    for version in versions:
        fetch_sdist(version, cache)
    builder_environment(Cell(*DEFAULT_CELL), cache)
    return time.monotonic() - started


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
FIRST = ("test_images_e2e.py", "test_end_to_end.py", "test_panel.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first, in FIRST's order; the rest keep their order (a stable sort)."""
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))
