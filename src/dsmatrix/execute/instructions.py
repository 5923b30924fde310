"""Executed instructions, stock vs patched: the deterministic throughput metric.

Step time on a shared VM moves by percents; the code the fix touches costs microseconds. So
each build also counts what a training step and a release-path call *execute*: the build's
process runs ``payload/bench/count_instructions.py`` under valgrind's callgrind, instrumented only
around the counted steps and calls, each of which ends in a labelled dump (callgrind's client
requests, from ``<valgrind/callgrind.h>``, compiled here into a small library the script loads).
Stock, patched and stock again run at the same time: counts do not depend on what else runs.

**Decision rule.** Per benchmark, each process's mean count over its counted steps (or calls);
the ratio patched/stock; the A/A deviation ``u = |again/stock - 1|`` of the same run is
the measurement's uncertainty. ``no-regression`` when ``ratio * (1 + u) <= 1 + margin`` (default
0.5%), ``regression`` when ``ratio * (1 - u) > 1 + margin``, otherwise ``inconclusive``. The
calibration passes when ``u <= 0.25%`` for every step benchmark: counts differ from process to
process by up to about 0.1% here (object addresses decide hash-table probes in CPython and
DeepSpeed's sets of parameters), more counted steps do not shrink that, and 0.25% keeps a
decision possible at the 0.5% margin. A cell is judged on its step benchmarks; the release path
is reported beside them (it magnifies the code the fix changes, which a different, correct fix
may well write more slowly per call at no cost per step).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dsmatrix.execute.engine_tests import free_port, remove_shm_buffers, test_environment
from dsmatrix.execute.step_time import INCONCLUSIVE, NO_REGRESSION, NOT_MEASURED, REGRESSION, STABLE_PROCESS, STEP, kind_of
from dsmatrix.infra import processes
from dsmatrix.infra.errors import RunError
from dsmatrix.infra.locations import suite_path

BENCH = suite_path("bench")
PASS, FAIL = "pass", "fail"
DEFAULT_MARGIN = 0.005
CALIBRATION_TOLERANCE = 0.0025
COUNTED_STEPS = 5
# callgrind's client requests for count_instructions.py (ctypes): counting on (zeroed), off, and a
# dump labelled with the benchmark that just ran.
MARKS_SOURCE = """#include <valgrind/callgrind.h>
void dsmatrix_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void dsmatrix_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
void dsmatrix_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""
RULE = (
    "per benchmark, the mean instructions per step (or release-path call) of the stock, patched and stock-again "
    "processes under callgrind; u = |stock again / stock - 1|: no-regression if patched/stock x (1 + u) <= {limit:g}, "
    "regression if patched/stock x (1 - u) > {limit:g}, else inconclusive; calibration passes if u <= {tolerance:g} "
    "on every step benchmark; judged on the training step"
)
BUILDS = (("stock", "stock"), ("patched", "patched"), ("stock-again", "stock"))


def valgrind_version() -> str | None:
    """``valgrind-3.19.0`` when valgrind is on PATH, else None."""
    if shutil.which("valgrind") is None:
        return None
    out = subprocess.run(["valgrind", "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


def decide(ratio: float, uncertainty: float, margin: float) -> str:
    """The rule for one benchmark: its ratio, widened both ways by the A/A deviation."""
    limit = 1 + margin
    if ratio * (1 + uncertainty) <= limit:
        return NO_REGRESSION
    if ratio * (1 - uncertainty) > limit:
        return REGRESSION
    return INCONCLUSIVE


def compare(name: str, counts: Mapping[str, Sequence[int]], margin: float = DEFAULT_MARGIN) -> dict[str, Any]:
    """One benchmark: per-build means, ratio, A/A deviation and verdict."""
    stock, patched, again = (statistics.fmean(counts[label]) for label, _ in BUILDS)
    ratio, aa = patched / stock, again / stock
    uncertainty = abs(aa - 1)
    return {
        "benchmark": name,
        "kind": kind_of(name),
        "stock": stock,
        "patched": patched,
        "stock_again": again,
        "ratio": ratio,
        "aa": aa,
        "uncertainty": uncertainty,
        "spread": {label: (max(counts[label]) - min(counts[label])) / statistics.fmean(counts[label]) for label, _ in BUILDS},
        "verdict": decide(ratio, uncertainty, margin),
    }


def verdict_of(comparisons: Sequence[Mapping[str, Any]], tolerance: float = CALIBRATION_TOLERANCE) -> tuple[str, str]:
    """(verdict, calibration) of a cell: the worst step verdict; ``inconclusive`` when the A/A
    deviation of a step benchmark exceeds the tolerance (the counts are not as repeatable as the rule needs)."""
    steps = [c for c in comparisons if c["kind"] == STEP]
    if not steps:
        return NOT_MEASURED, FAIL
    calibration = PASS if all(c["uncertainty"] <= tolerance for c in steps) else FAIL
    verdicts = {c["verdict"] for c in steps}
    if REGRESSION in verdicts:
        return REGRESSION, calibration
    if calibration == FAIL or INCONCLUSIVE in verdicts:
        return INCONCLUSIVE, calibration
    return NO_REGRESSION, calibration


_DUMP = re.compile(r"^desc: Trigger: Client Request: (?P<label>[^\n]+)$.*?^totals:\s+(?P<totals>\d+)", re.MULTILINE | re.DOTALL)


def read_intervals(out: Path) -> dict[str, list[int]]:
    """Benchmark -> instructions of each counted step or call, from callgrind's labelled dumps
    ``out.1 .. out.N`` (in order; the unnumbered final dump is the program's end, not counted)."""
    dumps = sorted((p for p in out.parent.glob(f"{out.name}.*") if p.suffix[1:].isdigit()), key=lambda p: int(p.suffix[1:]))
    intervals: dict[str, list[int]] = {}
    for dump in dumps:
        match = _DUMP.search(dump.read_text(errors="replace"))
        if match is None:
            raise RunError(f"{dump}: not a labelled callgrind dump (no client-request trigger and totals)")
        intervals.setdefault(match["label"].strip(), []).append(int(match["totals"]))
    if not intervals:
        raise RunError(f"{out}: callgrind wrote no labelled dump")
    return intervals


def compile_marks(folder: Path) -> Path:
    """The client-request library, compiled with the C compiler DeepSpeed's JIT builds use too."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RunError("no C compiler (cc) to compile callgrind's client requests")
    source, library = folder / "marks.c", folder / "marks.so"
    source.write_text(MARKS_SOURCE)
    proc = subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RunError(f"compiling {source} failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    return library


def _count_command(python: Path, out: Path, marks: Path, runtime: Mapping[str, Sequence[str]], steps: int) -> list[str]:
    return [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
        "--dump-line=no", "--compress-strings=yes", "--compress-pos=yes",
        str(python), str(BENCH / "count_instructions.py"), f"--marks-library={marks}", f"--steps={steps}",
        f"--dtype={','.join(runtime['dtype'])}", f"--checkpointing={','.join(runtime['checkpointing'])}",
    ]  # fmt: skip


def run_counts(
    pythons: Mapping[str, Path],
    extensions: Mapping[str, Path],
    runtime: Mapping[str, Sequence[str]],
    out_dir: Path,
    name: str,
    margin: float = DEFAULT_MARGIN,
    steps: int = COUNTED_STEPS,
    timeout_s: float = 3600,
) -> dict[str, Any]:
    """Stock, patched and stock again counted at the same time; compared per benchmark."""
    tool = valgrind_version()
    if tool is None:
        return {"verdict": NOT_MEASURED, "reason": "valgrind is not installed here (apt-get install valgrind)"}
    started = time.monotonic()
    work = out_dir / f"{name}-callgrind"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    marks = compile_marks(work)
    procs: dict[str, tuple[subprocess.Popen[bytes], Path, int]] = {}
    try:
        for label, build in BUILDS:
            port = free_port()
            env = {**test_environment(pythons[build], extensions[build], port, 0, 1), **STABLE_PROCESS}
            log = out_dir / f"{name}-instructions-{label}.log"
            command = _count_command(pythons[build], work / label, marks, runtime, steps)
            with log.open("w") as handle:
                procs[label] = (processes.start(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=BENCH), log, port)
        deadline = started + timeout_s
        for label, (proc, log, _) in procs.items():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                raise RunError(f"instruction count ({label}) timed out after {timeout_s:.0f} s (log: {log})") from exc
            if proc.returncode != 0:
                raise RunError(f"instruction count ({label}) exited {proc.returncode} (log: {log})")
    finally:
        for proc, _, port in procs.values():
            processes.stop(proc)
            remove_shm_buffers(port)
    counts = {label: read_intervals(work / label) for label, _ in BUILDS}
    shutil.rmtree(work)  # callgrind's profiles are large; the counts are kept below
    names = sorted(set.intersection(*(set(c) for c in counts.values())))
    comparisons = [compare(b, {label: counts[label][b] for label, _ in BUILDS}, margin) for b in names]
    verdict, calibration = verdict_of(comparisons)
    saved = out_dir / f"{name}-instructions.json"
    saved.write_text(json.dumps({"tool": tool, "counts": counts}, indent=1) + "\n")
    return {
        "metric": "instructions",
        "tool": f"{tool} callgrind",
        "margin": margin,
        "tolerance": CALIBRATION_TOLERANCE,
        "steps": steps,
        "rule": RULE.format(limit=1 + margin, tolerance=CALIBRATION_TOLERANCE),
        "comparisons": comparisons,
        "verdict": verdict,
        "calibration": calibration,
        "files": [f"bench/{saved.name}"],
        "duration_s": round(time.monotonic() - started, 1),
    }
