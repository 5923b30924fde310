"""What makes a result reusable (the fingerprint, the suite's digest), and the stock runs kept in the cache:
validating several patches runs stock once."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from dsmatrix.build.patches import PatchSet
from dsmatrix.execute.deepspeed_tests import DEFAULT_SET
from dsmatrix.execute.engine_tests import run_engine_tests
from dsmatrix.execute.prepare import PreparedBuild
from dsmatrix.infra.cache import Cache, materialise
from dsmatrix.infra.hosts import LOCAL
from dsmatrix.infra.locations import PACKAGE
from dsmatrix.judge.outcomes import TestOutcome, TestRun, outcomes_from_junits
from dsmatrix.plan.cells import Cell


def tree_digest(folder: Path) -> str:
    """sha256 over a folder's files (names and contents)."""
    sha = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            sha.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    return sha.hexdigest()


def suite_digest() -> str:
    """sha256 over the suite's own code: this package, with its payload (the engine tests, the
    benchmarks and the choice of DeepSpeed's own tests). A result is reused only by the same suite:
    a changed test, rule or runner invalidates earlier results."""
    sha = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".json", ".j2", ".ini", ".toml") and "__pycache__" not in path.parts:
            sha.update(f"dsmatrix/{path.relative_to(PACKAGE)}".encode() + b"\0" + path.read_bytes())
    return sha.hexdigest()


def fingerprint(
    cell: Cell, runtime: dict[str, list[str]], patch: PatchSet, suite: str, host: str = LOCAL, deepspeed_tests: str = DEFAULT_SET
) -> str:
    """What makes a cell result reusable: versions, platform, host, runtime axes, patch and test-suite
    hashes, and for a git source which set of DeepSpeed's own tests ran."""
    data: dict[str, object] = {"cell": cell.values(), "runtime": runtime, "patch": patch.sha256, "suite": suite, "host": host}
    if cell.source:
        data["deepspeed_tests"] = deepspeed_tests
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def stock_tests(
    cell: Cell, build: PreparedBuild, runtime: dict[str, list[str]], cache: Cache, raw: Path, reuse: bool
) -> tuple[TestRun, str]:
    """The stock build's engine-test run, reused from the cache when the same stock wheel already
    ran the same suite over the same runtime axes (validating several patches runs stock once);
    returns the run and the id of the run that produced it ("" when run now)."""
    key = {"cell": cell.stock_values(), "runtime": runtime, "wheel": build.info.get("wheel_sha256", ""), "suite": suite_digest()}

    def run_now() -> TestRun:
        return run_engine_tests(build.python, build.extensions, runtime, raw, f"{cell.id}-stock")

    return cached_stock_run(cache.stock_results(cell.stock_id, key), build, cache, raw, reuse, run_now, outcomes_from_junits)


def cached_stock_run(
    entry: Path,
    build: PreparedBuild,
    cache: Cache,
    raw: Path,
    reuse: bool,
    run_now: Callable[[], TestRun],
    outcomes: Callable[[Sequence[Path]], Mapping[str, TestOutcome]],
) -> tuple[TestRun, str]:
    """A stock test run kept in the cache ``entry``: run now (``reuse`` false, or none kept), else its
    files copied into ``raw`` and read back with ``outcomes``. A concurrent run waits for the entry's
    lock instead of repeating the run."""
    fresh: list[TestRun] = []

    def keep(staging: Path) -> None:
        test_run = run_now()
        files = [f.name for f in (*test_run.junits, *test_run.logs)]
        for f in (*test_run.junits, *test_run.logs):
            shutil.copy2(f, staging / f.name)
        info = {"run_id": raw.parent.name, "duration_s": test_run.duration_s, "files": files}
        (staging / "run.json").write_text(json.dumps(info, indent=2))
        fresh.append(test_run)

    with cache.using_extensions([build.extensions]):
        materialise(entry, lambda e: reuse and (e / "run.json").is_file(), keep)
    if fresh:
        return fresh[0], ""
    info = json.loads((entry / "run.json").read_text())
    raw.mkdir(parents=True, exist_ok=True)
    copied = [Path(shutil.copy2(entry / f, raw / f)) for f in info["files"]]
    junits = tuple(p for p in copied if p.suffix == ".xml")
    logs = tuple(p for p in copied if p.suffix == ".log")
    return TestRun(dict(outcomes(junits)), info["duration_s"], junits, logs), info["run_id"]
