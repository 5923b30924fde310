"""Bug 1: the class-level release cache keeps destroyed engines (coordinator, modules, ZeRO
parameters) alive.

After ``destroy()``, with every reference dropped and ``gc.collect()``, nothing of a destroyed
engine may survive beyond what DeepSpeed retains without the release cache. Zero survivors,
not "no growth": a cache that still pins the most recent engine(s) is a leak too. The models
differ from one lifecycle to the next (width, depth, order of the layers), so that state of one
engine served to the next through a reused ``id()`` or ``ds_id`` would show as a wrong release
or a crash in training.
"""

from __future__ import annotations

import weakref

import pytest
import zero3

# (width, layers, flow): a different shape, depth and order each lifecycle
LIFECYCLES = [(16, 4, [0, 1, 2, 3]), (24, 3, [2, 0, 1]), (12, 5, [4, 3, 1, 0, 2])]
STEPS = 3  # step 1 records the trace, steps 2-3 use it (and fill the release cache)


def _one_lifecycle(dtype: str, checkpointing: str, width: int, layers: int, flow: list[int]) -> tuple[list[weakref.ref], int]:
    """Build, train to a complete trace, destroy; return weak references and nodes dropped."""
    model = zero3.new_model(checkpointing, width=width, layers=layers)
    model.flow = flow
    engine = zero3.build_engine(model, dtype)
    coordinator = zero3.coordinator_of(engine)
    observer = zero3.Observer(engine, model)
    for _ in range(STEPS):
        observer.step(lambda: zero3.train_step(engine, dtype))
    assert coordinator.is_complete_trace(), "harness: the trace never completed"
    assert observer.steps[-1].releases, "harness: no release observed"
    engine.destroy()
    dropped = zero3.release_grad_accumulators(engine)
    refs = [weakref.ref(coordinator), weakref.ref(model), *(weakref.ref(p) for p in model.parameters())]
    return refs, dropped


@pytest.mark.bug("lifecycle")
def test_destroyed_engines_leave_nothing_alive(dtype: str, checkpointing: str, record_property) -> None:
    """No coordinator, model or ZeRO parameter of a destroyed engine survives ``gc.collect()``.

    Two DeepSpeed retainers unrelated to the fix are told apart: ``parameter_offload.FWD_MODULE_STACK``
    keeps every engine's root module (and a submodule per early-stopped checkpoint recompute),
    and DeepSpeed 0.14/0.15 keep AccumulateGrad nodes in ``optimizer.grad_accs`` (a cycle through
    C++ that GC cannot break). Our engines' entries are taken out of both and counted
    (``fwd_module_stack_retained``, ``grad_acc_nodes_retained``), so only what something else
    still holds is judged.
    """
    engines: list[list[weakref.ref]] = []
    coordinators, models, parameters = [], [], []
    held_total = nodes_total = 0
    for width, layers, flow in LIFECYCLES:
        refs, nodes = _one_lifecycle(dtype, checkpointing, width, layers, flow)
        engines.append(refs)
        nodes_total += nodes
        held_total += zero3.release_from_fwd_module_stack([refs[1] for refs in engines])
        zero3.collect()
        coordinators.append(sum(refs[0]() is not None for refs in engines))
        models.append(sum(refs[1]() is not None for refs in engines))
        parameters.append(sum(ref() is not None for refs in engines for ref in refs[2:]))
    figures = {
        "surviving_coordinators": coordinators,
        "surviving_models": models,
        "surviving_parameters": parameters,
        "fwd_module_stack_retained": held_total,
        "grad_acc_nodes_retained": nodes_total,
    }
    for key, value in figures.items():
        record_property(key, value)
    if any(coordinators + models + parameters):
        zero3.bug_observed(
            record_property,
            figures,
            f"destroyed engines stay alive: after lifecycles 1..{len(LIFECYCLES)} surviving coordinators {coordinators}, "
            f"models {models}, parameters {parameters} (DeepSpeed's own retainers taken out first and reported: "
            f"FWD_MODULE_STACK held {held_total} of their modules, optimizer.grad_accs {nodes_total} AccumulateGrad nodes)",
        )
