"""Bug 1: the class-level ``lru_cache`` keeps every coordinator (and its modules) alive."""

from __future__ import annotations

import weakref

import pytest
import zero3

LIFECYCLES = 3
STEPS = 3  # step 1 records the trace, steps 2-3 use it (and fill the release cache)


def _one_lifecycle(dtype: str, checkpointing: str) -> tuple[weakref.ref, weakref.ref]:
    """Build, train to a complete trace, destroy; return weak references only."""
    model = zero3.new_model(checkpointing)
    engine = zero3.build_engine(model, dtype)
    coordinator = zero3.coordinator_of(engine)
    for _ in range(STEPS):
        zero3.train_step(engine, dtype)
    assert coordinator.is_complete_trace(), "harness: the trace never completed"
    engine.destroy()
    return weakref.ref(model), weakref.ref(coordinator)


@pytest.mark.bug("lifecycle")
def test_destroyed_engines_are_collected(dtype: str, checkpointing: str, record_property) -> None:
    """Destroyed, dereferenced engines must not stay alive, lifecycle after lifecycle.

    Observed with weak references to each engine's model and coordinator after
    ``gc.collect()``. DeepSpeed also keeps every engine's root module in
    ``parameter_offload.FWD_MODULE_STACK`` (unrelated to the fix; it pins the model and, through
    the hooks still on it, the coordinator). That retainer is counted and reported as the
    ``fwd_module_stack_retained`` property, and our own destroyed roots are taken off the stack
    before counting, so only what something else (the release cache) still holds is judged.
    """
    refs: list[tuple[weakref.ref, weakref.ref]] = []
    series: list[zero3.LifecycleSurvivors] = []
    held_total = 0
    for _ in range(LIFECYCLES):
        refs.append(_one_lifecycle(dtype, checkpointing))
        zero3.collect()
        held = zero3.release_from_fwd_module_stack([m for m, _ in refs])
        held_total += held
        zero3.collect()
        series.append(
            zero3.LifecycleSurvivors(
                coordinators=sum(c() is not None for _, c in refs),
                models=sum(m() is not None for m, _ in refs),
                held_by_fwd_module_stack=held,
            )
        )
    record_property("fwd_module_stack_retained", held_total)
    record_property("surviving_coordinators", [s.coordinators for s in series])
    record_property("surviving_models", [s.models for s in series])
    first, last = series[0], series[-1]
    if last.coordinators > first.coordinators or last.models > first.models:
        pytest.fail(
            f"engines outlive destroy(): after lifecycles 1..{LIFECYCLES} surviving coordinators "
            f"{[s.coordinators for s in series]}, models {[s.models for s in series]} "
            f"(not counting DeepSpeed's FWD_MODULE_STACK, reported separately: it held {held_total} of their modules)"
        )
