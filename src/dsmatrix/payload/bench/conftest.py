"""Benchmarks run inside one cell environment, exactly like the engine tests (``payload/engine``):
same options (``--dtype``, ``--checkpointing``), same single-rank gloo rendezvous, same harness.
Run by ``nox -s bench`` in alternating stock/patched processes; never by ``nox -s tests``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

import turns  # noqa: E402

turns.park()  # wait for the first turn before anything heavy (DeepSpeed's import, engines) runs

from cell_options import distributed, pytest_addoption, pytest_configure, pytest_generate_tests  # noqa: E402,F401
