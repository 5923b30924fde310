"""Step time, stock vs patched: rounds of interleaved steps until the sequential rule decides.

Stock and patched live in different environments, so they are measured in different processes.
Each build has one benchmark host (``payload/bench/bench_host.py``) that imports torch and
DeepSpeed once and forks a pytest-benchmark worker (``payload/bench/bench_step.py``) per round
and lane: a lane is one CPU, and a round is three workers on it, stock, patched and stock again,
of which exactly one runs at a time. Each parks before every timed step (``payload/bench/turns.py``)
and the driver hands the turn round-robin, in an order rotated from round to round, so the
machine's drifts hit every build alike. A worker builds ``RoundShape.engines`` engines in turn and
times ``RoundShape.steps`` steps on each, in CPU time with one intra-op thread (``STABLE_PROCESS``,
``TIMER``), and saves its JSON (readable with ``pytest-benchmark compare``); one worker gives one
median per benchmark, one round one ratio. Lanes run side by side, so two CPUs give two rounds at a time.

After every third round, ``judge.step_time`` decides or asks for more (its sequential rule
stops as soon as every step comparison and its A/A calibration is decided); rounds also stop at
the round cap or the time budget (``minutes`` per dtype x checkpointing combination measured).
Timings taken under emulation are never judged.

The cell's throughput verdict combines this with executed instructions (``dsmatrix.execute.instructions``):
see ``judge.throughput.cell_throughput``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsmatrix.execute.launch import Job, free_port, job_error, supervise, test_environment
from dsmatrix.infra.errors import RunError
from dsmatrix.infra.locations import suite_path
from dsmatrix.judge.step_time import CONFIDENCE, DEFAULT_MARGIN, RULE, Comparison, certifiable_margin, compare, decided, throughput_verdict

BENCH = suite_path("bench")
DEFAULT_MAX_ROUNDS = 48  # a multiple of 3 and of the lanes: every build takes every turn position equally often
DEFAULT_MINUTES = 4.0  # time budget of the step-time rounds, per dtype x checkpointing combination
LOOK_EVERY = 3
DEFAULT_LANES = 2


@dataclass(frozen=True)
class RoundShape:
    """What one worker measures per benchmark: ``engines`` engines in turn, ``steps`` timed steps
    each (docs/measurements.md, "Where step-time variance lives", for the choice)."""

    engines: int = 4
    steps: int = 5


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


def merge_rounds(rounds: Sequence[Path], target: Path) -> Path:
    """One build's rounds as one pytest-benchmark JSON (each benchmark named with its round, in
    the order measured), for ``pytest-benchmark compare``; the per-round files are removed."""
    merged = json.loads(rounds[0].read_text())
    merged["benchmarks"] = []
    for index, path in enumerate(rounds, start=1):
        for bench in json.loads(path.read_text()).get("benchmarks", []):
            bench["name"] += f"-round{index:02d}"
            bench["fullname"] += f"-round{index:02d}"
            merged["benchmarks"].append(bench)
    target.write_text(json.dumps(merged, indent=1))
    for path in rounds:
        path.unlink()
    return target


def read_medians(path: Path) -> dict[str, float]:
    """Benchmark name -> median seconds, from one pytest-benchmark JSON file."""
    data = json.loads(path.read_text())
    return {b["name"]: float(b["stats"]["median"]) for b in data.get("benchmarks", [])}


@dataclass(frozen=True)
class _Turns:
    """The driver's ends of one host's turn pipes: the turn (or a round) handed over, the turn given back."""

    label: str
    go: int
    parked: int
    log: Path


def round_json(out_dir: Path, name: str, lane: int | str, index: int | str, label: str) -> Path:
    """Where the worker of ``label`` in ``lane`` writes its pytest-benchmark JSON for that lane's round ``index``."""
    return out_dir / f"{name}-bench-l{lane}-r{index}-{label}.json"


def _host(
    label: str,
    cpus: Sequence[int],
    python: Path,
    extensions_dir: Path,
    runtime: Mapping[str, Sequence[str]],
    out_dir: Path,
    name: str,
    shape: RoundShape,
) -> tuple[Job, list[_Turns]]:
    """One build's benchmark host (``payload/bench/bench_host.py``): it warms up once, then serves
    one lane per CPU in ``cpus``, forking a pytest-benchmark worker pinned to that CPU per round.
    Each lane has its own turn pipes and rendezvous port."""
    command = [
        str(python), str(BENCH / "bench_host.py"), str(round_json(out_dir, name, "{lane}", "{round}", label)), "--",
        str(BENCH / "bench_step.py"), "-p", "no:cacheprovider", "-q",
        "--benchmark-disable-gc", "--benchmark-save-data", f"--benchmark-timer={TIMER}",
        f"--dtype={','.join(runtime['dtype'])}", f"--checkpointing={','.join(runtime['checkpointing'])}",
    ]  # fmt: skip
    log = out_dir / f"{name}-bench-{label}.log"
    pipes = [(os.pipe(), os.pipe()) for _ in cpus]  # per lane: (go read, go write), (parked read, parked write)
    ports = tuple(free_port() for _ in cpus)
    env = {
        **test_environment(python, extensions_dir, ports[0], 0, 1),
        **STABLE_PROCESS,
        "DSMATRIX_BENCH_STEPS": str(shape.steps),
        "DSMATRIX_BENCH_ENGINES": str(shape.engines),
        "DSMATRIX_BENCH_TURNS": ";".join(f"{go[0]},{parked[1]}" for go, parked in pipes),
        "DSMATRIX_BENCH_CPU": ",".join(map(str, cpus)),
        "DSMATRIX_BENCH_PORTS": ",".join(map(str, ports)),
    }
    inherited = tuple(fd for go, parked in pipes for fd in (go[0], parked[1]))
    job = Job(f"benchmark host ({label})", command, env, log, cwd=BENCH, ports=ports, inherited=inherited)
    return job, [_Turns(f"{label} (lane {lane})", go[1], parked[0], log) for lane, (go, parked) in enumerate(pipes)]


def _answer(turns: _Turns, deadline: float) -> bytes:
    """The next byte a host or its worker sends: ``.`` parked, ``d`` round done, ``x`` worker failed."""
    ready, _, _ = select.select([turns.parked], [], [], max(0.0, deadline - time.monotonic()))
    if not ready:
        raise RunError(f"benchmark round timed out while {turns.label} had the turn (log: {turns.log})")
    answer = os.read(turns.parked, 1)
    if not answer:
        raise job_error(f"benchmark host ({turns.label})", "exited during a round", turns.log)
    return answer


def _one_round(rings: Sequence[Sequence[_Turns]], deadline: float) -> None:
    """Start a round in every host, then in each ring (a lane: hosts sharing one CPU) hand the turn
    round-robin in the order given until each worker has ended, so exactly one process per lane
    runs at a time. Lanes run side by side."""
    ended: dict[str, bytes] = {}
    for ring in rings:
        for taker in ring:
            os.write(taker.go, b"r")
    for ring in rings:
        for taker in ring:  # each worker parks before anything heavy runs
            if (answer := _answer(taker, deadline)) != b".":
                ended[taker.label] = answer
    holders: dict[int, tuple[int, _Turns]] = {}  # parked fd -> (ring, taker holding the turn)

    def hand_on(ring: int, after: int) -> None:
        takers = rings[ring]
        for step in range(1, len(takers) + 1):
            taker = takers[(after + step) % len(takers)]
            if taker.label not in ended:
                os.write(taker.go, b"g")
                holders[taker.parked] = (ring, taker)
                return

    for ring in range(len(rings)):
        hand_on(ring, -1)
    while holders:
        ready, _, _ = select.select(list(holders), [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise RunError(f"benchmark round timed out while {next(iter(holders.values()))[1].label} had the turn")
        for fd in ready:
            ring, taker = holders.pop(fd)
            if (answer := _answer(taker, deadline)) != b".":
                ended[taker.label] = answer
            hand_on(ring, rings[ring].index(taker))
    failed = [taker for ring in rings for taker in ring if ended[taker.label] != b"d"]
    if failed:
        raise job_error(f"benchmark worker ({failed[0].label})", "failed", failed[0].log)


def lane_cpus() -> list[int]:
    """The CPUs benchmark lanes run on, one lane per CPU: the last ``DSMATRIX_BENCH_LANES`` (default
    2) this process may use."""
    cpus = sorted(os.sched_getaffinity(0))
    wanted = int(os.environ.get("DSMATRIX_BENCH_LANES", str(DEFAULT_LANES)))
    return cpus[-max(1, min(wanted, len(cpus))) :]


def run_rounds(
    pythons: Mapping[str, Path],
    extensions: Mapping[str, Path],
    runtime: Mapping[str, Sequence[str]],
    out_dir: Path,
    name: str,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    minutes: float = DEFAULT_MINUTES,
    margin: float = DEFAULT_MARGIN,
    timeout_s: float | None = None,
    shape: RoundShape = RoundShape(),
) -> dict[str, Any]:
    """Rounds of stock, patched and stock-again processes taking strict turns (the order rotated
    from round to round) until the sequential rule decides every step comparison and its A/A
    calibration, or ``max_rounds`` or ``minutes`` is reached."""
    out_dir.mkdir(parents=True, exist_ok=True)
    order = (("stock", "stock"), ("patched", "patched"), ("stock-again", "stock"))
    medians: dict[str, list[dict[str, float]]] = {label: [] for label, _ in order}
    started = time.monotonic()
    budget_s = minutes * 60 * len(runtime["dtype"]) * len(runtime["checkpointing"])

    def comparisons() -> tuple[list[Comparison], list[Comparison]]:
        names = sorted(set.intersection(*(set(m) for label in medians for m in medians[label])))

        def series(label: str, bench: str) -> list[float]:
            return [m[bench] for m in medians[label]]

        fix = [compare(b, series("stock", b), series("patched", b), margin) for b in names]
        return fix, [compare(b, series("stock", b), series("stock-again", b), margin) for b in names]

    stopped = f"round cap ({max_rounds})"
    index = 0  # rounds measured, over every lane
    lanes = range(len(lane_cpus()))
    hosts = {label: _host(label, lane_cpus(), pythons[build], extensions[build], runtime, out_dir, name, shape) for label, build in order}
    takers = {(lane, label): hosts[label][1][lane] for lane in lanes for label, _ in order}
    ours = {fd for turns in takers.values() for fd in (turns.go, turns.parked)}
    files: dict[str, list[Path]] = {label: [] for label, _ in order}

    def close(fd: int) -> None:
        if fd in ours:
            ours.discard(fd)
            os.close(fd)

    def drive(procs: Sequence[subprocess.Popen[bytes]], deadline: float) -> None:
        nonlocal index, stopped
        for turns in takers.values():  # each lane's server says it is ready once its host is warm
            if _answer(turns, deadline) != b".":
                raise job_error(f"benchmark host ({turns.label})", "failed to start", turns.log)
        sweep = 0
        while index < max_rounds:
            round_started = time.monotonic()
            rotations = {lane: (index + lane) % 3 for lane in lanes}  # every build takes every turn position alike
            rings = [[takers[lane, label] for label, _ in order[r:] + order[:r]] for lane, r in rotations.items()]
            _one_round(rings, deadline)
            sweep += 1
            for lane in lanes:
                index += 1
                for label, _ in order:
                    files[label].append(round_json(out_dir, name, lane, sweep, label))
                    medians[label].append(read_medians(files[label][-1]))
            if index % LOOK_EVERY == 0 and decided([c for pair in comparisons() for c in pair]):
                stopped = "decided"
                break
            spent, last = time.monotonic() - started, time.monotonic() - round_started
            if spent + last > budget_s and index < max_rounds:
                stopped = f"time budget ({budget_s / 60:g} min)"
                break
        for turns in takers.values():  # end of file: every host exits
            close(turns.go)

    try:
        supervise([job for job, _ in hosts.values()], timeout_s or budget_s + 900, drive)
    finally:
        for fd in list(ours):
            close(fd)
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
        "files": [merge_rounds(files[label], out_dir / f"{name}-bench-{label}.json").name for label in files if files[label]],
        "lanes": len(lanes),
        "duration_s": round(time.monotonic() - started, 1),
    }
