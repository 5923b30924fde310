"""Launching a build's processes: each rank's environment, a free rendezvous port, and the one
supervised pattern every launcher uses (start with a log, wait to a deadline, stop, remove the
shared memory DeepSpeed left, read the log's tail, raise).

Each build's environment holds its own ``TORCH_EXTENSIONS_DIR`` (DeepSpeed JIT-builds a CPU
comm op there; the default cache is keyed only by Python, so sharing it across versions loads
wrong builds); where Debian's ccache is installed, the compiles go through it, so each op is
compiled once for every environment with the same torch and op sources (the engine tests build it
in turn under a lock in ccache's folder, so environments side by side do not both compile it);
``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE=1`` (0.14/0.15 otherwise call numactl) and a single-rank
gloo rendezvous on a free loopback port.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dsmatrix.infra import processes
from dsmatrix.infra.errors import RunError

CCACHE_MASQUERADE = Path("/usr/lib/ccache")  # Debian's ccache: compiler-named links to ccache


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


@dataclass
class Job:
    """One supervised process: its command and environment, its log, what it must leave behind."""

    label: str  # names it in errors: "engine tests (world size 2, rank 0)"
    command: list[str]
    env: Mapping[str, str]
    log: Path
    cwd: Path | None = None
    ports: tuple[int, ...] = ()  # its rendezvous ports: DeepSpeed's shared-memory buffers named with them are removed
    output: Path | None = None  # a file it must write (JUnit, JSON)
    ok: tuple[int, ...] = (0,)  # exit statuses that are results
    inherited: tuple[int, ...] = ()  # pipe ends the child keeps; the parent closes them once it started
    popen: Mapping[str, object] = field(default_factory=dict)


def log_tail(log: Path) -> str:
    """The last line of a log, shortened (what an error quotes)."""
    lines = log.read_text(errors="replace").strip().splitlines() if log.is_file() else []
    return lines[-1][:300] if lines else "no output"


def job_error(label: str, what: str, log: Path) -> RunError:
    """A one-line error naming the process, what happened, its log's last line and the log."""
    return RunError(f"{label} {what}: {log_tail(log)} (log: {log})")


def supervise(
    jobs: Sequence[Job], timeout_s: float, drive: Callable[[Sequence[subprocess.Popen[bytes]], float], None] | None = None
) -> None:
    """Start ``jobs`` together, each writing its log; ``drive`` them (or just wait) until a deadline
    ``timeout_s`` away; then stop every one and remove its shared memory, whatever happened. A
    one-line RunError naming the job and its log when one timed out, exited with a status not in
    its ``ok``, or left no ``output``."""
    started: list[subprocess.Popen[bytes]] = []
    deadline = time.monotonic() + timeout_s
    try:
        for job in jobs:
            with job.log.open("w") as out:
                popen = {**job.popen, **({"pass_fds": job.inherited} if job.inherited else {})}
                started.append(processes.start(job.command, stdout=out, stderr=subprocess.STDOUT, env=dict(job.env), cwd=job.cwd, **popen))
            for fd in job.inherited:  # the child's ends: a pipe reads end-of-file once the child exits
                os.close(fd)
        if drive is not None:
            drive(started, deadline)
        for job, proc in zip(jobs, started, strict=False):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise RunError(f"{job.label} timed out after {timeout_s:.0f} s (log: {job.log})") from None
    finally:
        for job in jobs[len(started) :]:  # never started: their pipe ends are still ours
            for fd in job.inherited:
                os.close(fd)
        for proc in started:
            processes.stop(proc)
        for job in jobs:
            for port in job.ports:
                remove_shm_buffers(port)
    for job, proc in zip(jobs, started, strict=True):
        if proc.returncode not in job.ok or (job.output is not None and not job.output.is_file()):
            raise RunError(f"{job.label} exited {proc.returncode}: {log_tail(job.log)} (log: {job.log})")
