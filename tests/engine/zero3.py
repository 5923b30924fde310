"""Harness for the engine tests: tiny models, real ZeRO-3 engines, and observers.

Everything here drives real DeepSpeed engines (``deepspeed.initialize``, forward, backward,
step) on the CPU accelerator. Observers look at *behaviour*: which parameters become
``NOT_AVAILABLE`` when the engine releases a submodule, read from ``param.ds_status`` of
parameter objects captured before training (reading ``module.weight`` during a pass would make
DeepSpeed gather it and disturb what we measure).
"""

from __future__ import annotations

import gc
import inspect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import deepspeed
import torch
from packaging.version import Version
from torch.utils.checkpoint import checkpoint

WIDTH = 16  # numel of one Linear(16, 16): 256 + 16 = 272
LAYERS = 4
# Reuse distance (in parameter numel) that spans exactly one other layer: a layer used again
# after one other layer stays resident, one used again later is released.
REUSE_DISTANCE = 300

ReleaseEvent = tuple[str, str, tuple[str, ...]]


def deepspeed_version() -> Version:
    """The installed DeepSpeed release (local labels such as ``+zfix.…`` dropped)."""
    return Version(Version(deepspeed.__version__).base_version)


class FlowNet(torch.nn.Module):
    """Linear layers run in a configurable order (``flow``): dynamic control flow.

    With ``checkpointed`` the inner part of the flow (all but the first and last layer) runs
    under non-reentrant activation checkpointing, so backward recomputes its forward.
    """

    def __init__(self, checkpointed: bool, frozen: Sequence[int] = (), width: int = WIDTH) -> None:
        super().__init__()
        self.width = width
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(LAYERS))
        self.checkpointed = checkpointed
        self.flow: list[int] = [0, 1, 2, 3]
        for index in frozen:
            self.layers[index].requires_grad_(False)

    def _run(self, x: torch.Tensor, flow: Sequence[int]) -> torch.Tensor:
        # Activation before each layer, so a checkpointed region ends in a Linear whose backward
        # (inside the module's backward hooks) is what triggers the recompute.
        for index in flow:
            x = self.layers[index](torch.relu(x))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head, inner, tail = self.flow[:1], self.flow[1:-1], self.flow[-1:]
        x = self._run(x, head)
        if self.checkpointed and inner:
            x = checkpoint(self._run, x, inner, use_reentrant=False)
        else:
            x = self._run(x, inner)
        x = self._run(x, tail)
        return x.float().pow(2).mean()


def engine_config(dtype: str, reuse_distance: int = REUSE_DISTANCE) -> dict[str, Any]:
    """ZeRO-3 settings under which release decisions are visible.

    The defaults hide them: the persistence threshold keeps small parameters resident forever
    and a reuse distance of 1e9 keeps everything resident from forward to backward. Prefetch is
    off so every gather happens where the trace says.
    """
    return {
        "train_micro_batch_size_per_gpu": 2,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": reuse_distance,
            "stage3_prefetch_bucket_size": 0,
        },
    }


def build_engine(model: torch.nn.Module, dtype: str, reuse_distance: int = REUSE_DISTANCE) -> Any:
    """A real DeepSpeed ZeRO-3 engine around ``model`` (plain SGD: no compiled optimizer)."""
    torch.manual_seed(0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=engine_config(dtype, reuse_distance))
    return engine


def new_model(checkpointing: str, frozen: Sequence[int] = (), width: int = WIDTH) -> FlowNet:
    torch.manual_seed(0)
    return FlowNet(checkpointed=checkpointing == "on", frozen=frozen, width=width)


def batch(dtype: str, width: int = WIDTH) -> torch.Tensor:
    return torch.randn(2, width).to(torch.bfloat16 if dtype == "bf16" else torch.float32)


def train_step(engine: Any, dtype: str) -> float:
    """One forward/backward/step; returns the loss as a float so no graph outlives the step."""
    loss = engine(batch(dtype, engine.module.width))
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def coordinator_of(engine: Any) -> Any:
    """The engine's training PartitionedParameterCoordinator (created if still lazy).

    DeepSpeed 0.14 keys coordinators by ``training``; later releases keep one.
    """
    offload = engine.optimizer.parameter_offload
    getter = offload.get_param_coordinator
    if "training" in inspect.signature(getter).parameters:
        return getter(True)
    return getter()


class ReleaseRecorder:
    """Records which parameters each ``release_sub_module`` call really released.

    The coordinator's bound method is shadowed on the instance by a spy that compares
    ``ds_status`` of every parameter before and after the real call; it changes nothing.
    """

    def __init__(self, engine: Any, model: torch.nn.Module) -> None:
        self.coordinator = coordinator_of(engine)
        self.module_names = {id(m): (n or "<root>") for n, m in model.named_modules()}
        self.params = list(model.named_parameters())
        self.events: list[ReleaseEvent] | None = None
        real = self.coordinator.release_sub_module

        def spy(submodule: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            before = self.resident()
            result = real(submodule, *args, **kwargs)
            if self.events is not None:
                forward = kwargs.get("forward", args[0] if args else None)
                direction = {True: "fwd", False: "bwd"}.get(forward, "?")
                released = tuple(sorted(before - self.resident()))
                self.events.append((self.module_names.get(id(submodule), "?"), direction, released))
            return result

        self.coordinator.release_sub_module = spy

    def resident(self) -> set[str]:
        return {name for name, p in self.params if p.ds_status.name == "AVAILABLE"}

    def record(self, step: Callable[[], object]) -> list[ReleaseEvent]:
        """Run ``step`` and return the release events it produced."""
        self.events = []
        try:
            step()
            return self.events
        finally:
            self.events = None


@dataclass(frozen=True)
class LifecycleSurvivors:
    """What is still alive after one more engine lifecycle (cumulative counts)."""

    coordinators: int
    models: int
    held_by_fwd_module_stack: int


def fwd_module_stack() -> list[torch.nn.Module]:
    """DeepSpeed's module-level FWD_MODULE_STACK (holds every engine's root module forever)."""
    from deepspeed.runtime.zero import parameter_offload

    return parameter_offload.FWD_MODULE_STACK


def release_from_fwd_module_stack(models: Sequence[weakref.ref]) -> int:
    """Take our destroyed engines' modules off FWD_MODULE_STACK; returns how many entries.

    The stack holds every engine's root module, plus one submodule per early-stopped
    non-reentrant checkpoint recompute. This is the diagnostic step that separates that
    unrelated retainer from the cache under test; callers report the count, never hide it.
    """
    ours = {id(m) for ref in models if ref() is not None for m in ref().modules()}
    stack = fwd_module_stack()
    kept = [m for m in stack if id(m) not in ours]
    removed = len(stack) - len(kept)
    stack[:] = kept
    return removed


def release_grad_accumulators(engine: Any) -> int:
    """Drop the AccumulateGrad nodes DeepSpeed 0.14/0.15 keep in ``optimizer.grad_accs``; count them.

    Those releases keep the nodes after ``destroy()``; each holds its parameter from C++, which
    closes a reference cycle (parameter -> ZeRO closures -> Init -> model) that Python's GC
    cannot see, so every engine leaks whatever the release cache does. Like FWD_MODULE_STACK,
    it is unrelated to the fix: callers report the count and never hide it.
    """
    nodes = getattr(engine.optimizer, "grad_accs", None)
    if not isinstance(nodes, list):
        return 0
    count = len(nodes)
    nodes.clear()
    return count


def collect() -> None:
    for _ in range(3):
        gc.collect()
