"""Harness for the engine tests: tiny models, real ZeRO-3 engines, and a behaviour observer.

Everything here drives real DeepSpeed engines (``deepspeed.initialize``, forward, backward,
step) on the CPU accelerator. The observer looks at *behaviour* only: which parameters each
``fetch_sub_module`` call gathers and each ``release_sub_module`` call frees (the two public
methods DeepSpeed's module hooks call on the coordinator), read from ``param.ds_status`` of
parameter objects captured before training (reading ``module.weight`` during a pass would make
DeepSpeed gather it and disturb what we measure). No test reads a private method or field of
the coordinator, so any correct fix, however it is written, is judged the same way.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import json
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import deepspeed
import pytest
import torch
from packaging.version import Version
from torch.utils.checkpoint import checkpoint

WIDTH = 16  # numel of one Linear(16, 16): 256 + 16 = 272
LAYERS = 4
# Reuse distance (in parameter numel) that spans exactly one other layer: a layer used again
# after one other layer stays resident, one used again later is released.
REUSE_DISTANCE = 300
PREFETCH_NUMEL = 600  # a prefetch bucket of about two layers, for the prefetch-on variants


def deepspeed_version() -> Version:
    """The installed DeepSpeed release (local labels such as ``+zfix.…`` dropped)."""
    return Version(Version(deepspeed.__version__).base_version)


# --------------------------------------------------------------------------------------------
# Models


class FlowNet(torch.nn.Module):
    """Linear layers run in a configurable order (``flow``): dynamic control flow.

    With ``checkpointed`` the inner part of the flow (all but the first and last layer) runs
    under non-reentrant activation checkpointing, so backward recomputes its forward.
    """

    def __init__(self, checkpointed: bool, width: int = WIDTH, layers: int = LAYERS) -> None:
        super().__init__()
        self.width = width
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(layers))
        self.checkpointed = checkpointed
        self.flow: list[int] = list(range(layers))

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


class SharedLayerNet(torch.nn.Module):
    """One layer applied ``repeats`` times (weight sharing, ALBERT-style) between two others.

    Each application of the shared layer is activation-checkpointed on its own, so in backward
    every application is recomputed while the others' backward is in progress.
    """

    def __init__(self, checkpointed: bool, repeats: int = 3, width: int = WIDTH) -> None:
        super().__init__()
        self.width = width
        self.embed = torch.nn.Linear(width, width)
        self.shared = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, width)
        self.repeats = repeats
        self.checkpointed = checkpointed

    def _apply_shared(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(torch.relu(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for _ in range(self.repeats):
            x = checkpoint(self._apply_shared, x, use_reentrant=False) if self.checkpointed else self._apply_shared(x)
        return self.head(torch.relu(x)).float().pow(2).mean()


class Gated(torch.nn.Module):
    """A parent that holds its own parameter and uses it around a child module.

    DeepSpeed releases the child and then the parent at the same trace step, so a release
    decision that ignores which submodule is released shows here.
    """

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(width, width))
        self.inner = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x @ self.gain) @ self.gain


class Block(torch.nn.Module):
    """Nested modules: a gated parent and a plain layer inside a container."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gated = Gated(width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.gated(x)))


class StaticNet(torch.nn.Module):
    """A static graph with nested modules, parents holding their own parameters (the root too)
    and a module shared between two places: used again right after one other layer (within the
    reuse distance: kept resident) and then not before backward (released). The blocks run
    under activation checkpointing when asked.

    ``far_reuse`` uses ``mix`` once more after the blocks (beyond the reuse distance);
    ``frozen_inner`` freezes each gated block's inner layer, so the checkpoint recompute hands
    its parameters to the module whose backward runs (a recompute owner, DeepSpeed >= 0.19.3).
    """

    def __init__(self, checkpointed: bool, width: int = WIDTH, far_reuse: bool = False, frozen_inner: bool = False) -> None:
        super().__init__()
        self.width = width
        self.stem = torch.nn.Linear(width, width)
        self.mix = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(2))
        self.head = torch.nn.Linear(width, width)
        self.bias = torch.nn.Parameter(torch.zeros(width))  # the root's own parameter
        self.checkpointed = checkpointed
        self.far_reuse = far_reuse
        for block in self.blocks:
            block.gated.inner.requires_grad_(not frozen_inner)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x) + self.bias
        x = self.stem(torch.relu(self.mix(x)))  # the stem again, one layer later
        x = checkpoint(self._blocks, x, use_reentrant=False) if self.checkpointed else self._blocks(x)
        if self.far_reuse:
            x = self.mix(torch.relu(x))  # the mix again, several layers later
        return (self.head(torch.relu(x)) + self.bias).float().pow(2).mean()


def new_model(checkpointing: str, width: int = WIDTH, layers: int = LAYERS) -> FlowNet:
    torch.manual_seed(0)
    return FlowNet(checkpointed=checkpointing == "on", width=width, layers=layers)


# --------------------------------------------------------------------------------------------
# Engines


@dataclass(frozen=True)
class Settings:
    """A named ZeRO-3 configuration and the model it runs (``None``: DeepSpeed's default).

    The stock-equivalence test runs each of ``SETTINGS``; its name is recorded with the
    behaviour, so a difference from stock names the configuration that showed it.
    """

    name: str
    shows: str  # which decision of the release computation matters under it
    persistence_threshold: int | None = 0
    reuse_distance: int | None = REUSE_DISTANCE
    prefetch_bucket: int | None = 0
    width: int = WIDTH
    far_reuse: bool = False
    frozen_inner: bool = False
    leaf_blocks: bool = False
    granularity_threshold: int | None = None  # DeepSpeed makes modules of at most this granularity z3 leaves

    def unsupported(self) -> str:
        """Why the installed DeepSpeed cannot run these settings (empty when it can)."""
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        fields = getattr(DeepSpeedZeroConfig, "model_fields", None) or DeepSpeedZeroConfig.__fields__  # pydantic 2, or 1
        if self.granularity_threshold is not None and "module_granularity_threshold" not in fields:
            return f"DeepSpeed {deepspeed_version()} has no stage3_module_granularity_threshold"
        return ""

    def cpu_cannot_run(self, error: RuntimeError) -> bool:
        """Whether ``error`` is DeepSpeed's own fast-fetch release failing on CPU: before 0.18 it
        allocates a buffer on ``get_accelerator().current_device()``, which the CPU accelerator
        gives as the string '0', not a device torch knows. Both builds fail alike there; a build
        that fails so where the other runs is told by the skip on one build only (an error)."""
        return self.granularity_threshold is not None and "Invalid device string" in str(error)

    def zero_optimization(self) -> dict[str, Any]:
        chosen = {
            "stage3_param_persistence_threshold": self.persistence_threshold,
            "stage3_max_reuse_distance": self.reuse_distance,
            "stage3_prefetch_bucket_size": self.prefetch_bucket,
            "stage3_module_granularity_threshold": self.granularity_threshold,
        }
        return {"stage": 3, **{key: value for key, value in chosen.items() if value is not None}}

    def model(self, checkpointing: str) -> StaticNet:
        torch.manual_seed(0)
        net = StaticNet(checkpointing == "on", self.width, far_reuse=self.far_reuse, frozen_inner=self.frozen_inner)
        if self.leaf_blocks:
            from deepspeed.utils import set_z3_leaf_modules

            set_z3_leaf_modules(net, [Block])
        return net


# DeepSpeed's granularity of a module is its parameters' numel per layer below it: a Block of width
# 16 has 800 / 4 = 200, the StaticNet around it 2432 / 12 = 202. A threshold of 201 makes the
# blocks leaves and leaves the root alone.
BLOCK_GRANULARITY = 201
DEFAULT_WIDTH = 320  # a Linear(320, 320) weight (102400 numel) exceeds DeepSpeed's persistence threshold of 1e5; its bias does not
VISIBLE = Settings("decisions-visible", "every parameter released unless reused within one layer")
SETTINGS = (
    VISIBLE,
    Settings("prefetch-on", "prefetch gathers ahead of the trace", prefetch_bucket=PREFETCH_NUMEL),
    Settings(
        "deepspeed-defaults",
        "DeepSpeed's own defaults: biases persistent, weights kept from forward to backward, prefetch on",
        persistence_threshold=None,
        reuse_distance=None,
        prefetch_bucket=None,
        width=DEFAULT_WIDTH,
    ),
    Settings(
        "defaults-prefetch-off",
        "DeepSpeed's defaults without prefetch: only the reuse-distance look-ahead keeps weights from forward to backward",
        persistence_threshold=None,
        reuse_distance=None,
        width=DEFAULT_WIDTH,
    ),
    Settings(
        "persistent-mixed",
        "persistent biases beside released weights; with checkpointing a persistent parameter owned by a recompute owner",
        persistence_threshold=WIDTH,
        frozen_inner=True,
    ),
    Settings("reuse-inside-and-outside", "one reuse within the reuse distance (kept), one beyond it (released)", far_reuse=True),
    Settings(
        "prefetch-skips-reuse",
        "no reuse distance: a reuse skipped by prefetch is all that keeps a parameter",
        reuse_distance=0,
        prefetch_bucket=PREFETCH_NUMEL,
    ),  # fmt: skip
    Settings("leaf-modules", "z3 leaf blocks: fetched and released whole", leaf_blocks=True),
    Settings(
        "leaf-fast-fetch",
        "blocks made z3 leaves by DeepSpeed's granularity threshold: fetched whole, released without freeing data first",
        granularity_threshold=BLOCK_GRANULARITY,
    ),
)


def engine_config(dtype: str, settings: Settings = VISIBLE) -> dict[str, Any]:
    """ZeRO-3 settings (by default ``VISIBLE``: release decisions visible).

    DeepSpeed's defaults hide decisions: the persistence threshold keeps small parameters
    resident forever and a reuse distance of 1e9 keeps everything resident from forward to
    backward. Prefetch is off unless asked for, so every gather happens where the trace says.
    """
    return {
        "train_micro_batch_size_per_gpu": 2,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == "bf16"},
        "zero_optimization": settings.zero_optimization(),
    }


def build_engine(model: torch.nn.Module, dtype: str, reuse_distance: int = REUSE_DISTANCE, settings: Settings = VISIBLE) -> Any:
    """A real DeepSpeed ZeRO-3 engine around ``model`` (plain SGD over every parameter)."""
    torch.manual_seed(0)
    optimizer = torch.optim.SGD(list(model.parameters()), lr=1e-3)
    if reuse_distance != REUSE_DISTANCE:
        settings = dataclasses.replace(settings, reuse_distance=reuse_distance)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=engine_config(dtype, settings))
    return engine


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

    Reached through the public ``get_param_coordinator()``; DeepSpeed 0.14 keys coordinators
    by ``training``, later releases keep one.
    """
    offload = engine.optimizer.parameter_offload
    getter = offload.get_param_coordinator
    if "training" in inspect.signature(getter).parameters:
        return getter(True)
    return getter()


# --------------------------------------------------------------------------------------------
# Observing behaviour


@dataclass(frozen=True)
class Event:
    """Parameters that became resident (gathered) or were freed (released) in one call."""

    call: str  # fetch | release | outside (between the coordinator's calls: step end, reset)
    module: str
    direction: str  # fwd | bwd | -
    gathered: tuple[str, ...]
    released: tuple[str, ...]

    def line(self) -> str:
        parts = [f"{self.call} {self.module} {self.direction}"]
        if self.gathered:
            parts.append("+" + ",".join(self.gathered))
        if self.released:
            parts.append("-" + ",".join(self.released))
        return " ".join(parts)


@dataclass
class StepBehaviour:
    """What one training step gathered and released, in order, and its peak resident numel."""

    events: list[Event] = field(default_factory=list)
    peak_numel: int = 0

    @property
    def gathers(self) -> int:
        return sum(len(e.gathered) for e in self.events)

    @property
    def releases(self) -> int:
        return sum(len(e.released) for e in self.events)

    def lines(self) -> list[str]:
        return [e.line() for e in self.events if e.gathered or e.released]


class Observer:
    """Records, step by step, which parameters the engine gathers and releases.

    The coordinator's public ``fetch_sub_module`` and ``release_sub_module`` (what DeepSpeed's
    module hooks call) are shadowed on the instance by spies that compare ``ds_status`` of every
    parameter before and after the real call; changes between calls (a step's end, a reset) are
    recorded as ``outside`` events. The spies change nothing the engine does.
    """

    def __init__(self, engine: Any, model: torch.nn.Module) -> None:
        self.coordinator = coordinator_of(engine)
        self.module_names = {id(m): (n or "<root>") for n, m in model.named_modules()}
        self.params = list(model.named_parameters())
        self.numel = {name: int(p.ds_numel) for name, p in self.params}
        self.steps: list[StepBehaviour] = []
        self._current: StepBehaviour | None = None
        self._last = self.resident()
        for method, call in (("fetch_sub_module", "fetch"), ("release_sub_module", "release")):
            self._spy(method, call)

    def _spy(self, method: str, call: str) -> None:
        real = getattr(self.coordinator, method)

        def spy(submodule: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            self._note("outside", "-", "-")
            try:
                return real(submodule, *args, **kwargs)
            finally:
                forward = kwargs.get("forward", args[0] if args else None)
                direction = {True: "fwd", False: "bwd"}.get(forward, "?")
                self._note(call, self.module_names.get(id(submodule), "?"), direction)

        setattr(self.coordinator, method, spy)

    def resident(self) -> frozenset[str]:
        """Names of the parameters gathered or being gathered (not ``NOT_AVAILABLE``)."""
        return frozenset(name for name, p in self.params if p.ds_status.name != "NOT_AVAILABLE")

    def _note(self, call: str, module: str, direction: str) -> None:
        now = self.resident()
        if self._current is not None:
            gathered, released = tuple(sorted(now - self._last)), tuple(sorted(self._last - now))
            if gathered or released or call != "outside":
                self._current.events.append(Event(call, module, direction, gathered, released))
            self._current.peak_numel = max(self._current.peak_numel, sum(self.numel[n] for n in now))
        self._last = now

    def step(self, run: Callable[[], object]) -> StepBehaviour:
        """Run one training step and return (and keep) its behaviour."""
        self._note("outside", "-", "-")
        self._current = StepBehaviour(peak_numel=sum(self.numel[n] for n in self._last))
        try:
            run()
            self._note("outside", "-", "-")
            self.steps.append(self._current)
            return self._current
        finally:
            self._current = None


def first_difference(ours: Sequence[str], reference: Sequence[str]) -> str:
    """The first line where two behaviour listings differ, for a failure message."""
    for index, (a, b) in enumerate(zip(ours, reference, strict=False)):
        if a != b:
            return f"event #{index}: {a!r}, reference {b!r}"
    if len(ours) != len(reference):
        return f"{len(ours)} events, reference {len(reference)}"
    return "identical"


# --------------------------------------------------------------------------------------------
# Evidence


def bug_observed(record_property: Callable[[str, object], None], figures: dict[str, Any], message: str) -> None:
    """Fail the test as *the bug was seen*, recording the measured figures.

    Only a failure raised through here counts as evidence that a build has the bug: the
    verdict reads the ``bug_observed`` property. Any other failure of a bug test (a harness
    assertion, an exception) is not evidence, and makes a stock build's cell ``error``.
    """
    record_property("bug_observed", json.dumps(figures, sort_keys=True))
    pytest.fail(message, pytrace=False)


def record_behaviour(record_property: Callable[[str, object], None], steps: Sequence[StepBehaviour]) -> None:
    """Record what the steps gathered and released, for the verdict's comparison with stock."""
    listing = [[*s.lines(), f"peak {s.peak_numel}"] for s in steps]
    record_property("behaviour", json.dumps(listing, separators=(",", ":")))
    record_property("gathers_per_step", [s.gathers for s in steps])
    record_property("peak_numel_per_step", [s.peak_numel for s in steps])


# --------------------------------------------------------------------------------------------
# Lifecycles


@dataclass(frozen=True)
class Survivors:
    """What is still alive from destroyed engines (cumulative counts)."""

    coordinators: int
    models: int
    parameters: int


def fwd_module_stack() -> list[torch.nn.Module]:
    """DeepSpeed's module-level FWD_MODULE_STACK (holds every engine's root module forever)."""
    from deepspeed.runtime.zero import parameter_offload

    return parameter_offload.FWD_MODULE_STACK


def release_from_fwd_module_stack(models: Sequence[weakref.ref]) -> int:
    """Take our destroyed engines' modules off FWD_MODULE_STACK; returns how many entries.

    The stack holds every engine's root module, plus one submodule per early-stopped
    non-reentrant checkpoint recompute. This separates that retainer, which has nothing to do
    with the fix, from the cache under test; callers report the count, never hide it.
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
