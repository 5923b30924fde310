"""Instructions executed per training step and per release-path call, counted under callgrind.

Run by ``dsmatrix.execute.instructions`` inside one build's environment::

    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file=OUT \
        python count_instructions.py --marks-library marks.so --dtype fp32,bf16 --checkpointing off,on --steps 5

``marks.so`` wraps callgrind's client requests (``<valgrind/callgrind.h>``). Imports, engine
builds and the trace-recording steps run uninstrumented (about 5x native instead of 50x); around
the counted steps and calls instrumentation is on and every one ends in a dump labelled with its
benchmark (``CALLGRIND_DUMP_STATS_AT``), which holds exactly what ran since the previous one.
Outside valgrind the requests do nothing. Instruction counts are the same from run to run up to a
small amount of noise (hash layouts, allocator state), which the stock-again process measures.

The step is the time benchmark's (``bench_step.py``): 4 x Linear(1024, 1024), persistence
threshold 0, reuse distance 0, so every step gathers and releases every layer.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

WIDTH = 1024
TRACE_STEPS = 3  # record the trace, then run on it (release decisions cached)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--marks-library", type=Path, required=True, help="the compiled client requests (dsmatrix.execute.instructions)")
    parser.add_argument("--dtype", default="fp32,bf16")
    parser.add_argument("--checkpointing", default="off,on")
    parser.add_argument("--steps", type=int, default=5, help="counted steps (and release-path calls) per combination")
    args = parser.parse_args()
    for key, value in (("DS_ACCELERATOR", "cpu"), ("MASTER_ADDR", "127.0.0.1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    for key in ("WORLD_SIZE", "LOCAL_SIZE"):
        os.environ.setdefault(key, "1")
    os.environ.setdefault("MASTER_PORT", "29541")
    marks = ctypes.CDLL(str(args.marks_library))
    import deepspeed
    import zero3
    from release_path import release_every_layer

    deepspeed.init_distributed(dist_backend="gloo")
    for dtype in args.dtype.split(","):
        for checkpointing in args.checkpointing.split(","):
            combo = f"{dtype}-ckpt-{checkpointing}"
            engine = zero3.build_engine(zero3.new_model(checkpointing, width=WIDTH), dtype, reuse_distance=0)
            for _ in range(TRACE_STEPS):
                zero3.train_step(engine, dtype)
            if not zero3.coordinator_of(engine).is_complete_trace():
                raise SystemExit("harness: the trace never completed")
            release_all, _ = release_every_layer(engine)
            gc.collect()
            gc.disable()  # as in the time benchmark (--benchmark-disable-gc)
            marks.dsmatrix_start()
            for _ in range(args.steps):
                zero3.train_step(engine, dtype)
                marks.dsmatrix_dump(f"test_train_step[{combo}]".encode())
            for _ in range(args.steps):
                release_all()
                marks.dsmatrix_dump(f"test_release_path[{combo}]".encode())
            marks.dsmatrix_stop()
            gc.enable()
            engine.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
