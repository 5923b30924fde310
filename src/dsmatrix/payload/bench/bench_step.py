"""Step time, stock vs patched: one ZeRO-3 training step.

The model is the seed's: 4 x Linear(1024, 1024). With a persistence threshold of 0 and a reuse
distance of 0 every parameter is released after use and gathered again, so each step runs the
release decisions the fix touches. The release path alone (``release_path.py``) is measured in
executed instructions (``count_instructions.py``), where its few microseconds are not noise.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import turns
import zero3

WIDTH = 1024
STEPS = int(os.environ.get("DSMATRIX_BENCH_STEPS", "5"))  # timed steps per engine
ENGINES = int(os.environ.get("DSMATRIX_BENCH_ENGINES", "4"))  # engines per benchmark, one after the other
WARMUP = 2  # untimed steps on the first engine (a new engine has run its trace steps)
TRACE_STEPS = 3  # record the trace, then run on it (release cache filled)


class Engines:
    """The engines one benchmark measures in turn: a new one after every ``STEPS`` timed steps, so a
    process samples several engines' memory layouts. ``setup`` is pytest-benchmark's (untimed)
    setup: it parks (hands the turn on) and returns the current engine."""

    def __init__(self, dtype: str, checkpointing: str) -> None:
        self.dtype, self.checkpointing = dtype, checkpointing
        self.calls = 0
        self.engine = self._build()

    def _build(self) -> Any:
        engine = zero3.build_engine(zero3.new_model(self.checkpointing, width=WIDTH), self.dtype, reuse_distance=0)
        for _ in range(TRACE_STEPS):
            zero3.train_step(engine, self.dtype)
        assert zero3.coordinator_of(engine).is_complete_trace(), "harness: the trace never completed"
        return engine

    def setup(self) -> tuple[tuple[Any, str], dict[str, Any]]:
        turns.park()
        timed = self.calls - WARMUP
        if timed > 0 and timed % STEPS == 0:
            self.engine.destroy()
            self.engine = self._build()
        self.calls += 1
        return (self.engine, self.dtype), {}

    def close(self) -> None:
        self.engine.destroy()


@pytest.fixture
def engines(dtype: str, checkpointing: str) -> Iterator[Engines]:
    rotation = Engines(dtype, checkpointing)
    yield rotation
    rotation.close()


def test_train_step(benchmark: Any, engines: Engines) -> None:
    benchmark.extra_info.update(kind="step", engines=ENGINES, steps_per_engine=STEPS)
    # the setup (untimed) hands the CPU to the round's other processes before every step
    benchmark.pedantic(zero3.train_step, setup=engines.setup, rounds=ENGINES * STEPS, iterations=1, warmup_rounds=WARMUP)
