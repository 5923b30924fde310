"""The images for real (acceptance session): build both from nothing with the suite's own base (no
registry), check their architecture labels and what a cell sees inside, and run one cell inside the
x86_64 image and one inside the arm64 image (under qemu on an x86_64 machine: 35-50x slower).

Needs root and a machine that can install Debian's docker.io (the suite installs what is missing
and starts a daemon when none answers); skipped with the reason otherwise, failed under CI and in
the acceptance session.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import require, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.docker]
CELL = "py3.11-torch2.13.0+cpu-ds0.19.8"
ARM64_CELL = "py3.11-torch2.9.1-ds0.19.8-arm64"


def _engine_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


def _started_daemons_alive(output: str) -> list[int]:
    """The dockerd processes the run says it started (``started dockerd (pid N``) that still run."""
    pids = [int(pid) for pid in re.findall(r"started dockerd \(pid (\d+)", output)]
    return [pid for pid in pids if Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/comm").read_text().strip() == "dockerd"]


@pytest.fixture(scope="module")
def docker_here() -> None:
    require(os.geteuid() == 0, "root: the suite installs docker.io and starts dockerd")
    require(shutil.which("dockerd") or shutil.which("apt-get"), "dockerd, or apt-get to install docker.io")


def _inspect(tag: str) -> dict:
    out = subprocess.run(["docker", "image", "inspect", tag], capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]


def test_both_images_build_and_say_what_they_run_on(docker_here: None, tmp_path: Path) -> None:
    proc = run_cli("images", cwd=tmp_path, timeout=1800)
    print(proc.stdout[-4000:], proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stderr
    assert "dsmatrix/x86_64:latest: linux/amd64" in proc.stdout
    assert "dsmatrix/rpi5:latest: linux/arm64" in proc.stdout
    assert "inside: aarch64, cortex-a76 (qemu-user CPU model), no BF16, emulated (qemu-user)" in proc.stdout
    assert not _started_daemons_alive(proc.stdout), "the daemon the suite started must be stopped"
    with _engine(running=_engine_answers()):  # asked now: whatever answered before the run may be gone
        assert (_inspect("dsmatrix/x86_64:latest")["Architecture"], _inspect("dsmatrix/rpi5:latest")["Architecture"]) == ("amd64", "arm64")


def _fixed_cell_in_image(tmp_path: Path, args: tuple[str, ...], cell: str, tag: str, timeout: float) -> tuple[Path, dict]:
    """Run ``dsmatrix matrix ARGS`` in an image: it exits 0, its cell ``cell`` is `fixed` in image
    ``tag``, and the daemon it started is stopped. Returns the run's folder and the cell result."""
    results = tmp_path / "results"
    proc = run_cli("matrix", *args, "--results", str(results), cwd=tmp_path, timeout=timeout)
    print(proc.stdout[-4000:], proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    result = json.loads((results / "latest" / "cells" / f"{cell}.json").read_text())
    assert result["verdict"] == "fixed", result["reasons"]
    assert result["image"]["tag"] == tag
    assert not _started_daemons_alive(proc.stdout), "the daemon the suite started must be stopped"
    return results / "latest", result


def test_a_cell_runs_inside_the_x86_64_image(docker_here: None, tmp_path: Path) -> None:
    args = ("--in-image", "--deepspeed", "0.19.8", "--dtype", "fp32", "--checkpointing", "on", "--no-bench")  # all three bugs apply there
    run, result = _fixed_cell_in_image(tmp_path, args, CELL, "dsmatrix/x86_64:latest", 3000)
    host = result["host"]
    assert (host["platform"], host["in_container"], host["emulated"]) == ("linux/amd64", True, False)
    assert host["os_image"].startswith("Debian GNU/Linux 12") and host["python"].startswith("3.11.")
    assert all((run / path).is_file() for path in result["builds"]["patched"]["junit"])
    assert not list(run.rglob("*.tmp"))


def test_a_cell_runs_inside_the_arm64_image(docker_here: None, tmp_path: Path) -> None:
    """The Raspberry Pi 5 image's cell: natively on aarch64, under qemu-user here (fp32 with
    checkpointing: every bug applies there)."""
    args = ("--platform", "linux/arm64", "--deepspeed", "0.19.8", "--dtype", "fp32", "--checkpointing", "on", "--no-bench")
    _, result = _fixed_cell_in_image(tmp_path, args, ARM64_CELL, "dsmatrix/rpi5:latest", 5400)
    host = result["host"]
    assert (host["platform"], host["in_container"], host["machine"]) == ("linux/arm64", True, "aarch64"), host
    assert host["emulated"] == (platform.machine() != "aarch64"), host
    failed_on_stock = {o["bug"] for o in result["builds"]["stock"]["tests"].values() if o.get("bug") and o["outcome"] == "failed"}
    assert failed_on_stock == {"lifecycle", "retrace", "recompute"}, failed_on_stock


@contextlib.contextmanager
def _engine(running: bool) -> Iterator[None]:
    """A throwaway daemon for `docker image inspect` when no engine answers (the suite's own stopped)."""
    if running:
        yield
        return
    flags = ["--bridge=none", "--iptables=false", "--ip-masq=false", "--storage-driver=overlay2"]  # as the suite starts it
    proc = subprocess.Popen(["dockerd", *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not _engine_answers():
            assert time.monotonic() < deadline, "dockerd did not start"
            time.sleep(1)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=60)
