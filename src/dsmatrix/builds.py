"""Stock and patched DeepSpeed wheels, built once from the PyPI sdist and cached.

DeepSpeed ships only an sdist whose ``setup.py`` imports torch, so wheels are built in a
builder environment that has the cell's Python and torch, without build isolation. The
patched wheel carries a local version label ``+patched.<sha12>`` and a ``build.json``
sidecar with the patch's sha256. Cache key: (DeepSpeed, Python, torch, stock | patch sha256).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from dsmatrix.cells import Cell
from dsmatrix.environments import Environment, ensure_environment, find_interpreter
from dsmatrix.errors import BuildError, UnknownVersionError
from dsmatrix.patches import PatchSet, apply_diff

BUILD_REQUIREMENTS = ("setuptools", "wheel", "pip", "packaging", "ninja", "numpy", "py-cpuinfo", "psutil")


@dataclass(frozen=True)
class BuiltWheel:
    build: str  # "stock" or "patched"
    wheel: Path
    info: dict[str, object]


def fetch_sdist(deepspeed: str, cache: Path) -> Path:
    """The DeepSpeed sdist for ``deepspeed``, downloaded once into the cache (under a lock)."""
    target = cache / "sdists" / f"deepspeed-{deepspeed}.tar.gz"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):
        return _fetch_sdist(deepspeed, target)


def _fetch_sdist(deepspeed: str, target: Path) -> Path:
    if target.is_file():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", f"deepspeed=={deepspeed}", "-d", tmp],
            capture_output=True,
            text=True,
        )
        files = list(Path(tmp).glob("deepspeed-*.tar.gz"))
        if proc.returncode != 0 or len(files) != 1:
            lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("ERROR")]
            raise UnknownVersionError(f"DeepSpeed {deepspeed}: sdist not downloadable: {' '.join(lines) or proc.stderr.strip()[-300:]}")
        os.replace(files[0], target)
    return target


def unpack_sdist(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(into, filter="data")
        else:  # Python < 3.11.4 (Debian bookworm's 3.11.2, in the images): refuse unsafe members by hand
            for member in tar.getmembers():
                if member.name.startswith("/") or ".." in Path(member.name).parts or member.issym() or member.islnk():
                    raise UnknownVersionError(f"{sdist.name}: unsafe member {member.name!r}")
            tar.extractall(into)
    (tree,) = [p for p in into.iterdir() if p.is_dir()]
    return tree


def builder_dir(python: str, torch: str, cache: Path) -> Path:
    """Where the builder for (Python, torch) lives; it exists once that torch set is cached."""
    return cache / "builders" / f"py{python}-torch{torch}"


def build_key(patch: PatchSet | None) -> str:
    """Cache key of a build: ``stock`` or ``patched-<sha12>``."""
    return f"patched-{patch.short}" if patch else "stock"


def builder_environment(cell: Cell, cache: Path) -> Environment:
    """An environment with the cell's Python and torch plus setup.py's build needs."""
    return ensure_environment(
        builder_dir(cell.python, cell.torch, cache),
        find_interpreter(cell.python),
        [f"torch=={cell.torch}", *BUILD_REQUIREMENTS],
        f"{cell.label} builder",
    )


def _wheel_dir(cell: Cell, cache: Path, patch: PatchSet | None) -> Path:
    return cache / "wheels" / f"deepspeed-{cell.deepspeed}" / f"py{cell.python}-torch{cell.torch}" / build_key(patch)


def build_wheel(cell: Cell, cache: Path, patch: PatchSet | None) -> BuiltWheel:
    """Build (or reuse) the stock wheel (``patch=None``) or the patched wheel for ``cell``.

    Under a lock per wheel, so runs sharing the cache never build (or replace) one at once.
    """
    final = _wheel_dir(cell, cache, patch)
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{final}.lock"):
        return _build_wheel(cell, cache, patch, final)


def _build_wheel(cell: Cell, cache: Path, patch: PatchSet | None, final: Path) -> BuiltWheel:
    build = "patched" if patch else "stock"
    sidecar = final / "build.json"
    if sidecar.is_file():
        info = json.loads(sidecar.read_text())
        wheel = final / str(info["wheel"])
        if wheel.is_file():
            return BuiltWheel(build, wheel, info)
    builder = builder_environment(cell, cache)
    sdist = fetch_sdist(cell.deepspeed, cache)
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{final.name}-") as tmp:
        tree = unpack_sdist(sdist, Path(tmp) / "src")
        env = {**os.environ, "PIP_NO_INPUT": "1"}
        env.pop("DS_BUILD_STRING", None)
        info: dict[str, object] = {"deepspeed": cell.deepspeed, "python": cell.python, "torch": cell.torch, "build": build}
        if patch:
            diff = patch.diff_for(cell.deepspeed)
            apply_diff(diff, tree, cell.deepspeed)
            env["DS_BUILD_STRING"] = f"+patched.{patch.short}"
            info.update(patch_sha256=patch.sha256, patch_source=str(patch.source), diff=diff.name)
        out = Path(tmp) / "out"
        proc = subprocess.run(
            [str(builder.python), "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--quiet", str(tree), "-w", str(out)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tree,
        )
        wheels = list(out.glob("deepspeed-*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            tail = [ln for ln in proc.stderr.splitlines() if "rror" in ln][-2:] or proc.stderr.strip().splitlines()[-2:]
            raise BuildError(f"{cell.label}: building the {build} wheel failed: {' '.join(tail)}")
        wheel = wheels[0]
        info.update(wheel=wheel.name, wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), builder=builder.installed)
        (out / "build.json").write_text(json.dumps(info, indent=2))
        if final.exists():
            shutil.rmtree(final)
        os.replace(out, final)
    return BuiltWheel(build, final / wheel.name, info)
