"""Control: the harness sees real ZeRO-3 gathers and releases (passes on every build; not a bug test)."""

from __future__ import annotations

import math

import zero3


def test_engine_trains_and_releases(dtype: str, checkpointing: str) -> None:
    """A real engine trains, and the observer sees every parameter gathered and released.

    Guards the bug tests against passing because the observer saw nothing.
    """
    model = zero3.new_model(checkpointing)
    engine = zero3.build_engine(model, dtype)
    observer = zero3.Observer(engine, model)
    losses: list[float] = []
    for _ in range(3):
        observer.step(lambda: losses.append(zero3.train_step(engine, dtype)))
    assert all(math.isfinite(loss) for loss in losses)
    assert observer.coordinator.is_complete_trace()
    last = observer.steps[-1]
    names = {name for name, _ in model.named_parameters()}
    assert names <= {n for e in last.events for n in e.gathered}, "a parameter was never gathered"
    assert names <= {n for e in last.events for n in e.released}, "a parameter was never released"
    assert not observer.resident(), "parameters left gathered after a step"
    engine.destroy()
