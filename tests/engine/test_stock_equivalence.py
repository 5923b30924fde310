"""Where stock is right, the fix must not change what the engine does.

On a static graph (no retrace, nothing frozen) stock's release decisions are correct, so the
patched build must gather and release exactly the same parameters after the same submodules,
step by step. Each test here passes on both builds and records the behaviour it saw; the
verdict compares the patched recording with the stock one (``reference("stock")``). The models
have nested modules, parents holding their own parameters around children (released at the
same trace step as the child), a module shared between two places and the root's own
parameter, with and without checkpointing, with prefetch off and on.
"""

from __future__ import annotations

import pytest
import zero3

STEPS = 4  # step 1 records the trace; steps 2-4 use it


@pytest.mark.reference("stock")
@pytest.mark.parametrize("prefetch", [0, zero3.PREFETCH_NUMEL], ids=["prefetch-off", "prefetch-on"])
def test_static_graph_behaves_as_stock(dtype: str, checkpointing: str, prefetch: int, record_property) -> None:
    """Record every gather and release of a static model over several steps (compared with stock)."""
    torch_model = zero3.StaticNet(checkpointed=checkpointing == "on")
    engine = zero3.build_engine(torch_model, dtype, prefetch=prefetch)
    observer = zero3.Observer(engine, torch_model)
    for _ in range(STEPS):
        observer.step(lambda: zero3.train_step(engine, dtype))
    complete = observer.coordinator.is_complete_trace()
    engine.destroy()
    assert complete, "harness: the trace never completed"
    steps = observer.steps[1:]
    assert all(s.gathers and s.releases for s in steps), "harness: a step gathered or released nothing"
    released = {name for s in steps for e in s.events for name in e.released}
    assert {"gain" in n for n in released} >= {True}, "harness: no parent's own parameter was ever released"
    zero3.record_behaviour(record_property, steps)
