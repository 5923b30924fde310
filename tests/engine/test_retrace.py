"""Bug 2: ``_clear_trace_structures()`` does not clear the release cache."""

from __future__ import annotations

import pytest
import zero3

FLOW_A = [0, 1, 2, 3]
# Layer 1 is used again after one other layer: within the reuse distance, so a correct trace
# keeps it resident where flow A released it. Same prefix, so the same (submodule, step) keys.
FLOW_B = [0, 1, 2, 1, 3]
STEPS_PER_FLOW = 3


def _release_decisions(flows: list[list[int]], dtype: str, checkpointing: str):
    """Train one engine through ``flows`` (one per step).

    Returns the last step's release events and whether any step invalidated the trace.
    """
    model = zero3.new_model(checkpointing)
    engine = zero3.build_engine(model, dtype)
    recorder = zero3.ReleaseRecorder(engine, model)
    coordinator = recorder.coordinator
    invalidated = was_complete = False
    for flow in flows[:-1]:
        model.flow = flow
        zero3.train_step(engine, dtype)
        # Releases differ in when they move INVALID -> RECORD; a complete trace that stops
        # being complete was invalidated.
        complete = coordinator.is_complete_trace()
        invalidated |= was_complete and not complete
        was_complete |= complete
    model.flow = flows[-1]
    events = recorder.record(lambda: zero3.train_step(engine, dtype))
    assert coordinator.is_complete_trace(), "harness: the last step did not run on a complete trace"
    engine.destroy()
    return events, invalidated


@pytest.mark.bug("retrace")
def test_retrace_matches_fresh_engine(dtype: str, checkpointing: str) -> None:
    """After the trace is invalidated and re-recorded, release decisions follow the new trace.

    An engine trained on flow A until its trace is complete, then switched to flow B (the trace
    is invalidated on the first B step, re-recorded on the second, used from the third) must
    release the same parameters after the same submodules as a fresh engine that only ever saw
    flow B. Observed through ``ds_status`` around each ``release_sub_module`` call; the trace
    state is read through the coordinator's public ``is_complete_trace()``.
    """
    retraced, invalidated = _release_decisions([FLOW_A] * STEPS_PER_FLOW + [FLOW_B] * STEPS_PER_FLOW, dtype, checkpointing)
    fresh, _ = _release_decisions([FLOW_B] * STEPS_PER_FLOW, dtype, checkpointing)
    assert invalidated, "harness: switching the flow did not invalidate the trace"
    assert any(released for _, _, released in fresh), "harness: no release observed"
    mismatches = [(i, r, f) for i, (r, f) in enumerate(zip(retraced, fresh, strict=False)) if r != f]
    if len(retraced) != len(fresh) or mismatches:
        pytest.fail(
            f"release decisions after retrace differ from a fresh engine's ({len(retraced)} vs {len(fresh)} releases): "
            + "; ".join(
                f"release #{i} of {r[0]} ({r[1]}) freed {list(r[2])}, fresh engine freed {list(f[2])}" for i, r, f in mismatches[:4]
            )
        )
