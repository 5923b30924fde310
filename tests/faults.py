"""Fault injection for whole matrix runs: start ``dsmatrix matrix`` on a private cache, wait until it
reaches a kill point (seen from outside, in the process table), send it a signal after a random
delay, and take stock of what it left: processes, torch extension locks, held cache locks,
half-built entries, the run's summary.

Works against any version of the suite (it watches processes, not the suite's output), so the
same kill points measure what a run left before and after the fix: ``python tests/faults.py
--help``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from filelock import FileLock, Timeout

JIT_TOOLS = ("ninja", "cc1plus", "c++", "g++", "as", "ld")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    comm: str
    cmdline: tuple[str, ...]
    cwd: str
    start: int

    @property
    def command(self) -> str:
        return " ".join(self.cmdline)

    def describe(self) -> str:
        return f"{self.pid} {self.comm}: {self.command[:160]}"


def processes() -> list[Proc]:
    """Every process of this machine that can be read."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = tuple(a for a in (entry / "cmdline").read_bytes().decode(errors="replace").split("\0") if a)
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":  # zombie: already dead, waiting to be reaped
            continue
        found.append(Proc(int(entry.name), int(fields[1]), comm, cmdline, cwd, int(fields[19])))
    return found


def of_cache(cache: Path) -> list[Proc]:
    """Processes working for a run on ``cache``: their command line or working folder names it."""
    root = str(cache)
    return [p for p in processes() if p.pid != os.getpid() and (root in p.command or p.cwd.startswith(root))]


def _is(*words: str) -> Callable[[Proc], bool]:
    return lambda p: all(w in p.cmdline or w in p.command for w in words)


# Kill points: what the process table shows while a run is at that stage.
KILL_POINTS: dict[str, Callable[[Proc], bool]] = {
    "sdist-fetch": _is("pip", "download"),
    "wheel-build": _is("pip", "wheel", "--no-build-isolation"),
    "environment": lambda p: Path(p.cmdline[0]).name == "uv" and "install" in p.cmdline and "/envs/" in p.command if p.cmdline else False,
    "jit-build": lambda p: p.comm in JIT_TOOLS and "torch-extensions" in p.cwd,
    "test-run": lambda p: "pytest" in p.cmdline and "/envs/" in p.command and "patched" in p.command,
}
SUMMARY_WRITE = "summary-write"  # reached through the suite's own seam (DSMATRIX_KILL_AT_WRITE)
ALL_POINTS = (*KILL_POINTS, SUMMARY_WRITE)


@dataclass
class Leftovers:
    """What a cache holds that no finished run should leave."""

    processes: list[str] = field(default_factory=list)
    torch_locks: list[str] = field(default_factory=list)
    held_locks: list[str] = field(default_factory=list)
    partial_entries: list[str] = field(default_factory=list)

    def any(self) -> bool:
        return bool(self.processes or self.torch_locks or self.held_locks or self.partial_entries)


def leftovers(cache: Path) -> Leftovers:
    found = Leftovers(processes=[p.describe() for p in of_cache(cache)])
    found.torch_locks = sorted(str(p.relative_to(cache)) for p in (cache / "torch-extensions").glob("*/*/*/lock"))
    for path in sorted(cache.rglob("*.lock")):
        if "torch-extensions" in path.parts and path.name == "lock":
            continue
        try:
            with FileLock(str(path), timeout=0):
                pass
        except Timeout:
            found.held_locks.append(str(path.relative_to(cache)))
    for folder in ("sdists", "builders", "wheels", "envs", "stock-results"):
        for path in (cache / folder).rglob("*") if (cache / folder).is_dir() else []:
            if ".partial-" in path.name or path.name.startswith("tmp") or "-src-" in path.name:
                if path.is_dir() and not any(".partial-" in parent.name for parent in path.parents):
                    found.partial_entries.append(str(path.relative_to(cache)))
    return found


@dataclass
class KillRecord:
    point: str
    signal: str
    delay_s: float
    reached: bool
    exit_code: int | None
    summary_status: str | None
    cell_verdicts: dict[str, str]
    right_after: Leftovers  # what the killed run left, a few seconds after the signal
    target: str = ""  # the process that showed the kill point

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class RunHandle:
    proc: subprocess.Popen[str]
    log: Path


def start_run(command: Sequence[str], cache: Path, log: Path, cwd: Path, extra_env: dict[str, str] | None = None) -> RunHandle:
    """Start a run as a user's shell would, in a session of its own (signals reach only what we send)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "DSMATRIX_KILL_AT_WRITE")}
    env.update(DSMATRIX_CACHE=str(cache), PYTHONUNBUFFERED="1", **(extra_env or {}))
    log.parent.mkdir(parents=True, exist_ok=True)
    handle = log.open("w")
    proc = subprocess.Popen(list(command), cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return RunHandle(proc, log)


def latest_summary(results: Path) -> dict[str, object] | None:
    try:
        return json.loads((results / "latest" / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def kill_at(
    command: Sequence[str],
    cache: Path,
    results: Path,
    point: str,
    sig: signal.Signals,
    rng: random.Random,
    log: Path,
    cwd: Path,
    timeout_s: float = 1800,
    max_delay_s: float = 3.0,
) -> KillRecord:
    """One run killed at ``point`` with ``sig`` after a random delay; returns what it left. A run
    that finishes before reaching the point is recorded as not reached."""
    delay = round(rng.uniform(0.0, max_delay_s), 2)
    extra = {"DSMATRIX_KILL_AT_WRITE": "summary.json:2"} if point == SUMMARY_WRITE else None
    # What a killed run before this one left (its orphans, its summary) is not this run's: an orphaned
    # pytest of the last run must not count as this run reaching its tests, nor its summary as this run's.
    earlier = {p.pid for p in of_cache(cache)}
    earlier_run = (latest_summary(results) or {}).get("run_id")
    run = start_run(command, cache, log, cwd, extra)
    deadline = time.monotonic() + timeout_s
    target = ""
    reached = point == SUMMARY_WRITE
    if point in KILL_POINTS:
        while time.monotonic() < deadline and run.proc.poll() is None:
            hit = next((p for p in of_cache(cache) if p.pid not in earlier and KILL_POINTS[point](p)), None)
            if hit is not None:
                reached, target = True, hit.describe()
                break
            time.sleep(0.1)
        if reached:
            time.sleep(delay)
            if run.proc.poll() is None:
                os.kill(run.proc.pid, sig)
    if point in KILL_POINTS and not reached and run.proc.poll() is None:
        run.proc.kill()
    try:
        code = run.proc.wait(timeout=120 if point in KILL_POINTS else timeout_s)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        code = run.proc.wait()
    time.sleep(2.0)  # what is left a moment later (a stopped group has had its grace period by now)
    summary = latest_summary(results) or {}
    if earlier_run is not None and summary.get("run_id") == earlier_run:
        summary = {}  # this run wrote no summary (stopped while it checked its inputs)
    verdicts = {str(c["id"]): str(c["verdict"]) for c in summary.get("cells", [])}  # type: ignore[union-attr]
    signal_name = "SIGKILL (seam)" if point == SUMMARY_WRITE else sig.name
    return KillRecord(point, signal_name, delay, reached, code, summary.get("status"), verdicts, leftovers(cache), target)  # type: ignore[arg-type]


def wait_run(command: Sequence[str], cache: Path, log: Path, cwd: Path, timeout_s: float = 1800) -> tuple[int | None, float]:
    """Run to the end (or ``timeout_s``: the run and its children are then killed, exit None)."""
    run = start_run(command, cache, log, cwd)
    started = time.monotonic()
    try:
        return run.proc.wait(timeout=timeout_s), time.monotonic() - started
    except subprocess.TimeoutExpired:
        for p in of_cache(cache):
            os.kill(p.pid, signal.SIGKILL)
        run.proc.kill()
        run.proc.wait()
        return None, time.monotonic() - started


def cell_outcomes(results: Path) -> dict[str, object]:
    """The latest run's cells: verdict and every test's outcome per build (what must not change)."""
    summary = latest_summary(results) or {}
    out: dict[str, object] = {}
    for entry in summary.get("cells", []):  # type: ignore[union-attr]
        cell = json.loads((results / "latest" / entry["file"]).read_text())
        tests = {b: {t: o["outcome"] for t, o in build.get("tests", {}).items()} for b, build in cell.get("builds", {}).items()}
        out[cell["cell"]["id"]] = {"verdict": cell["verdict"], "tests": tests}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Walk the kill points with any version of the suite and print what each left (JSON lines)."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--python", default=sys.executable, help="the interpreter whose dsmatrix runs")
    parser.add_argument("--cwd", type=Path, required=True, help="where the runs start (a checkout)")
    parser.add_argument("--work", type=Path, required=True, help="private cache, results and logs go here")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--signals", default="KILL,INT,KILL,KILL,INT,KILL", help="one per kill point, in order")
    parser.add_argument("--rerun-timeout", type=float, default=900)
    parser.add_argument("selection", nargs="*", default=["--tier", "smoke"])
    args = parser.parse_args(argv)
    cache, results = args.work / "cache", args.work / "results"
    command = [args.python, "-m", "dsmatrix", "matrix", "--results", str(results), *args.selection]
    rng = random.Random(args.seed)
    for n, (point, sig) in enumerate(zip(ALL_POINTS, args.signals.split(","), strict=True)):
        record = kill_at(command, cache, results, point, signal.Signals[f"SIG{sig}"], rng, args.work / f"{n}-{point}.log", args.cwd)
        print(json.dumps(record.as_dict()), flush=True)
    code, took = wait_run(command, cache, args.work / "rerun.log", args.cwd, args.rerun_timeout)
    print(json.dumps({"rerun_exit": code, "rerun_s": round(took, 1), "after_rerun": asdict(leftovers(cache))}), flush=True)
    print(json.dumps({"cells": cell_outcomes(results)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
