"""What the suite's tests share: the checkout's folders, running the tool as a user would, the
processes a run left, the wheel's identity, warming the cache, and requiring a tool (strict under CI)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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


def check_one_line_error(tmp_path: Path, *args: str, expect: str, code: int = 2) -> None:
    results = tmp_path / "results"
    proc = run_cli("matrix", "--results", str(results), *args, cwd=tmp_path, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("dsmatrix: error: "), proc.stderr
    assert expect in lines[0], lines[0]
    assert not results.exists(), "bad input must not leave a results folder"


def simple_index(root: Path, wheels: list[Path]) -> str:
    """A PEP 503 package index at ``root`` serving ``wheels`` (a plain machine's stand-in for a
    package index: uv reads it as it reads PyPI); returns its file:// URL."""
    for wheel in wheels:
        project = root / wheel.name.split("-", 1)[0].lower().replace("_", "-")
        project.mkdir(parents=True, exist_ok=True)
        link = f'<a href="{wheel.resolve().as_uri()}">{wheel.name}</a>'
        (project / "index.html").write_text(f"<!DOCTYPE html><html><body>{link}</body></html>\n")
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve().as_uri()


def hide_pip_configuration(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this machine's pip configuration and local wheel folders hidden: what pip (and
    so the suite) sees on a machine with only the public package index."""
    hidden = {k: v for k, v in env.items() if not k.startswith(("PIP_", "UV_"))}
    return {**hidden, "PIP_CONFIG_FILE": os.devnull}
