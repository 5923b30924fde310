"""One build's benchmark host (driven by ``dsmatrix.execute.step_time``): it imports once, then for
every round the driver starts it forks a worker per lane (one CPU each) that runs ``bench_step.py``
under pytest-benchmark, writing that round's JSON.

A new worker per round measures new engines in a new process, as a new interpreter did, but a fork
costs milliseconds where an interpreter paid about 6 s for importing torch and DeepSpeed and for
the modules a first engine build imports lazily. The host learns those from a throwaway fork
that runs the benchmark once, untimed, and imports them itself (never the benchmark's own modules:
they park at import). Then it forks one server per lane, each with its lane's two turn pipes of
``turns.py``: the server writes ``.`` once ready; the driver writes ``r`` to start a round (the
worker then parks and takes turns as any benchmark process does); when the worker has exited the
server writes ``d`` (its JSON written) or ``x`` (it failed). End of file on the driver's pipe ends
the server; the host exits when every server has.

    DSMATRIX_BENCH_TURNS=go,parked;go,parked DSMATRIX_BENCH_CPU=cpu,cpu \
        python bench_host.py JSON_TEMPLATE -- PYTEST_ARGS...    (JSON_TEMPLATE holds ``{lane}``, ``{round}``)
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAYLOAD = HERE.parent
TURNS = "DSMATRIX_BENCH_TURNS"
CPU = "DSMATRIX_BENCH_CPU"  # per lane, the one CPU its workers run on (the host warms up on any)
PORTS = "DSMATRIX_BENCH_PORTS"  # per lane, its workers' rendezvous port


def fork_pytest(pytest_args: list[str], report: int | None = None) -> int:
    """Start pytest in a forked child; its pid. With ``report``, the child writes there the
    modules it imported from outside the payload (JSON list) and takes no turns."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            before = set(sys.modules)
            if report is not None:
                os.environ.pop(TURNS, None)
            else:
                os.sched_setaffinity(0, {int(os.environ[CPU])})
            import pytest

            code = int(pytest.main(pytest_args))
            if report is not None:
                added = [name for name in sorted(set(sys.modules) - before) if not _in_payload(sys.modules[name])]
                with os.fdopen(report, "wb") as out:
                    out.write(json.dumps(added).encode())
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def exit_status(pid: int) -> int:
    """Wait for a forked child; its exit status."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _in_payload(module: object) -> bool:
    origin = getattr(module, "__file__", None)
    return origin is None or Path(origin).resolve().is_relative_to(PAYLOAD)


def warm(pytest_args: list[str]) -> None:
    """Import here what one untimed run of the benchmark imports (torch, DeepSpeed, pytest and
    everything a first engine build loads lazily), so each worker starts with it."""
    read, write = os.pipe()
    untimed = {"DSMATRIX_BENCH_STEPS": "1", "DSMATRIX_BENCH_ENGINES": "1"}
    env = {key: os.environ.get(key) for key in untimed}
    os.environ.update(untimed)
    try:
        pid = fork_pytest([*pytest_args, "--benchmark-disable"], report=write)
    finally:
        os.close(write)
        for key, value in env.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    with os.fdopen(read, "rb") as answer:  # read before waiting: the list outgrows a pipe's buffer
        names = json.loads(answer.read() or b"[]")
    status = exit_status(pid)
    if status != 0:
        raise SystemExit(f"dsmatrix benchmark host: the warm-up run failed (exit {status})")
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  (a module only its importer's context can load: the worker loads it)
            continue


def serve(lane: int, go: int, parked: int, json_template: str, pytest_args: list[str]) -> None:
    """One lane's rounds: a worker forked per ``r``, answered ``d`` or ``x``; end of file ends them."""
    os.environ[TURNS], os.environ[CPU] = f"{go},{parked}", os.environ[CPU].split(",")[lane]
    os.environ["MASTER_PORT"] = os.environ[PORTS].split(",")[lane]
    index = 0
    while (command := os.read(go, 1)) == b"r":
        index += 1
        target = json_template.format(lane=lane, round=index)
        status = exit_status(fork_pytest([*pytest_args, f"--benchmark-json={target}"]))
        os.write(parked, b"d" if status == 0 else b"x")
    if command:
        raise SystemExit(f"dsmatrix benchmark host: unexpected command {command!r}")


def main() -> None:
    json_template, separator, *pytest_args = sys.argv[1:]
    if separator != "--" or "{round}" not in json_template or "{lane}" not in json_template:
        raise SystemExit("usage: bench_host.py JSON_TEMPLATE -- PYTEST_ARGS...  (JSON_TEMPLATE holds {lane} and {round})")
    lanes = [tuple(int(fd) for fd in pair.split(",")) for pair in os.environ[TURNS].split(";")]
    warm(pytest_args)
    children = []
    for lane, (go, parked) in enumerate(lanes):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for fd in {fd for pair in lanes for fd in pair} - {go, parked}:
                    os.close(fd)
                os.write(parked, b".")
                serve(lane, go, parked, json_template, pytest_args)
                code = 0
            finally:
                os._exit(code)
        children.append(pid)
    for fd in {fd for pair in lanes for fd in pair}:  # each lane's server holds its own ends
        os.close(fd)
    failed = [status for status in map(exit_status, children) if status]
    if failed:
        raise SystemExit(f"dsmatrix benchmark host: a lane's server failed (exit {failed[0]})")


if __name__ == "__main__":
    main()
