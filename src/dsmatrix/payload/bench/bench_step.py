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
STEPS = int(os.environ.get("DSMATRIX_BENCH_STEPS", "15"))  # timed steps per process (pytest-benchmark rounds)


@pytest.fixture(scope="session", autouse=True)
def throwaway_first_benchmark() -> None:
    """The first step benchmark of every process was the noisiest in every run: run one like it,
    interleaved the same way, and throw it away."""
    engine = zero3.build_engine(zero3.new_model("off", width=WIDTH), "fp32", reuse_distance=0)
    for _ in range(STEPS):
        turns.park()
        zero3.train_step(engine, "fp32")
    engine.destroy()


@pytest.fixture
def engine(dtype: str, checkpointing: str) -> Iterator[Any]:
    model = zero3.new_model(checkpointing, width=WIDTH)
    engine = zero3.build_engine(model, dtype, reuse_distance=0)
    for _ in range(3):  # record the trace, then run on it (release cache filled)
        zero3.train_step(engine, dtype)
    assert zero3.coordinator_of(engine).is_complete_trace(), "harness: the trace never completed"
    yield engine
    engine.destroy()


def test_train_step(benchmark: Any, engine: Any, dtype: str) -> None:
    benchmark.extra_info["kind"] = "step"
    # turns.park (untimed setup) hands the CPU to the round's other processes before every step
    benchmark.pedantic(zero3.train_step, args=(engine, dtype), setup=turns.park, rounds=STEPS, iterations=1, warmup_rounds=2)
