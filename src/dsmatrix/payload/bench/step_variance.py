"""Where step-time variance lives, in one build's environment: between steps of one engine, between
engines of one process, between processes (each a new memory layout) and over time.

Workers run one after the other on one CPU. Each builds ``--engines`` engines in turn and times
``--steps`` training steps on each (CPU time, one intra-op thread, gc off: as the step-time rounds
do). A worker is either a new interpreter (``--mode exec``: imports torch and DeepSpeed again; with
``--aslr off`` its address space is not randomised) or a fork of this process after the imports
(``--mode fork``). Prints one JSON object: every worker's step times and what it cost.

    python step_variance.py --mode fork --workers 12 --engines 2 --steps 30 --dtype bf16 --checkpointing on
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "engine"))

ADDR_NO_RANDOMIZE = 0x0040000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_environment(port: int) -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}


def work(args: argparse.Namespace, started: float) -> dict[str, Any]:
    """One worker: engines built in turn, each timed over ``args.steps`` steps."""
    import_s = time.monotonic() - started
    from datetime import timedelta

    import deepspeed
    import torch
    import zero3

    torch.set_num_threads(1)
    began = time.monotonic()
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(minutes=5))
    init_s = time.monotonic() - began
    engines = []
    for _ in range(args.engines):
        began = time.monotonic()
        engine = zero3.build_engine(zero3.new_model(args.checkpointing, width=1024), args.dtype, reuse_distance=0)
        for _ in range(3):
            zero3.train_step(engine, args.dtype)
        build_s = time.monotonic() - began
        gc.disable()
        times = []
        for _ in range(args.steps):
            before = time.process_time()
            zero3.train_step(engine, args.dtype)
            times.append(time.process_time() - before)
        gc.enable()
        engine.destroy()
        engines.append({"build_s": round(build_s, 3), "times": times})
    torch.distributed.destroy_process_group()
    return {"pid": os.getpid(), "import_s": round(import_s, 3), "init_s": round(init_s, 3), "engines": engines}


def remove_buffers(port: str) -> None:
    for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        buffer.unlink(missing_ok=True)


def in_fork(child: Callable[[], bytes]) -> tuple[int, bytes]:
    """Run ``child`` in a forked process and read what it returns through a pipe (all of it, before
    reaping the child, so a large answer never blocks it): (wait status, bytes)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        code = 1
        try:
            os.write(write, child())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    return status, b"".join(chunks)


def warm_host(args: argparse.Namespace) -> list[str]:
    """Import, in this process, what a first engine build imports lazily: a forked child builds one
    engine and names the modules it added; the process group stays the child's."""

    def child() -> bytes:
        before = set(sys.modules)
        work(argparse.Namespace(**{**vars(args), "engines": 1, "steps": 1}), time.monotonic())
        return json.dumps(sorted(set(sys.modules) - before)).encode()

    _, output = in_fork(child)
    names = json.loads(output)
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            failed.append(name)
    return failed


def no_aslr() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.personality(ctypes.c_ulong(ADDR_NO_RANDOMIZE)) == -1:
        raise OSError(ctypes.get_errno(), "personality(ADDR_NO_RANDOMIZE)")


def run_exec(args: argparse.Namespace, index: int) -> dict[str, Any]:
    env = dict(os.environ)
    command = [sys.executable, __file__, "--worker", *sys.argv[1:]]
    began = time.monotonic()
    out = subprocess.run(command, env=env, capture_output=True, text=True, preexec_fn=no_aslr if args.aslr == "off" else None)
    if out.returncode:
        raise SystemExit(f"worker {index} exited {out.returncode}: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {**result, "wall_s": round(time.monotonic() - began, 3)}


def run_fork(args: argparse.Namespace, index: int) -> dict[str, Any]:
    def child() -> bytes:
        try:
            return json.dumps(work(args, time.monotonic())).encode()
        except BaseException:
            import traceback

            traceback.print_exc()
            raise

    began = time.monotonic()
    status, output = in_fork(child)
    if status or not output:
        raise SystemExit(f"worker {index} failed (status {status})")
    return {**json.loads(output), "wall_s": round(time.monotonic() - began, 3)}


def summary(workers: list[dict[str, Any]]) -> dict[str, Any]:
    """Standard deviations of log step time (x100 ~ percent) at each level, and the drift over workers."""
    import math
    import statistics

    logs = [[[math.log(t) for t in e["times"]] for e in w["engines"]] for w in workers]
    within = [statistics.stdev(e) for w in logs for e in w if len(e) > 1]
    engine_medians = [[statistics.median(e) for e in w] for w in logs]
    between_engines = [statistics.stdev(m) for m in engine_medians if len(m) > 1]
    worker_means = [statistics.fmean(m) for m in engine_medians]
    steps = len(logs[0][0])
    trend = statistics.linear_regression(range(len(worker_means)), worker_means).slope if len(worker_means) > 2 else 0.0
    return {
        "median_step_ms": round(1000 * math.exp(statistics.median(worker_means)), 3),
        "sd_step_within_engine_pct": round(100 * statistics.fmean(within), 3),
        "se_engine_median_pct": round(100 * 1.2533 * statistics.fmean(within) / math.sqrt(steps), 3),
        "sd_between_engines_pct": round(100 * statistics.fmean(between_engines), 3) if between_engines else None,
        "sd_between_workers_pct": round(100 * statistics.stdev(worker_means), 3) if len(worker_means) > 1 else None,
        "drift_per_worker_pct": round(100 * trend, 3),
        "worker_medians_ms": [round(1000 * math.exp(m), 3) for m in worker_means],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("exec", "fork"), default="fork")
    parser.add_argument("--aslr", choices=("on", "off"), default="on")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--engines", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--checkpointing", default="on")
    parser.add_argument("--warm-host", action="store_true", help="fork mode: build and destroy one engine before forking")
    args = parser.parse_args()
    started = time.monotonic()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not args.worker:  # one rendezvous port for every worker, one after the other (as a benchmark host does)
        os.environ.update(rank_environment(free_port()))
    if args.worker:
        print(json.dumps(work(args, started)))
        return
    if args.mode == "fork":
        import deepspeed  # noqa: F401  (the imports a forked worker inherits)
        import torch
        import zero3  # noqa: F401

        torch.set_num_threads(1)
        if args.warm_host:
            print("warm host: not importable:", warm_host(args), file=sys.stderr)
    parent_import_s = time.monotonic() - started
    run = run_fork if args.mode == "fork" else run_exec
    try:
        workers = [run(args, index) for index in range(args.workers)]
    finally:
        remove_buffers(os.environ["MASTER_PORT"])
    result = {"args": vars(args), "parent_import_s": round(parent_import_s, 3), "summary": summary(workers), "workers": workers}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
