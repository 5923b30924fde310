"""Run the engine tests (``payload/engine``) inside one build's environment, read the JUnit.

Each build's environment holds its own ``TORCH_EXTENSIONS_DIR`` (DeepSpeed JIT-builds a CPU
comm op there; the default cache is keyed only by Python, so sharing it across versions loads
wrong builds); where Debian's ccache is installed, the compiles go through it, so each op is
compiled once for every environment with the same torch and op sources (the engine tests build it
in turn under a lock in ccache's folder, so environments side by side do not both compile it);
``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE=1`` (0.14/0.15 otherwise call numactl) and a single-rank
gloo rendezvous on a free loopback port.
"""

from __future__ import annotations

import glob
import json
import os
import random
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from junitparser import Error, Failure, JUnitXml, Properties, Skipped

from dsmatrix.infra import processes
from dsmatrix.infra.errors import RunError
from dsmatrix.infra.locations import suite_path

ENGINE_TESTS = suite_path("engine")
CCACHE_MASQUERADE = Path("/usr/lib/ccache")  # Debian's ccache: compiler-named links to ccache
PYTEST_OK = (0, 1)  # all passed / some failed: both are results


@dataclass(frozen=True)
class TestOutcome:
    __test__ = False  # not a pytest test class

    outcome: str  # passed | failed | error | skipped
    bug: str = ""  # non-empty for bug tests: lifecycle | retrace | recompute
    message: str = ""
    duration_s: float = 0.0
    properties: Mapping[str, str] = field(default_factory=dict)
    observed: str = ""  # a bug test's figures when it saw the bug (the only evidence that counts)
    reference: str = ""  # the build whose recorded behaviour this test's must equal (``stock``)


@dataclass(frozen=True)
class TestRun:
    __test__ = False  # not a pytest test class

    outcomes: Mapping[str, TestOutcome]
    duration_s: float
    junits: tuple[Path, ...]
    logs: tuple[Path, ...]


def remove_shm_buffers(port: int, shm: Path = Path("/dev/shm")) -> int:
    """Delete the shared-memory buffers DeepSpeed's CPU comm op left for our rendezvous port.

    Every process that loads the op creates ``deepspeed_allreduce_buffer_<rank>_<addr>_<port>_*``
    (64 MiB) and never removes it: on a host they pile up until reboot, and in a container with
    docker's default 64 MiB ``/dev/shm`` the next process segfaults (seen in the rpi5 image).
    Only buffers named with our own port are touched.
    """
    removed = 0
    for path in shm.glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A free TCP port for a rendezvous, below the kernel's ephemeral range.

    A port the kernel hands out (bind to 0) can be taken again by any process's next outgoing
    or gloo connection before our rank binds it; with a benchmark round's three processes
    starting together that happened (EADDRINUSE). Ports below the ephemeral range are only
    ever taken by someone asking for them by number.
    """
    low, _ = _ephemeral_ports()
    for port in random.sample(range(max(1024, low - 20000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything below the range taken: fall back to the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_environment(python: Path, extensions_dir: Path, port: int, rank: int, world_size: int) -> dict[str, str]:
    """The environment of one rank, as if its venv were activated: the venv's ``bin`` first on
    PATH (torch JIT-builds DeepSpeed's comm op with the ``ninja`` that DeepSpeed installs there)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VIRTUAL_ENV"))}
    path = [str(python.parent), env.get("PATH", os.defpath)]
    if CCACHE_MASQUERADE.is_dir() and shutil.which("ccache"):  # torch JIT-builds with `c++`: let ccache answer it
        path.insert(1, str(CCACHE_MASQUERADE))
        env.update(CCACHE_BASEDIR=str(python.parent.parent), CCACHE_NOHASHDIR="1")
        if env.get("CCACHE_DIR"):  # the comm op is built in turn, so ccache answers the second environment
            Path(env["CCACHE_DIR"]).mkdir(parents=True, exist_ok=True)
            env["DSMATRIX_JIT_LOCKS"] = env["CCACHE_DIR"]
    env.update(
        PATH=os.pathsep.join(path),
        VIRTUAL_ENV=str(python.parent.parent),
        DS_ACCELERATOR="cpu",
        LOCAL_SIZE=str(world_size),
        TORCH_EXTENSIONS_DIR=str(extensions_dir),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        PYTHONUNBUFFERED="1",
    )
    # One intra-op thread per rank (unless set; the matrix command sets it for every child): cells,
    # builds and ranks run side by side and share the cores (measured, docs/measurements.md).
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


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
    procs = []
    for rank in range(world_size):
        junit = out_dir / f"{name}-ws{world_size}-rank{rank}.xml"
        log = out_dir / f"{name}-ws{world_size}-rank{rank}.log"
        command = [
            str(python), "-m", "pytest", str(ENGINE_TESTS), "-p", "no:cacheprovider", "-q", "-rfEs",
            "-o", "junit_family=xunit1", f"--junitxml={junit}",
            f"--dtype={','.join(runtime['dtype'])}", f"--checkpointing={','.join(runtime['checkpointing'])}",
        ]  # fmt: skip
        with log.open("w") as out:
            env = {**test_environment(python, extensions_dir, port, rank, world_size), **env_extra}
            procs.append((processes.start(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ENGINE_TESTS), junit, log))
    deadline = time.monotonic() + timeout_s
    try:
        for proc, _, log in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RunError(f"engine tests (world size {world_size}) timed out after {timeout_s:.0f} s (log: {log})") from None
    finally:
        for proc, _, _ in procs:
            processes.stop(proc)
        remove_shm_buffers(port)
    for rank, (proc, junit, log) in enumerate(procs):
        if proc.returncode not in PYTEST_OK or not junit.is_file():
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise RunError(f"engine tests (world size {world_size}, rank {rank}) exited {proc.returncode}: {tail[0][:300]} (log: {log})")
    return [(junit, log) for _, junit, log in procs]


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


def outcomes_from_junits(junits: Sequence[Path]) -> dict[str, TestOutcome]:
    """The merged outcomes (``@ws<N>`` ids) of JUnit files named ``<name>-ws<N>-rank<R>.xml``."""
    by_size: dict[int, list[Path]] = {}
    for junit in sorted(junits):
        size = int(junit.stem.rsplit("-ws", 1)[1].split("-rank", 1)[0])
        by_size.setdefault(size, []).append(junit)
    outcomes: dict[str, TestOutcome] = {}
    for size, files in sorted(by_size.items()):
        merged = merge_ranks([read_junit(f) for f in files])
        outcomes.update({f"{test_id}@ws{size}": outcome for test_id, outcome in merged.items()})
    return outcomes


SEVERITY = {"error": 3, "failed": 2, "passed": 1, "skipped": 0}


def merge_ranks(per_rank: Sequence[Mapping[str, TestOutcome]]) -> dict[str, TestOutcome]:
    """One outcome per test over all ranks: the worst one, with the rank that saw it.

    A test skipped on some ranks and run on others, or missing on a rank, is an error.
    """
    if len(per_rank) == 1:
        return dict(per_rank[0])
    merged: dict[str, TestOutcome] = {}
    for test_id in sorted(set().union(*per_rank)):
        found = [(rank, outcomes.get(test_id)) for rank, outcomes in enumerate(per_rank)]
        missing = [rank for rank, o in found if o is None]
        present = [(rank, o) for rank, o in found if o is not None]
        bug = present[0][1].bug
        if missing:
            merged[test_id] = TestOutcome("error", bug, f"not run on rank(s) {missing}")
            continue
        skipped = {o.outcome == "skipped" for _, o in present}
        if len(skipped) > 1:
            merged[test_id] = TestOutcome(
                "error", bug, "skipped on some ranks only: " + ", ".join(f"rank {r} {o.outcome}" for r, o in present)
            )
            continue
        rank, worst = max(present, key=lambda item: SEVERITY[item[1].outcome])
        message = f"rank {rank}: {worst.message}" if worst.message and worst.outcome != "skipped" else worst.message
        properties = {f"rank{r}.{k}": v for r, o in present for k, v in o.properties.items()}
        duration = max(o.duration_s for _, o in present)
        # evidence only when every rank that failed failed by seeing the bug
        failing = [(r, o) for r, o in present if o.outcome in ("failed", "error")]
        seen = bool(failing) and all(o.observed for _, o in failing)
        observed = "; ".join(f"rank {r}: {o.observed}" for r, o in failing) if seen else ""
        merged[test_id] = TestOutcome(worst.outcome, bug, message, duration, properties, observed, present[0][1].reference)
    return merged


def read_junit(path: Path, full_ids: bool = False) -> dict[str, TestOutcome]:
    """Outcome per test id (``file::name[params]``; ``full_ids``: ``dotted.module.Class::name[params]``)
    from a pytest JUnit XML file."""
    outcomes: dict[str, TestOutcome] = {}
    for suite in JUnitXml.fromfile(str(path)):
        for case in suite:
            test_file = (case.classname if full_ids else case.classname.rsplit(".", 1)[-1]) if case.classname else "?"
            test_id = f"{test_file}::{case.name}"
            found = case.child(Properties)
            properties = {p.name: p.value for p in found} if found is not None else {}
            outcome, message = "passed", ""
            for result in case.result:
                if isinstance(result, Skipped):
                    outcome, message = "skipped", result.message or ""
                elif isinstance(result, Error):
                    outcome, message = "error", result.message or ""
                elif isinstance(result, Failure):
                    outcome, message = "failed", result.message or ""
            outcomes[test_id] = TestOutcome(
                outcome=outcome,
                bug=properties.pop("bug", ""),
                message=_one_line(message),
                duration_s=round(float(case.time or 0.0), 3),
                properties=properties,
                observed=properties.pop("bug_observed", ""),
                reference=properties.pop("reference", ""),
            )
    return outcomes


def _one_line(message: str, limit: int = 600) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def outcome_dict(outcome: TestOutcome) -> dict[str, object]:
    data: dict[str, object] = {"outcome": outcome.outcome, "duration_s": outcome.duration_s}
    if outcome.bug:
        data["bug"] = outcome.bug
    if outcome.message:
        data["message"] = outcome.message
    if outcome.observed:
        data["bug_observed"] = _maybe_json(outcome.observed)
    if outcome.reference:
        data["reference"] = outcome.reference
    if outcome.properties:
        data["properties"] = {k: _maybe_json(v) for k, v in outcome.properties.items()}
    return data


def outcome_from_dict(data: Mapping[str, object] | None) -> TestOutcome | None:
    """The inverse of ``outcome_dict`` (a stored result read back); None for a test a build did not run."""
    if not data:
        return None
    observed = data.get("bug_observed")
    properties = data.get("properties") or {}
    return TestOutcome(
        outcome=str(data.get("outcome", "error")),
        bug=str(data.get("bug", "")),
        message=str(data.get("message", "")),
        duration_s=float(data.get("duration_s", 0.0)),  # type: ignore[arg-type]
        properties={k: v if isinstance(v, str) else json.dumps(v) for k, v in properties.items()},  # type: ignore[union-attr]
        observed="" if observed is None else observed if isinstance(observed, str) else json.dumps(observed),
        reference=str(data.get("reference", "")),
    )


def _maybe_json(value: str) -> object:
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return value
