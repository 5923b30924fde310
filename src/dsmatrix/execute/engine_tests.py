"""Run the engine tests (``payload/engine``) inside one build's environment, one pytest per rank
(``execute.launch`` gives each rank its environment), and read their JUnit (``judge.outcomes``)."""

from __future__ import annotations

import glob
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from dsmatrix.execute.launch import Job, free_port, supervise, test_environment
from dsmatrix.infra.errors import RunError
from dsmatrix.infra.locations import suite_path
from dsmatrix.judge.outcomes import PYTEST_OK, TestOutcome, TestRun, merge_ranks, read_junit

ENGINE_TESTS = suite_path("engine")


def run_engine_tests(
    python: Path,
    extensions_dir: Path,
    runtime: Mapping[str, Sequence[str]],
    out_dir: Path,
    name: str,
    timeout_s: float = 3600,
    env_extra: Mapping[str, str] | None = None,
) -> TestRun:
    """Run the engine tests with ``python`` at every selected world size, one pytest per rank.

    Test ids get an ``@ws<N>`` suffix; a test's outcome is merged over its ranks. RunError
    unless every rank produced results.
    """
    extensions_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    outcomes: dict[str, TestOutcome] = {}
    junits: list[Path] = []
    logs: list[Path] = []
    for world_size in (int(ws) for ws in runtime.get("world_size", ("1",))):
        per_rank = _run_ranks(python, extensions_dir, runtime, world_size, out_dir, name, timeout_s, env_extra or {})
        junits += [junit for junit, _ in per_rank]
        logs += [log for _, log in per_rank]
        merged = merge_ranks([read_junit(junit) for junit, _ in per_rank])
        outcomes.update({f"{test_id}@ws{world_size}": outcome for test_id, outcome in merged.items()})
    if not outcomes:
        raise RunError(f"engine tests collected nothing (logs: {out_dir})")
    return TestRun(outcomes, time.monotonic() - started, tuple(junits), tuple(logs))


def _run_ranks(
    python: Path,
    extensions_dir: Path,
    runtime: Mapping[str, Sequence[str]],
    world_size: int,
    out_dir: Path,
    name: str,
    timeout_s: float,
    env_extra: Mapping[str, str],
) -> list[tuple[Path, Path]]:
    """Launch one pytest process per rank on one rendezvous; wait for all of them."""
    port = free_port()
    jobs = []
    for rank in range(world_size):
        junit = out_dir / f"{name}-ws{world_size}-rank{rank}.xml"
        command = [
            str(python), "-m", "pytest", str(ENGINE_TESTS), "-p", "no:cacheprovider", "-q", "-rfEs",
            "-o", "junit_family=xunit1", f"--junitxml={junit}",
            f"--dtype={','.join(runtime['dtype'])}", f"--checkpointing={','.join(runtime['checkpointing'])}",
        ]  # fmt: skip
        env = {**test_environment(python, extensions_dir, port, rank, world_size), **env_extra}
        log = junit.with_suffix(".log")
        label = f"engine tests (world size {world_size}, rank {rank})"
        jobs.append(Job(label, command, env, log, cwd=ENGINE_TESTS, ports=(port,), output=junit, ok=PYTEST_OK))
    supervise(jobs, timeout_s)
    return [(job.output, job.log) for job in jobs if job.output is not None]


PROGRESS_LINE = re.compile(r"^([.FEsxX]+)\s*(\[\s*\d+%\])?$")  # pytest -q: one character a finished test


def probe_of_tests(out_dir: Path, name: str, extensions_dir: Path) -> Callable[[], str]:
    """What a running test stage can say: the op torch is JIT-building (its ``lock`` in the
    extensions folder), or how many tests the newest rank-0 log shows finished (and failed). Each
    log is read on from where the last call stopped, whole lines only."""
    read: dict[Path, tuple[int, str]] = {}  # log -> (bytes read, progress marks seen)

    def marks_of(log: Path) -> str:
        offset, marks = read.get(log, (0, ""))
        with log.open("rb") as handle:
            if os.fstat(handle.fileno()).st_size < offset:  # written anew (a stage run again): from the start
                offset, marks = 0, ""
            handle.seek(offset)
            chunk = handle.read()
        whole = chunk[: chunk.rfind(b"\n") + 1]
        lines = whole.decode(errors="replace").splitlines()
        marks += "".join(m.group(1) for line in lines if (m := PROGRESS_LINE.match(line)))
        read[log] = (offset + len(whole), marks)
        return marks

    def probe() -> str:
        building = sorted(lock.parent.name for lock in extensions_dir.glob("*/lock"))
        if building:
            return f"JIT build of {', '.join(building)}"
        logs = sorted(out_dir.glob(f"{glob.escape(name)}-ws*-rank0.log"), key=lambda p: p.stat().st_mtime)
        if not logs:
            return ""
        marks = marks_of(logs[-1])
        world = logs[-1].name.rsplit("-ws", 1)[-1].split("-", 1)[0]
        failed = sum(marks.count(c) for c in "FE")
        return f"world size {world}: {len(marks)} test(s) done" + (f", {failed} failed" if failed else "")

    return probe
