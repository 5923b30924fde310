"""Command line: ``python -m dsmatrix matrix|bench|report|images`` (what the nox sessions call).

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
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsmatrix import __version__
from dsmatrix.build.environments import DEFAULT_TORCH_CPU_INDEX, TORCH_CPU_INDEX
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
from dsmatrix.infra.errors import ConfigError, FatalError, InterpreterNotFound, MissingPrerequisites, UnknownVersionError
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

DESCRIPTION = (
    "Compatibility-matrix validation of DeepSpeed's ZeRO-3 release-cache fix. Each cell (a Python, "
    "torch and DeepSpeed) builds a stock and a patched DeepSpeed wheel, runs the same engine tests "
    "and benchmarks on both, and gets a verdict: fixed, not-fixed, undetected or error."
)

EXIT_CODES = """exit codes:
  0    every selected cell fixed, and no throughput regression decided
  1    a cell not fixed (not-fixed, undetected, error) or a regression decided;
       report: the headline misses --require
  2    bad matrix file, selection or option
  3    this machine lacks a prerequisite (g++, Python headers, GNU patch, git,
       docker, emulation, an image)
  4    a torch, DeepSpeed or git version that cannot be found
  5    no interpreter for a Python of the selection
  6    malformed patch set, or no diff for a DeepSpeed version
  7    a diff does not apply
  8    not enough free disk
  9    a results file is unreadable or was altered
  130  interrupted (finished cells are kept; the next run completes the others)"""

ENVIRONMENT = f"""environment:
  {TORCH_CPU_INDEX}  CPU-only torch wheel index, for torch X+cpu pins
                            that pip's sources lack (default:
                            {DEFAULT_TORCH_CPU_INDEX})
  DSMATRIX_CACHE            the shared cache (default: ~/.cache/dsmatrix)
  PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS
                            with pip's configuration files: the package sources
                            handed to uv
  PYENV_ROOT                interpreters are looked for on PATH, then in its
                            versions folder (default: ~/.pyenv)"""

DEEPSPEED_HELP = (
    "DeepSpeed release(s), e.g. 0.19.8 (repeat or comma-separate); or DeepSpeed from git: "
    "git:URL_OR_PATH@REF (the fix applied to REF), or git:URL_OR_PATH with --base REF --head REF "
    "(PR mode: stock from base, patched from head, no diff applied)"
)


class HelpFormatter(argparse.HelpFormatter):
    """Wraps a one-paragraph description, keeps the epilog's lines, and shows each option's default
    where it has one to show."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(text, width, indent) if "\n" not in text else "".join(indent + line for line in text.splitlines(True))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def _matrix_arguments(matrix: argparse.ArgumentParser, bench_default: str) -> None:
    """The options ``matrix`` and ``bench`` share: what to run, where, and how."""
    matrix.add_argument("--root", type=Path, help="project root: its matrix/matrix.toml and patches/ (default: found from here upwards)")
    matrix.add_argument("--matrix", type=Path, help="matrix file (default: the project's, else the bundled one)")
    matrix.add_argument("--tier", default="default", help="tier of the matrix file whose cells and runtime axes run")
    for axis in ("platform",) + CELL_AXES + RUNTIME_AXES:
        flag = f"--{axis.replace('_', '-')}"
        text = DEEPSPEED_HELP if axis == "deepspeed" else f"select {axis} value(s) (repeat or comma-separate; default: the tier's)"
        matrix.add_argument(flag, dest=axis, action="append", metavar="VALUE", help=text)
    matrix.add_argument("--patch", type=Path, help="manifest folder or a single diff (default: the project's fix, else the bundled one)")
    matrix.add_argument("--base", metavar="REF", help="PR mode, with --deepspeed git:REPO: stock from this ref (default: its @REF)")
    matrix.add_argument("--head", metavar="REF", help="PR mode: patched is built from this ref of the same repository, no diff applied")
    matrix.add_argument(
        "--deepspeed-tests",
        default="core",
        metavar="SET",
        help="git sources: the set of DeepSpeed's own tests run on both builds (core, quick, full, or none)",
    )
    matrix.add_argument("--results", type=Path, default=Path("results"), help="results store: one folder per run, latest/ the newest")
    matrix.add_argument(
        "--cache-dir",
        type=Path,
        default=default_root(),
        help="shared cache of sdists, wheels and environments (default: ~/.cache/dsmatrix)",
    )
    matrix.add_argument("--plan", action="store_true", help="print the selected cells (and excluded ones) and exit")
    matrix.add_argument("--json", action="store_true", help="with --plan: the cells as a GitHub Actions job matrix ({include: [...]})")
    matrix.add_argument("--fresh", action="store_true", help="reuse nothing: re-run every cell, stock tests included")
    matrix.add_argument(
        "--rerun-failed", action="store_true", help="reuse only `fixed` results (by default `fixed` and `not-fixed` are final and reused)"
    )
    matrix.add_argument("--in-image", action="store_true", help="run this platform's cells in its image as well")
    matrix.add_argument("--base-image", help="base image for building missing images (default: debootstrap one here)")
    matrix.add_argument("--jobs", "-j", default="auto", metavar="N", help="cells run at once here (auto: a cell per core, memory allowing)")
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
    matrix.add_argument(
        "--cell",
        "--only",
        dest="only",
        action="append",
        metavar="CELL",
        help="run only these cells: ids (py3.11-torch2.13.0+cpu-ds0.19.8, comma-separated) or labels as --plan prints them; "
        "nox's cell sessions run --tier release --cell LABEL",
    )
    matrix.add_argument(
        "--bench",
        action=argparse.BooleanOptionalAction,
        help=f"instruction-count, step-time and leak benchmarks per cell; finished cells only get benchmarked (default: {bench_default})",
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
    matrix.add_argument("--margin", type=float, default=DEFAULT_MARGIN, help="step-time regression margin, 0.035 being 3.5%%")
    matrix.add_argument(
        "--instructions-margin",
        type=float,
        default=DEFAULT_INSTRUCTIONS_MARGIN,
        help="executed-instructions regression margin, 0.005 being 0.5%%",
    )
    matrix.add_argument("--leak-lifecycles", type=int, default=20, help="engine lifecycles in the leak benchmark")


def build_parser() -> argparse.ArgumentParser:
    """The ``dsmatrix`` command line and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="dsmatrix", description=DESCRIPTION, epilog=f"{EXIT_CODES}\n\n{ENVIRONMENT}", formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{matrix,bench,report,images}")
    epilog = f"{EXIT_CODES}\n\n{ENVIRONMENT}"
    matrix = sub.add_parser(
        "matrix",
        help="run the selected cells, stock vs patched (nox -s matrix)",
        description="Run the tier's cells, stock vs patched: build both wheels, run the engine tests on both, and "
        "benchmark where the tier says so; a verdict per cell, recorded as soon as it is finished.",
        epilog=epilog,
        formatter_class=HelpFormatter,
    )
    _matrix_arguments(matrix, "the tier's `benchmarks` in matrix.toml: on in every tier but smoke")
    bench = sub.add_parser(
        "bench",
        help="the same, benchmarks always on (nox -s bench)",
        description="dsmatrix matrix --bench: the selected cells with their benchmarks; a cell with a finished "
        "correctness result is only benchmarked. Exits 1 on a decided throughput regression.",
        epilog=epilog,
        formatter_class=HelpFormatter,
    )
    _matrix_arguments(bench, "on")
    bench.set_defaults(bench=True)
    report = sub.add_parser(
        "report",
        help="merge results stores into the release-qualification report (nox -s report)",
        description="Merge results stores into reports/<id>/qualification.{md,html,json}, with summary.md and, for git "
        "sources, evidence.md; print the summary.",
        epilog=EXIT_CODES,
        formatter_class=HelpFormatter,
    )
    report.add_argument(
        "stores", nargs="*", type=Path, default=[Path("results")], help="results stores (their latest run) or run folders; default: results"
    )
    report.add_argument("--output", type=Path, default=Path("reports"), help="where the report's folder is written")
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
        help="exit 1 unless the headline is QUALIFIED (qualified) or at least CORRECT, THROUGHPUT NOT SHOWN (correct); "
        "without it the report exits 0",
    )
    images = sub.add_parser(
        "images",
        help="build the container images (nox -s images)",
        description="Build the container images the --in-image and arm64 cells run in (containers/*/Dockerfile).",
        epilog=EXIT_CODES,
        formatter_class=HelpFormatter,
    )
    images.add_argument("--platform", action="append", metavar="PLATFORM", help=f"one of {', '.join(IMAGES)} (default: both)")
    images.add_argument("--base-image", help="an official Debian image where a registry is reachable (default: debootstrap one here)")
    images.add_argument("--cache-dir", type=Path, default=default_root(), help="shared cache (default: ~/.cache/dsmatrix)")
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


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
    if gits and shutil.which("git") is None:
        raise MissingPrerequisites(["git (DeepSpeed from git, --deepspeed git:...): apt-get install git"])
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


def _cell_ids(raw: list[str], labels: dict[str, str]) -> list[str]:
    """``--cell`` values as cell ids: a label as ``--plan`` prints it (which holds commas), else
    comma-separated ids."""
    ids: list[str] = []
    for item in raw:
        ids += [labels[item.strip()]] if item.strip() in labels else [v.strip() for v in item.split(",") if v.strip()]
    return ids


def _select(matrix: Matrix, args: argparse.Namespace, cache: Cache) -> Selection:
    """The tier's cells on the chosen platforms, narrowed by the axis options and ``--cell``."""
    platforms = _split(args.platform) or [native_platform()]
    selection = plan_cells(matrix, matrix.tier(args.tier), _git_sources(args, cache), platforms)
    git_elsewhere = [c for c in selection.cells if c.source and (c.platform != native_platform() or args.in_image)]
    if git_elsewhere:
        raise ConfigError(f"{git_elsewhere[0].label}: git sources run on this machine's platform ({native_platform()}), not in an image")
    if args.only:
        cells = [*selection.cells, *(e.cell for e in selection.excluded)]
        wanted = set(_cell_ids(args.only, {c.label: c.id for c in cells}))
        unknown = sorted(wanted - {c.id for c in cells})
        if unknown:
            listed = ", ".join(c.id for c in selection.cells) or "none"
            raise ConfigError(f"--cell {unknown[0]}: not a cell of tier {args.tier} on {', '.join(platforms)} (its cells: {listed})")
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


COMMANDS = {"matrix": command_matrix, "bench": command_matrix, "images": command_images, "report": command_report}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return COMMANDS[args.command](args)
    except FatalError as exc:
        for line in str(exc).splitlines() or [""]:
            print(f"dsmatrix: error: {line}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # e.g. while a git source is fetched, before any run folder exists
        print(f"dsmatrix: {args.command} interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
