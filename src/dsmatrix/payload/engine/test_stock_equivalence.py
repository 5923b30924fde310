"""Where stock is right, the fix must not change what the engine does.

On a static graph (no retrace, nothing frozen during training) stock's release decisions are
correct, so the patched build must gather and release exactly the same parameters after the
same submodules, step by step. Each test here passes on both builds and records the behaviour
it saw; the verdict compares the patched recording with the stock one (``reference("stock")``).
The models have nested modules, parents holding their own parameters around children (released
at the same trace step as the child), a module shared between two places and the root's own
parameter, with and without checkpointing.

They run under each of ``zero3.SETTINGS``, named configurations that make each decision of the
release computation matter: DeepSpeed's own defaults, persistent parameters beside released ones
(one owned by a recompute owner), reuse inside and beyond the reuse distance, a reuse that only
prefetch's skip keeps resident, prefetch on, and z3 leaf modules (set by hand, and by DeepSpeed's
granularity threshold, which also releases them without freeing their data first).
"""

from __future__ import annotations

import pytest
import zero3

STEPS = 4  # step 1 records the trace; steps 2-4 use it


@pytest.mark.reference("stock")
@pytest.mark.parametrize("settings", zero3.SETTINGS, ids=[s.name for s in zero3.SETTINGS])
def test_static_graph_behaves_as_stock(dtype: str, checkpointing: str, settings: zero3.Settings, record_property) -> None:
    """Record every gather and release of a static model over several steps (compared with stock)."""
    record_property("settings", settings.name)
    if settings.unsupported():
        pytest.skip(f"not applicable: {settings.unsupported()}")
    torch_model = settings.model(checkpointing)
    engine = zero3.build_engine(torch_model, dtype, settings=settings)
    observer = zero3.Observer(engine, torch_model)
    try:
        for _ in range(STEPS):
            observer.step(lambda: zero3.train_step(engine, dtype))
    except RuntimeError as exc:
        if not settings.cpu_cannot_run(exc):
            raise
        engine.destroy()
        pytest.skip(f"not applicable: DeepSpeed {zero3.deepspeed_version()} cannot run {settings.name} on CPU: {exc}")
    complete = observer.coordinator.is_complete_trace()
    engine.destroy()
    steps = observer.steps[1:]
    zero3.record_behaviour(record_property, steps)  # recorded first: a difference from stock is named even if a check below fails
    assert complete, "harness: the trace never completed"
    assert all(s.gathers and s.releases for s in steps), "harness: a step gathered or released nothing"
    released = {name for s in steps for e in s.events for name in e.released}
    assert {"gain" in n for n in released} >= {True}, "harness: no parent's own parameter was ever released"
