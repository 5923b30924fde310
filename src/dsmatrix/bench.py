"""Benchmarks: step time stock vs patched with a stated decision rule, and the leak benchmark.

Stock and patched live in different environments, so they are measured in different processes.
Each round starts three at once, stock, patched and stock again, pinned to one CPU, and lets
exactly one run at a time: each parks before every timed step (``tests/bench/turns.py``) and
the driver hands the turn round-robin, in an order rotated from round to round. Their steps
interleave one by one, so the machine's drifts hit every build alike. Every process is timed in
CPU time with one intra-op thread (``STABLE_PROCESS``, ``TIMER``), runs
``tests/bench/bench_step.py`` under pytest-benchmark and saves its JSON; one process gives one
median per benchmark.

**Decision rule.** Per round, the ratio patched / stock of the two processes' medians; over
rounds, the geometric mean with a 95% bootstrap interval (``scipy.stats.bootstrap``).
``no-regression`` when the interval's upper bound is <= 1 + margin (default 2%),
``regression`` when its lower bound is > 1 + margin, otherwise ``inconclusive``, with an
estimate of the rounds that would decide it (the half-width shrinks as 1/sqrt(rounds)). A cell
is judged on its training-step benchmarks; the release-path micro-benchmark is reported beside
them. The A/A calibration (stock vs stock again, same rounds) must come out ``no-regression``;
its upper bounds give the smallest margin this machine certifies with that many rounds.
Timings taken under emulation are never judged.
"""

from __future__ import annotations

import json
import math
import os
import select
import statistics
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dsmatrix.errors import RunError
from dsmatrix.locations import suite_path
from dsmatrix.run import free_port, remove_shm_buffers, test_environment

BENCH = suite_path("bench")
NO_REGRESSION, REGRESSION, INCONCLUSIVE, NOT_MEASURED = "no-regression", "regression", "inconclusive", "not-measured"
DEFAULT_MARGIN = 0.02
DEFAULT_ROUNDS = 15  # a multiple of 3: every build takes every turn position equally often
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
CONFIDENCE = 0.95
RULE = (
    "per round, patched/stock of the two processes' median step times (their steps interleaved one by one); "
    "over rounds, the geometric mean with a {confidence:.0%} bootstrap interval: no-regression if the upper bound "
    "<= {limit:g}, regression if the lower bound > {limit:g}, else inconclusive; judged on the training step"
)


@dataclass(frozen=True)
class BenchOptions:
    """How much to measure: interleaved rounds, the regression margin, leak lifecycles."""

    rounds: int = DEFAULT_ROUNDS
    margin: float = DEFAULT_MARGIN
    lifecycles: int = 20


STEP, RELEASE_PATH = "step", "release-path"


def kind_of(benchmark: str) -> str:
    """``step`` for the training-step benchmark (judged), ``release-path`` for the micro-benchmark."""
    return RELEASE_PATH if benchmark.startswith("test_release_path") else STEP


@dataclass(frozen=True)
class Comparison:
    """One benchmark's patched/stock (or A/A) ratio, its interval and the rule's verdict."""

    benchmark: str
    kind: str
    rounds: int
    ratio: float
    low: float
    high: float
    margin: float
    verdict: str
    stock_s: float  # median over rounds of the per-process medians
    patched_s: float
    rounds_to_decide: int | None = None

    @property
    def width(self) -> float:
        return self.high - self.low

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "width": self.width}


def ratio_interval(stock: Sequence[float], patched: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    """Geometric mean over rounds of the per-round ratio patched/stock, with its bootstrap interval.

    ``stock[i]`` and ``patched[i]`` are the median step times of round ``i``'s two processes,
    whose steps ran interleaved; so each round's ratio is free of whatever the machine did
    between rounds, and only the rounds' ratios are resampled.
    """
    import numpy as np
    from scipy.stats import bootstrap

    logs = np.log(np.asarray(patched, dtype=float) / np.asarray(stock, dtype=float))
    ratio = float(np.exp(logs.mean()))
    if len(logs) < 3:
        return ratio, -math.inf, math.inf
    result = bootstrap(
        (logs,),
        np.mean,
        vectorized=True,
        confidence_level=CONFIDENCE,
        n_resamples=9999,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    low, high = result.confidence_interval
    return ratio, float(np.exp(low)), float(np.exp(high))


def decide(ratio: float, low: float, high: float, margin: float, rounds: int) -> tuple[str, int | None]:
    """The decision rule; for ``inconclusive``, roughly how many rounds in all would decide it."""
    limit = 1 + margin
    if high <= limit:
        return NO_REGRESSION, None
    if low > limit:
        return REGRESSION, None
    half = (high - low) / 2
    distance = abs(limit - ratio)
    if not math.isfinite(half) or distance == 0:
        return INCONCLUSIVE, None
    needed = max(rounds + 1, math.ceil(rounds * (half / distance) ** 2))
    return INCONCLUSIVE, needed if needed <= 20 * rounds else None  # beyond that: the ratio sits at the margin


def compare(name: str, stock: Sequence[float], patched: Sequence[float], margin: float = DEFAULT_MARGIN) -> Comparison:
    ratio, low, high = ratio_interval(stock, patched)
    verdict, more = decide(ratio, low, high, margin, len(stock))
    return Comparison(
        name, kind_of(name), len(stock), ratio, low, high, margin, verdict, statistics.median(stock), statistics.median(patched), more
    )


def throughput_verdict(comparisons: Sequence[Comparison]) -> str:
    """A cell's throughput verdict: the worst over its step benchmarks (the release path is a
    magnifier reported beside it, not a throughput figure)."""
    verdicts = {c.verdict for c in comparisons if c.kind == STEP}
    for verdict in (REGRESSION, INCONCLUSIVE):
        if verdict in verdicts:
            return verdict
    return NO_REGRESSION if verdicts else NOT_MEASURED


def certifiable_margin(calibration: Sequence[Comparison]) -> float | None:
    """The smallest margin at which every A/A step comparison of this run is ``no-regression``:
    what this machine can certify with this many rounds (the A/A upper bounds, as a margin)."""
    return margin_certified_by(c.high for c in calibration if c.kind == STEP)


def margin_certified_by(highs: Iterable[float]) -> float | None:
    """The margin A/A upper bounds ``highs`` certify (None without a finite bound)."""
    finite = [h for h in highs if math.isfinite(h)]
    return round(max(0.0, max(finite) - 1), 4) if finite else None


def read_medians(path: Path) -> dict[str, float]:
    """Benchmark name -> median seconds, from one pytest-benchmark JSON file."""
    data = json.loads(path.read_text())
    return {b["name"]: float(b["stats"]["median"]) for b in data.get("benchmarks", [])}


def _pin_to_one_cpu() -> None:
    """Every benchmark process on the same (last) CPU: vCPUs of a shared VM do not run alike."""
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[-1]})


@dataclass
class _TurnTaker:
    """One process of a round: its pipes (turn handed over / turn given back) and its files."""

    label: str
    proc: subprocess.Popen[bytes]
    go: int
    parked: int
    port: int
    out: Path
    log: Path


def _start_turn_taker(label: str, python: Path, extensions_dir: Path, runtime: Mapping[str, Sequence[str]], out: Path) -> _TurnTaker:
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
    with log.open("w") as handle:
        proc = subprocess.Popen(
            command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=BENCH,
            pass_fds=(go_read, parked_write), preexec_fn=_pin_to_one_cpu,
        )  # fmt: skip
    os.close(go_read)
    os.close(parked_write)
    return _TurnTaker(label, proc, go_write, parked_read, port, out, log)


def _wait_parked(taker: _TurnTaker, deadline: float) -> bool:
    """Wait until ``taker`` gives its turn back (True) or exits (False)."""
    remaining = deadline - time.monotonic()
    ready, _, _ = select.select([taker.parked], [], [], max(0.0, remaining))
    if not ready:
        raise RunError(f"benchmark round timed out while {taker.label} had the turn (log: {taker.log})")
    if os.read(taker.parked, 1):
        return True
    taker.proc.wait()
    return False


def _run_round(takers: Sequence[_TurnTaker], timeout_s: float) -> None:
    """Hand the turn round-robin until every process has exited: exactly one runs at a time."""
    deadline = time.monotonic() + timeout_s
    live = [t for t in takers if _wait_parked(t, deadline)]
    while live:
        for taker in list(live):
            os.write(taker.go, b"g")
            if not _wait_parked(taker, deadline):
                live.remove(taker)


def _bench_round(
    builds: Sequence[tuple[str, Path, Path]], runtime: Mapping[str, Sequence[str]], out_dir: Path, stem: str, timeout_s: float
) -> dict[str, dict[str, float]]:
    """One round: the given builds' processes started together and run in strict turns;
    label -> benchmark -> median seconds."""
    takers: list[_TurnTaker] = []
    try:
        for label, python, extensions_dir in builds:
            takers.append(_start_turn_taker(label, python, extensions_dir, runtime, out_dir / f"{stem}-{label}.json"))
        _run_round(takers, timeout_s)
    finally:
        for taker in takers:
            if taker.proc.poll() is None:
                taker.proc.kill()
                taker.proc.wait()
            os.close(taker.go)
            os.close(taker.parked)
            remove_shm_buffers(taker.port)
    for taker in takers:
        if taker.proc.returncode != 0 or not taker.out.is_file():
            raise RunError(f"benchmark process ({taker.label}) exited {taker.proc.returncode} (log: {taker.log})")
    return {taker.label: read_medians(taker.out) for taker in takers}


def run_rounds(
    pythons: Mapping[str, Path],
    extensions: Mapping[str, Path],
    runtime: Mapping[str, Sequence[str]],
    out_dir: Path,
    name: str,
    rounds: int = DEFAULT_ROUNDS,
    margin: float = DEFAULT_MARGIN,
    timeout_s: float = 1800,
) -> dict[str, Any]:
    """``rounds`` rounds of stock, patched and stock-again processes taking strict turns (the order
    rotated from round to round); compare per benchmark."""
    out_dir.mkdir(parents=True, exist_ok=True)
    order = (("stock", "stock"), ("patched", "patched"), ("stock-again", "stock"))
    medians: dict[str, list[dict[str, float]]] = {label: [] for label, _ in order}
    started = time.monotonic()
    for index in range(rounds):
        rotated = order[index % 3 :] + order[: index % 3]
        builds = [(label, pythons[build], extensions[build]) for label, build in rotated]
        for label, result in _bench_round(builds, runtime, out_dir, f"{name}-bench-r{index + 1}", timeout_s).items():
            medians[label].append(result)
    names = sorted(set.intersection(*(set(m) for label in medians for m in medians[label])))

    def series(label: str, bench: str) -> list[float]:
        return [m[bench] for m in medians[label]]

    fix = [compare(b, series("stock", b), series("patched", b), margin) for b in names]
    calibration = [compare(b, series("stock", b), series("stock-again", b), margin) for b in names]
    return {
        "rounds": rounds,
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


LEAK_LINES = (
    ("stock", "stock", False),
    ("patched", "patched", False),
    ("stock, FWD_MODULE_STACK drained (diagnostic)", "stock", True),
    ("patched, FWD_MODULE_STACK drained (diagnostic)", "patched", True),
)


def run_leak(
    pythons: Mapping[str, Path], extensions: Mapping[str, Path], out_dir: Path, name: str, lifecycles: int, timeout_s: float = 1800
) -> list[dict[str, Any]]:
    """The leak benchmark's lines: stock and patched, then both with the unrelated retainer drained
    (diagnostic: what is left is what the release cache holds)."""
    lines = []
    for label, build, drain in LEAK_LINES:
        out = out_dir / f"{name}-leak-{build}{'-drained' if drain else ''}.json"
        port = free_port()
        env = test_environment(pythons[build], extensions[build], port, 0, 1)
        command = [str(pythons[build]), str(BENCH / "leak.py"), "--lifecycles", str(lifecycles), "--json", str(out)]
        log = out.with_suffix(".log")
        started = time.monotonic()
        try:
            with log.open("w") as handle:
                proc = subprocess.run(
                    command + (["--drain"] if drain else []), stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
                )
        finally:
            remove_shm_buffers(port)
        if proc.returncode != 0 or not out.is_file():
            raise RunError(f"leak benchmark ({label}) exited {proc.returncode} (log: {log})")
        line = {"line": label, "build": build, "drain": drain, "file": f"bench/{out.name}", **json.loads(out.read_text())}
        lines.append({**line, "duration_s": round(time.monotonic() - started, 1)})
    return lines
