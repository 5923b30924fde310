"""Command line: ``python -m dsmatrix matrix|report`` (what the nox sessions call).

``matrix`` checks all input first (matrix file, selection, interpreters, versions, patch
applicability) so bad input fails in one line before anything is written; then runs cell after
cell, recording each as soon as it is finished.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from dsmatrix import __version__
from dsmatrix.cells import Selection, plan_cells
from dsmatrix.errors import ConfigError, FatalError
from dsmatrix.matrix import CELL_AXES, RUNTIME_AXES, load_matrix
from dsmatrix.patches import load_patch_set
from dsmatrix.pipeline import cache_size, check_disk, engine_tests_digest, fingerprint, preflight, run_cell
from dsmatrix.report import write_report
from dsmatrix.results import find_finished, start_run
from dsmatrix.verdict import exit_code

REPO = Path(__file__).resolve().parents[2]


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
        flag = f"--{axis.replace('_', '-')}"
        matrix.add_argument(flag, dest=axis, action="append", metavar="VALUE", help=f"select {axis} value(s) (repeat or comma-separate)")
    matrix.add_argument("--patch", type=Path, default=REPO / "patches" / "zero3-release-cache", help="manifest folder or a single diff")
    matrix.add_argument("--results", type=Path, default=Path("results"))
    matrix.add_argument("--cache-dir", type=Path, default=default_cache())
    matrix.add_argument("--plan", action="store_true", help="print the selected cells (and excluded ones) and exit")
    matrix.add_argument("--json", action="store_true", help="with --plan: print the cells as JSON (for CI job matrices)")
    matrix.add_argument("--fresh", action="store_true", help="re-run cells that already have a result for the same fingerprint")
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


def print_plan(selection: Selection, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"cells": [{**c.as_dict(), "label": c.label} for c in selection.cells]}))
        return
    for cell in selection.cells:
        print(cell.label)
    for excluded in selection.excluded:
        print(f"{excluded.cell.label}: excluded by {excluded.rule.id}: {excluded.rule.reason}")
    runtime = ", ".join(f"{a}={'/'.join(v)}" for a, v in selection.runtime.items())
    print(f"{len(selection.cells)} cell(s), {len(selection.excluded)} excluded; runtime axes: {runtime}")


def command_matrix(args: argparse.Namespace) -> int:
    args.results = args.results.resolve()
    matrix = load_matrix(args.matrix)
    selection = plan_cells(matrix, matrix.tier(args.tier), _wanted(args))
    if args.plan:
        print_plan(selection, args.json)
        return 0
    if not selection.cells:
        rules = ", ".join(sorted({e.rule.id for e in selection.excluded}))
        raise ConfigError(f"tier {args.tier}: the selection leaves no cell to run ({len(selection.excluded)} excluded by {rules})")
    patch = load_patch_set(args.patch)
    runtime = {a: list(v) for a, v in selection.runtime.items()}
    suite = engine_tests_digest()
    prints = {cell: fingerprint(cell, runtime, patch, suite) for cell in selection.cells}
    reusable = {} if args.fresh else {c: r for c in selection.cells if (r := find_finished(args.results, prints[c])) is not None}
    todo = [c for c in selection.cells if c not in reusable]
    pending = Selection(tuple(todo), selection.runtime)
    preflight(pending, patch, args.cache_dir)
    need = check_disk(pending, args.cache_dir)
    excluded = [
        {"cell": {**e.cell.as_dict(), "label": e.cell.label}, "rule": e.rule.id, "reason": e.rule.reason} for e in selection.excluded
    ]
    run = start_run(
        args.results,
        {"tier": args.tier, "matrix": str(args.matrix), "patch": patch.describe(), "runtime": runtime, "excluded": excluded},
    )
    print(
        f"dsmatrix: run {run.id}: {len(selection.cells)} cell(s) ({len(reusable)} already done), {len(excluded)} excluded; "
        f"patch {patch.source.name} ({patch.short}); uv cache {cache_size()}, this run may add ~{need:.1f} GiB; results in {run.root}"
    )
    verdicts: list[str] = []
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` ends the run like Ctrl-C: finished cells stay
    try:
        for cell in selection.cells:
            if cell in reusable:
                result = {**reusable[cell], "reused_from": reusable[cell].get("reused_from") or reusable[cell]["run_id"]}
                print(f"{cell.label}: {result['verdict'].upper()}  (result of run {result['reused_from']}; --fresh re-runs it)")
            else:
                print(f"{cell.label}: running ...", flush=True)
                result = run_cell(cell, selection, patch, args.cache_dir, run, prints[cell])
                t = result["timings"]
                print(f"{cell.label}: {result['verdict'].upper()}  (set-up {t['setup_s']} s, tests {t['tests_s']} s)")
                for reason in result["reasons"]:
                    print(f"    {reason}")
            run.add_cell(result)
            verdicts.append(result["verdict"])
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
