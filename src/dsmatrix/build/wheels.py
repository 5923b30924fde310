"""Stock and patched DeepSpeed wheels, built once from the source and cached.

The source is the release's PyPI sdist, or for a git source the commit's exported tree. DeepSpeed
ships only an sdist whose ``setup.py`` imports torch, so wheels are built in a builder
environment that has the cell's Python and torch, without build isolation. The patched wheel
carries a local version label ``+patched.<sha12>`` (``+git.<commit>`` for a commit's own build)
and a ``build.json`` sidecar with the patch's sha256. Cache key: (release or commit, Python,
torch, stock | patch sha256). In PR mode the patched build is the head commit's own build: no
diff is applied.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dsmatrix.build.environments import Environment, ensure_environment
from dsmatrix.build.patches import PatchSet, apply_diff
from dsmatrix.build.sources import source_tarball
from dsmatrix.infra import processes, progress
from dsmatrix.infra.cache import Cache, materialise
from dsmatrix.infra.errors import BuildError, UnknownVersionError
from dsmatrix.infra.interpreters import find_interpreter
from dsmatrix.plan.cells import Cell

SDIST = "deepspeed-{}.tar.gz"
BUILD_REQUIREMENTS = ("setuptools", "wheel", "pip", "packaging", "ninja", "numpy", "py-cpuinfo", "psutil")


@dataclass(frozen=True)
class BuiltWheel:
    build: str  # "stock" or "patched"
    wheel: Path
    info: dict[str, object]


def fetch_sdist(deepspeed: str, cache: Cache) -> Path:
    """The DeepSpeed sdist for ``deepspeed``, downloaded once into the cache."""

    def download(staging: Path) -> None:
        progress.stage(f"downloading the DeepSpeed {deepspeed} sdist")
        proc = processes.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"deepspeed=={deepspeed}",
                "-d",
                str(staging),
            ],
            capture_output=True,
            text=True,
        )
        files = list(staging.glob("deepspeed-*.tar.gz"))
        if proc.returncode != 0 or len(files) != 1:
            lines = [_shorten_versions(ln) for ln in proc.stderr.splitlines() if ln.startswith("ERROR")]
            raise UnknownVersionError(f"DeepSpeed {deepspeed}: sdist not downloadable: {' '.join(lines) or proc.stderr.strip()[-300:]}")
        os.replace(files[0], staging / SDIST.format(deepspeed))

    folder = materialise(cache.sdist(deepspeed), lambda entry: (entry / SDIST.format(deepspeed)).is_file(), download)
    return folder / SDIST.format(deepspeed)


def _shorten_versions(line: str) -> str:
    """pip's "(from versions: <every release>)" cut to the newest few, so the error stays one readable line."""
    return re.sub(r"\(from versions: ([^)]*)\)", lambda m: f"(newest: {', '.join(m.group(1).split(', ')[-6:])})", line)


def unpack_sdist(sdist: Path, into: Path) -> Path:
    """The source tree of an sdist or a git archive: exactly one top folder, every member inside ``into``
    (tar's ``data`` filter: no absolute names, no links out, no devices), or a one-line BuildError."""
    try:
        with tarfile.open(sdist) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(into, filter="data")
            else:  # Python < 3.11.4 (Debian bookworm's 3.11.2, in the images): refuse unsafe members by hand
                for member in tar.getmembers():
                    if member.name.startswith("/") or ".." in Path(member.name).parts or member.issym() or member.islnk():
                        raise BuildError(f"{sdist.name}: unsafe member {member.name[:120]!r}")
                tar.extractall(into)
    except (tarfile.TarError, OSError, EOFError) as exc:  # FilterError is a TarError; a cut gzip stream, an EOFError
        raise BuildError(f"{sdist.name}: cannot unpack: {str(exc)[:200]}") from None
    tops = sorted(into.iterdir())
    if len(tops) != 1 or not tops[0].is_dir():
        raise BuildError(f"{sdist.name}: holds {len(tops)} top-level entries, not one source folder")
    return tops[0]


def build_key(patch: PatchSet | None) -> str:
    """Cache key of a build: ``stock`` or ``patched-<sha12>``."""
    return f"patched-{patch.short}" if patch else "stock"


def source_archive(cell: Cell, cache: Cache, build: str = "stock") -> Path:
    """The source tarball a build of ``cell`` starts from: the release sdist or the commit's tree."""
    if cell.source:
        return source_tarball(cell.source.commit_for(build), cache)
    return fetch_sdist(cell.deepspeed, cache)


def _applied_patch(cell: Cell, patch: PatchSet | None) -> PatchSet | None:
    """The diff a build applies: none for stock, none for PR mode (the head carries the change)."""
    return None if cell.source and cell.source.pr else patch


def source_name(cell: Cell) -> str:
    """How errors name a cell's DeepSpeed: ``0.19.8`` or ``git:LOCATION@REF (0.19.6, edaa722126)``."""
    if cell.source:
        return f"{cell.source.base.spec} ({cell.deepspeed}, {cell.source.base.short})"
    return cell.deepspeed


def builder_environment(cell: Cell, cache: Cache) -> Environment:
    """An environment with the cell's Python and torch plus setup.py's build needs."""
    interpreter = find_interpreter(cell.python)
    requirements = [f"torch=={cell.torch}", *BUILD_REQUIREMENTS]
    path = cache.builder(cell.python, cell.torch, {"interpreter": str(interpreter), "requirements": requirements})
    if not (path / "bin" / "python").exists():
        progress.stage(f"builder environment (torch {cell.torch}; another build may be creating it)")
    return ensure_environment(path, interpreter, requirements, f"{cell.label} builder")


def build_wheel(cell: Cell, cache: Cache, patch: PatchSet | None) -> BuiltWheel:
    """Build (or reuse) the stock wheel (``patch=None``) or the patched wheel for ``cell``."""
    build = "patched" if patch else "stock"
    source_key = cell.source.commit_for(build).key if cell.source else cell.deepspeed
    applied = _applied_patch(cell, patch)
    folder = materialise(
        cache.wheel(source_key, cell.python, cell.torch, build_key(applied)),
        _wheel_complete,
        lambda staging: _build_wheel(cell, cache, build, applied, staging),
    )
    info = json.loads((folder / "build.json").read_text())
    if "patch_source" in info:  # a wheel cached by any checkout: its patch by name, never that checkout's path
        info["patch_source"] = Path(str(info["patch_source"])).name
    return BuiltWheel(build, folder / str(info["wheel"]), info)


def _wheel_complete(folder: Path) -> bool:
    try:
        info = json.loads((folder / "build.json").read_text())
    except (OSError, ValueError):
        return False
    return (folder / str(info.get("wheel", ""))).is_file()


def _build_wheel(cell: Cell, cache: Cache, build: str, patch: PatchSet | None, out: Path) -> None:
    builder = builder_environment(cell, cache)
    sdist = source_archive(cell, cache, build)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f"{out.name}-src-") as tmp:
        tree = unpack_sdist(sdist, Path(tmp))
        env = {**os.environ, "PIP_NO_INPUT": "1"}
        env.pop("DS_BUILD_STRING", None)
        info: dict[str, object] = {"deepspeed": cell.deepspeed, "python": cell.python, "torch": cell.torch, "build": build}
        label = ""
        if cell.source:  # setup.py would ask git for a hash (of whatever repository holds the cache)
            commit = cell.source.commit_for(build)
            label = f"+git.{commit.short}"
            info.update(git=commit.as_dict())
        if patch:
            diff = patch.diff_for(cell.deepspeed)
            apply_diff(diff, tree, source_name(cell))
            label = f"{label}.patched.{patch.short}" if label else f"+patched.{patch.short}"
            info.update(patch_sha256=patch.sha256, patch_source=str(patch.source), diff=diff.name)
        if label:
            env["DS_BUILD_STRING"] = label
        progress.stage(f"building the {build} wheel")
        proc = processes.run(
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
