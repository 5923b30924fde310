"""Disk: what a run adds to the cache, and the low-disk mode that fits a run on a small disk.

The bulk is uv's cache of each (Python, torch) set: the package index's x86_64 torch wheels are
CUDA builds (~7 GiB with their nvidia-* wheels), CPU builds ~1 GiB. Environments hardlink from
that cache, so they cost little beside it, and pruning the cache frees nothing while they exist.

Low-disk mode runs the cells of one set together; a set not in the cache yet gets a uv cache of its own
(``<cache>/uv-sets/<set>``), and after the set's last cell that uv cache and the set's
environments and builder are removed (wheels and stock test results stay: they are small). The run then
needs room for the largest set (times ``--jobs``), not for all of them; it is refused up front
only when even that does not fit. It is on by default when the free disk is smaller than the
run's estimate. ``DiskWatch`` samples the disk while the run lasts and reports the peak.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsmatrix.infra.cache import Cache, lock_for
from dsmatrix.infra.errors import DiskSpaceError
from dsmatrix.plan.cells import Cell

GIB = 1024**3
# uv cache cost of one new (Python, torch) set, measured here: the package index's x86_64 torch
# wheels are CUDA builds (~6.7 GB unpacked with their nvidia-* dependencies); CPU builds ~1 GB.
TORCH_SET_GIB = {"cuda": 7.0, "cpu": 1.0}
ENVIRONMENT_GIB = 0.1
LOW_DISK = ("auto", "on", "off")

TorchSet = tuple[str, str, str]  # (python, torch, platform)


def torch_set(cell: Cell) -> TorchSet:
    return (cell.python, cell.torch, cell.platform)


def set_name(key: TorchSet) -> str:
    python, torch, platform = key
    return f"py{python}-torch{torch}-{platform.replace('/', '_')}"


def set_gib(key: TorchSet) -> float:
    """The estimated uv-cache size of one set (arm64's torch wheels in the matrix are CPU builds)."""
    _, torch, platform = key
    return TORCH_SET_GIB["cpu" if "+cpu" in torch or platform == "linux/arm64" else "cuda"]


def by_set(cells: Sequence[Cell]) -> list[list[Cell]]:
    """The cells in groups of one set each, sets in the order they first appear."""
    order: dict[TorchSet, list[Cell]] = {}
    for cell in cells:
        order.setdefault(torch_set(cell), []).append(cell)
    return list(order.values())


def grouped(cells: Sequence[Cell]) -> list[Cell]:
    """The cells with each set's cells together, sets in the order they first appear."""
    return [cell for group in by_set(cells) for cell in group]


@dataclass(frozen=True)
class DiskPlan:
    """The run's disk estimate and whether it runs in low-disk mode."""

    low_disk: bool
    need_gib: float  # every new set kept, as a normal run does
    peak_gib: float  # what the run needs at its fullest (low-disk: the largest sets, ``jobs`` at once)
    free_gib: float
    new_sets: tuple[TorchSet, ...]  # sets not in the cache yet: low-disk mode prunes only these
    reason: str

    def pruned(self, key: TorchSet) -> bool:
        """Whether low-disk mode gives ``key`` a uv cache of its own and prunes it after its last cell."""
        return self.low_disk and key in self.new_sets

    def describe(self) -> str:
        if not self.low_disk:
            return f"this run may add ~{self.need_gib:.1f} GiB ({self.free_gib:.0f} GiB free)"
        return f"low-disk mode ({self.reason}): at most ~{self.peak_gib:.1f} GiB at once instead of ~{self.need_gib:.1f} GiB"


def plan_disk(cells: Sequence[Cell], cache: Cache, mode: str = "auto", jobs: int = 1) -> DiskPlan:
    """The estimate for ``cells``; DiskSpaceError when it cannot fit (low-disk mode included, when allowed)."""
    new = sorted({torch_set(c) for c in cells if not cache.has_builder(c.python, c.torch)})
    need = sum(set_gib(k) for k in new) + ENVIRONMENT_GIB * 2 * len(cells)
    cache.root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(cache.root).free / GIB
    sets = sorted({torch_set(c) for c in cells})
    largest = sorted((set_gib(k) + ENVIRONMENT_GIB * 2 * sum(torch_set(c) == k for c in cells) for k in sets), reverse=True)
    peak = sum(largest[: max(1, jobs)])
    if mode == "on":
        low, reason = True, "--low-disk on"
    elif mode == "off" or need <= free:
        low, reason = False, ""
    else:
        low, reason = True, f"~{need:.1f} GiB needed, {free:.1f} GiB free"
    if not low and need > free:
        raise DiskSpaceError(
            f"{cache.root}: the selected cells need about {need:.1f} GiB ({len(new)} new torch set(s)), only {free:.1f} GiB free"
            " (--low-disk auto or on runs one set at a time)"
        )
    if low and peak > free:
        raise DiskSpaceError(
            f"{cache.root}: even one torch set at a time (low-disk mode, --jobs {jobs}) needs about {peak:.1f} GiB,"
            f" only {free:.1f} GiB free"
        )
    return DiskPlan(low, round(need, 1), round(peak if low else need, 1), round(free, 1), tuple(new), reason)


def uv_cache(cache: Cache, key: TorchSet) -> Path:
    """The uv cache of one set in low-disk mode."""
    return cache.uv_set(set_name(key))


def set_entries(cache: Cache, key: TorchSet, cells: Iterable[Cell]) -> list[Path]:
    """What pruning a set removes: its uv cache, its builder, and the environments of its cells."""
    python, torch, _ = key
    entries = [uv_cache(cache, key), *cache.builders(python, torch)]
    for cell in cells:
        entries += [cache.environments(cell.id), cache.environments(cell.stock_id)]
    return [e for e in dict.fromkeys(entries) if e.exists()]


def prune_set(cache: Cache, entries: Iterable[Path]) -> float:
    """Remove a finished set's entries (``set_entries``; each under its lock, as it was built);
    returns the GiB freed."""
    before = shutil.disk_usage(cache.root).used
    for entry in entries:
        with lock_for(entry):
            shutil.rmtree(entry, ignore_errors=True)
        Path(f"{entry}.lock").unlink(missing_ok=True)
    return max(0.0, (before - shutil.disk_usage(cache.root).used) / GIB)


def tree_gib(paths: Iterable[Path]) -> float:
    """The disk the files below ``paths`` take, each inode counted once (environments hardlink)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root in paths:
        for folder, _, files in os.walk(root):
            for name in files:
                try:
                    st = os.lstat(os.path.join(folder, name))
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total / GIB


class DiskWatch:
    """Samples the used space of the cache's file system every ``every_s`` while the run lasts."""

    def __init__(self, root: Path, every_s: float = 5.0) -> None:
        self.root, self.every_s = root, every_s
        self.start = shutil.disk_usage(root).used
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="dsmatrix-disk", daemon=True)

    def __enter__(self) -> DiskWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()

    def sample(self) -> None:
        self.peak = max(self.peak, shutil.disk_usage(self.root).used)

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    @property
    def peak_gib(self) -> float:
        """The most the disk held above what it held when the run started."""
        return max(0.0, (self.peak - self.start) / GIB)

    def facts(self) -> dict[str, float]:
        return {"peak_above_start_gib": round(self.peak_gib, 2), "sampled_every_s": self.every_s}
