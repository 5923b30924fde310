"""Bug 1: the class-level ``lru_cache`` keeps every coordinator (and its modules) alive."""

from __future__ import annotations

import weakref

import pytest
import zero3

LIFECYCLES = 3
STEPS = 3  # step 1 records the trace, steps 2-3 use it (and fill the release cache)


def _one_lifecycle(dtype: str, checkpointing: str) -> tuple[weakref.ref, weakref.ref, int]:
    """Build, train to a complete trace, destroy; return weak references (and nodes dropped)."""
    model = zero3.new_model(checkpointing)
    engine = zero3.build_engine(model, dtype)
    coordinator = zero3.coordinator_of(engine)
    for _ in range(STEPS):
        zero3.train_step(engine, dtype)
    assert coordinator.is_complete_trace(), "harness: the trace never completed"
    engine.destroy()
    dropped = zero3.release_grad_accumulators(engine)
    return weakref.ref(model), weakref.ref(coordinator), dropped


@pytest.mark.bug("lifecycle")
def test_destroyed_engines_are_collected(dtype: str, checkpointing: str, record_property) -> None:
    """Destroyed, dereferenced engines must not stay alive, lifecycle after lifecycle.

    Observed with weak references to each engine's model and coordinator after
    ``gc.collect()``. Two DeepSpeed retainers unrelated to the fix are told apart from the
    cache: ``parameter_offload.FWD_MODULE_STACK`` keeps every engine's root module (and a
    submodule per early-stopped checkpoint recompute), which pins the model and, through the
    hooks still on it, the coordinator; and DeepSpeed 0.14/0.15 keep AccumulateGrad nodes in
    ``optimizer.grad_accs`` (private state, read because nothing else shows it), a cycle
    through C++ that GC cannot break. Both are counted and reported as the
    ``fwd_module_stack_retained`` and ``grad_acc_nodes_retained`` properties, and our own
    engines' entries are taken out before counting, so only what something else (the release
    cache) still holds is judged.
    """
    refs: list[tuple[weakref.ref, weakref.ref]] = []
    series: list[zero3.LifecycleSurvivors] = []
    held_total = nodes_total = 0
    for _ in range(LIFECYCLES):
        model_ref, coordinator_ref, nodes = _one_lifecycle(dtype, checkpointing)
        refs.append((model_ref, coordinator_ref))
        nodes_total += nodes
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
    record_property("grad_acc_nodes_retained", nodes_total)
    record_property("surviving_coordinators", [s.coordinators for s in series])
    record_property("surviving_models", [s.models for s in series])
    first, last = series[0], series[-1]
    if last.coordinators > first.coordinators or last.models > first.models:
        pytest.fail(
            f"engines outlive destroy(): after lifecycles 1..{LIFECYCLES} surviving coordinators "
            f"{[s.coordinators for s in series]}, models {[s.models for s in series]} "
            f"(not counting DeepSpeed's own retainers, reported separately: FWD_MODULE_STACK held {held_total} of their "
            f"modules, optimizer.grad_accs {nodes_total} AccumulateGrad nodes)"
        )
