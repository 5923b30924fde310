"""Progress lines, the ETA, the benchmark gate and a cell's two builds side by side (real threads,
real child processes, no DeepSpeed)."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dsmatrix import parallel, processes, progress
from dsmatrix.run import probe_of_tests


def _stamped_lines(capsys: pytest.CaptureFixture[str], reporter: progress.Reporter, work) -> list[tuple[float, str]]:
    """Run ``work`` under ``reporter`` and return its output lines with the time each was printed."""
    lines: list[tuple[float, str]] = []
    start = time.monotonic()

    def line(text: str) -> None:
        lines.append((time.monotonic() - start, text))

    reporter.line = line  # type: ignore[method-assign]
    with progress.reporting(reporter):
        work()
    return lines


def test_a_silent_stage_gets_a_heartbeat_line_with_its_probe(capsys: pytest.CaptureFixture[str]) -> None:
    """In a CI log nothing stays silent longer than the heartbeat: a 3 s child process with a 0.5 s heartbeat."""
    reporter = progress.Reporter(total=1, live=False, heartbeat_s=0.5)

    def work() -> None:
        with progress.lane("cell-a"):
            progress.stage("stock wheel", lambda: "JIT build of deepspeed_shm_comm")
            processes.run([sys.executable, "-c", "import time; time.sleep(3)"])
            progress.stage("stock environment")
        reporter.cell_finished(3.0)

    lines = _stamped_lines(capsys, reporter, work)
    times = [0.0] + [t for t, _ in lines]
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 1.6  # the beat checks every second
    beats = [text for _, text in lines if text.startswith("cell-a: stock wheel ... ") and "JIT build" in text]
    assert len(beats) >= 2, lines
    assert any(re.fullmatch(r"cell-a: stock environment \.\.\. \(stock wheel: 3 s\)", text) for _, text in lines)
    assert lines[-1][1].startswith("dsmatrix: 1/1 cell(s) done") and lines[-1][1].endswith("done")


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
    started: dict[str, float] = {}

    def work(build: str) -> str:
        started[build] = time.monotonic()
        processes.run([sys.executable, "-c", "import time; time.sleep(1)"])
        if build == "patched":
            raise RuntimeError("patched failed")
        return build

    begin = time.monotonic()
    with pytest.raises(RuntimeError, match="patched failed"):
        parallel.each(("stock", "patched"), work, True, lambda b: f"cell [{b}]")
    assert abs(started["stock"] - started["patched"]) < 0.5 and time.monotonic() - begin < 1.9
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
    in_shared = threading.Event()

    def ordinary(name: str, hold: float) -> None:
        with gate.shared():
            events.append(f"{name} start")
            in_shared.set()
            time.sleep(hold)
            events.append(f"{name} end")

    def benchmark() -> None:
        with gate.exclusive():
            events.append("bench start")
            time.sleep(0.3)
            events.append("bench end")

    first = threading.Thread(target=ordinary, args=("a", 0.5))
    first.start()
    in_shared.wait()
    bench = threading.Thread(target=benchmark)
    bench.start()
    time.sleep(0.1)
    late = threading.Thread(target=ordinary, args=("b", 0.0))  # arrives while the benchmark waits: goes after it
    late.start()
    for t in (first, bench, late):
        t.join(5)
    assert events == ["a start", "a end", "bench start", "bench end", "b start", "b end"]


def test_an_interrupt_stops_the_children_of_every_thread(tmp_path: Path) -> None:
    """``stop_all`` (what an interrupt in the waiting thread calls) stops children other threads wait on, and no new one starts."""
    marker = f"sleep {1000 + int(time.time()) % 1000}.5"
    errors: list[BaseException] = []

    def waits() -> None:
        try:
            processes.run(["sh", "-c", marker])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=waits)
    thread.start()
    time.sleep(0.5)
    try:
        processes.stop_all()
        thread.join(10)
        assert not thread.is_alive()
        assert subprocess.run(["pgrep", "-f", marker], capture_output=True).returncode == 1
        with pytest.raises(processes.Stopping):
            processes.run(["true"])
    finally:
        processes.resume_starting()


def test_pruning_a_finished_set_heartbeats(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Removing a torch set's several GiB took 178 s here, and the run said nothing meanwhile."""
    from dsmatrix import matrix_run
    from dsmatrix.cache import Cache
    from dsmatrix.cells import Cell
    from dsmatrix.disk import torch_set

    def slow_removal(cache: Cache, entries: object) -> float:
        processes.run([sys.executable, "-c", "import time; time.sleep(2)"])
        return 5.5

    monkeypatch.setattr(matrix_run, "prune_set", slow_removal)
    cell = Cell("3.12", "2.9.1", "0.19.2")
    reporter = progress.Reporter(total=1, live=False, heartbeat_s=0.5)
    lines = _stamped_lines(capsys, reporter, lambda: matrix_run._prune(Cache(tmp_path), torch_set(cell), [cell]))
    beats = [text for _, text in lines if text.startswith("low-disk: py3.12-torch2.9.1-linux_amd64: removing its uv cache")]
    assert len(beats) >= 3, lines


def test_benchmarking_a_reused_cell_reports_under_the_cells_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`nox -s bench` over finished cells: the heartbeats said `dsmatrix: benchmarks ...`, not which cell."""
    from dsmatrix import matrix_run
    from dsmatrix.cells import Cell, Selection

    def benchmarks(result: dict, *args: object) -> dict:
        progress.stage("stock environment")
        processes.run([sys.executable, "-c", "import time; time.sleep(1.5)"])
        return result

    monkeypatch.setattr(matrix_run, "add_benchmarks", benchmarks)
    cell = Cell("3.12", "2.9.1", "0.19.2")
    options = matrix_run.MatrixOptions("nightly", tmp_path, None, tmp_path / "results", None, Selection((cell,), {}), bench=object())  # type: ignore[arg-type]
    plan = matrix_run.Plan({cell: "local"}, {cell: ""}, {cell: {"run_id": "20261203-000000-0000"}})
    reporter = progress.Reporter(total=1, live=False, heartbeat_s=0.5)
    lines = _stamped_lines(capsys, reporter, lambda: matrix_run._reused(options, plan, cell, None))  # type: ignore[arg-type]
    assert any(text.startswith(f"{cell.label}: stock environment ... ") for _, text in lines), lines


def test_a_cell_waiting_to_benchmark_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """A cell whose benchmarks waited 7 minutes for another cell's went on showing its last stage
    ("patched engine tests ... JIT build of deepspeed_shm_comm") with the clock running."""
    reporter = progress.Reporter(total=2, jobs=2, live=False, heartbeat_s=0.5)
    holding = threading.Event()

    def other_cell() -> None:
        with progress.lane("cell-a"), parallel.GATE.shared():
            holding.set()
            processes.run([sys.executable, "-c", "import time; time.sleep(2)"])

    def work() -> None:
        other = threading.Thread(target=other_cell)
        other.start()
        holding.wait(5)
        with progress.lane("cell-b"):
            progress.stage("patched engine tests", lambda: "JIT build of deepspeed_shm_comm")
            with parallel.alone("benchmarks"):
                pass
        other.join(5)

    lines = _stamped_lines(capsys, reporter, work)
    waiting = [text for _, text in lines if text.startswith("cell-b: benchmarks: waiting to run alone")]
    assert len(waiting) >= 2, lines  # the announcement and at least one heartbeat
    assert not [text for t, text in lines if text.startswith("cell-b: patched engine tests ...") and t > 0.6], lines
    assert any(text.startswith("cell-b: benchmarks (alone) ... (benchmarks: waiting to run alone") for _, text in lines), lines
