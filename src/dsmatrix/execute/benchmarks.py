"""A cell's benchmarks (executed instructions, step-time rounds, leak lines) and its throughput verdict."""

from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dsmatrix.build.patches import PatchSet
from dsmatrix.execute.instructions import run_counts
from dsmatrix.execute.leak import run_leak
from dsmatrix.execute.prepare import PreparedBuild, prepare_builds
from dsmatrix.execute.step_time import DEFAULT_MAX_ROUNDS, DEFAULT_MINUTES, run_rounds
from dsmatrix.infra import parallel
from dsmatrix.infra.cache import Cache
from dsmatrix.infra.errors import FatalError
from dsmatrix.infra.hosts import describe
from dsmatrix.infra.results import Run
from dsmatrix.judge.instructions import CALIBRATION_TOLERANCE
from dsmatrix.judge.step_time import DEFAULT_MARGIN
from dsmatrix.judge.throughput import HEADLINE_RULE, NO_REGRESSION, NOT_MEASURED, REGRESSION, cell_throughput
from dsmatrix.plan.cells import Cell, Selection


def run_benchmarks(
    builds: dict[str, PreparedBuild], runtime: Any, run: Run, cell: Cell, options: BenchOptions, emulated: bool, cache: Cache
) -> dict[str, Any]:
    """Executed instructions, step-time rounds and the leak lines for one cell, and the cell's
    throughput verdict (``HEADLINE_RULE``); never judged under emulation."""
    if emulated:
        return {"verdict": f"{NOT_MEASURED} (emulated)", "reason": "timings under qemu-user say nothing about native speed"}
    pythons = {b: builds[b].python for b in builds}
    extensions = {b: builds[b].extensions for b in builds}
    with cache.using_extensions(list(extensions.values())):
        return _run_benchmarks(pythons, extensions, runtime, run, cell, options)


def _run_benchmarks(
    pythons: dict[str, Path], extensions: dict[str, Path], runtime: Any, run: Run, cell: Cell, options: BenchOptions
) -> dict[str, Any]:
    out = run.root / "bench"
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        instructions = run_counts(pythons, extensions, runtime, out, cell.id, options.instructions_margin)
        print(f"    instructions: {instructions['verdict']} ({instructions.get('duration_s', 0):.0f} s)", flush=True)
        step = run_rounds(pythons, extensions, runtime, out, cell.id, options.max_rounds, options.minutes, options.margin)
        leak = run_leak(pythons, extensions, out, cell.id, options.lifecycles)
    except FatalError as exc:  # the correctness verdict stands; the benchmarks say why they have none
        return {"verdict": "error", "reason": str(exc), "duration_s": round(time.monotonic() - started, 1)}
    step["files"] = [f"bench/{name}" for name in step["files"]]
    verdict, decided_by = cell_throughput(step["verdict"], step["calibration_verdict"], instructions)
    return {
        **step,
        "time_verdict": step["verdict"],
        "rounds_duration_s": step["duration_s"],
        "verdict": verdict,
        "decided_by": decided_by,
        "headline_rule": HEADLINE_RULE.format(
            instructions=options.instructions_margin, tolerance=CALIBRATION_TOLERANCE, time=options.margin
        ),
        "instructions": instructions,
        "leak": leak,
        "duration_s": round(time.monotonic() - started, 1),
        "options": asdict(options),
    }


def measured_alike(result: dict[str, Any], bench: BenchOptions) -> bool:
    """Whether a finished result's benchmarks decided its throughput with these options: a resumed run
    keeps them, with their files, instead of measuring another quarter of an hour (an undecided or
    failed measurement is measured again)."""
    found = result.get("benchmarks") or {}
    return found.get("options") == asdict(bench) and found.get("verdict") in (NO_REGRESSION, REGRESSION)


def recorded_files(benchmarks: dict[str, Any]) -> list[str]:
    """The files a benchmarks record names (``bench/<name>``): step-time rounds, instruction counts, leak lines."""
    named = [*benchmarks.get("files", []), *(benchmarks.get("instructions") or {}).get("files", [])]
    return [*named, *(line["file"] for line in benchmarks.get("leak") or [] if line.get("file"))]


def keep_benchmark_files(found_run: Path, run: Run, benchmarks: dict[str, Any]) -> bool:
    """Copy the files a reused cell's benchmarks record names from the run that measured them into
    ``run``; False when one is missing there (the cell is then measured again)."""
    (run.root / "bench").mkdir(parents=True, exist_ok=True)
    sources = [found_run / "bench" / Path(name).name for name in recorded_files(benchmarks)]
    if not all(source.is_file() for source in sources):
        return False
    for source in sources:
        shutil.copy2(source, run.root / "bench" / source.name)
    return True


def add_benchmarks(result: dict[str, Any], cell: Cell, selection: Selection, patch: PatchSet, cache: Cache, run: Run, bench: BenchOptions):
    """Benchmarks for a cell whose correctness result is reused (its builds are cached)."""
    try:
        with parallel.GATE.shared():
            builds = prepare_builds(cell, patch, cache)
    except FatalError as exc:
        return {**result, "benchmarks": {"verdict": "error", "reason": str(exc)}}
    with parallel.alone("benchmarks"):
        return {**result, "benchmarks": run_benchmarks(builds, selection.runtime, run, cell, bench, describe()["emulated"], cache)}


@dataclass(frozen=True)
class BenchOptions:
    """How much to measure: the step-time rounds' cap and time budget, both margins, leak lifecycles."""

    max_rounds: int = DEFAULT_MAX_ROUNDS
    minutes: float = DEFAULT_MINUTES
    margin: float = DEFAULT_MARGIN
    instructions_margin: float = 0.005
    lifecycles: int = 20
