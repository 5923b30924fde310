"""Run the engine tests (``tests/engine``) inside one build's environment, read the JUnit.

Each build gets its own ``TORCH_EXTENSIONS_DIR`` (DeepSpeed JIT-builds a CPU comm op there;
the default cache is keyed only by Python, so sharing it across versions loads wrong builds),
``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE=1`` (0.14/0.15 otherwise call numactl) and a single-rank
gloo rendezvous on a free loopback port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from junitparser import Error, Failure, JUnitXml, Properties, Skipped

from dsmatrix.errors import RunError

ENGINE_TESTS = Path(__file__).resolve().parents[2] / "tests" / "engine"
PYTEST_OK = (0, 1)  # all passed / some failed: both are results


@dataclass(frozen=True)
class TestOutcome:
    __test__ = False  # not a pytest test class

    outcome: str  # passed | failed | error | skipped
    bug: str = ""  # non-empty for bug tests: lifecycle | retrace | recompute
    message: str = ""
    duration_s: float = 0.0
    properties: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TestRun:
    __test__ = False  # not a pytest test class

    outcomes: Mapping[str, TestOutcome]
    duration_s: float
    junit: Path
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_environment(extensions_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VIRTUAL_ENV"))}
    env.update(
        DS_ACCELERATOR="cpu",
        LOCAL_SIZE="1",
        TORCH_EXTENSIONS_DIR=str(extensions_dir),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_engine_tests(
    python: Path,
    extensions_dir: Path,
    runtime: Mapping[str, Sequence[str]],
    junit: Path,
    log: Path,
    timeout_s: float = 3600,
) -> TestRun:
    """Run pytest on the engine tests with ``python``; RunError unless it produced results."""
    extensions_dir.mkdir(parents=True, exist_ok=True)
    junit.parent.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [
        str(python),
        "-m",
        "pytest",
        str(ENGINE_TESTS),
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfEs",
        "-o",
        "junit_family=xunit1",
        f"--junitxml={junit}",
        f"--dtype={','.join(runtime['dtype'])}",
        f"--checkpointing={','.join(runtime['checkpointing'])}",
    ]
    started = time.monotonic()
    with log.open("w") as out:
        try:
            proc = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, env=test_environment(extensions_dir), timeout=timeout_s, cwd=ENGINE_TESTS
            )
        except subprocess.TimeoutExpired:
            raise RunError(f"engine tests timed out after {timeout_s:.0f} s (log: {log})") from None
    duration = time.monotonic() - started
    if proc.returncode not in PYTEST_OK or not junit.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise RunError(f"engine tests exited {proc.returncode}: {tail[0][:300]} (log: {log})")
    outcomes = read_junit(junit)
    if not outcomes:
        raise RunError(f"engine tests collected nothing (log: {log})")
    return TestRun(outcomes, duration, junit, log)


def read_junit(path: Path) -> dict[str, TestOutcome]:
    """Outcome per test id (``file::name[params]``) from a pytest JUnit XML file."""
    outcomes: dict[str, TestOutcome] = {}
    for suite in JUnitXml.fromfile(str(path)):
        for case in suite:
            test_file = case.classname.rsplit(".", 1)[-1] if case.classname else "?"
            test_id = f"{test_file}::{case.name}"
            found = case.child(Properties)
            properties = {p.name: p.value for p in found} if found is not None else {}
            outcome, message = "passed", ""
            for result in case.result:
                if isinstance(result, Skipped):
                    outcome, message = "skipped", result.message or ""
                elif isinstance(result, Error):
                    outcome, message = "error", result.message or ""
                elif isinstance(result, Failure):
                    outcome, message = "failed", result.message or ""
            outcomes[test_id] = TestOutcome(
                outcome=outcome,
                bug=properties.pop("bug", ""),
                message=_one_line(message),
                duration_s=round(float(case.time or 0.0), 3),
                properties=properties,
            )
    return outcomes


def _one_line(message: str, limit: int = 600) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def outcome_dict(outcome: TestOutcome) -> dict[str, object]:
    data: dict[str, object] = {"outcome": outcome.outcome, "duration_s": outcome.duration_s}
    if outcome.bug:
        data["bug"] = outcome.bug
    if outcome.message:
        data["message"] = outcome.message
    if outcome.properties:
        data["properties"] = {k: _maybe_json(v) for k, v in outcome.properties.items()}
    return data


def _maybe_json(value: str) -> object:
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return value
