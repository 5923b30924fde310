"""Command line: ``python -m dsmatrix matrix|images|report`` (what the nox sessions call).

``matrix`` checks all input first (matrix file, selection, interpreters, versions, patch
applicability, and for cells on another platform the docker engine, emulation and image) so bad
input fails in one line before anything is written; then runs cell after cell, recording each as
soon as it is finished. Cells of this machine's platform run here; the others (or all, with
``--in-image``) run inside their platform's image, which runs this same command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsmatrix import __version__
from dsmatrix.bench import DEFAULT_MARGIN, DEFAULT_MAX_ROUNDS, DEFAULT_MINUTES, REGRESSION, BenchOptions
from dsmatrix.cells import Cell, Selection, plan_cells
from dsmatrix.errors import ConfigError, FatalError
from dsmatrix.hosts import native_platform
from dsmatrix.images import (
    IMAGES,
    build_image,
    docker_engine,
    ensure_emulation,
    image_for,
    inside_view,
    run_in_image,
)
from dsmatrix.instructions import DEFAULT_MARGIN as DEFAULT_INSTRUCTIONS_MARGIN
from dsmatrix.locations import default_matrix, default_patch, image_source_tree, project_root
from dsmatrix.matrix import CELL_AXES, RUNTIME_AXES, load_matrix
from dsmatrix.patches import PatchSet, load_patch_set
from dsmatrix.pipeline import add_benchmarks, cache_size, check_disk, check_patch, engine_tests_digest, fingerprint, preflight, run_cell
from dsmatrix.report import load_report, passes, write_report
from dsmatrix.results import Run, find_finished, import_cells, start_run
from dsmatrix.verdict import ERROR, exit_code


def default_cache() -> Path:
    return Path(os.environ.get("DSMATRIX_CACHE", Path.home() / ".cache" / "dsmatrix"))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dsmatrix", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    matrix = sub.add_parser("matrix", help="run the selected cells, stock vs patched")
    matrix.add_argument("--root", type=Path, help="project root: its matrix/matrix.toml and patches/ (default: found from here upwards)")
    matrix.add_argument("--matrix", type=Path, help="matrix file (default: the project's, else the bundled one)")
    matrix.add_argument("--tier", default="default")
    for axis in ("platform",) + CELL_AXES + RUNTIME_AXES:
        flag = f"--{axis.replace('_', '-')}"
        matrix.add_argument(flag, dest=axis, action="append", metavar="VALUE", help=f"select {axis} value(s) (repeat or comma-separate)")
    matrix.add_argument("--patch", type=Path, help="manifest folder or a single diff (default: the project's fix, else the bundled one)")
    matrix.add_argument("--results", type=Path, default=Path("results"))
    matrix.add_argument("--cache-dir", type=Path, default=default_cache())
    matrix.add_argument("--plan", action="store_true", help="print the selected cells (and excluded ones) and exit")
    matrix.add_argument("--json", action="store_true", help="with --plan: the cells as a GitHub Actions job matrix ({include: [...]})")
    matrix.add_argument("--fresh", action="store_true", help="re-run cells that already have a result for the same fingerprint")
    matrix.add_argument("--in-image", action="store_true", help="run this platform's cells in its image as well")
    matrix.add_argument("--base-image", help="base image for building missing images (default: debootstrap one here)")
    matrix.add_argument("--cell", "--only", dest="only", action="append", metavar="CELL_ID", help="run only these cell ids (a CI job)")
    matrix.add_argument(
        "--bench",
        action=argparse.BooleanOptionalAction,
        help="instruction-count, step-time and leak benchmarks per cell (default: on, off in tiers default and smoke); "
        "finished cells only get benchmarked",
    )
    matrix.add_argument(
        "--max-rounds",
        type=int,
        default=DEFAULT_MAX_ROUNDS,
        help="cap on step-time rounds (stock, patched, stock again); stop once decided",
    )
    matrix.add_argument("--bench-minutes", type=float, default=DEFAULT_MINUTES, help="time budget of one cell's step-time rounds")
    matrix.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="step-time regression margin (0.02 = 2%%)")
    matrix.add_argument(
        "--instructions-margin",
        type=float,
        default=DEFAULT_INSTRUCTIONS_MARGIN,
        help="executed-instructions regression margin (0.005: 0.5%%)",
    )
    matrix.add_argument("--leak-lifecycles", type=int, default=20, help="engine lifecycles in the leak benchmark")
    images = sub.add_parser("images", help="build the container images (containers/*/Dockerfile)")
    images.add_argument("--platform", action="append", metavar="PLATFORM", help=f"one of {', '.join(IMAGES)} (default: both)")
    images.add_argument("--base-image", help="an official Debian image where a registry is reachable (default: debootstrap one here)")
    images.add_argument("--cache-dir", type=Path, default=default_cache())
    report = sub.add_parser("report", help="merge results stores into the release-qualification report (Markdown, HTML, JSON)")
    report.add_argument(
        "stores", nargs="*", type=Path, default=[Path("results")], help="results stores (their latest run) or run folders; default: results"
    )
    report.add_argument("--output", type=Path, default=Path("reports"))
    report.add_argument(
        "--require",
        choices=("qualified", "correct"),
        help="exit 1 unless the headline is QUALIFIED (qualified) or at least CORRECT, THROUGHPUT NOT SHOWN (correct)",
    )
    return parser.parse_args(argv)


def _split(raw: list[str] | None) -> list[str] | None:
    return [v.strip() for item in raw for v in item.split(",") if v.strip()] if raw else None


def _wanted(args: argparse.Namespace) -> dict[str, list[str] | None]:
    return {axis: _split(getattr(args, axis)) for axis in CELL_AXES + RUNTIME_AXES}


def _selection_argv(args: argparse.Namespace) -> list[str]:
    """The matrix arguments a host hands on to its image (everything but where inputs, results and caches go)."""
    argv = ["--tier", args.tier]
    bench = _bench_options(args)
    if bench:
        argv += ["--bench", f"--max-rounds={bench.max_rounds}", f"--bench-minutes={bench.minutes}", f"--margin={bench.margin}"]
        argv += [f"--instructions-margin={bench.instructions_margin}", f"--leak-lifecycles={bench.lifecycles}"]
    else:
        argv += ["--no-bench"]
    for axis in RUNTIME_AXES:
        for value in _wanted(args)[axis] or ():
            argv += [f"--{axis.replace('_', '-')}", value]
    return argv


# The GitHub-hosted runner of each platform: native, no emulation (the rpi5 image runs on a
# self-hosted Raspberry Pi 5, see README).
GITHUB_RUNNERS = {"linux/amd64": "ubuntu-24.04", "linux/arm64": "ubuntu-24.04-arm"}


def print_plan(selection: Selection, as_json: bool) -> None:
    if as_json:
        include = [{**c.as_dict(), "label": c.label, "runner": GITHUB_RUNNERS[c.platform]} for c in selection.cells]
        excluded = [{"id": e.cell.id, "rule": e.rule.id} for e in selection.excluded]
        print(json.dumps({"include": include, "excluded": excluded}))
        return
    for cell in selection.cells:
        print(cell.label)
    for excluded in selection.excluded:
        print(f"{excluded.cell.label}: excluded by {excluded.rule.id}: {excluded.rule.reason}")
    runtime = ", ".join(f"{a}={'/'.join(v)}" for a, v in selection.runtime.items())
    print(f"{len(selection.cells)} cell(s), {len(selection.excluded)} excluded; runtime axes: {runtime}")


# Tiers that check correctness only unless --bench is given; every other tier benchmarks by default.
QUICK_TIERS = ("default", "smoke")


def _bench_options(args: argparse.Namespace) -> BenchOptions | None:
    """Benchmarks run when asked for, and by default in every tier but the quick ones."""
    wanted = args.bench if args.bench is not None else args.tier not in QUICK_TIERS
    if args.max_rounds < 3:
        raise ConfigError(f"--max-rounds {args.max_rounds}: the sequential rule needs at least 3 rounds")
    positive = {"--bench-minutes": args.bench_minutes, "--margin": args.margin, "--instructions-margin": args.instructions_margin}
    for flag, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{flag} {value}: must be positive")
    if not wanted:
        return None
    return BenchOptions(args.max_rounds, args.bench_minutes, args.margin, args.instructions_margin, args.leak_lifecycles)


def _host_of(cell: Cell, args: argparse.Namespace) -> str:
    """Where a cell runs: ``local``, or ``image:<name>`` for its platform's container image."""
    if cell.platform == native_platform() and not args.in_image:
        return "local"
    return f"image:{image_for(cell.platform).name}"


def command_matrix(args: argparse.Namespace) -> int:
    args.results = args.results.resolve()
    args.root = project_root(args.root)
    args.matrix = (args.matrix or default_matrix(args.root)).resolve()
    args.patch = (args.patch or default_patch(args.root)).resolve()
    matrix = load_matrix(args.matrix)
    platforms = _split(args.platform) or [native_platform()]
    selection = plan_cells(matrix, matrix.tier(args.tier), _wanted(args), platforms)
    if args.only:
        selection = Selection(tuple(c for c in selection.cells if c.id in args.only), selection.runtime, selection.excluded)
    if args.plan:
        print_plan(selection, args.json)
        return 0
    if not selection.cells:
        rules = ", ".join(sorted({e.rule.id for e in selection.excluded}))
        raise ConfigError(f"tier {args.tier}: the selection leaves no cell to run ({len(selection.excluded)} excluded by {rules})")
    patch = load_patch_set(args.patch)
    _bench_options(args)  # bad benchmark options fail here, before anything runs
    runtime = {a: list(v) for a, v in selection.runtime.items()}
    suite = engine_tests_digest()
    hosts = {cell: _host_of(cell, args) for cell in selection.cells}
    prints = {cell: fingerprint(cell, runtime, patch, suite, hosts[cell]) for cell in selection.cells}
    reusable = {} if args.fresh else {c: r for c in selection.cells if (r := find_finished(args.results, prints[c])) is not None}
    todo = [c for c in selection.cells if c not in reusable]
    local = Selection(tuple(c for c in todo if hosts[c] == "local"), selection.runtime)
    in_images = sorted({c.platform for c in todo if hosts[c] != "local"})
    preflight(local, patch, args.cache_dir)
    check_patch({c.deepspeed for c in todo}, patch, args.cache_dir)  # also for cells that run in an image
    need = check_disk(local, args.cache_dir)
    for platform in in_images:
        cells = tuple(c for c in todo if c.platform == platform and hosts[c] != "local")
        need += check_disk(Selection(cells, selection.runtime), args.cache_dir / "images" / image_for(platform).name / "dsmatrix")
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(_images_ready(in_images, args)) if in_images else None
        return _run_matrix(args, selection, patch, runtime, hosts, prints, reusable, need, client)


@contextlib.contextmanager
def _images_ready(platforms: list[str], args: argparse.Namespace) -> Any:
    """A docker client with an up-to-date image for every platform in ``platforms``."""
    with docker_engine(args.cache_dir / "docker") as client:
        for platform in platforms:
            ensure_emulation(platform)
            # always built: docker's layer cache makes an unchanged image seconds, a changed Dockerfile is never stale
            build_image(client, image_for(platform), args.base_image, args.cache_dir / "images")
        yield client


def _run_matrix(
    args: argparse.Namespace,
    selection: Selection,
    patch: PatchSet,
    runtime: dict[str, list[str]],
    hosts: dict[Cell, str],
    prints: dict[Cell, str],
    reusable: dict[Cell, dict[str, Any]],
    need: float,
    client: Any,
) -> int:
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
    bench = _bench_options(args)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` ends the run like Ctrl-C: finished cells stay
    try:
        for cell in selection.cells:
            if cell in reusable:
                result = {**reusable[cell], "reused_from": reusable[cell].get("reused_from") or reusable[cell]["run_id"]}
                print(f"{cell.label}: {result['verdict'].upper()}  (result of run {result['reused_from']}; --fresh re-runs it)")
                if bench and hosts[cell] == "local":  # measured anew: a benchmark is of its moment
                    print(f"{cell.label}: benchmarks ...", flush=True)
                    result = add_benchmarks(result, cell, selection, patch, args.cache_dir, run, bench)
                    _print_benchmarks(result)
            elif hosts[cell] == "local":
                print(f"{cell.label}: running ...", flush=True)
                result = run_cell(cell, selection, patch, args.cache_dir, run, prints[cell], bench, reuse_stock=not args.fresh)
                _print_result(cell, result)
            else:
                continue  # runs with the other cells of its image, below
            run.add_cell(result)
            verdicts.append(result["verdict"])
        for platform in sorted({c.platform for c in selection.cells if hosts[c] != "local" and c not in reusable}):
            cells = [c for c in selection.cells if c.platform == platform and hosts[c] != "local" and c not in reusable]
            verdicts += _run_image_cells(args, client, platform, cells, prints, run)
    except KeyboardInterrupt:
        run.write_summary("interrupted")
        print(f"dsmatrix: interrupted; {len(verdicts)} finished cell(s) kept in {run.root}", file=sys.stderr)
        return 130
    run.write_summary("complete")
    throughput = [(c.get("benchmarks") or {}).get("verdict") for c in run.cells]
    counted = {v: throughput.count(v) for v in dict.fromkeys(t for t in throughput if t)}
    measured = "; throughput: " + ", ".join(f"{n} {v}" for v, n in counted.items()) if counted else ""
    print(f"dsmatrix: {sum(v == 'fixed' for v in verdicts)}/{len(verdicts)} cell(s) fixed{measured}; summary: {run.root / 'summary.json'}")
    return exit_code(verdicts) or (1 if REGRESSION in counted else 0)


def _print_result(cell: Cell, result: dict[str, Any]) -> None:
    t = result["timings"]
    emulated = ", emulated" if t.get("emulated") else ""
    timing = f"  (set-up {t['setup_s']} s, tests {t['tests_s']} s{emulated})" if t else ""
    print(f"{cell.label}: {result['verdict'].upper()}{timing}")
    for reason in result["reasons"]:
        print(f"    {reason}")
    _print_benchmarks(result)


def _print_benchmarks(result: dict[str, Any]) -> None:
    bench = result.get("benchmarks")
    if not bench:
        return
    decided_by = f" (decided by {bench['decided_by']})" if bench.get("decided_by") else ""
    print(f"    throughput: {bench['verdict']}{decided_by}" + (f" ({bench['reason']})" if bench.get("reason") else ""))
    counts = bench.get("instructions") or {}
    if counts.get("comparisons"):
        print(f"    instructions: {counts['verdict']}, A/A calibration {counts['calibration']} ({counts['duration_s']:.0f} s)")
        for c in counts["comparisons"]:
            judged = c["verdict"] if c["kind"] == "step" else "reported, not judged"
            print(f"      patched/stock {c['benchmark']}: {c['ratio']:.5f} (A/A {c['aa']:.5f}) {judged}")
    elif counts:
        print(f"    instructions: {counts['verdict']} ({counts.get('reason', '')})")
    if "rounds" in bench:
        minutes = bench.get("rounds_duration_s", 0) / 60
        time_verdict = bench.get("time_verdict", bench["verdict"])
        print(f"    step time: {time_verdict}, {bench['rounds']} round(s) in {minutes:.1f} min, stopped: {bench.get('stopped', '')}")
    for label, key in (("patched/stock", "comparisons"), ("A/A stock/stock", "calibration")):
        for c in bench.get(key, []):
            print(f"      {label} {c['benchmark']}: {c['ratio']:.3f} [{c['low']:.3f}, {c['high']:.3f}] {c['verdict']}")
    for line in bench.get("leak", []):
        print(f"      leak {line['line']}: {line['growth_mb']:+.0f} MB over {len(line['series'])} lifecycles")


def _run_image_cells(
    args: argparse.Namespace, client: Any, platform: str, cells: list[Cell], prints: dict[Cell, str], run: Run
) -> list[str]:
    """Run ``cells`` inside ``platform``'s image and import each finished one into ``run``.

    A cell that does not come back (the container failed or was stopped) becomes an ``error``
    cell naming the image and its last line; an interrupt keeps every cell that finished.
    """
    spec = image_for(platform)
    image = client.images.get(spec.tag)
    staging = args.cache_dir / "images" / spec.name / f"results-{run.id}"
    argv = [*_selection_argv(args), "--platform", platform, "--fresh"] + [f"--only={c.id}" for c in cells]
    print(f"dsmatrix: {len(cells)} cell(s) in {spec.tag} ({platform}) ...", flush=True)
    started = time.monotonic()
    by_id = {c.id: c for c in cells}
    facts = {"image": {"tag": spec.tag, "id": image.id, "platform": platform}}
    code, last = 130, "interrupted"
    verdicts: list[str] = []

    def finish(result: dict[str, Any]) -> dict[str, Any]:
        cell = by_id.pop(result["cell"]["id"])
        _print_result(cell, result)
        verdicts.append(result["verdict"])  # below: the fingerprint as this host computes it, for reuse
        return {**result, **facts, "fingerprint": prints[cell], "container_wall_s": round(time.monotonic() - started, 1)}

    try:
        source = image_source_tree(args.root)
        code, last = run_in_image(client, spec, argv, staging, args.cache_dir, source, args.matrix, args.patch)
    finally:
        import_cells(staging, run, finish, seen_as=Path("/results"))
        shutil.rmtree(staging, ignore_errors=True)
    for cell in by_id.values():  # never came back
        reason = f"{spec.tag}: `nox -s matrix` inside exited {code} before this cell finished: {last}"
        result = {"schema": 1, "fingerprint": prints[cell], "cell": {**cell.as_dict(), "label": cell.label}, **facts}
        result.update(verdict=ERROR, reasons=[reason], error_kind="HostError", builds={}, timings={})
        result["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        run.add_cell(result)
        _print_result(cell, result)
        verdicts.append(ERROR)
    return verdicts


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def command_report(args: argparse.Namespace) -> int:
    target = write_report(args.stores, args.output)
    print((target / "qualification.md").read_text())
    report = load_report(target)
    print(f"dsmatrix: {report['verdict']}: {report['verdict_summary']}; {target}/qualification.{{md,html,json}}")
    if args.require and not passes(report["verdict"], args.require):
        print(f"dsmatrix: --require {args.require}: the headline is {report['verdict']}", file=sys.stderr)
        return 1
    return 0


def command_images(args: argparse.Namespace) -> int:
    platforms = _split(args.platform) or list(IMAGES)
    specs = [image_for(p) for p in platforms]
    with docker_engine(args.cache_dir / "docker") as client:
        built = []
        for spec in specs:
            ensure_emulation(spec.platform)
            facts = build_image(client, spec, args.base_image, args.cache_dir / "images")
            built.append((facts, inside_view(client, spec)))
    for facts, inside in built:
        print(f"{facts['tag']}: {facts['platform']} {facts['id'][:19]} (FROM {facts['base']})")
        emulated = f"emulated ({inside['emulator']})" if inside["emulated"] else "native"
        bf16 = "BF16" if inside["bf16"] else "no BF16"
        os_image = f"Python {inside['python']}, {inside['os_image']}"
        print(f"    inside: {inside['machine']}, {inside['cpu_model']}, {bf16}, {emulated}; {os_image}")
        print(f"    CPU features: {' '.join(inside['cpu_features'][:40])}")
    return 0


COMMANDS = {"matrix": command_matrix, "images": command_images, "report": command_report}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return COMMANDS[args.command](args)
    except FatalError as exc:
        print(f"dsmatrix: error: {exc}", file=sys.stderr)
        return exc.exit_code
