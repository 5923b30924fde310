"""Debian packages this machine installs when a tool is missing (docker.io, qemu-user-static, debootstrap), as root."""

from __future__ import annotations

import os
import shutil
import subprocess


def run_tool(cmd: list[str], what: str, error: type[Exception], timeout: float = 900) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise error(f"{what}: {exc}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or f"exit code {proc.returncode}").splitlines()[-1]
        raise error(f"{what}: {last}")
    return proc.stdout


def install_debian_packages(packages: list[str], why: str, error: type[Exception]) -> None:
    """Install ``packages`` from Debian (as root), or raise ``error`` saying what to install."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise error(f"{why}: install {' '.join(packages)} (apt-get install {' '.join(packages)}) as root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    print(f"dsmatrix: {why}: installing {', '.join(packages)} from Debian ...", flush=True)
    if subprocess.run(install, capture_output=True, env=env).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env)  # a fresh machine has no package lists
        proc = subprocess.run(install, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:]
            raise error(f"{why}: apt-get install {' '.join(packages)} failed: {' '.join(tail)}")
