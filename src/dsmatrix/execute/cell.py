"""One cell through the pipeline: preflight checks, wheels, environments, tests, verdict.

Everything a cell needs is checked before the run starts (interpreters, versions, patch
applicability), so bad input fails in one line before anything is written. A cell whose
set-up or run fails later becomes an ``error`` verdict with the reason; the run goes on.
"""

from __future__ import annotations

import resource
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsmatrix.build.patches import PatchSet, apply_diff
from dsmatrix.build.wheels import source_archive, source_name, unpack_sdist
from dsmatrix.execute.benchmarks import BenchOptions, run_benchmarks
from dsmatrix.execute.change_coverage import ChangeCoverage, summary_line
from dsmatrix.execute.deepspeed_tests import DEFAULT_SET, copy_tests, load_selection, run_deepspeed_tests
from dsmatrix.execute.engine_tests import probe_of_tests, run_engine_tests
from dsmatrix.execute.prepare import BUILDS, PreparedBuild, build_lane, prepare_builds
from dsmatrix.execute.reuse import cached_stock_run, stock_tests, suite_digest, tree_digest
from dsmatrix.infra import parallel, progress
from dsmatrix.infra.cache import Cache
from dsmatrix.infra.errors import FatalError
from dsmatrix.infra.hosts import describe
from dsmatrix.infra.results import Run, cell_result_skeleton
from dsmatrix.judge.deepspeed_tests import compare
from dsmatrix.judge.outcomes import TestOutcome, TestRun, outcome_dict, read_junit
from dsmatrix.judge.verdict import ERROR, cell_verdict, with_deepspeed_tests
from dsmatrix.plan.cells import Cell, Selection


def _deepspeed_outcomes(junits: Sequence[Path]) -> dict[str, TestOutcome]:
    return read_junit(junits[0], full_ids=True)


def deepspeed_tests_on_both(
    cell: Cell,
    patch: PatchSet,
    builds: dict[str, PreparedBuild],
    cache: Cache,
    run: Run,
    change: ChangeCoverage,
    reuse: bool = True,
    name: str = DEFAULT_SET,
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
                ran[build], reused_from = cached_stock_run(entry, b, cache, raw, reuse, run_stock, _deepspeed_outcomes)
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
    deepspeed_tests: str = DEFAULT_SET,
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
            change = ChangeCoverage.prepare(cell, patch, builds["patched"].python, run.root)

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
            if cell.source and deepspeed_tests != "none":
                result["deepspeed_tests"] = deepspeed_tests_on_both(cell, patch, builds, cache, run, change, reuse_stock, deepspeed_tests)
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
