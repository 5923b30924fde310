"""The step-time round driver's protocol and its per-build JSON, with threads standing in for the
forked workers (the protocol is bytes on pipes; the real workers run in the acceptance session)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from dsmatrix.execute.step_time import _one_round, _Turns, merge_rounds

STEPS = 3


LANES_MEET = threading.Barrier(2)  # the first step of each lane's first taker: both lanes must hold a turn at once


def _worker(go: int, parked: int, log: list[tuple[str, int]], name: str, lock: threading.Lock, running: dict[int, int], ring: int) -> None:
    """A round's worker as bench_host forks it: parks once started, then once per step; ``d`` when done."""
    assert os.read(go, 1) == b"r"
    os.write(parked, b".")
    for step in range(STEPS):
        assert os.read(go, 1) == b"g"
        if step == 0 and not log:
            LANES_MEET.wait(timeout=10)
        with lock:
            running[ring] += 1
            assert running[ring] == 1, "two processes of one lane ran at once"
            log.append((name, step))
            running[ring] -= 1
        os.write(parked, b".")
    assert os.read(go, 1) == b"g"
    os.write(parked, b"d")


def test_each_lane_hands_the_turn_round_robin_and_lanes_run_side_by_side(tmp_path: Path) -> None:
    logs: list[list[tuple[str, int]]] = [[], []]
    lock, running = threading.Lock(), {0: 0, 1: 0}
    rings, threads = [], []
    for ring, labels in enumerate((("stock", "patched", "stock-again"), ("patched", "stock-again", "stock"))):
        takers = []
        for label in labels:
            go_read, go_write = os.pipe()
            parked_read, parked_write = os.pipe()
            takers.append(_Turns(f"{label} (lane {ring})", go_write, parked_read, tmp_path / "log"))
            threads.append(threading.Thread(target=_worker, args=(go_read, parked_write, logs[ring], label, lock, running, ring)))
        rings.append(takers)
    for thread in threads:
        thread.start()
    _one_round(rings, deadline=time.monotonic() + 30)
    for thread in threads:
        thread.join(5)
    assert logs[0] == [(label, step) for step in range(STEPS) for label in ("stock", "patched", "stock-again")]
    assert logs[1] == [(label, step) for step in range(STEPS) for label in ("patched", "stock-again", "stock")]


def test_a_builds_rounds_become_one_pytest_benchmark_file(tmp_path: Path) -> None:
    rounds = []
    for index in (1, 2):
        path = tmp_path / f"c-bench-l0-r{index}-stock.json"
        benchmark = {"name": "test_train_step[fp32-ckpt-on]", "fullname": "bench_step.py::test_train_step[fp32-ckpt-on]"}
        path.write_text(json.dumps({"machine_info": {}, "benchmarks": [{**benchmark, "stats": {"median": index / 100}}]}))
        rounds.append(path)
    merged = json.loads(merge_rounds(rounds, tmp_path / "c-bench-stock.json").read_text())
    assert [b["name"] for b in merged["benchmarks"]] == ["test_train_step[fp32-ckpt-on]-round01", "test_train_step[fp32-ckpt-on]-round02"]
    assert [b["stats"]["median"] for b in merged["benchmarks"]] == [0.01, 0.02]
    assert not any(path.exists() for path in rounds)
