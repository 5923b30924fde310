"""Process groups: a child's grandchildren stop with it, and the groups of a run killed outright are
stopped by the next one (real processes: sh, sleep, a Python owner killed with SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsmatrix.infra import processes


def _members(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def test_a_timeout_stops_the_grandchildren_too() -> None:
    """Like torch's JIT build: the child (sh) runs grandchildren (sleep); a timeout must stop all of them."""
    started = time.monotonic()
    marker = f"sleep {300 + os.getpid() % 997}.{time.time_ns() % 10**6:06d}"  # no other process on the machine runs this
    with pytest.raises(subprocess.TimeoutExpired):
        processes.run(["sh", "-c", f"{marker} & {marker} & wait"], timeout=1)
    assert time.monotonic() - started < 20
    assert not [p for p in _members_of_command(marker)], "a grandchild outlived its group"


def _members_of_command(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (
                    text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                    and "Z" not in (entry / "stat").read_text().split()[2]
                ):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_the_groups_of_a_killed_run_are_stopped_by_the_next(tmp_path: Path) -> None:
    registry = tmp_path / "processes"
    owner_code = (
        "import sys, time; from pathlib import Path; from dsmatrix.infra import processes\n"
        f"processes.track_in(Path({str(registry)!r}))\n"
        "processes.start(['sh', '-c', 'sleep 301 & sleep 301 & wait'])\n"
        # what ninja does with each compile command: a process group of its own inside the session
        'grandchild = \'import subprocess, time; subprocess.Popen(["sleep", "302"], process_group=0); time.sleep(300)\'\n'
        "processes.start([sys.executable, '-c', grandchild])\n"
        "print('started', flush=True); time.sleep(300)\n"
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None and owner.stdout.readline().strip() == "started"
    deadline = time.monotonic() + 10
    while len(list(registry.glob("*.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    entries = sorted(registry.glob("*.json"), key=lambda e: json.loads(e.read_text())["command"][0] != "sh")
    leader, ninja_like = (json.loads(e.read_text())["leader"] for e in entries)
    assert _wait_for(3, leader) == 3  # sh and two sleeps, in the child's own group
    deadline = time.monotonic() + 10
    while len(processes.session_members(ninja_like)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    own_group = [p for p in processes.session_members(ninja_like) if os.getpgid(p) != ninja_like]
    assert len(own_group) == 1, "the grandchild left its parent's group"
    assert processes.stop_orphans(registry) == [], "the owner is alive: its groups are its own"
    os.kill(owner.pid, signal.SIGKILL)  # killed outright: it cannot stop its group
    owner.wait()
    assert len(_members(leader)) == 3, "SIGKILL of the owner leaves its children running"
    stopped = processes.stop_orphans(registry)
    assert sorted(s["leader"] for s in stopped) == sorted([leader, ninja_like])
    assert all(s["command"] and all(isinstance(part, str) for part in s["command"]) for s in stopped), "what was stopped is named"
    deadline = time.monotonic() + 10
    while (_members(leader) or processes.session_members(ninja_like)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _members(leader) and not list(registry.glob("*.json"))
    assert not processes.session_members(ninja_like), "a grandchild in a group of its own survived"


def _wait_for(count: int, pgid: int) -> int:
    deadline = time.monotonic() + 10
    while len(_members(pgid)) != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(_members(pgid))


def test_an_empty_forged_or_foreign_process_record_is_stale_never_obeyed(tmp_path: Path) -> None:
    """The cache's process records say which groups a dead run left behind. One that is empty, not
    JSON, names pid 0 or 1, has a leader started before its owner or at another moment than the
    process now holding that pid, or was written by another user, is dropped: the process it names
    (a session this run does not own) lives on. The docker daemon record is checked the same way."""
    from dsmatrix.infra import docker_engine

    victim = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        started = processes.start_time(victim.pid)
        gone = subprocess.Popen(["true"])
        gone.wait()
        dead = {"owner": gone.pid, "owner_start": 1}
        registry = tmp_path / "processes"
        registry.mkdir()
        forged = {
            "empty": "{}",
            "not-json": "\x00garbage",
            "a-list": "[1, 2]",
            "init": json.dumps({**dead, "leader": 1, "leader_start": processes.start_time(1)}),
            "group-zero": json.dumps({**dead, "leader": 0, "leader_start": 1}),
            "text-pids": json.dumps({**dead, "leader": str(victim.pid), "leader_start": started}),
            "leader-before-owner": json.dumps(
                {"owner": gone.pid, "owner_start": started + 100, "leader": victim.pid, "leader_start": started}
            ),
            "pid-reused": json.dumps({**dead, "leader": victim.pid, "leader_start": started - 1}),
            "another-users": json.dumps({**dead, "leader": victim.pid, "leader_start": started}),
        }
        for name, text in forged.items():
            (registry / f"{name}.json").write_text(text)
        os.chown(registry / "another-users.json", 65534, 65534)
        assert processes.stop_orphans(registry) == []
        assert victim.poll() is None, "a forged record killed a session the run does not own"
        assert not list(registry.glob("*.json")), "stale records are dropped"

        state = tmp_path / "docker"
        (state / "users").mkdir(parents=True)
        (state / "users" / "1.json").write_text("{}")
        (state / "daemon.json").write_text(json.dumps({"pid": victim.pid, "start": started}))
        assert docker_engine._live_users(state) == [] and not docker_engine._ours(state), (
            "only a dockerd of this user is the suite's daemon"
        )
    finally:
        victim.kill()
        victim.wait()
