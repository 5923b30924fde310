"""Command line: ``python -m dsmatrix matrix|images|report`` (what the nox sessions call).

``matrix`` checks all input first (matrix file, selection, interpreters, versions, patch
applicability, and for cells on another platform the docker engine, emulation and image) so bad
input fails in one line before anything is written; then runs cell after cell, recording each as
soon as it is finished. Cells of this machine's platform run here; the others (or all, with
``--in-image``) run inside their platform's image, which runs this same command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsmatrix import __version__
from dsmatrix.build.images import IMAGES, build_images, image_for
from dsmatrix.build.patches import PatchSet, load_patch_set, pr_change
from dsmatrix.build.sources import changed_diff, resolve
from dsmatrix.execute.benchmarks import BenchOptions
from dsmatrix.execute.deepspeed_tests import load_selection
from dsmatrix.execute.in_image import inside_view
from dsmatrix.execute.schedule import MatrixOptions, interrupts_raise, plan_run, run_matrix
from dsmatrix.execute.step_time import DEFAULT_MAX_ROUNDS, DEFAULT_MINUTES
from dsmatrix.infra import progress
from dsmatrix.infra.cache import Cache, default_root
from dsmatrix.infra.docker_engine import docker_engine
from dsmatrix.infra.errors import ConfigError, FatalError, InterpreterNotFound, UnknownVersionError
from dsmatrix.infra.hosts import native_platform
from dsmatrix.infra.locations import default_matrix, default_patch, project_root
from dsmatrix.infra.parallel import SIDE_BY_SIDE
from dsmatrix.judge.headline import passes
from dsmatrix.judge.instructions import DEFAULT_MARGIN as DEFAULT_INSTRUCTIONS_MARGIN
from dsmatrix.judge.step_time import DEFAULT_MARGIN
from dsmatrix.judge.throughput import STEP, UNMEASURED
from dsmatrix.judge.verdict import FIXED, INTERRUPTED_EXIT
from dsmatrix.plan.cells import Cell, Selection, plan_cells
from dsmatrix.plan.disk import LOW_DISK
from dsmatrix.plan.git_source import GitSource, check_ref, is_git, split_spec
from dsmatrix.plan.matrix import CELL_AXES, RUNTIME_AXES, Matrix, load_matrix
from dsmatrix.report.qualification import load_report, write_report
from dsmatrix.report.render import render_markdown
from dsmatrix.report.stores import TierPlan


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
    matrix.add_argument("--base", metavar="REF", help="PR mode, with --deepspeed git:REPO: stock from this ref (default: its @REF)")
    matrix.add_argument("--head", metavar="REF", help="PR mode: patched is built from this ref of the same repository, no diff applied")
    matrix.add_argument(
        "--deepspeed-tests",
        default="core",
        metavar="SET",
        help="git sources: the set of DeepSpeed's own tests run on both builds (core, quick, full, or none)",
    )
    matrix.add_argument("--results", type=Path, default=Path("results"))
    matrix.add_argument("--cache-dir", type=Path, default=default_root())
    matrix.add_argument("--plan", action="store_true", help="print the selected cells (and excluded ones) and exit")
    matrix.add_argument("--json", action="store_true", help="with --plan: the cells as a GitHub Actions job matrix ({include: [...]})")
    matrix.add_argument("--fresh", action="store_true", help="reuse nothing: re-run every cell, stock tests included")
    matrix.add_argument(
        "--rerun-failed", action="store_true", help="reuse only `fixed` results (by default `fixed` and `not-fixed` are final and reused)"
    )
    matrix.add_argument("--in-image", action="store_true", help="run this platform's cells in its image as well")
    matrix.add_argument("--base-image", help="base image for building missing images (default: debootstrap one here)")
    matrix.add_argument(
        "--jobs",
        "-j",
        default="auto",
        metavar="N",
        help="cells run at once here (default auto: a cell per core, memory allowing)",
    )
    matrix.add_argument(
        "--side-by-side",
        choices=SIDE_BY_SIDE,
        default="auto",
        help="a cell's stock and patched builds at the same time (auto: when each gets a core and the memory of its ranks)",
    )
    matrix.add_argument(
        "--low-disk",
        choices=LOW_DISK,
        default="auto",
        help="one new torch set at a time, its uv cache and environments removed after its last cell "
        "(auto: when the run's estimate exceeds the free disk)",
    )
    matrix.add_argument("--cell", "--only", dest="only", action="append", metavar="CELL_ID", help="run only these cell ids (a CI job)")
    matrix.add_argument(
        "--bench",
        action=argparse.BooleanOptionalAction,
        help="instruction-count, step-time and leak benchmarks per cell; finished cells only get benchmarked "
        "(default: the tier's `benchmarks` in matrix.toml: on in every tier but smoke)",
    )
    matrix.add_argument(
        "--max-rounds",
        type=int,
        default=DEFAULT_MAX_ROUNDS,
        help="cap on step-time rounds (stock, patched, stock again); stop once decided",
    )
    matrix.add_argument(
        "--bench-minutes",
        type=float,
        default=DEFAULT_MINUTES,
        help="time budget of the step-time rounds per dtype x checkpointing combination",
    )
    matrix.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="step-time regression margin (0.035 = 3.5%%)")
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
    images.add_argument("--cache-dir", type=Path, default=default_root())
    report = sub.add_parser("report", help="merge results stores into the release-qualification report (Markdown, HTML, JSON)")
    report.add_argument(
        "stores", nargs="*", type=Path, default=[Path("results")], help="results stores (their latest run) or run folders; default: results"
    )
    report.add_argument("--output", type=Path, default=Path("reports"))
    report.add_argument(
        "--tier",
        help="judge coverage by this tier's plan: every cell it plans must have finished in one of the stores (a tier run in parts)",
    )
    report.add_argument("--root", type=Path, help="with --tier: project root whose matrix/matrix.toml plans it")
    report.add_argument("--matrix", type=Path, help="with --tier: the matrix file (default: the project's, else the bundled one)")
    report.add_argument("--platform", action="append", metavar="PLATFORM", help="with --tier: platforms it is planned on (default: here)")
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


def _git_sources(args: argparse.Namespace, cache: Cache) -> dict[str, list[str | GitSource] | None]:
    """The axis selections with every ``git:`` DeepSpeed value resolved to its commit (PR mode:
    ``--base``/``--head`` on the one git value)."""
    wanted: dict[str, list[str | GitSource] | None] = dict(_wanted(args))  # type: ignore[arg-type]
    values = wanted.get("deepspeed") or []
    gits = [v for v in values if isinstance(v, str) and is_git(v)]
    for option, ref in (("--base", args.base), ("--head", args.head)):
        if ref is not None:
            check_ref(ref, option)
    if (args.base or args.head) and not args.head:
        raise ConfigError("--base needs --head (PR mode: stock from the base ref, patched from the head ref)")
    if args.head and (len(gits) != 1 or len(values) != 1):
        raise ConfigError("--head needs exactly one --deepspeed value, the repository: --deepspeed git:REPO --base REF --head REF")
    if args.head:
        _, own_ref = split_spec(gits[0], "--deepspeed")
        if args.base and own_ref:
            raise ConfigError(f"--deepspeed {gits[0]} --base {args.base}: give the base ref once")
        base = resolve(gits[0], cache, "--base", args.base or own_ref or None)
        head = resolve(gits[0], cache, "--head", args.head)
        if head.commit == base.commit:
            raise ConfigError(f"--base {base.ref} and --head {head.ref} are the same commit ({base.short}): nothing to qualify")
        wanted["deepspeed"] = [GitSource(base, head)]
        return wanted
    if gits:
        wanted["deepspeed"] = [GitSource(resolve(v, cache, "--deepspeed")) if isinstance(v, str) and is_git(v) else v for v in values]
    return wanted


def _patch(args: argparse.Namespace, root: Path | None, selection: Selection, cache: Cache) -> PatchSet | None:
    """The candidate fix: ``--patch`` or the project's; in PR mode the change between base and head."""
    if args.plan:
        return None
    pr = {c.source for c in selection.cells if c.source and c.source.pr}
    if pr:
        if args.patch:
            raise ConfigError(f"--patch {args.patch} with --head: PR mode applies no diff (the head commit carries the change)")
        (source,) = pr
        assert source.head is not None
        return pr_change(changed_diff(source, cache), source.base.commit, source.head.commit, cache.git_changes())
    return load_patch_set((args.patch or default_patch(root)).resolve())


def _selection_argv(args: argparse.Namespace, bench: BenchOptions | None) -> list[str]:
    """The matrix arguments a host hands on to its image (everything but where inputs, results and caches go)."""
    argv = ["--tier", args.tier]
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


def _bench_options(args: argparse.Namespace, tier_benchmarks: bool = True) -> BenchOptions | None:
    """Benchmarks run when asked for, and by default in tiers whose ``benchmarks`` is not false."""
    wanted = args.bench if args.bench is not None else tier_benchmarks
    if args.max_rounds < 3:
        raise ConfigError(f"--max-rounds {args.max_rounds}: the sequential rule needs at least 3 rounds")
    positive = {"--bench-minutes": args.bench_minutes, "--margin": args.margin, "--instructions-margin": args.instructions_margin}
    for flag, value in positive.items():
        if not value > 0:
            raise ConfigError(f"{flag} {value}: must be positive")
    if not wanted:
        return None
    return BenchOptions(args.max_rounds, args.bench_minutes, args.margin, args.instructions_margin, args.leak_lifecycles)


def _resume(args: argparse.Namespace) -> str:
    if args.fresh and args.rerun_failed:
        raise ConfigError("--fresh and --rerun-failed: choose one (--fresh re-runs every cell)")
    return "none" if args.fresh else "fixed-only" if args.rerun_failed else "finished"


def _select(matrix: Matrix, args: argparse.Namespace, cache: Cache) -> Selection:
    """The tier's cells on the chosen platforms, narrowed by the axis options and ``--cell``."""
    platforms = _split(args.platform) or [native_platform()]
    selection = plan_cells(matrix, matrix.tier(args.tier), _git_sources(args, cache), platforms)
    git_elsewhere = [c for c in selection.cells if c.source and (c.platform != native_platform() or args.in_image)]
    if git_elsewhere:
        raise ConfigError(f"{git_elsewhere[0].label}: git sources run on this machine's platform ({native_platform()}), not in an image")
    if args.only:
        known = {c.id for c in selection.cells} | {e.cell.id for e in selection.excluded}
        unknown = [c for c in _split(args.only) or [] if c not in known]
        if unknown:
            listed = ", ".join(c.id for c in selection.cells) or "none"
            raise ConfigError(f"--cell {unknown[0]}: not a cell of tier {args.tier} on {', '.join(platforms)} (its cells: {listed})")
        wanted = set(_split(args.only) or [])
        kept = tuple(c for c in selection.cells if c.id in wanted)
        selection = Selection(kept, selection.runtime, tuple(e for e in selection.excluded if e.cell.id in wanted))
    return selection


def matrix_options(args: argparse.Namespace) -> MatrixOptions:
    """Every option of ``dsmatrix matrix`` resolved and checked once."""
    root = project_root(args.root)
    matrix_file = (args.matrix or default_matrix(root)).resolve()
    matrix = load_matrix(matrix_file)
    cache = Cache(args.cache_dir.resolve())
    selection = _select(matrix, args, cache)
    bench = _bench_options(args, matrix.tier(args.tier).benchmarks)
    if args.deepspeed_tests != "none":
        load_selection(args.deepspeed_tests)  # an unknown set fails here, in one line
    return MatrixOptions(
        tier=args.tier,
        matrix=matrix_file,
        patch=_patch(args, root, selection, cache),
        results=args.results.resolve(),
        cache=cache,
        selection=selection,
        root=root,
        resume=_resume(args),
        in_image=args.in_image,
        base_image=args.base_image,
        bench=bench,
        image_argv=tuple(_selection_argv(args, bench)),
        deepspeed_tests=args.deepspeed_tests,
        jobs=_jobs(args.jobs),
        low_disk=args.low_disk,
        side_by_side=args.side_by_side,
    )


def _jobs(value: str) -> int | None:
    """``--jobs``: a positive number, or None for ``auto`` (decided when the run is planned)."""
    if value == "auto":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--jobs {value}: must be a whole number of at least 1, or auto")
    return int(value)


def command_matrix(args: argparse.Namespace) -> int:
    # One OpenMP/BLAS thread per child process unless set: a run keeps the cores busy with processes
    # side by side (cells, builds, ranks), and spinning extra threads only costs CPU (measured, docs/measurements.md).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    options = matrix_options(args)
    selection = options.selection
    if args.plan:
        print_plan(selection, args.json)
        return 0
    if not selection.cells:
        rules = ", ".join(sorted({e.rule.id for e in selection.excluded})) or "no rule"
        raise ConfigError(f"tier {args.tier}: the selection leaves no cell to run ({len(selection.excluded)} excluded by {rules})")
    try:
        with interrupts_raise(), progress.reporting(progress.Reporter(total=0, live=False)):  # heartbeats while inputs are checked
            plan = plan_run(options)
    except KeyboardInterrupt:  # before the run folder exists: its children are stopped, nothing was written
        print("dsmatrix: interrupted while checking the inputs; nothing was written", file=sys.stderr)
        return INTERRUPTED_EXIT
    except UnknownVersionError as exc:  # name the versions the matrix knows beside the one it could not find
        axes = load_matrix(options.matrix).axes  # read once, only on this error path
        wanted = _wanted(args)
        outside = [a for a, values in wanted.items() if a in CELL_AXES and any(v not in axes[a] and not is_git(v) for v in values or ())]
        if not outside or isinstance(exc, InterpreterNotFound):
            raise
        known = "; ".join(f"{a}: {', '.join(axes[a])}" for a in outside)
        raise type(exc)(f"{exc} (not in {options.matrix.name}, which knows {known})") from None
    runtime = {a: list(v) for a, v in selection.runtime.items()}
    meta = {"tier": args.tier, "matrix": str(options.matrix), "patch": options.patch.describe(), "runtime": runtime}
    meta.update(excluded=selection.excluded_records(), planned=selection.planned_records())
    outcome = run_matrix(options, plan, _print_result, meta)
    if outcome.interrupted:
        return outcome.exit_code
    throughput = [v for v in outcome.throughput.values() if v != UNMEASURED]
    counted = {v: throughput.count(v) for v in dict.fromkeys(throughput)}
    measured = "; throughput: " + ", ".join(f"{n} {v}" for v, n in counted.items()) if counted else ""
    fixed = sum(v == FIXED for v in outcome.verdicts)
    print(f"dsmatrix: {fixed}/{len(outcome.verdicts)} cell(s) fixed{measured}; summary: {outcome.run.root / 'summary.json'}")
    return outcome.exit_code


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
            judged = c["verdict"] if c["kind"] == STEP else "reported, not judged"
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


def _tier_plan(args: argparse.Namespace) -> TierPlan | None:
    """``report --tier``: the cells and exclusions the tier plans on the matrix, on the chosen platforms."""
    if not args.tier:
        if args.matrix or args.root or args.platform:
            raise ConfigError("--matrix, --root and --platform judge coverage by a tier: give --tier as well")
        return None
    matrix = load_matrix((args.matrix or default_matrix(project_root(args.root))).resolve())
    selection = plan_cells(matrix, matrix.tier(args.tier), {}, _split(args.platform) or [native_platform()])
    return TierPlan(args.tier, selection.planned_records(), selection.excluded_records())


def command_report(args: argparse.Namespace) -> int:
    target = write_report(args.stores, args.output, _tier_plan(args))
    report = load_report(target)
    print(render_markdown(report, "summary"))
    print(f"dsmatrix: {report['verdict']}: {report['verdict_summary']}; {target}/qualification.{{md,html,json}}")
    if report.get("figures_left_out"):
        print(f"dsmatrix: {report['figures_left_out']}", file=sys.stderr)
    if args.require and not passes(report["verdict"], args.require):
        print(f"dsmatrix: --require {args.require}: the headline is {report['verdict']}", file=sys.stderr)
        return 1
    return 0


def command_images(args: argparse.Namespace) -> int:
    platforms = _split(args.platform) or list(IMAGES)
    specs = [image_for(p) for p in platforms]
    cache = Cache(args.cache_dir.resolve())
    # plain heartbeat lines: a debootstrap or a docker build step says nothing for minutes
    with progress.reporting(progress.Reporter(total=0, live=False)), docker_engine(cache.docker) as client:
        images = build_images(client, [spec.platform for spec in specs], args.base_image, cache.images())
        built = [(images[spec.platform], inside_view(client, spec)) for spec in specs]
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
    except KeyboardInterrupt:  # e.g. while a git source is fetched, before any run folder exists
        print(f"dsmatrix: {args.command} interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
