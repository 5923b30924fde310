"""Control: the harness sees real ZeRO-3 releases (passes on every build; not a bug test)."""

from __future__ import annotations

import math

import zero3


def test_engine_trains_and_releases(dtype: str, checkpointing: str) -> None:
    """A real engine trains, and the recorder sees parameters released in forward and backward.

    Guards the bug tests against passing because the observer saw nothing.
    """
    model = zero3.new_model(checkpointing)
    engine = zero3.build_engine(model, dtype)
    recorder = zero3.ReleaseRecorder(engine, model)
    losses = [zero3.train_step(engine, dtype) for _ in range(2)]
    events = recorder.record(lambda: losses.append(zero3.train_step(engine, dtype)))
    assert all(math.isfinite(loss) for loss in losses)
    assert recorder.coordinator.is_complete_trace()
    released = {name for _, _, names in events for name in names}
    assert {name for name, _ in model.named_parameters()} <= released
    assert not recorder.resident(), "parameters left gathered after a step"
    engine.destroy()
