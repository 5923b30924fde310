"""The release path alone: ``release_sub_module`` on every (already released) layer of a trained
engine, as DeepSpeed's hooks call it, without the matmuls that drown it in a step.

On DeepSpeed >= 0.19.3 with checkpointing the call goes through the backward-pass merge of
recompute parameters (in-place ``update`` on stock, a union on a fix), as during a checkpointed
backward: the layer is active and owns recompute parameters. Otherwise the forward path.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import zero3


def release_every_layer(engine: Any) -> tuple[Callable[[], None], bool]:
    """A function releasing every layer once, and whether it takes the backward path."""
    coordinator = zero3.coordinator_of(engine)
    layers = list(engine.module.layers)
    active = getattr(coordinator, "_PartitionedParameterCoordinator__active_backward_submodules", None)
    backward = isinstance(active, dict) and all(hasattr(m, "ds_recompute_parameters") for m in layers)

    # older DeepSpeed (0.14.x) releases without a ``forward`` argument: call it as its hooks do
    takes_forward = "forward" in inspect.signature(coordinator.release_sub_module).parameters

    def release_all() -> None:
        for layer in layers:
            if backward:
                active[layer.ds_id] = layer
                layer.ds_recompute_parameters = set(layer.parameters())
            if takes_forward:
                coordinator.release_sub_module(layer, forward=not backward)
            else:
                coordinator.release_sub_module(layer)

    return release_all, backward
