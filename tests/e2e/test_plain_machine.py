"""The first run on a machine whose pip knows only the public package index: this machine's pip
configuration and local wheel folders hidden, a fresh HOME (empty caches), and the CPU-only torch
the default cell pins served by a local file:// index that ``DSMATRIX_TORCH_CPU_INDEX`` names (the
stand-in for PyTorch's CPU wheel index). Everything else comes from the public index."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import hide_pip_configuration, simple_index

TORCH = "torch==2.13.0+cpu"


@pytest.mark.e2e
@pytest.mark.network
def test_the_default_cell_is_fixed_with_only_the_public_index_and_the_cpu_index(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"  # the CPU wheel, taken once through this machine's pip sources
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), TORCH], check=True)
    index = simple_index(tmp_path / "cpu-index", sorted(wheels.glob("torch-*.whl")))
    pyenv = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    env = {**hide_pip_configuration(dict(os.environ)), "HOME": str(tmp_path / "home"), "PYENV_ROOT": pyenv}
    env.update({"DSMATRIX_TORCH_CPU_INDEX": index, "PYTHONUNBUFFERED": "1"})
    env.pop("XDG_CACHE_HOME", None)
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], env=env, capture_output=True, text=True)
    assert not [line for line in listed.stdout.splitlines() if "find-links" in line or "index-url" in line], listed.stdout

    results = tmp_path / "results"
    command = [sys.executable, "-m", "dsmatrix", "matrix", "--deepspeed", "0.19.8", "--no-bench", "--results", str(results)]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=3600)
    print(proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    (cell_file,) = (results / "latest" / "cells").glob("*.json")
    result = json.loads(cell_file.read_text())
    assert result["verdict"] == "fixed", result["reasons"]
    for build in ("stock", "patched"):
        assert result["builds"][build]["installed"]["torch"] == "2.13.0+cpu"
    assert (tmp_path / "home" / ".cache" / "uv").is_dir(), "a fresh uv cache, filled from the indexes"
