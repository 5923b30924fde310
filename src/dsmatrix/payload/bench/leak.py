"""Leak benchmark: RSS and survivors over sequential ZeRO-3 engine lifecycles (the seed's setup).

Each lifecycle builds an engine around 4 x Linear(1024, 1024), trains it to a complete trace
(the release cache filled), destroys it, drops every reference and runs ``gc.collect()``; then
records the process's RSS and how many coordinators and Linear submodules are still alive.
``--drain`` also takes the destroyed engines off DeepSpeed's module-level FWD_MODULE_STACK (and,
on 0.14/0.15, drops the AccumulateGrad nodes in ``optimizer.grad_accs``): two retainers unrelated
to the fix, drained only in the diagnostic line, and counted there.

Run inside a build's environment: ``python leak.py --lifecycles 20 --json out.json [--drain]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

WIDTH = 1024
STEPS = 3


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lifecycles", type=int, default=20)
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument("--drain", action="store_true", help="drain FWD_MODULE_STACK (diagnostic line)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    for key, value in (("DS_ACCELERATOR", "cpu"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0")):
        os.environ.setdefault(key, value)
    for key in ("LOCAL_RANK",):
        os.environ.setdefault(key, "0")
    for key in ("WORLD_SIZE", "LOCAL_SIZE"):
        os.environ.setdefault(key, "1")
    import deepspeed
    import zero3

    deepspeed.init_distributed(dist_backend="gloo")
    zero3.collect()
    baseline = rss_mb()
    coordinators: list[weakref.ref] = []
    models: list[weakref.ref] = []
    layers: list[weakref.ref] = []
    series = []
    drained = {"fwd_module_stack": 0, "grad_acc_nodes": 0}
    for lifecycle in range(1, args.lifecycles + 1):
        model = zero3.new_model("off", width=WIDTH)
        engine = zero3.build_engine(model, args.dtype, reuse_distance=0)
        for _ in range(STEPS):
            zero3.train_step(engine, args.dtype)
        coordinators.append(weakref.ref(zero3.coordinator_of(engine)))
        models.append(weakref.ref(model))
        layers += [weakref.ref(m) for m in model.layers]
        engine.destroy()
        if args.drain:
            drained["grad_acc_nodes"] += zero3.release_grad_accumulators(engine)
        del engine, model
        zero3.collect()
        if args.drain:
            drained["fwd_module_stack"] += zero3.release_from_fwd_module_stack(models)
            zero3.collect()
        series.append(
            {
                "lifecycle": lifecycle,
                "rss_mb": round(rss_mb(), 1),
                "coordinators_alive": sum(r() is not None for r in coordinators),
                "linear_submodules_alive": sum(r() is not None for r in layers),
                "fwd_module_stack_len": len(zero3.fwd_module_stack()),
            }
        )
        print(json.dumps(series[-1]), flush=True)
    result = {
        "deepspeed": deepspeed.__version__,
        "dtype": args.dtype,
        "drain": args.drain,
        "drained": drained,
        "baseline_rss_mb": round(baseline, 1),
        "series": series,
        "growth_mb": round(series[-1]["rss_mb"] - series[0]["rss_mb"], 1),
    }
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
