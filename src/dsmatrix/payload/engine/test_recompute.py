"""Bug 3 (DeepSpeed >= 0.19.3): backward adds recompute parameters to a cached release set in place.

Observed by behaviour. A layer applied several times (weight sharing), each application
checkpointed on its own, is frozen for a warm-up and then unfrozen (gradual unfreezing). While
it is frozen, the checkpoint recompute attributes its parameters to the module whose backward is
running (``ds_recompute_parameters``) and backward releases them with that module. After
unfreezing, a correct engine gathers and releases exactly as an engine that was never frozen;
an engine whose cached release sets were changed in place keeps releasing the shared layer
where it should stay resident, and gathers it again, for the rest of training.
"""

from __future__ import annotations

import json

import pytest
import zero3
from packaging.version import Version

RECOMPUTE_SINCE = Version("0.19.3")
WARMUP = 3  # frozen steps: the first records the trace, the next ones use it
AFTER = 3  # steps after unfreezing; the last two are compared


def _steps(dtype: str, frozen_warmup: bool) -> list[zero3.StepBehaviour]:
    model = zero3.SharedLayerNet(checkpointed=True)
    model.shared.requires_grad_(not frozen_warmup)
    engine = zero3.build_engine(model, dtype)
    observer = zero3.Observer(engine, model)
    for _ in range(WARMUP):
        observer.step(lambda: zero3.train_step(engine, dtype))
    model.shared.requires_grad_(True)
    for _ in range(AFTER):
        observer.step(lambda: zero3.train_step(engine, dtype))
    engine.destroy()
    return observer.steps


@pytest.mark.bug("recompute")
def test_unfrozen_shared_layer_matches_never_frozen(dtype: str, checkpointing: str, record_property) -> None:
    """After unfreezing, gathers and releases equal those of an engine that was never frozen."""
    if zero3.deepspeed_version() < RECOMPUTE_SINCE:
        pytest.skip(f"not applicable: DeepSpeed {zero3.deepspeed_version()} has no recompute path (added in 0.19.3)")
    if checkpointing != "on":
        pytest.skip("not applicable: the recompute path needs activation checkpointing")
    unfrozen = _steps(dtype, frozen_warmup=True)
    reference = _steps(dtype, frozen_warmup=False)
    assert all(s.gathers for s in reference), "harness: a step gathered nothing"
    # While frozen, the recompute's attribution makes backward release (and gather again) the
    # shared layer more often than in an engine never frozen: proof the scenario reached it.
    assert unfrozen[WARMUP - 1].gathers > reference[WARMUP - 1].gathers, (
        "harness: while frozen, the engine gathered no more than one never frozen (no recompute attribution seen)"
    )
    figures = {
        "gathers_per_step_unfrozen": [s.gathers for s in unfrozen],
        "gathers_per_step_never_frozen": [s.gathers for s in reference],
        "peak_numel_unfrozen": [s.peak_numel for s in unfrozen],
        "peak_numel_never_frozen": [s.peak_numel for s in reference],
    }
    record_property("figures", json.dumps(figures, sort_keys=True))
    ours = [line for s in unfrozen[-2:] for line in s.lines()]
    theirs = [line for s in reference[-2:] for line in s.lines()]
    if ours != theirs:
        zero3.bug_observed(
            record_property,
            figures,
            f"after unfreezing, the engine gathers {unfrozen[-1].gathers} parameters per step where an engine never frozen "
            f"gathers {reference[-1].gathers}; first difference: {zero3.first_difference(ours, theirs)}",
        )
