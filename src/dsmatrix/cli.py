"""Command line: ``python -m dsmatrix matrix|report`` (what the nox sessions call).

``matrix`` checks all input first (matrix file, selection, interpreters, versions, patch
applicability) so bad input fails in one line before anything is written; then runs cell after
cell, recording each as soon as it is finished.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsmatrix import __version__
from dsmatrix.builds import build_wheel, fetch_sdist, unpack_sdist
from dsmatrix.cells import Cell, Selection, select_cells
from dsmatrix.environments import check_installable, ensure_environment, find_interpreter
from dsmatrix.errors import CellError, FatalError
from dsmatrix.matrix import CELL_AXES, RUNTIME_AXES, load_matrix
from dsmatrix.patches import PatchSet, apply_diff, load_patch_set
from dsmatrix.report import write_report
from dsmatrix.results import Run, start_run
from dsmatrix.run import outcome_dict, run_engine_tests
from dsmatrix.verdict import ERROR, cell_verdict, exit_code

REPO = Path(__file__).resolve().parents[2]
BUILDS = ("stock", "patched")
TEST_REQUIREMENTS = ("pytest", "packaging")


def default_cache() -> Path:
    return Path(os.environ.get("DSMATRIX_CACHE", Path.home() / ".cache" / "dsmatrix"))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dsmatrix", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    matrix = sub.add_parser("matrix", help="run the selected cells, stock vs patched")
    matrix.add_argument("--matrix", type=Path, default=REPO / "matrix" / "matrix.toml", help="matrix file")
    matrix.add_argument("--tier", default="default")
    for axis in CELL_AXES + RUNTIME_AXES:
        matrix.add_argument(f"--{axis}", action="append", metavar="VALUE", help=f"select {axis} value(s) (repeat or comma-separate)")
    matrix.add_argument("--patch", type=Path, default=REPO / "patches" / "zero3-release-cache", help="manifest folder or a single diff")
    matrix.add_argument("--results", type=Path, default=Path("results"))
    matrix.add_argument("--cache-dir", type=Path, default=default_cache())
    matrix.add_argument("--plan", action="store_true", help="print the selected cells and exit")
    report = sub.add_parser("report", help="render a results run as Markdown")
    report.add_argument("--results", type=Path, default=Path("results"))
    report.add_argument("--run", default="latest", help="run id (default: latest)")
    report.add_argument("--output", type=Path, default=Path("reports"))
    return parser.parse_args(argv)


def _wanted(args: argparse.Namespace) -> dict[str, list[str] | None]:
    wanted: dict[str, list[str] | None] = {}
    for axis in CELL_AXES + RUNTIME_AXES:
        raw = getattr(args, axis)
        wanted[axis] = [v.strip() for item in raw for v in item.split(",") if v.strip()] if raw else None
    return wanted


def preflight(selection: Selection, patch: PatchSet, cache: Path) -> None:
    """Check every input the run depends on; raises a one-line FatalError on the first problem."""
    for python in sorted({c.python for c in selection.cells}):
        find_interpreter(python)
    for python, torch in sorted({(c.python, c.torch) for c in selection.cells}):
        check_installable(f"torch=={torch}", python)
    for deepspeed in sorted({c.deepspeed for c in selection.cells}):
        diff = patch.diff_for(deepspeed)
        sdist = fetch_sdist(deepspeed, cache)
        with tempfile.TemporaryDirectory() as tmp:
            apply_diff(diff, unpack_sdist(sdist, Path(tmp)), deepspeed)


def run_cell(cell: Cell, selection: Selection, patch: PatchSet, cache: Path, run: Run) -> dict[str, Any]:
    """Build, install and test one cell; set-up and run failures become an ``error`` verdict."""
    started = time.monotonic()
    result: dict[str, Any] = {
        "schema": 1,
        "cell": {**cell.as_dict(), "label": cell.label},
        "runtime": {axis: list(v) for axis, v in selection.runtime.items()},
        "patch": patch.describe(),
        "builds": {},
        "timings": {},
    }
    setup_s = tests_s = 0.0
    try:
        envs = {}
        for build in BUILDS:
            wheel = build_wheel(cell, cache, patch if build == "patched" else None)
            key = f"patched-{patch.short}" if build == "patched" else "stock"
            envs[build] = ensure_environment(
                cache / "envs" / cell.id / key,
                find_interpreter(cell.python),
                [f"torch=={cell.torch}", str(wheel.wheel), *TEST_REQUIREMENTS],
                f"{cell.label} {build}",
            )
            result["builds"][build] = {"wheel": wheel.wheel.name, "build_info": wheel.info, "installed": envs[build].installed}
        setup_s = time.monotonic() - started
        runs = {}
        for build in BUILDS:
            key = result["builds"][build]["build_info"].get("wheel_sha256", build)[:12]
            runs[build] = run_engine_tests(
                envs[build].python,
                cache / "torch-extensions" / cell.id / key,
                selection.runtime,
                run.junit_path(cell.id, build),
                run.root / "logs" / f"{cell.id}-{build}.log",
            )
            result["builds"][build].update(
                junit=str(runs[build].junit.relative_to(run.root)),
                log=str(runs[build].log.relative_to(run.root)),
                tests_s=round(runs[build].duration_s, 1),
                tests={t: outcome_dict(o) for t, o in sorted(runs[build].outcomes.items())},
            )
        tests_s = time.monotonic() - started - setup_s
        verdict = cell_verdict(runs["stock"].outcomes, runs["patched"].outcomes)
        result.update(verdict=verdict.verdict, reasons=list(verdict.reasons))
    except CellError as exc:
        result.update(verdict=ERROR, reasons=[str(exc)])
    except FatalError as exc:  # e.g. an interpreter that vanished since the preflight
        result.update(verdict=ERROR, reasons=[str(exc)])
    except Exception as exc:  # noqa: BLE001 - one cell's crash must not lose the others
        result.update(verdict=ERROR, reasons=[f"internal error: {type(exc).__name__}: {exc}"])
    result["timings"] = {"setup_s": round(setup_s, 1), "tests_s": round(tests_s, 1), "total_s": round(time.monotonic() - started, 1)}
    result["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return result


def command_matrix(args: argparse.Namespace) -> int:
    args.results = args.results.resolve()
    matrix = load_matrix(args.matrix)
    selection = select_cells(matrix.tier(args.tier), _wanted(args))
    if args.plan:
        for cell in selection.cells:
            print(cell.label)
        print(f"{len(selection.cells)} cell(s); runtime axes: " + ", ".join(f"{a}={'/'.join(v)}" for a, v in selection.runtime.items()))
        return 0
    patch = load_patch_set(args.patch)
    preflight(selection, patch, args.cache_dir)
    run = start_run(
        args.results,
        {
            "tier": args.tier,
            "matrix": str(args.matrix),
            "patch": patch.describe(),
            "runtime": {a: list(v) for a, v in selection.runtime.items()},
        },
    )
    print(f"dsmatrix: run {run.id}: {len(selection.cells)} cell(s), patch {patch.source.name} ({patch.short}), results in {run.root}")
    verdicts: list[str] = []
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` ends the run like Ctrl-C: finished cells stay
    try:
        for cell in selection.cells:
            print(f"{cell.label}: running ...", flush=True)
            result = run_cell(cell, selection, patch, args.cache_dir, run)
            run.add_cell(result)
            verdicts.append(result["verdict"])
            t = result["timings"]
            print(f"{cell.label}: {result['verdict'].upper()}  (set-up {t['setup_s']} s, tests {t['tests_s']} s)")
            for reason in result["reasons"]:
                print(f"    {reason}")
    except KeyboardInterrupt:
        run.write_summary("interrupted")
        print(f"dsmatrix: interrupted; {len(verdicts)} finished cell(s) kept in {run.root}", file=sys.stderr)
        return 130
    run.write_summary("complete")
    print(f"dsmatrix: {sum(v == 'fixed' for v in verdicts)}/{len(verdicts)} cell(s) fixed; summary: {run.root / 'summary.json'}")
    return exit_code(verdicts)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def command_report(args: argparse.Namespace) -> int:
    path = write_report(args.results / args.run, args.output)
    print(path.read_text())
    print(f"dsmatrix: report written to {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return command_matrix(args) if args.command == "matrix" else command_report(args)
    except FatalError as exc:
        print(f"dsmatrix: error: {exc}", file=sys.stderr)
        return exc.exit_code
