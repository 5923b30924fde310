"""Step time, stock vs patched: rounds of interleaved steps until the sequential rule decides.

Stock and patched live in different environments, so they are measured in different processes.
Each round starts three at once, stock, patched and stock again, pinned to one CPU, and lets
exactly one run at a time: each parks before every timed step (``payload/bench/turns.py``) and
the driver hands the turn round-robin, in an order rotated from round to round. Their steps
interleave one by one, so the machine's drifts hit every build alike. Every process is timed in
CPU time with one intra-op thread (``STABLE_PROCESS``, ``TIMER``), runs
``payload/bench/bench_step.py`` under pytest-benchmark and saves its JSON; one process gives one
median per benchmark.

After every third round, ``judge.step_time`` decides or asks for more (its sequential rule
stops as soon as every step comparison and its A/A calibration is decided); rounds also stop at
the round cap or the time budget. Timings taken under emulation are never judged.

The cell's throughput verdict combines this with executed instructions (``dsmatrix.execute.instructions``):
see ``judge.throughput.cell_throughput``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsmatrix.execute.launch import Job, free_port, supervise, test_environment
from dsmatrix.infra.errors import RunError
from dsmatrix.infra.locations import suite_path
from dsmatrix.judge.step_time import CONFIDENCE, DEFAULT_MARGIN, RULE, Comparison, certifiable_margin, compare, decided, throughput_verdict

BENCH = suite_path("bench")
DEFAULT_MAX_ROUNDS = 45  # a multiple of 3: every build takes every turn position equally often
DEFAULT_MINUTES = 9.0  # time budget of the step-time rounds of one cell
LOOK_EVERY = 3
STEPS = 50  # timed training steps per process
# CPU time of the benchmark process, not wall time: on a shared VM (this machine is one) wall time
# carries other tenants' steal time and scheduling, which made stock-vs-stock (A/A) rounds differ
# by up to 30%. With one intra-op thread, process CPU time is the work the step really does.
TIMER = "time.process_time"
# Per-process randomness that made rounds differ: hash seeds (set/dict layout on the release path)
# and glibc handing big tensor buffers back to the kernel between steps (page faults every step).
STABLE_PROCESS = {
    "OMP_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
    "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
}


def read_medians(path: Path) -> dict[str, float]:
    """Benchmark name -> median seconds, from one pytest-benchmark JSON file."""
    data = json.loads(path.read_text())
    return {b["name"]: float(b["stats"]["median"]) for b in data.get("benchmarks", [])}


def _pin_to_one_cpu() -> None:
    """Every benchmark process on the same (last) CPU: vCPUs of a shared VM do not run alike."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[-1]})


@dataclass(frozen=True)
class _Turns:
    """The driver's ends of one process's turn pipes: the turn handed over, the turn given back."""

    label: str
    go: int
    parked: int
    log: Path


def _turn_taker(label: str, python: Path, extensions_dir: Path, runtime: Mapping[str, Sequence[str]], out: Path) -> tuple[Job, _Turns]:
    command = [
        str(python), "-m", "pytest", str(BENCH / "bench_step.py"), "-p", "no:cacheprovider", "-q",
        f"--benchmark-json={out}", "--benchmark-disable-gc", "--benchmark-min-rounds=15", f"--benchmark-timer={TIMER}",
        f"--dtype={','.join(runtime['dtype'])}", f"--checkpointing={','.join(runtime['checkpointing'])}",
    ]  # fmt: skip
    go_read, go_write = os.pipe()
    parked_read, parked_write = os.pipe()
    port = free_port()
    env = {
        **test_environment(python, extensions_dir, port, 0, 1),
        **STABLE_PROCESS,
        "DSMATRIX_BENCH_STEPS": str(STEPS),
        "DSMATRIX_BENCH_TURNS": f"{go_read},{parked_write}",
    }
    log = out.with_suffix(".log")
    job = Job(
        f"benchmark process ({label})", command, env, log, cwd=BENCH, port=port, output=out,
        inherited=(go_read, parked_write), popen={"preexec_fn": _pin_to_one_cpu},
    )  # fmt: skip
    return job, _Turns(label, go_write, parked_read, log)


def _wait_parked(turns: _Turns, proc: subprocess.Popen[bytes], deadline: float) -> bool:
    """Wait until the process gives its turn back (True) or exits (False)."""
    remaining = deadline - time.monotonic()
    ready, _, _ = select.select([turns.parked], [], [], max(0.0, remaining))
    if not ready:
        raise RunError(f"benchmark round timed out while {turns.label} had the turn (log: {turns.log})")
    if os.read(turns.parked, 1):
        return True
    proc.wait()
    return False


def _hand_turns(turns: Sequence[_Turns]) -> Callable[[Sequence[subprocess.Popen[bytes]], float], None]:
    """The round's driver: hand the turn round-robin until every process has exited, so exactly one runs at a time."""

    def drive(procs: Sequence[subprocess.Popen[bytes]], deadline: float) -> None:
        live = [(t, p) for t, p in zip(turns, procs, strict=True) if _wait_parked(t, p, deadline)]
        while live:
            for taker in list(live):
                os.write(taker[0].go, b"g")
                if not _wait_parked(*taker, deadline):
                    live.remove(taker)

    return drive


def _bench_round(
    builds: Sequence[tuple[str, Path, Path]], runtime: Mapping[str, Sequence[str]], out_dir: Path, stem: str, timeout_s: float
) -> dict[str, dict[str, float]]:
    """One round: the given builds' processes started together and run in strict turns;
    label -> benchmark -> median seconds."""
    takers = [_turn_taker(label, python, ext, runtime, out_dir / f"{stem}-{label}.json") for label, python, ext in builds]
    try:
        supervise([job for job, _ in takers], timeout_s, _hand_turns([turns for _, turns in takers]))
    finally:
        for _, turns in takers:
            os.close(turns.go)
            os.close(turns.parked)
    return {turns.label: read_medians(job.output) for job, turns in takers if job.output is not None}


def run_rounds(
    pythons: Mapping[str, Path],
    extensions: Mapping[str, Path],
    runtime: Mapping[str, Sequence[str]],
    out_dir: Path,
    name: str,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    minutes: float = DEFAULT_MINUTES,
    margin: float = DEFAULT_MARGIN,
    timeout_s: float = 1800,
) -> dict[str, Any]:
    """Rounds of stock, patched and stock-again processes taking strict turns (the order rotated
    from round to round) until the sequential rule decides every step comparison and its A/A
    calibration, or ``max_rounds`` or ``minutes`` is reached."""
    out_dir.mkdir(parents=True, exist_ok=True)
    order = (("stock", "stock"), ("patched", "patched"), ("stock-again", "stock"))
    medians: dict[str, list[dict[str, float]]] = {label: [] for label, _ in order}
    started = time.monotonic()
    budget_s = minutes * 60

    def comparisons() -> tuple[list[Comparison], list[Comparison]]:
        names = sorted(set.intersection(*(set(m) for label in medians for m in medians[label])))

        def series(label: str, bench: str) -> list[float]:
            return [m[bench] for m in medians[label]]

        fix = [compare(b, series("stock", b), series("patched", b), margin) for b in names]
        return fix, [compare(b, series("stock", b), series("stock-again", b), margin) for b in names]

    stopped = f"round cap ({max_rounds})"
    index = 0
    while index < max_rounds:
        round_started = time.monotonic()
        rotated = order[index % 3 :] + order[: index % 3]
        builds = [(label, pythons[build], extensions[build]) for label, build in rotated]
        for label, result in _bench_round(builds, runtime, out_dir, f"{name}-bench-r{index + 1}", timeout_s).items():
            medians[label].append(result)
        index += 1
        if index % LOOK_EVERY == 0 and decided([c for pair in comparisons() for c in pair]):
            stopped = "decided"
            break
        spent, last = time.monotonic() - started, time.monotonic() - round_started
        if spent + last > budget_s and index < max_rounds:
            stopped = f"time budget ({minutes:g} min)"
            break
    fix, calibration = comparisons()
    return {
        "rounds": index,
        "max_rounds": max_rounds,
        "minutes": minutes,
        "stopped": stopped,
        "margin": margin,
        "rule": RULE.format(confidence=CONFIDENCE, limit=1 + margin),
        "comparisons": [c.as_dict() for c in fix],
        "calibration": [c.as_dict() for c in calibration],
        "verdict": throughput_verdict(fix),
        "calibration_verdict": throughput_verdict(calibration),
        "certifiable_margin": certifiable_margin(calibration),
        "medians_s": {label: medians[label] for label in medians},
        "files": sorted(str(p.name) for p in out_dir.glob(f"{name}-bench-r*.json")),
        "duration_s": round(time.monotonic() - started, 1),
    }
