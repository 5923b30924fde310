"""The docker engine: one that answers is used as it is; otherwise the suite starts its own daemon (no bridge,
no iptables, host networking), shared between runs, and stops exactly that daemon when the last run leaves."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from dsmatrix.infra.debian import install_debian_packages
from dsmatrix.infra.errors import DockerUnavailable


def new_client() -> Any:
    import docker  # imported here: the rest of the suite runs without the docker SDK

    return docker.from_env(timeout=600)


@contextlib.contextmanager
def docker_errors() -> Iterator[None]:
    """A docker API error (a failed container start, a lost daemon) as one line, not a traceback."""
    import docker

    try:
        yield
    except docker.errors.DockerException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DockerUnavailable(f"docker: {type(exc).__name__}: {first}") from None


@contextlib.contextmanager
def docker_engine(state_dir: Path) -> Iterator[Any]:
    """A docker client. An engine that answers and was not started by this suite is used as it is.
    Otherwise the suite's own daemon is shared between runs: under ``state_dir/daemon.lock`` a run
    starts it when none answers and registers itself in ``state_dir/users/``; on leaving, the last
    registered run still alive stops it. A run killed outright leaves its entry, which the next
    run sees is dead and drops."""
    from filelock import FileLock

    state_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(state_dir / "daemon.lock"))
    me = _register_user(state_dir)
    try:
        with lock:
            client = _answering_client()
            if client is None:
                client = _start_daemon(state_dir)
            elif not _ours(state_dir):  # an engine the suite did not start: use it, stop nothing
                _unregister_user(me)
        with docker_errors():
            yield client
    finally:
        with lock:
            _unregister_user(me)
            if _ours(state_dir) and not _live_users(state_dir):
                _stop_daemon(state_dir)


def _answering_client() -> Any | None:
    import docker

    try:
        client = new_client()
        client.ping()
    except docker.errors.DockerException:
        return None
    return client


def _register_user(state_dir: Path) -> Path:
    from dsmatrix.infra.processes import start_time

    users = state_dir / "users"
    users.mkdir(parents=True, exist_ok=True)
    entry = users / f"{os.getpid()}.json"
    entry.write_text(json.dumps({"pid": os.getpid(), "start": start_time(os.getpid())}))
    return entry


def _unregister_user(entry: Path) -> None:
    entry.unlink(missing_ok=True)


def _live_users(state_dir: Path) -> list[int]:
    """The runs registered as users of the suite's daemon that are still alive (dead entries dropped)."""
    from dsmatrix.infra.processes import alive, read_record

    live = []
    for entry in sorted((state_dir / "users").glob("*.json")):
        data = read_record(entry, ("pid", "start"))
        if data and alive(data["pid"], data["start"]):
            live.append(data["pid"])
        else:
            entry.unlink(missing_ok=True)
    return live


def _ours(state_dir: Path) -> bool:
    """Whether the suite's own daemon (``state_dir/daemon.json``) is running: the recorded process,
    started when recorded, is a dockerd of this user (a forged record names no other process)."""
    from dsmatrix.infra.processes import alive, mine, read_record

    data = read_record(state_dir / "daemon.json", ("pid", "start"))
    if data is None or not alive(data["pid"], data["start"]) or not mine(data["pid"]):
        return False
    try:
        return psutil.Process(data["pid"]).name() == "dockerd"
    except psutil.Error:
        return False


def _start_daemon(state_dir: Path) -> Any:
    from dsmatrix.infra.processes import start_time

    if shutil.which("dockerd") is None:
        install_debian_packages(["docker.io"], "no docker engine answers and dockerd is not installed", DockerUnavailable)
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise DockerUnavailable("no docker engine answers and docker.io installed no dockerd")
    log = state_dir / "dockerd.log"
    cmd = [dockerd, "--bridge=none", "--iptables=false", "--ip-masq=false", "--storage-driver=overlay2"]
    with log.open("ab") as out:  # its own session, and not a child the run stops: other runs may share it
        daemon = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        client = _wait_for_engine(daemon, log)
    except BaseException:
        _terminate(daemon.pid)
        raise
    (state_dir / "daemon.json").write_text(json.dumps({"pid": daemon.pid, "start": start_time(daemon.pid)}))
    print(f"dsmatrix: started dockerd (pid {daemon.pid}, log {log}); the last run using it stops it", flush=True)
    return client


def _stop_daemon(state_dir: Path) -> None:
    """Stop the suite's own daemon; called only when ``_ours`` says the record names it."""
    data = json.loads((state_dir / "daemon.json").read_text())
    _terminate(int(data["pid"]))
    (state_dir / "daemon.json").unlink(missing_ok=True)


def _terminate(pid: int, timeout_s: float = 60.0) -> None:
    """SIGTERM ``pid`` (dockerd stops its containers), SIGKILL after ``timeout_s``; reap it if it is our child."""
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        if not psutil.pid_exists(pid):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _wait_for_engine(daemon: subprocess.Popen[bytes], log: Path) -> Any:
    import docker

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if daemon.poll() is not None:
            last = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise DockerUnavailable(f"dockerd exited with code {daemon.returncode}: {last[0]} (log {log})")
        with contextlib.suppress(docker.errors.DockerException):
            client = new_client()
            client.ping()
            return client
        time.sleep(1)
    daemon.terminate()
    raise DockerUnavailable(f"dockerd did not answer within 60 s (log {log})")
