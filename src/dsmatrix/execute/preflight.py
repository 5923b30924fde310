"""What a cell must pass before anything runs: interpreters, torch versions, the fix applying to each source."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from dsmatrix.build.environments import check_installable, torch_cpu_index, uv_executable
from dsmatrix.build.patches import PatchSet, apply_diff
from dsmatrix.build.wheels import source_archive, source_name, unpack_sdist
from dsmatrix.infra import progress
from dsmatrix.infra.cache import Cache
from dsmatrix.infra.interpreters import find_interpreter
from dsmatrix.plan.cells import Cell, Selection


def cache_size() -> str:
    """uv's own report of its cache size (the bulk of the disk the matrix uses)."""
    proc = subprocess.run([uv_executable(), "cache", "size", "--human"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def preflight(selection: Selection) -> None:
    """Check the interpreters and torch versions the run depends on; raises a one-line FatalError
    on the first problem (``check_patch`` checks the fix)."""
    for python in sorted({c.python for c in selection.cells}):
        find_interpreter(python)
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
