"""Child processes, each in a process group of its own, stopped as a whole.

Every child (uv, pip's wheel build, pytest ranks, valgrind, dockerd) starts a new session, so
stopping it signals the whole group: torch's JIT build runs ninja and g++ as grandchildren, and
killing only the direct child leaves them running. A group is also written down in the cache's
``processes/`` folder with its owner's pid and start time; a run killed with SIGKILL cannot stop
its groups, so the next run does (``stop_orphans``) once it sees the owner is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

_registry: Path | None = None


def track_in(folder: Path | None) -> None:
    """Write every group this process starts into ``folder`` (None: do not write them down)."""
    global _registry
    _registry = folder
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None when it is gone. Read from
    ``/proc/<pid>/stat``: psutil's ``create_time()`` adds the boot time, which moves when the wall
    clock is stepped, and a record compared after such a step would misname a live run as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def alive(pid: int, started: int | None) -> bool:
    """Whether ``pid`` is still the process that started at ``started`` (pids are reused)."""
    return started is not None and start_time(pid) == started


def mine(pid: int) -> bool:
    """Whether ``pid`` runs as this process's user (the only processes a run may ever signal)."""
    import psutil  # imported here: the noxfile plans cells in nox's own environment

    try:
        return psutil.Process(pid).uids().effective == os.getuid()
    except psutil.Error:
        return False


def read_record(entry: Path, fields: Sequence[str]) -> dict[str, int] | None:
    """A process record of the cache (``fields``: pids and start times, positive integers) written
    by this user; None when it is unreadable, empty, forged or another user's: a stale record,
    never a reason to signal anything. A pid is never 0 or 1 (this group, init)."""
    try:
        if entry.stat().st_uid != os.getuid():
            return None
        data = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    values = {k: data.get(k) for k in fields}
    if not all(type(v) is int and v > 0 for v in values.values()) or any(v <= 1 for k, v in values.items() if not k.endswith("start")):
        return None
    return values  # type: ignore[return-value]


def _record(proc: subprocess.Popen[Any], command: Sequence[str]) -> Path | None:
    if _registry is None:
        return None
    entry = _registry / f"{proc.pid}.json"
    me = os.getpid()
    data = {"owner": me, "owner_start": start_time(me), "leader": proc.pid, "leader_start": start_time(proc.pid), "command": list(command)}
    tmp = entry.with_suffix(".tmp")  # renamed into place: a reader never sees half an entry
    tmp.write_text(json.dumps(data))
    os.replace(tmp, entry)
    return entry


def session_members(sid: int) -> list[int]:
    """The processes of session ``sid``. Every child starts a session of its own, and whatever it
    starts stays in it: ninja (torch's JIT build) puts each compile command in a process group of
    its own, which signalling the child's group misses."""
    import psutil

    members = []
    for pid in psutil.pids():
        with contextlib.suppress(OSError):  # gone meanwhile
            if os.getsid(pid) == sid:
                members.append(pid)
    return members


def signal_session(leader: int, sig: int) -> None:
    """``sig`` to the leader's process group and to every other process of its session."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, sig)
    for pid in session_members(leader):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def stop_group(proc: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    """SIGTERM the child's session (its group and any group inside it), then SIGKILL whatever is
    left of it after ``grace_s``; reap the child."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        signal_session(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        if not _group_alive(proc.pid):
            return
        deadline = time.monotonic() + wait
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not _group_alive(proc.pid):
            return


def _group_alive(pgid: int) -> bool:
    """Whether the child's group, or anything else of its session, is still there."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return bool(session_members(pgid))
    except PermissionError:
        return True
    return True


_entries: dict[int, Path] = {}
_live: dict[int, subprocess.Popen[Any]] = {}
_stopping = threading.Event()


class Stopping(RuntimeError):
    """The run is being stopped (an interrupt): no new child starts."""


def start(command: Sequence[str], **popen: Any) -> subprocess.Popen[Any]:
    """``Popen(command)`` in a new process group, written down; end it with ``stop``."""
    if _stopping.is_set():
        raise Stopping(f"not started, the run is stopping: {' '.join(command)[:120]}")
    proc = subprocess.Popen(list(command), start_new_session=True, **popen)
    _live[proc.pid] = proc
    entry = _record(proc, command)
    if entry is not None:
        _entries[proc.pid] = entry
    return proc


def live() -> list[int]:
    """The children this process started and has not stopped yet (their pids)."""
    return list(_live)


def stop_all() -> None:
    """Stop every group this process started and refuse new ones: what an interrupt does while
    other threads (a cell's two builds, ``--jobs``) wait on children of their own."""
    _stopping.set()
    for proc in list(_live.values()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in list(_live.values()):
        stop_group(proc)


def resume_starting() -> None:
    """Allow children again (after an interrupted run, in the same process: the suite's tests)."""
    _stopping.clear()


def stop(proc: subprocess.Popen[Any]) -> None:
    """Stop whatever is left of the child's group (nothing, when it exited with its children) and reap it."""
    if proc.poll() is None or _group_alive(proc.pid):
        stop_group(proc)
    _live.pop(proc.pid, None)
    entry = _entries.pop(proc.pid, None)
    if entry is not None:
        entry.unlink(missing_ok=True)


@contextlib.contextmanager
def group(command: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    """``start(command)``; on leaving, ``stop`` it."""
    proc = start(command, **popen)
    try:
        yield proc
    finally:
        stop(proc)


def run(command: Sequence[str], timeout: float | None = None, input: str | None = None, **popen: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` in a new process group: a timeout or an interrupt stops the whole group.

    Raises ``subprocess.TimeoutExpired`` as ``subprocess.run`` does."""
    if popen.pop("capture_output", False):
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        popen["stdin"] = subprocess.PIPE
    with group(command, **popen) as proc:
        stdout, stderr = proc.communicate(input=input, timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


ORPHAN_RECORD = ("owner", "owner_start", "leader", "leader_start")


def read_command(entry: Path) -> list[str]:
    """The command a process record names (for saying what was stopped): strings only, else none."""
    try:
        command = json.loads(entry.read_text()).get("command")
    except (OSError, ValueError, AttributeError):
        return []
    return [str(part) for part in command] if isinstance(command, list) else []


def stop_orphans(folder: Path) -> list[dict[str, Any]]:
    """Stop the groups that runs no longer alive left behind; returns what was stopped.

    A group is an orphan when its owner is gone. What is signalled is what is left of the leader's
    session that this user runs and that started no earlier than the leader: a record that is
    malformed, forged or another user's is dropped, never obeyed."""
    stopped = []
    for entry in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        record = read_record(entry, ORPHAN_RECORD)
        if record is not None and alive(record["owner"], record["owner_start"]):
            continue
        leader_now = start_time(record["leader"]) if record is not None else None
        if record is not None and record["leader_start"] >= record["owner_start"] and leader_now in (None, record["leader_start"]):
            # a leader pid alive since another moment was reused: the recorded session is gone
            leftovers = [pid for pid in session_members(record["leader"]) if mine(pid) and (start_time(pid) or 0) >= record["leader_start"]]
            for pid in leftovers:  # the whole session: ninja's compile groups too
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            if leftovers:
                command = read_command(entry)
                stopped.append({**record, "command": command})
        with contextlib.suppress(OSError):
            entry.unlink()
    return stopped
