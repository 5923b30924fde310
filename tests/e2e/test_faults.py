"""Fault injection and concurrency on real runs (marked ``faults``): a run killed at each stage of the
pipeline, then run again, must end with the verdicts of an uninterrupted run and leave no process,
no stale lock and no half-built cache entry; two ``nox -s matrix`` on one cache started together
must both finish with correct verdicts.

The short version (CI) walks the six kill points once on the smoke cell, alternating SIGKILL and
SIGINT where each matters most; ``DSMATRIX_FAULTS=long`` adds a second walk, on an empty cache of
its own, with the other signal at every point. The delays are random (seeded by ``DSMATRIX_FAULT_SEED``, printed).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import faults
import pytest
from helpers import REPO, warm

pytestmark = pytest.mark.faults

SELECTION = ["--tier", "smoke"]
SHORT = (("KILL", "INT", "KILL", "KILL", "INT", "KILL"),)
LONG = (("KILL", "INT", "KILL", "KILL", "INT", "KILL"), ("INT", "KILL", "INT", "INT", "KILL", "KILL"))


def _walks() -> tuple[tuple[str, ...], ...]:
    return LONG if os.environ.get("DSMATRIX_FAULTS") == "long" else SHORT


def test_killed_runs_resume_to_the_uninterrupted_verdicts(tmp_path: Path) -> None:
    seed = int(os.environ.get("DSMATRIX_FAULT_SEED", random.randrange(10_000)))
    print(f"fault seed {seed} (DSMATRIX_FAULT_SEED={seed} repeats these delays)")
    rng = random.Random(seed)
    problems: list[str] = []
    for w, signals in enumerate(_walks()):  # each walk on an empty cache of its own: every stage runs
        problems += _walk(tmp_path / f"walk-{w}", signals, rng)
    assert not problems, "\n".join(problems)


def _walk(work: Path, signals: tuple[str, ...], rng: random.Random) -> list[str]:
    """Kill one run per kill point, in pipeline order, then re-run and compare with a `--fresh` run."""
    cache, results = work / "cache", work / "results"
    command = [sys.executable, "-m", "dsmatrix", "matrix", "--results", str(results), *SELECTION]
    problems: list[str] = []
    records = []
    for n, (point, sig) in enumerate(zip(faults.ALL_POINTS, signals, strict=True)):
        log = work / f"{n}-{point}.log"
        record = faults.kill_at(command, cache, results, point, signal.Signals[f"SIG{sig}"], rng, log, REPO)
        records.append(record)
        print(json.dumps(record.as_dict()))
        where = f"{point} ({record.signal} after {record.delay_s} s; log {log})"
        if not record.reached:
            problems.append(f"{where}: the run never reached this point")
        if record.reached and record.signal == "SIGINT":
            if record.exit_code != 130:
                problems.append(f"{where}: exit {record.exit_code}, expected 130")
            planning = record.summary_status is None and "interrupted while checking the inputs" in log.read_text()
            if not planning and (record.summary_status != "interrupted" or "interrupted" not in record.cell_verdicts.values()):
                problems.append(f"{where}: summary {record.summary_status}, cells {record.cell_verdicts}: must be `interrupted`")
            if record.right_after.processes or record.right_after.held_locks:
                problems.append(f"{where}: left {record.right_after.processes + record.right_after.held_locks}")
        if n > 0 and records[-2].signal == "SIGKILL" and records[-2].right_after.processes:
            alive = [p for p in records[-2].right_after.processes if Path(f"/proc/{p.split()[0]}").exists()]
            if alive and "stopped a process group left by a killed run" not in log.read_text():
                problems.append(f"{where}: the orphans of the killed run before it still run: {alive}")
    code, took = faults.wait_run(command, cache, work / "rerun.log", REPO)
    left = faults.leftovers(cache)
    recovered = faults.cell_outcomes(results)
    print(f"re-run: exit {code} in {took:.0f} s; left {left}")
    if code != 0:
        problems.append(f"the re-run exited {code} (log {work / 'rerun.log'})")
    if left.any():
        problems.append(f"after the re-run the cache still holds {left}")
    reference_code, _ = faults.wait_run([*command, "--fresh"], cache, work / "reference.log", REPO)
    reference = faults.cell_outcomes(results)
    assert reference_code == 0, (work / "reference.log").read_text()[-2000:]
    if recovered != reference:
        problems.append(f"recovered verdicts differ from an uninterrupted run's: {recovered} != {reference}")
    if not all(v["verdict"] == "fixed" for v in reference.values()):  # type: ignore[index]
        problems.append(f"the uninterrupted run is not fixed: {reference}")
    return problems


def _nox_matrix_command(results: Path) -> list[str]:
    return [sys.executable, "-m", "nox", "-s", "matrix", "--", "--results", str(results), *SELECTION]


def _nox_matrix(results: Path, cache: Path, log: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(DSMATRIX_CACHE=str(cache), PYTHONUNBUFFERED="1")
    return subprocess.Popen(_nox_matrix_command(results), cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)


@pytest.fixture
def seeded_cache(tmp_path: Path) -> Path:
    """A private cache with the sdists and the builder environment already in it: the two runs
    start at the wheels, the part they share (the fault walk above needs a cache empty of everything)."""
    cache = tmp_path / "cache"
    print(f"seeded the private cache in {warm(cache):.0f} s")
    return cache


def test_two_nox_matrix_runs_on_one_cache(seeded_cache: Path, tmp_path: Path) -> None:
    """Both runs build, wait for each other's entries and finish `fixed`; the stock tests ran once."""
    cache = seeded_cache
    runs = [(tmp_path / f"results-{i}", tmp_path / f"nox-{i}.log") for i in (1, 2)]
    procs = [_nox_matrix(results, cache, log) for results, log in runs]
    started = time.monotonic()
    codes = [p.wait(timeout=3600) for p in procs]
    print(f"two runs together: {time.monotonic() - started:.0f} s, exits {codes}")
    for code, (_, log) in zip(codes, runs, strict=True):
        assert code == 0, log.read_text()[-3000:]
    outcomes = [faults.cell_outcomes(results) for results, _ in runs]
    assert outcomes[0] == outcomes[1] and all(v["verdict"] == "fixed" for v in outcomes[0].values()), outcomes  # type: ignore[index]
    cells = [json.loads(next((results / "latest" / "cells").glob("*.json")).read_text()) for results, _ in runs]
    reused = [c["builds"]["stock"].get("tests_reused_from") for c in cells]
    assert sum(bool(r) for r in reused) == 1, f"the stock tests ran {2 - sum(bool(r) for r in reused)} times: {reused}"
    assert len(list((cache / "wheels").glob("*/*/*/build.json"))) == 2, "one stock and one patched wheel"
    assert not faults.leftovers(cache).any(), faults.leftovers(cache)


def test_nox_matrix_stopped_through_nox_alone_records_the_interrupt(seeded_cache: Path, tmp_path: Path) -> None:
    """SIGINT, then SIGTERM, to nox's process only (what a script or a CI runner holding nox's pid sends,
    not a terminal's Ctrl-C to the whole group) while the tests run: nox passes the stop on and waits,
    so each run ends as a signalled dsmatrix does, summary and cell `interrupted`, nothing left."""
    results = tmp_path / "results"
    command = _nox_matrix_command(results)
    for sig in (signal.SIGINT, signal.SIGTERM):  # one cache: the second run starts at the tests
        log = tmp_path / f"nox-{sig.name}.log"
        record = faults.kill_at(command, seeded_cache, results, "test-run", sig, random.Random(0), log, REPO, max_delay_s=1.0)
        print(json.dumps(record.as_dict()))
        tail = f"{sig.name}: " + log.read_text()[-3000:]
        assert record.reached and record.exit_code not in (0, None), tail
        assert record.summary_status == "interrupted" and list(record.cell_verdicts.values()) == ["interrupted"], tail
        assert not record.right_after.processes and not record.right_after.held_locks, f"{sig.name}: {record.right_after}"
