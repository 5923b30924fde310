"""Progress lines, the ETA, the benchmark gate and a cell's two builds side by side (real threads,
real child processes, no DeepSpeed)."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import tagged_processes

from dsmatrix.execute import schedule
from dsmatrix.execute.engine_tests import probe_of_tests
from dsmatrix.infra import parallel, processes, progress
from dsmatrix.infra.hosts import LOCAL


def _wait_for_file(path: Path, limit_s: float = 120) -> list[str]:
    """A child process that waits until ``path`` exists (exit 0), or ``limit_s`` (exit 1): it lasts
    exactly as long as the test needs, whatever the machine's speed."""
    code = f"import pathlib, sys, time\nend = time.monotonic() + {limit_s}\n"
    code += f"while not pathlib.Path({str(path)!r}).exists():\n    if time.monotonic() > end: sys.exit(1)\n    time.sleep(0.05)\n"
    return [sys.executable, "-c", code]


def _release_when(path: Path, seen: Callable[[list[str]], bool]) -> tuple[list[str], Callable[[str], None]]:
    """Lines and a ``Reporter.line`` that records them and creates ``path`` once ``seen(lines)``."""
    lines: list[str] = []

    def line(text: str) -> None:
        lines.append(text)
        if seen(lines):
            path.touch()

    return lines, line


def _wait_until(condition: Callable[[], object], limit_s: float = 30) -> None:
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end, "the condition never came"
        time.sleep(0.01)


def test_a_silent_stage_gets_a_heartbeat_line_with_its_probe() -> None:
    """In a CI log nothing stays silent longer than the heartbeat: a line once a stage said nothing
    for ``heartbeat_s``, with what its probe sees (an injected clock, the beats called by hand)."""
    now = [1000.0]
    lines: list[str] = []
    reporter = progress.Reporter(total=1, live=False, heartbeat_s=10, clock=lambda: now[0])
    reporter.line = lines.append  # type: ignore[method-assign]

    def beat_at(t: float) -> None:
        now[0] = 1000.0 + t
        reporter.beat()

    reporter.stage("cell-a", "stock wheel", lambda: "JIT build of deepspeed_shm_comm")
    beat_at(9.9)
    assert lines == ["cell-a: stock wheel ..."]
    for t in (10.0, 15.0, 19.9, 21.0):
        beat_at(t)
    jit = "JIT build of deepspeed_shm_comm"
    assert lines[1:] == [f"cell-a: stock wheel ... 10 s, {jit}", f"cell-a: stock wheel ... 21 s, {jit}"]
    now[0] = 1023.0
    reporter.stage("cell-a", "stock environment")
    assert lines[-1] == "cell-a: stock environment ... (stock wheel: 23 s)"
    reporter.cell_finished(23.0)
    assert lines[-1].startswith("dsmatrix: 1/1 cell(s) done, 23 s so far") and lines[-1].endswith("done")


def test_the_reporters_thread_beats_while_a_child_runs(tmp_path: Path) -> None:
    """The real thread: a child that runs until two heartbeat lines came (a minute at most)."""
    release = tmp_path / "release"
    lines, line = _release_when(release, lambda lines: sum("JIT build" in text for text in lines) >= 2)
    reporter = progress.Reporter(total=1, live=False, heartbeat_s=0.5)
    reporter.line = line  # type: ignore[method-assign]
    with progress.reporting(reporter), progress.lane("cell-a"):
        progress.stage("stock wheel", lambda: "JIT build of deepspeed_shm_comm")
        child = processes.run(_wait_for_file(release, 60))
    assert child.returncode == 0, f"no two heartbeats in a minute: {lines}"
    assert all(re.fullmatch(r"cell-a: stock wheel \.\.\. \d+ s, JIT build of deepspeed_shm_comm", text) for text in lines[1:]), lines


def test_eta_is_the_median_cell_over_the_jobs() -> None:
    reporter = progress.Reporter(total=10, jobs=2, live=False)
    assert reporter.eta_text() == "ETA unknown (no cell finished yet)"
    reporter.line = lambda text: None  # type: ignore[method-assign]
    reporter.cell_finished(None)  # a reused cell says nothing about speed
    for wall in (100.0, 300.0, 120.0):
        reporter.cell_finished(wall)
    assert reporter.eta_s() == pytest.approx(6 * 120.0 / 2)
    assert "4/10 cell(s) done (1 reused)" in reporter.summary() and "ETA 6 min 00 s" in reporter.summary()


def test_tests_probe_reads_jit_locks_and_finished_tests(tmp_path: Path) -> None:
    extensions = tmp_path / "torch-extensions"
    (extensions / "deepspeed_shm_comm").mkdir(parents=True)
    probe = probe_of_tests(tmp_path, "cell-stock", extensions)
    assert probe() == ""
    (tmp_path / "cell-stock-ws2-rank0.log").write_text("..F.s.                [ 40%]\n.F\n")
    assert probe() == "world size 2: 8 test(s) done, 2 failed"
    log = tmp_path / "cell-stock-ws2-rank0.log"
    with log.open("a") as handle:  # read on from where it stopped; a line still being written waits
        handle.write("..")
        handle.flush()
        assert probe() == "world size 2: 8 test(s) done, 2 failed"
        handle.write("E\n")
    assert probe() == "world size 2: 11 test(s) done, 3 failed"
    log.write_text(".\n")  # the stage ran again: the log was written anew
    assert probe() == "world size 2: 1 test(s) done"
    (extensions / "deepspeed_shm_comm" / "lock").touch()
    assert probe() == "JIT build of deepspeed_shm_comm"


def test_builds_side_by_side_run_at_once_and_wait_for_each_other() -> None:
    both = threading.Barrier(2, timeout=60)  # each build waits for the other: only builds run at once get past it
    finished: list[str] = []

    def work(build: str) -> str:
        both.wait()
        processes.run([sys.executable, "-c", "pass"])
        if build == "patched":
            raise RuntimeError("patched failed")
        finished.append(build)
        return build

    with pytest.raises(RuntimeError, match="patched failed"):
        parallel.each(("stock", "patched"), work, True, lambda b: f"cell [{b}]")
    assert finished == ["stock"], "the failure is raised once the sibling has finished"
    assert parallel.each(("stock", "patched"), lambda b: b.upper(), False, str) == {"stock": "STOCK", "patched": "PATCHED"}


def test_auto_side_by_side_needs_a_core_and_memory_per_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(parallel, "cores", lambda: 2)
    monkeypatch.setattr(parallel, "available_gib", lambda: 20.0)
    assert parallel.builds_side_by_side("auto", jobs=1, world_size=2)
    assert not parallel.builds_side_by_side("auto", jobs=2, world_size=1)  # two cells already take both cores
    monkeypatch.setattr(parallel, "available_gib", lambda: 3.0)
    assert not parallel.builds_side_by_side("auto", jobs=1, world_size=1)
    assert parallel.builds_side_by_side("on", jobs=4, world_size=2) and not parallel.builds_side_by_side("off", 1, 1)


def test_a_benchmark_runs_alone() -> None:
    """The gate: a benchmark waits for running work, and work waits for a waiting benchmark."""
    gate = parallel.Gate()
    events: list[str] = []
    in_shared, release = threading.Event(), threading.Event()

    def ordinary(name: str, hold: threading.Event | None) -> None:
        with gate.shared():
            events.append(f"{name} start")
            if hold is not None:
                in_shared.set()
                hold.wait(30)
            events.append(f"{name} end")

    def benchmark() -> None:
        with gate.exclusive():
            events.append("bench start")
            events.append("bench end")

    first = threading.Thread(target=ordinary, args=("a", release))
    first.start()
    in_shared.wait(30)
    bench = threading.Thread(target=benchmark)
    bench.start()
    _wait_until(lambda: gate.waiting() == (1, 0))  # the benchmark waits for a
    late = threading.Thread(target=ordinary, args=("b", None))  # arrives while the benchmark waits: goes after it
    late.start()
    _wait_until(lambda: gate.waiting() == (1, 1))
    release.set()
    for t in (first, bench, late):
        t.join(30)
    assert events == ["a start", "a end", "bench start", "bench end", "b start", "b end"]


def test_an_interrupt_stops_the_children_of_every_thread() -> None:
    """``stop_all`` (what an interrupt in the waiting thread calls) stops children other threads wait on, and no new one starts."""
    tag = {"DSMATRIX_TEST_TAG": f"interrupt-{os.getpid()}-{time.time_ns()}"}
    errors: list[BaseException] = []

    def waits() -> None:
        try:
            processes.run(["sh", "-c", "sleep 300 & sleep 300; wait"], env={**os.environ, **tag})
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=waits)
    thread.start()
    # sh and its two sleeps, and sh written down as a child (Popen returns before the thread records it)
    _wait_until(lambda: len(tagged_processes(tag)) == 3 and set(tagged_processes(tag)) & set(processes.live()))
    try:
        processes.stop_all()
        thread.join(30)
        assert not thread.is_alive()
        assert not tagged_processes(tag), tagged_processes(tag)
        with pytest.raises(processes.Stopping):
            processes.run(["true"])
    finally:
        processes.resume_starting()


def test_pruning_a_finished_set_heartbeats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Removing a torch set's several GiB took 178 s here, and the run said nothing meanwhile."""
    from dsmatrix.infra.cache import Cache
    from dsmatrix.plan.cells import Cell
    from dsmatrix.plan.disk import torch_set

    heading = "low-disk: py3.12-torch2.9.1-linux_amd64: removing its uv cache"
    release = tmp_path / "release"
    lines, line = _release_when(release, lambda lines: sum(text.startswith(heading) for text in lines) >= 3)

    def slow_removal(cache: Cache, entries: object) -> float:
        assert processes.run(_wait_for_file(release, 60)).returncode == 0, f"no three lines in a minute: {lines}"
        return 5.5

    monkeypatch.setattr(schedule, "prune_set", slow_removal)
    cell = Cell("3.12", "2.9.1", "0.19.2")
    reporter = progress.Reporter(total=1, live=False, heartbeat_s=0.5)
    reporter.line = line  # type: ignore[method-assign]
    with progress.reporting(reporter):
        schedule._prune(Cache(tmp_path / "cache"), torch_set(cell), [cell])
    assert sum(text.startswith(heading) for text in lines) >= 3, lines


def test_benchmarking_a_reused_cell_reports_under_the_cells_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`nox -s bench` over finished cells: the heartbeats said `dsmatrix: benchmarks ...`, not which cell."""
    from dsmatrix.execute.benchmarks import BenchOptions
    from dsmatrix.plan.cells import Cell, Selection

    cell = Cell("3.12", "2.9.1", "0.19.2")
    beat = f"{cell.label}: stock environment ... "
    release = tmp_path / "release"
    lines, line = _release_when(release, lambda lines: any(text.startswith(beat) for text in lines))

    def benchmarks(result: dict, *args: object) -> dict:  # silent until its lane had a heartbeat
        progress.stage("stock environment")
        assert processes.run(_wait_for_file(release, 60)).returncode == 0, f"no heartbeat under the cell's name: {lines}"
        return result

    monkeypatch.setattr(schedule, "add_benchmarks", benchmarks)
    options = schedule.MatrixOptions("nightly", tmp_path, None, tmp_path / "results", None, Selection((cell,), {}), bench=BenchOptions())  # type: ignore[arg-type]
    plan = schedule.Plan({cell: LOCAL}, {cell: ""}, {cell: {"run_id": "20261203-000000-0000"}})
    reporter = progress.Reporter(total=1, live=False, heartbeat_s=0.5)
    reporter.line = line  # type: ignore[method-assign]
    with progress.reporting(reporter):
        schedule._reused(options, plan, cell, None)  # type: ignore[arg-type]
    assert any(text.startswith(beat) for text in lines), lines


def test_a_cell_waiting_to_benchmark_says_so(tmp_path: Path) -> None:
    """A cell whose benchmarks waited 7 minutes for another cell's went on showing its last stage
    ("patched engine tests ... JIT build of deepspeed_shm_comm") with the clock running."""
    waiting = "cell-b: benchmarks: waiting to run alone"
    release = tmp_path / "release"
    lines, line = _release_when(release, lambda lines: sum(text.startswith(waiting) for text in lines) >= 2)
    reporter = progress.Reporter(total=2, jobs=2, live=False, heartbeat_s=0.5)
    reporter.line = line  # type: ignore[method-assign]
    holding = threading.Event()

    def other_cell() -> None:  # holds the gate until cell-b's waiting line had a heartbeat
        with progress.lane("cell-a"), parallel.GATE.shared():
            holding.set()
            processes.run(_wait_for_file(release, 60))

    with progress.reporting(reporter):
        other = threading.Thread(target=other_cell)
        other.start()
        holding.wait(30)
        with progress.lane("cell-b"):
            progress.stage("patched engine tests", lambda: "JIT build of deepspeed_shm_comm")
            with parallel.alone("benchmarks"):
                pass
        other.join(60)
    mine = [text for text in lines if text.startswith("cell-b: ")]
    assert sum(text.startswith(waiting) for text in mine) >= 2, lines  # the announcement and at least one heartbeat
    first_wait = next(i for i, text in enumerate(mine) if text.startswith(waiting))
    assert not [text for text in mine[first_wait:] if text.startswith("cell-b: patched engine tests")], "a stale stage line"
    assert any(text.startswith("cell-b: benchmarks (alone) ... (benchmarks: waiting to run alone") for text in mine), lines
