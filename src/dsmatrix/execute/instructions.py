"""Executed instructions, stock vs patched: the deterministic throughput metric.

Step time on a shared VM moves by percents; the code the fix touches costs microseconds. So
each build also counts what a training step and a release-path call *execute*: the build's
process runs ``payload/bench/count_instructions.py`` under valgrind's callgrind, instrumented only
around the counted steps and calls, each of which ends in a labelled dump (callgrind's client
requests, from ``<valgrind/callgrind.h>``, compiled here into a small library the script loads).
Stock, patched and stock again run at the same time: counts do not depend on what else runs.

The decision rule is ``judge.instructions``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dsmatrix.execute.launch import Job, free_port, supervise, test_environment
from dsmatrix.execute.step_time import STABLE_PROCESS
from dsmatrix.infra.errors import RunError
from dsmatrix.infra.locations import suite_path
from dsmatrix.judge.instructions import BUILDS, CALIBRATION_TOLERANCE, DEFAULT_MARGIN, RULE, compare, verdict_of
from dsmatrix.judge.throughput import NOT_MEASURED

BENCH = suite_path("bench")
COUNTED_STEPS = 5
# callgrind's client requests for count_instructions.py (ctypes): counting on (zeroed), off, and a
# dump labelled with the benchmark that just ran.
MARKS_SOURCE = """#include <valgrind/callgrind.h>
void dsmatrix_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void dsmatrix_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
void dsmatrix_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""


def valgrind_version() -> str | None:
    """``valgrind-3.19.0`` when valgrind is on PATH, else None."""
    if shutil.which("valgrind") is None:
        return None
    out = subprocess.run(["valgrind", "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or None


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
    jobs = []
    for label, build in BUILDS:
        port = free_port()
        env = {**test_environment(pythons[build], extensions[build], port, 0, 1), **STABLE_PROCESS}
        command = _count_command(pythons[build], work / label, marks, runtime, steps)
        jobs.append(
            Job(f"instruction count ({label})", command, env, out_dir / f"{name}-instructions-{label}.log", cwd=BENCH, ports=(port,))
        )
    supervise(jobs, timeout_s)
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
