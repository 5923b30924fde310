"""How much runs at once: the machine's capacity, a cell's two builds side by side, cells in
parallel (``--jobs``), and the gate benchmarks pass through alone.

Everything but a benchmark holds the gate shared; a benchmark holds it exclusive, so it starts
only once every other cell's work has stopped and nothing starts while it runs (a waiting
benchmark goes first). An interrupt in the waiting thread stops every child process group the
run started (``processes.stop_all``) before the workers are joined.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import psutil

from dsmatrix.infra import processes, progress

T = TypeVar("T")
# Resident memory one engine-test process may reach: torch + DeepSpeed + a small ZeRO-3 engine
# peaked at ~0.9 GiB here; doubled for headroom (a JIT build's compiler runs beside it).
PROCESS_GIB = 2.0
SIDE_BY_SIDE = ("auto", "on", "off")


def cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def available_gib() -> float:
    """The memory that can be used without swapping (the kernel's ``MemAvailable``), in GiB."""
    return psutil.virtual_memory().available / 1024**3


def auto_jobs(cells: int, world_size: int) -> int:
    """``--jobs auto``: a cell per core, as far as the memory of their ranks allows (at least one).
    Measured on 2 cores: two cells at once beat one cell with its builds side by side (the work is
    CPU-bound, and two cells keep both cores busier through set-up and process start-up)."""
    by_memory = int(available_gib() // (PROCESS_GIB * world_size))
    return max(1, min(cells, cores(), by_memory))


def builds_side_by_side(mode: str, jobs: int, world_size: int) -> bool:
    """Whether a cell's stock and patched builds run at the same time: ``on``/``off``, or (``auto``)
    when every job's two builds get a core each and the memory of all their ranks."""
    if mode != "auto":
        return mode == "on"
    return cores() >= 2 * jobs and available_gib() >= PROCESS_GIB * 2 * jobs * world_size


class Gate:
    """Shared for ordinary work, exclusive for benchmarks (a waiting exclusive holder goes first)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False
        self._waiting = 0
        self._queued = 0

    def waiting(self) -> tuple[int, int]:
        """How many wait to enter: (exclusive, shared)."""
        with self._cond:
            return self._waiting, self._queued

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._queued += 1
            try:
                while self._exclusive or self._waiting:
                    self._cond.wait()
            finally:
                self._queued -= 1
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._shared:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


GATE = Gate()


@contextlib.contextmanager
def alone(what: str) -> Iterator[None]:
    """Enter stage ``what (alone)`` holding ``GATE`` exclusive; while it waits for the gate, the lane says so
    (a cell waiting for another cell's benchmarks went on showing "patched engine tests ... JIT
    build" with its clock running, for minutes)."""
    progress.stage(f"{what}: waiting to run alone (other cells' work or benchmarks first)")
    with GATE.exclusive():
        progress.stage(f"{what} (alone)")
        yield


def each(names: Sequence[str], work: Callable[[str], T], together: bool, lane_of: Callable[[str], str]) -> dict[str, T]:
    """``work(name)`` for every name, in turn or (``together``) each in a thread and progress lane of
    its own; the first failure is raised once all have stopped."""
    if not together or len(names) < 2:
        return {name: work(name) for name in names}

    def in_lane(name: str) -> T:
        with progress.lane(lane_of(name)):
            return work(name)

    with ThreadPoolExecutor(len(names), thread_name_prefix="dsmatrix-build") as pool:
        futures = {name: pool.submit(contextvars.copy_context().run, in_lane, name) for name in names}
        try:
            for future in futures.values():
                future.exception()  # wait for all: a failed build must not leave its sibling running unseen
        except KeyboardInterrupt:
            processes.stop_all()
            raise
        return {name: future.result() for name, future in futures.items()}
