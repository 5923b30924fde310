"""Benchmarks: step time stock vs patched, rounds until a sequential rule decides, and the leak benchmark.

Stock and patched live in different environments, so they are measured in different processes.
Each round starts three at once, stock, patched and stock again, pinned to one CPU, and lets
exactly one run at a time: each parks before every timed step (``payload/bench/turns.py``) and
the driver hands the turn round-robin, in an order rotated from round to round. Their steps
interleave one by one, so the machine's drifts hit every build alike. Every process is timed in
CPU time with one intra-op thread (``STABLE_PROCESS``, ``TIMER``), runs
``payload/bench/bench_step.py`` under pytest-benchmark and saves its JSON; one process gives one
median per benchmark.

**Decision rule (sequential).** Per round, the log of the ratio patched / stock of the two
processes' medians. After every third round (each build has then taken each turn position
equally often) the rule looks at an anytime-valid 95% confidence sequence for the mean log
ratio: the t confidence sequence of Lindon et al. (2024), from ``savvi``, intersected over the
rounds so far. Its coverage holds however many times it is looked at, so stopping as soon as it
decides keeps the stated error rate (5% per comparison). ``no-regression`` when the upper bound
of the ratio is <= 1 + margin (default 2%), ``regression`` when the lower bound is > 1 + margin,
otherwise ``inconclusive``. Rounds go on until every step comparison and its A/A calibration
(stock vs stock again, same rounds, must come out ``no-regression``) is decided, or the round
cap or the time budget is reached. Timings taken under emulation are never judged.

The cell's throughput verdict combines this with executed instructions (``dsmatrix.execute.instructions``):
see ``cell_throughput``.
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

from dsmatrix.execute.engine_tests import free_port, remove_shm_buffers, test_environment
from dsmatrix.infra import processes
from dsmatrix.infra.errors import RunError
from dsmatrix.infra.locations import suite_path

BENCH = suite_path("bench")
NO_REGRESSION, REGRESSION, INCONCLUSIVE, NOT_MEASURED = "no-regression", "regression", "inconclusive", "not-measured"
DEFAULT_MARGIN = 0.02
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
CONFIDENCE = 0.95
RULE = (
    "per round, log(patched/stock) of the two processes' median step times (their steps interleaved one by one); "
    "after every third round, an anytime-valid {confidence:.0%} confidence sequence for the ratio (Lindon et al. t "
    "confidence sequence, savvi): no-regression if its upper bound <= {limit:g}, regression if its lower bound > {limit:g}, "
    "else inconclusive; rounds go on until every step comparison and its A/A calibration is decided, or the cap"
)
HEADLINE_RULE = (
    "a cell's throughput is decided on the training step by executed instructions where valgrind counts them "
    "(near-deterministic: margin {instructions:.1%}, A/A within {tolerance:.2%}), else by step time (margin {time:.0%}, "
    "A/A calibration no-regression); a regression decided by either metric fails the cell (by step time unless its A/A "
    "calibration is itself a regression): instructions do not see time spent waiting"
)


@dataclass(frozen=True)
class BenchOptions:
    """How much to measure: the step-time rounds' cap and time budget, both margins, leak lifecycles."""

    max_rounds: int = DEFAULT_MAX_ROUNDS
    minutes: float = DEFAULT_MINUTES
    margin: float = DEFAULT_MARGIN
    instructions_margin: float = 0.005
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

    @property
    def width(self) -> float:
        return self.high - self.low

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "width": self.width}


def ratio_interval(stock: Sequence[float], patched: Sequence[float]) -> tuple[float, float, float]:
    """Geometric mean over rounds of the per-round ratio patched/stock, with its anytime-valid interval.

    ``stock[i]`` and ``patched[i]`` are the median step times of round ``i``'s two processes,
    whose steps ran interleaved; so each round's ratio is free of whatever the machine did
    between rounds. The interval is savvi's t confidence sequence for the mean log ratio (an
    intercept-only anytime-valid linear model), intersected over all rounds so far.
    """
    import numpy as np
    from savvi.linear_regression import LinearRegression

    logs = np.log(np.asarray(patched, dtype=float) / np.asarray(stock, dtype=float))
    sequence = LinearRegression(alpha=1 - CONFIDENCE, p=1)
    with np.errstate(divide="ignore", invalid="ignore"):  # too few rounds yet: an infinite interval
        for value in logs:
            sequence.update(np.array([value, 1.0]))
            sequence.infer()
    low, high = (float(v) for v in sequence.conf_int[0])
    return float(np.exp(logs.mean())), math.exp(low) if math.isfinite(low) else 0.0, math.exp(high) if math.isfinite(high) else math.inf


def decide(low: float, high: float, margin: float) -> str:
    """The decision rule on one interval."""
    limit = 1 + margin
    if high <= limit:
        return NO_REGRESSION
    if low > limit:
        return REGRESSION
    return INCONCLUSIVE


def compare(name: str, stock: Sequence[float], patched: Sequence[float], margin: float = DEFAULT_MARGIN) -> Comparison:
    ratio, low, high = ratio_interval(stock, patched)
    verdict = decide(low, high, margin)
    medians = statistics.median(stock), statistics.median(patched)
    return Comparison(name, kind_of(name), len(stock), ratio, low, high, margin, verdict, *medians)


def throughput_verdict(comparisons: Sequence[Comparison]) -> str:
    """One metric's verdict for a cell: the worst over its step benchmarks."""
    verdicts = {c.verdict for c in comparisons if c.kind == STEP}
    for verdict in (REGRESSION, INCONCLUSIVE):
        if verdict in verdicts:
            return verdict
    return NO_REGRESSION if verdicts else NOT_MEASURED


def cell_throughput(time_verdict: str, calibration_verdict: str, instructions: Mapping[str, Any] | None) -> tuple[str, str]:
    """(verdict, decided by) of a cell's throughput, by ``HEADLINE_RULE``.

    Instructions decide where they were counted with a passing calibration; step time decides
    otherwise (its A/A calibration ``no-regression``). A regression decided by either metric is a
    regression: by instructions with their calibration passing, by step time unless its A/A
    calibration itself came out a regression. Instruction counts cannot see time spent waiting.
    """
    counted = instructions is not None and instructions.get("verdict") in (NO_REGRESSION, REGRESSION, INCONCLUSIVE)
    instructions_ok = counted and instructions.get("calibration") == "pass"
    time_ok = calibration_verdict == NO_REGRESSION
    # a decided step-time regression stands unless the A/A itself came out a regression (a biased bench)
    time_regression = time_verdict == REGRESSION and calibration_verdict != REGRESSION
    if instructions_ok and instructions["verdict"] == REGRESSION:
        return REGRESSION, "instructions"
    if time_regression:
        return REGRESSION, "step time"
    if counted:
        return (instructions["verdict"] if instructions_ok else INCONCLUSIVE), "instructions"
    if time_verdict == NOT_MEASURED:
        return NOT_MEASURED, ""
    return (time_verdict if time_ok else INCONCLUSIVE), "step time"


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
        proc = processes.start(
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
            processes.stop(taker.proc)
            os.close(taker.go)
            os.close(taker.parked)
            remove_shm_buffers(taker.port)
    for taker in takers:
        if taker.proc.returncode != 0 or not taker.out.is_file():
            raise RunError(f"benchmark process ({taker.label}) exited {taker.proc.returncode} (log: {taker.log})")
    return {taker.label: read_medians(taker.out) for taker in takers}


def decided(comparisons: Sequence[Comparison]) -> bool:
    return all(c.verdict != INCONCLUSIVE for c in comparisons if c.kind == STEP)


def run_rounds(
    pythons: Mapping[str, Path],
    extensions: Mapping[str, Path],
    runtime: Mapping[str, Sequence[str]],
    out_dir: Path,
    name: str,
    options: BenchOptions = BenchOptions(),
    timeout_s: float = 1800,
) -> dict[str, Any]:
    """Rounds of stock, patched and stock-again processes taking strict turns (the order rotated
    from round to round) until the sequential rule decides every step comparison and its A/A
    calibration, or ``options.max_rounds`` or ``options.minutes`` is reached."""
    out_dir.mkdir(parents=True, exist_ok=True)
    order = (("stock", "stock"), ("patched", "patched"), ("stock-again", "stock"))
    medians: dict[str, list[dict[str, float]]] = {label: [] for label, _ in order}
    started = time.monotonic()
    budget_s = options.minutes * 60

    def comparisons() -> tuple[list[Comparison], list[Comparison]]:
        names = sorted(set.intersection(*(set(m) for label in medians for m in medians[label])))

        def series(label: str, bench: str) -> list[float]:
            return [m[bench] for m in medians[label]]

        fix = [compare(b, series("stock", b), series("patched", b), options.margin) for b in names]
        return fix, [compare(b, series("stock", b), series("stock-again", b), options.margin) for b in names]

    stopped = f"round cap ({options.max_rounds})"
    index = 0
    while index < options.max_rounds:
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
        if spent + last > budget_s and index < options.max_rounds:
            stopped = f"time budget ({options.minutes:g} min)"
            break
    fix, calibration = comparisons()
    return {
        "rounds": index,
        "max_rounds": options.max_rounds,
        "minutes": options.minutes,
        "stopped": stopped,
        "margin": options.margin,
        "rule": RULE.format(confidence=CONFIDENCE, limit=1 + options.margin),
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
                proc = processes.run(
                    command + (["--drain"] if drain else []), stdout=handle, stderr=subprocess.STDOUT, env=env, timeout=timeout_s
                )
        finally:
            remove_shm_buffers(port)
        if proc.returncode != 0 or not out.is_file():
            raise RunError(f"leak benchmark ({label}) exited {proc.returncode} (log: {log})")
        line = {"line": label, "build": build, "drain": drain, "file": f"bench/{out.name}", **json.loads(out.read_text())}
        lines.append({**line, "duration_s": round(time.monotonic() - started, 1)})
    return lines
