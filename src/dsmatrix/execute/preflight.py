"""What a cell must pass before anything runs: interpreters, torch versions, the fix applying to each source."""

from __future__ import annotations

import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from dsmatrix.build.environments import check_installable, torch_cpu_index, uv_executable
from dsmatrix.build.patches import PatchSet, apply_diff
from dsmatrix.build.wheels import source_archive, source_name, unpack_sdist
from dsmatrix.infra import progress
from dsmatrix.infra.cache import Cache
from dsmatrix.infra.errors import MissingPrerequisites
from dsmatrix.infra.interpreters import find_interpreter, headers_missing
from dsmatrix.plan.cells import Cell, Selection


def cache_size() -> str:
    """uv's own report of its cache size (the bulk of the disk the matrix uses)."""
    proc = subprocess.run([uv_executable(), "cache", "size", "--human"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def missing_prerequisites(pythons: Sequence[str]) -> list[str]:
    """What this machine lacks to build and test cells here with these Pythons (found already):
    one line each, naming what needs it and how to get it (Debian's package names)."""
    if platform.system() != "Linux":
        return [f"Linux: cells run DeepSpeed's CPU build on Linux only (this is {platform.system()}); use a Linux machine, VM or CI"]
    missing = []
    if shutil.which("g++") is None:
        missing.append("g++ (DeepSpeed compiles its CPU comm op with it when the tests start): apt-get install g++")
    for python in pythons:
        where = headers_missing(find_interpreter(python))
        if where:
            missing.append(f"Python {python}'s headers (Python.h in {where}, for the same compile): apt-get install python{python}-dev")
    version = subprocess.run(["patch", "--version"], capture_output=True, text=True) if shutil.which("patch") else None
    if version is None or "GNU patch" not in version.stdout:
        found = version.stdout.splitlines()[0] if version and version.stdout else "none on PATH"
        missing.append(f"GNU patch (applies the fix's diffs; found: {found}): apt-get install patch")
    return missing


def preflight(selection: Selection, bench: bool = False) -> None:
    """Check what the run depends on before anything is downloaded: the tools and headers, the
    interpreters, the torch versions; raises a FatalError, one line per problem (``check_patch``
    checks the fix)."""
    pythons = sorted({c.python for c in selection.cells})
    for python in pythons:
        find_interpreter(python)
    missing = missing_prerequisites(pythons) if selection.cells else []
    if missing:
        raise MissingPrerequisites(missing)
    if bench and selection.cells and shutil.which("valgrind") is None:
        print("dsmatrix: valgrind is not installed: instructions are not counted, step time alone decides throughput "
              "(apt-get install valgrind)", flush=True)  # fmt: skip
    if any(c.torch.endswith("+cpu") for c in selection.cells):
        torch_cpu_index()  # a malformed setting is named even where pip's sources hold the wheel
    for python, torch in sorted({(c.python, c.torch) for c in selection.cells}):
        progress.stage(f"checking the inputs: torch {torch} for Python {python}")
        check_installable(f"torch=={torch}", python)


def check_patch(cells: Sequence[Cell], patch: PatchSet, cache: Cache) -> None:
    """Every DeepSpeed source has a diff, and it applies to that release's sdist or commit's tree
    (any platform). PR mode applies nothing: the head commit carries the change."""
    sources = {c.source_key: c for c in cells if not (c.source and c.source.pr)}
    for _, cell in sorted(sources.items()):
        progress.stage(f"checking the inputs: the fix applies to DeepSpeed {source_name(cell)}")
        diff = patch.diff_for(cell.deepspeed)
        with tempfile.TemporaryDirectory() as tmp:
            apply_diff(diff, unpack_sdist(source_archive(cell, cache), Path(tmp)), source_name(cell))
