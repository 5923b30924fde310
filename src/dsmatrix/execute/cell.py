"""One cell through the pipeline: preflight checks, wheels, environments, tests, verdict.

Everything a cell needs is checked before the run starts (interpreters, versions, patch
applicability), so bad input fails in one line before anything is written. A cell whose
set-up or run fails later becomes an ``error`` verdict with the reason; the run goes on.
"""

from __future__ import annotations

import hashlib
import json
import re
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsmatrix.build.environments import check_installable, ensure_environment, find_interpreter, pip_freeze, uv_executable
from dsmatrix.build.patches import PatchSet, apply_diff
from dsmatrix.build.wheels import build_key, build_wheel, source_archive, source_name, unpack_sdist
from dsmatrix.execute.change_coverage import REQUIREMENT as COVERAGE_REQUIREMENT
from dsmatrix.execute.change_coverage import Hunk, changed_hunks, measure, package_root, rcfile, summary_line
from dsmatrix.execute.deepspeed_tests import REQUIREMENTS as DEEPSPEED_TEST_REQUIREMENTS
from dsmatrix.execute.deepspeed_tests import compare, copy_tests, load_selection, run_deepspeed_tests
from dsmatrix.execute.engine_tests import (
    ENGINE_TESTS,
    TestOutcome,
    TestRun,
    outcome_dict,
    outcomes_from_junits,
    probe_of_tests,
    read_junit,
    run_engine_tests,
)
from dsmatrix.execute.instructions import CALIBRATION_TOLERANCE, run_counts
from dsmatrix.execute.step_time import HEADLINE_RULE, NOT_MEASURED, BenchOptions, cell_throughput, run_leak, run_rounds
from dsmatrix.infra import parallel, progress
from dsmatrix.infra.cache import Cache, extensions_folder, materialise
from dsmatrix.infra.errors import FatalError
from dsmatrix.infra.hosts import describe
from dsmatrix.infra.locations import suite_path
from dsmatrix.infra.results import Run, cell_result_skeleton
from dsmatrix.judge.verdict import ERROR, cell_verdict, with_deepspeed_tests
from dsmatrix.plan.cells import Cell, Selection

BUILDS = ("stock", "patched")
OWN_TESTS = "core"  # the default set of DeepSpeed's own tests for a git source (dsmatrix/payload/deepspeed_tests/selection.toml)
# setuptools: torch.utils.cpp_extension imports it to JIT-build DeepSpeed's comm op (torch 2.4)
TEST_REQUIREMENTS = ("pytest", "packaging", "setuptools", "pytest-benchmark")
PACKAGE = Path(__file__).parent
BENCH_SCRIPTS = suite_path("bench")


def tree_digest(folder: Path) -> str:
    """sha256 over a folder's files (names and contents)."""
    sha = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            sha.update(str(path.relative_to(folder)).encode() + b"\0" + path.read_bytes() + b"\0")
    return sha.hexdigest()


def suite_digest() -> str:
    """sha256 over the suite's own code: this package, the engine tests, the benchmarks and the choice
    of DeepSpeed's own tests. A result
    is reused only by the same suite: a changed test, rule or runner invalidates earlier results."""
    sha = hashlib.sha256()
    folders = (("dsmatrix", PACKAGE), ("engine", ENGINE_TESTS), ("bench", BENCH_SCRIPTS), ("deepspeed", suite_path("deepspeed_tests")))
    for name, folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.suffix in (".py", ".json", ".j2", ".ini", ".toml") and "__pycache__" not in path.parts:
                sha.update(f"{name}/{path.relative_to(folder)}".encode() + b"\0" + path.read_bytes())
    return sha.hexdigest()


def fingerprint(
    cell: Cell, runtime: dict[str, list[str]], patch: PatchSet, suite: str, host: str = "local", own_tests: str = OWN_TESTS
) -> str:
    """What makes a cell result reusable: versions, platform, host, runtime axes, patch and test-suite
    hashes, and for a git source which set of DeepSpeed's own tests ran."""
    data: dict[str, object] = {"cell": cell.values(), "runtime": runtime, "patch": patch.sha256, "suite": suite, "host": host}
    if cell.source:
        data["deepspeed_tests"] = own_tests
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def cache_size() -> str:
    """uv's own report of its cache size (the bulk of the disk the matrix uses)."""
    proc = subprocess.run([uv_executable(), "cache", "size", "--human"], capture_output=True, text=True)
    return proc.stdout.strip() or "unknown"


def preflight(selection: Selection) -> None:
    """Check the interpreters and torch versions the run depends on; raises a one-line FatalError
    on the first problem (``check_patch`` checks the fix)."""
    for python in sorted({c.python for c in selection.cells}):
        find_interpreter(python)
    for python, torch in sorted({(c.python, c.torch) for c in selection.cells}):
        progress.stage(f"checking the inputs: torch {torch} for Python {python}")
        check_installable(f"torch=={torch}", python)


def check_patch(cells: Sequence[Cell], patch: PatchSet, cache: Cache) -> None:
    """Every DeepSpeed source has a diff, and it applies to that release's sdist or commit's tree
    (any platform). PR mode applies nothing: the head commit carries the change."""
    sources = {c.source_key: c for c in cells if not (c.source and c.source.pr)}
    for _, cell in sorted(sources.items()):
        progress.stage(f"checking the inputs: the fix applies to DeepSpeed {source_name(cell)}")
        diff = patch.diff_for(cell.deepspeed)
        with tempfile.TemporaryDirectory() as tmp:
            apply_diff(diff, unpack_sdist(source_archive(cell, cache), Path(tmp)), source_name(cell))


@dataclass(frozen=True)
class PreparedBuild:
    """One build of a cell, ready to run: its environment, wheel and torch-extensions folder."""

    python: Path
    extensions: Path
    wheel: str
    info: dict[str, Any]
    installed: dict[str, str]
    freeze: list[str]

    def facts(self) -> dict[str, Any]:
        return {"wheel": self.wheel, "build_info": self.info, "installed": self.installed, "freeze": self.freeze}


def build_requirements(cell: Cell, build: str) -> list[str]:
    """What a build's environment holds besides torch and the wheel: the engine tests' needs,
    coverage.py in the patched build (changed-line coverage), and for a git source DeepSpeed's
    own test runner."""
    requirements = list(TEST_REQUIREMENTS)
    if build == "patched":
        requirements.append(COVERAGE_REQUIREMENT)
    if cell.source:
        requirements += DEEPSPEED_TEST_REQUIREMENTS
    return requirements


def build_lane(cell: Cell) -> Callable[[str], str]:
    """The progress lane of one build of ``cell`` while both run side by side."""
    return lambda build: f"{cell.label} [{build}]"


def prepare_builds(cell: Cell, patch: PatchSet, cache: Cache, together: bool = False) -> dict[str, PreparedBuild]:
    """Stock and patched wheels built and installed, each in its own environment (all cached);
    ``together``: both builds at once."""
    interpreter = find_interpreter(cell.python)

    def prepare(build: str) -> PreparedBuild:
        build_patch = patch if build == "patched" else None
        progress.stage(f"{build} wheel")
        wheel = build_wheel(cell, cache, build_patch)
        progress.stage(f"{build} environment")
        requirements = [f"torch=={cell.torch}", str(wheel.wheel), *build_requirements(cell, build)]
        request = {"interpreter": str(interpreter), "requirements": requirements}
        path = cache.environment(cell.stock_id if build == "stock" else cell.id, build_key(build_patch), request)
        env = ensure_environment(path, interpreter, requirements, f"{cell.label} {build}")
        extensions = extensions_folder(env.path)
        return PreparedBuild(env.python, extensions, wheel.wheel.name, wheel.info, env.installed, pip_freeze(env.python))

    return parallel.each(BUILDS, prepare, together, build_lane(cell))


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


def run_benchmarks(
    builds: dict[str, PreparedBuild], runtime: Any, run: Run, cell: Cell, options: BenchOptions, emulated: bool, cache: Cache
) -> dict[str, Any]:
    """Executed instructions, step-time rounds and the leak lines for one cell, and the cell's
    throughput verdict (``HEADLINE_RULE``); never judged under emulation."""
    if emulated:
        return {"verdict": f"{NOT_MEASURED} (emulated)", "reason": "timings under qemu-user say nothing about native speed"}
    pythons = {b: builds[b].python for b in builds}
    extensions = {b: builds[b].extensions for b in builds}
    with cache.using_extensions(list(extensions.values())):
        return _run_benchmarks(pythons, extensions, runtime, run, cell, options)


def _run_benchmarks(
    pythons: dict[str, Path], extensions: dict[str, Path], runtime: Any, run: Run, cell: Cell, options: BenchOptions
) -> dict[str, Any]:
    out = run.root / "bench"
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        instructions = run_counts(pythons, extensions, runtime, out, cell.id, options.instructions_margin)
        print(f"    instructions: {instructions['verdict']} ({instructions.get('duration_s', 0):.0f} s)", flush=True)
        step = run_rounds(pythons, extensions, runtime, out, cell.id, options)
        leak = run_leak(pythons, extensions, out, cell.id, options.lifecycles)
    except FatalError as exc:  # the correctness verdict stands; the benchmarks say why they have none
        return {"verdict": "error", "reason": str(exc), "duration_s": round(time.monotonic() - started, 1)}
    step["files"] = [f"bench/{name}" for name in step["files"]]
    verdict, decided_by = cell_throughput(step["verdict"], step["calibration_verdict"], instructions)
    return {
        **step,
        "time_verdict": step["verdict"],
        "rounds_duration_s": step["duration_s"],
        "verdict": verdict,
        "decided_by": decided_by,
        "headline_rule": HEADLINE_RULE.format(
            instructions=options.instructions_margin, tolerance=CALIBRATION_TOLERANCE, time=options.margin
        ),
        "instructions": instructions,
        "leak": leak,
        "duration_s": round(time.monotonic() - started, 1),
    }


def add_benchmarks(result: dict[str, Any], cell: Cell, selection: Selection, patch: PatchSet, cache: Cache, run: Run, bench: BenchOptions):
    """Benchmarks for a cell whose correctness result is reused (its builds are cached)."""
    try:
        with parallel.GATE.shared():
            builds = prepare_builds(cell, patch, cache)
    except FatalError as exc:
        return {**result, "benchmarks": {"verdict": "error", "reason": str(exc)}}
    with parallel.alone("benchmarks"):
        return {**result, "benchmarks": run_benchmarks(builds, selection.runtime, run, cell, bench, describe()["emulated"], cache)}


@dataclass
class ChangeCoverage:
    """Changed-line coverage of one cell's patched build: the change's hunks, the coverage.py
    configs the patched test runs start with, and the data they leave."""

    hunks: list[Hunk]
    other: list[str]
    root: Path
    data: Path

    @classmethod
    def prepare(cls, cell: Cell, patch: PatchSet, build: PreparedBuild, run_root: Path) -> ChangeCoverage:
        hunks, other = changed_hunks(patch.diff_for(cell.deepspeed).read_text(errors="replace"))
        data = run_root / "coverage" / cell.id
        shutil.rmtree(data, ignore_errors=True)
        return cls(hunks, other, package_root(build.python), data)

    def env(self, context: str) -> dict[str, str]:
        """The environment variable that makes every process of a patched test run measure the change."""
        files = sorted({h.file for h in self.hunks})
        return {"COVERAGE_PROCESS_START": str(rcfile(self.data / f"{context}.coveragerc", self.data, self.root, files, context))}

    def measure(self, compared: Mapping[str, TestOutcome]) -> dict[str, Any]:
        """Changed lines and branches; branches count only in the test functions of ``compared``
        (the reference tests, whose patched behaviour was compared with stock's)."""
        functions = [_test_function(test) for test, outcome in compared.items() if outcome.reference == "stock"]
        return measure(self.data, self.root, self.hunks, self.other, functions)


def _test_function(test_id: str) -> str:
    """``module.function`` (coverage.py's test-function context) of ``path/module.py::function[params]@ws1``."""
    module, _, name = test_id.partition("::")
    function = re.split(r"[\[@]", name, maxsplit=1)[0]
    return f"{module.rsplit('/', 1)[-1].removesuffix('.py')}.{function}"


def _own_outcomes(junits: Sequence[Path]) -> dict[str, TestOutcome]:
    return read_junit(junits[0], full_ids=True)


def own_tests(
    cell: Cell,
    patch: PatchSet,
    builds: dict[str, PreparedBuild],
    cache: Cache,
    run: Run,
    change: ChangeCoverage,
    reuse: bool = True,
    name: str = OWN_TESTS,
) -> dict[str, Any]:
    """DeepSpeed's own tests of set ``name`` (from the patched source's ``tests/``) on both builds, compared."""
    selection = load_selection(name)
    with tempfile.TemporaryDirectory(dir=run.root, prefix=f".{cell.id}-tests-") as tmp:
        tree = unpack_sdist(source_archive(cell, cache, "patched"), Path(tmp) / "source")
        if not (cell.source and cell.source.pr):
            apply_diff(patch.diff_for(cell.deepspeed), tree, source_name(cell))
        tests_dir, selection, missing = copy_tests(tree, Path(tmp) / "copy", selection)
        if tests_dir is None:
            return {"skipped": f"the source has no {', '.join(selection.paths)}", "set": selection.name, "selection": str(selection.source)}
        ran: dict[str, TestRun] = {}
        reused_from = ""
        raw = run.root / "raw"
        for build, b in builds.items():
            progress.stage(f"{build} DeepSpeed tests", probe_of_tests(raw, f"{cell.id}-{build}-deepspeed", b.extensions))
            name = f"{cell.id}-{build}-deepspeed"
            if build == "stock":
                wheel = b.info.get("wheel_sha256", "")
                key = {"wheel": wheel, "tests": tree_digest(tests_dir), "paths": selection.paths, "suite": suite_digest()}

                def run_stock(b: PreparedBuild = b, name: str = name) -> TestRun:
                    return run_deepspeed_tests(b.python, b.extensions, tests_dir, selection, raw, name)

                entry = cache.stock_results(cell.stock_id, {"deepspeed_tests": key})
                ran[build], reused_from = cached_stock_run(entry, b, cache, raw, reuse, run_stock, _own_outcomes)
            else:
                with cache.using_extensions([b.extensions]):
                    ran[build] = run_deepspeed_tests(b.python, b.extensions, tests_dir, selection, raw, name, change.env("deepspeed"))
    comparison = compare(ran["stock"].outcomes, ran["patched"].outcomes)
    return {
        **comparison,
        **({"stock_reused_from": reused_from} if reused_from else {}),
        "set": selection.name,
        "paths": list(selection.paths),
        **({"missing_paths": missing} if missing else {}),
        "selection": str(selection.source),
        "builds": {
            build: {
                "junit": [str(p.relative_to(run.root)) for p in r.junits],
                "logs": [str(p.relative_to(run.root)) for p in r.logs],
                "tests_s": round(r.duration_s, 1),
                "tests": {t: outcome_dict(o) for t, o in sorted(r.outcomes.items())},
            }
            for build, r in ran.items()
        },
    }


def _children_cpu_s() -> float:
    """User + system CPU seconds of every child process reaped so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_cell(
    cell: Cell,
    selection: Selection,
    patch: PatchSet,
    cache: Cache,
    run: Run,
    fingerprint: str,
    bench: BenchOptions | None = None,
    reuse_stock: bool = True,
    own_tests_set: str = OWN_TESTS,
    together: bool = False,
) -> dict[str, Any]:
    """Build, install and test one cell; set-up and run failures become an ``error`` verdict.

    The stock build's test results are reused from the cache when nothing they depend on changed
    (``reuse_stock``; ``--fresh`` turns it off). ``together``: the two builds are prepared and
    tested at the same time. Benchmarks run alone (``parallel.GATE``)."""
    started = time.monotonic()
    cpu_before = _children_cpu_s()
    result = cell_result_skeleton(cell, fingerprint, ERROR, "did not finish")
    result.update(runtime={axis: list(v) for axis, v in selection.runtime.items()}, patch=patch.describe(), host=describe())
    result["concurrency"] = {"builds_side_by_side": together}
    setup_s = tests_s = 0.0
    try:
        with parallel.GATE.shared():
            builds = prepare_builds(cell, patch, cache, together)
            result["builds"] = {build: b.facts() for build, b in builds.items()}
            setup_s = time.monotonic() - started
            change = ChangeCoverage.prepare(cell, patch, builds["patched"], run.root)

            def engine_tests(build: str) -> tuple[TestRun, str]:
                b = builds[build]
                name = f"{cell.id}-{build}"
                progress.stage(f"{build} engine tests", probe_of_tests(run.root / "raw", name, b.extensions))
                if build == "stock":  # a cached result when nothing it depends on changed
                    return stock_tests(cell, b, selection.runtime, cache, run.root / "raw", reuse_stock)
                with cache.using_extensions([b.extensions]):
                    ran = run_engine_tests(
                        b.python, b.extensions, selection.runtime, run.root / "raw", name, env_extra=change.env("engine")
                    )
                return ran, ""

            tested = parallel.each(BUILDS, engine_tests, together, build_lane(cell))
            runs = {build: ran for build, (ran, _) in tested.items()}
            for build, (ran, reused_from) in tested.items():
                if reused_from:
                    result["builds"][build]["tests_reused_from"] = reused_from
                result["builds"][build].update(
                    junit=[str(path.relative_to(run.root)) for path in ran.junits],
                    logs=[str(path.relative_to(run.root)) for path in ran.logs],
                    tests_s=round(ran.duration_s, 1),
                    tests={t: outcome_dict(o) for t, o in sorted(ran.outcomes.items())},
                )
            verdict = cell_verdict(runs["stock"].outcomes, runs["patched"].outcomes)
            if cell.source and own_tests_set != "none":
                result["deepspeed_tests"] = own_tests(cell, patch, builds, cache, run, change, reuse_stock, own_tests_set)
                verdict = with_deepspeed_tests(verdict, result["deepspeed_tests"])
            result["change_coverage"] = change.measure(runs["patched"].outcomes)
            tests_s = time.monotonic() - started - setup_s
            result.update(verdict=verdict.verdict, reasons=[*verdict.reasons, summary_line(result["change_coverage"])])
        if bench is not None:
            with parallel.alone("benchmarks"):
                result["benchmarks"] = run_benchmarks(builds, selection.runtime, run, cell, bench, result["host"]["emulated"], cache)
            tests_s = time.monotonic() - started - setup_s - result["benchmarks"].get("duration_s", 0.0)
    except FatalError as exc:  # CellError, or e.g. an interpreter that vanished since the preflight
        result.update(verdict=ERROR, reasons=[str(exc)], error_kind=type(exc).__name__)
    except Exception as exc:  # noqa: BLE001 - one cell's crash must not lose the others
        result.update(verdict=ERROR, reasons=[f"internal error: {type(exc).__name__}: {exc}"], error_kind="internal")
    result["timings"] = {
        "setup_s": round(setup_s, 1),
        "tests_s": round(tests_s, 1),
        "total_s": round(time.monotonic() - started, 1),
        # CPU time of the processes this cell ran (both builds); another cell's too when --jobs > 1
        "children_cpu_s": round(_children_cpu_s() - cpu_before, 1),
        "emulated": result["host"]["emulated"],  # emulated timings never feed a throughput verdict
    }
    result["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return result
