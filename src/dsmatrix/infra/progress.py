"""Where a long run is: each running cell's stage with its elapsed time, and the run's count and ETA.

Work reports into lanes: a cell, or one build of a cell while stock and patched run side by side
(``with lane("…")`` in the thread doing it; ``stage("patched wheel")`` from anywhere below).
On a terminal, rich draws a live panel (one row per lane: stage, detail, elapsed; and the run's
bar with its ETA) below the scrolling log. In a CI log (no terminal) the same facts come as plain
lines: a line when a stage starts (with how long the previous one took), a heartbeat line every
``HEARTBEAT_S`` while a stage says nothing (with what the stage's probe sees: a JIT build, the
tests' percentage), and after each cell the count and ETA. Nothing stays silent longer than that.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

HEARTBEAT_S = 10.0  # a stage silent this long gets a line in a CI log
Probe = Callable[[], str]  # what a stage can say about itself right now ("" when nothing)


def seconds(value: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 12 min``."""
    value = max(0, round(value))
    if value < 60:
        return f"{value} s"
    if value < 3600:
        return f"{value // 60} min {value % 60:02d} s"
    return f"{value // 3600} h {value % 3600 // 60:02d} min"


@dataclass
class _Lane:
    name: str
    started: float
    said: float
    stage: str = "starting"
    probe: Probe | None = None
    task: int | None = None


class Reporter:
    """The run's progress: lanes, finished cells, the live panel or the plain lines."""

    def __init__(
        self,
        total: int,
        jobs: int = 1,
        live: bool | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.jobs, self.heartbeat_s, self.clock = total, jobs, heartbeat_s, clock
        self.done = 0
        self.reused = 0
        self.walls: list[float] = []
        self.started = clock()
        self._lanes: dict[str, _Lane] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        console = Console(file=sys.stdout)
        self.live = console.is_terminal and not os.environ.get("CI") if live is None else live
        self._progress: Progress | None = None
        self._overall: int | None = None
        if self.live:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(bar_width=20),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[eta]}"),
                console=console,
                redirect_stdout=True,
                redirect_stderr=True,
            )

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Reporter:
        if self._progress is not None:
            self._progress.start()
            self._overall = self._progress.add_task("cells", total=self.total, completed=0, eta="")
        self._thread = threading.Thread(target=self._beat, name="dsmatrix-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._progress is not None:
            self._progress.stop()

    # -- what work reports -----------------------------------------------------------------
    def open_lane(self, name: str) -> None:
        with self._lock:
            now = self.clock()
            lane = self._lanes[name] = _Lane(name, started=now, said=now)
            if self._progress is not None:
                lane.task = self._progress.add_task(f"{name}: starting", total=None, eta="")

    def close_lane(self, name: str) -> None:
        with self._lock:
            lane = self._lanes.pop(name, None)
            if lane is not None and lane.task is not None and self._progress is not None:
                self._progress.remove_task(lane.task)

    def stage(self, name: str, what: str, probe: Probe | None = None) -> None:
        with self._lock:
            lane = self._lanes.get(name)
            if lane is None:
                self.open_lane(name)
                lane = self._lanes[name]
            now = self.clock()
            took = f" ({lane.stage}: {seconds(now - lane.started)})" if lane.stage != "starting" else ""
            lane.stage, lane.started, lane.said, lane.probe = what, now, now, probe
            self.line(f"{name}: {what} ...{took}")
            if lane.task is not None and self._progress is not None:
                self._progress.reset(lane.task, description=f"{name}: {what}", total=None)

    def line(self, text: str) -> None:
        """One line of the log (above the live panel on a terminal)."""
        print(text, flush=True)

    def cell_finished(self, wall_s: float | None) -> None:
        """A cell is recorded: ``wall_s`` is how long it ran here (None: reused, took no time)."""
        with self._lock:
            self.done += 1
            if wall_s is None:
                self.reused += 1
            else:
                self.walls.append(wall_s)
            self.line(f"dsmatrix: {self.summary()}")
            if self._progress is not None and self._overall is not None:
                self._progress.update(self._overall, completed=self.done, eta=self.eta_text())

    # -- what it says ----------------------------------------------------------------------
    def eta_s(self) -> float | None:
        """Remaining cells times the median wall time of the cells run here, over the jobs; None before one finished."""
        if not self.walls:
            return None
        return (self.total - self.done) * statistics.median(self.walls) / max(1, self.jobs)

    def eta_text(self) -> str:
        eta = self.eta_s()
        if self.done >= self.total:
            return "done"
        return "ETA unknown (no cell finished yet)" if eta is None else f"ETA {seconds(eta)}"

    def summary(self) -> str:
        reused = f" ({self.reused} reused)" if self.reused else ""
        median = f", median {seconds(statistics.median(self.walls))} a cell" if self.walls else ""
        so_far = seconds(self.clock() - self.started)
        return f"{self.done}/{self.total} cell(s) done{reused}, {so_far} so far{median}; {self.eta_text()}"

    def _beat(self) -> None:
        while not self._stop.wait(1.0):
            self.beat()

    def beat(self) -> None:
        """One heartbeat at ``clock()`` (the reporter's thread calls it every second): the live panel's
        details, or a line for each lane silent for ``heartbeat_s``."""
        now = self.clock()
        with self._lock:
            lanes = list(self._lanes.values())
        busy = {lane.name.rsplit(" [", 1)[0] for lane in lanes if lane.name.endswith("]")}
        for lane in lanes:
            if lane.name in busy and lane.task is None:  # its builds' lanes speak for it
                continue
            detail = _probe(lane.probe)
            if lane.task is not None and self._progress is not None:
                self._progress.update(lane.task, description=f"{lane.name}: {lane.stage}{' · ' + detail if detail else ''}")
            elif now - lane.said >= self.heartbeat_s:
                lane.said = now
                self.line(f"{lane.name}: {lane.stage} ... {seconds(now - lane.started)}{', ' + detail if detail else ''}")


def _probe(probe: Probe | None) -> str:
    if probe is None:
        return ""
    try:
        return probe()
    except Exception:  # noqa: BLE001 - a probe reads files that come and go; it never stops the run
        return ""


class _Quiet(Reporter):
    """What work reports into outside a run (a test calling the pipeline directly): plain stage lines, no heartbeat."""

    def __init__(self) -> None:
        super().__init__(total=0, live=False)


_current: Reporter = _Quiet()
_local = threading.local()


@contextlib.contextmanager
def reporting(reporter: Reporter) -> Iterator[Reporter]:
    """Make ``reporter`` the one every ``stage`` and ``lane`` of this process reports into."""
    global _current
    previous, _current = _current, reporter
    try:
        with reporter:
            yield reporter
    finally:
        _current = previous


def current() -> Reporter:
    return _current


def current_lane() -> str:
    return getattr(_local, "lane", "dsmatrix")


@contextlib.contextmanager
def lane(name: str) -> Iterator[None]:
    """Report this thread's stages under ``name`` (a cell's label, or ``<label> [patched]``)."""
    previous = getattr(_local, "lane", None)
    _local.lane = name
    _current.open_lane(name)
    try:
        yield
    finally:
        _current.close_lane(name)
        if previous is None:
            del _local.lane
        else:
            _local.lane = previous


def stage(what: str, probe: Probe | None = None) -> None:
    """This thread's lane enters stage ``what``; ``probe`` may say more while it lasts."""
    _current.stage(current_lane(), what, probe)
