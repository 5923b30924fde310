"""A matrix run: plan it (inputs checked, results to reuse found), then run its cells here or in
their platform's image, recording each as soon as it finishes.

Resume rule: a finished cell result is reused only when its fingerprint matches (cell, runtime
axes, patch, host and the suite's own code, ``suite_digest``) and its verdict is final. ``fixed``
and ``not-fixed`` are final: both builds ran and were compared. ``undetected``, ``error`` and
``interrupted`` are not: they say the suite could not decide, so they always run again.
``--rerun-failed`` reuses ``fixed`` only; ``--fresh`` reuses nothing (stock test results neither).

Interrupts: SIGINT and SIGTERM stop every child's process group (``processes``), record the cell
that was running as ``interrupted``, write the summary with status ``interrupted`` and exit 130.
A run killed outright (SIGKILL) leaves its groups to the next run, which stops them
(``Cache.open``); its finished cells are on disk already.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsmatrix.build.environments import uv_cache_dir
from dsmatrix.build.images import build_images, image_for
from dsmatrix.build.patches import PatchSet
from dsmatrix.execute.benchmarks import BenchOptions, add_benchmarks, keep_benchmark_files, measured_alike
from dsmatrix.execute.cell import run_cell
from dsmatrix.execute.deepspeed_tests import DEFAULT_SET
from dsmatrix.execute.in_image import run_in_image
from dsmatrix.execute.preflight import cache_size, check_patch, preflight
from dsmatrix.execute.reuse import fingerprint, suite_digest
from dsmatrix.infra import processes, progress
from dsmatrix.infra.cache import Cache
from dsmatrix.infra.docker_engine import docker_engine
from dsmatrix.infra.errors import DiskSpaceError
from dsmatrix.infra.hosts import LOCAL, native_platform
from dsmatrix.infra.locations import image_source_tree
from dsmatrix.infra.parallel import auto_jobs, builds_side_by_side
from dsmatrix.infra.results import Run, cell_result_skeleton, find_finished, import_cells, start_run
from dsmatrix.judge.throughput import cell_throughputs
from dsmatrix.judge.verdict import ERROR, FIXED, INTERRUPTED, INTERRUPTED_EXIT, NOT_FIXED, run_exit_status
from dsmatrix.plan.cells import Cell, Selection
from dsmatrix.plan.disk import (
    DiskPlan,
    DiskWatch,
    TorchSet,
    by_set,
    grouped,
    plan_disk,
    prune_set,
    set_entries,
    set_name,
    torch_set,
    tree_gib,
    uv_cache,
)

FINAL = (FIXED, NOT_FIXED)  # verdicts a resumed run reuses (see the module docstring)
RESUME = {"finished": FINAL, "fixed-only": (FIXED,), "none": ()}


@dataclass(frozen=True)
class MatrixOptions:
    """Everything a matrix run needs, resolved once from the command line."""

    tier: str
    matrix: Path
    patch: PatchSet | None  # None only for --plan
    results: Path
    cache: Cache
    selection: Selection
    root: Path | None = None
    resume: str = "finished"  # a key of RESUME
    in_image: bool = False
    base_image: str | None = None
    bench: BenchOptions | None = None
    image_argv: tuple[str, ...] = ()  # selection arguments handed on to an image's own run
    deepspeed_tests: str = DEFAULT_SET  # the set of DeepSpeed's own tests git-source cells run ("none": none)
    jobs: int | None = 1  # cells run at once (--jobs; None: auto, decided by plan_run)
    low_disk: str = "auto"  # one of disk.LOW_DISK
    side_by_side: str = "auto"  # a cell's two builds at once: one of parallel.SIDE_BY_SIDE


@dataclass
class Plan:
    """Where each cell runs, its fingerprint, and the results it can reuse."""

    hosts: dict[Cell, str]
    prints: dict[Cell, str]
    reusable: dict[Cell, dict[str, Any]]
    disk: DiskPlan | None = None  # this machine's cells
    jobs: int = 1  # this machine's cells run at once
    need_gib: float = 0.0
    todo: list[Cell] = field(default_factory=list)  # in the order they run (low-disk: a torch set's cells together)
    orphans_stopped: list[dict[str, Any]] = field(default_factory=list)  # process groups killed runs had left

    @property
    def image_platforms(self) -> list[str]:
        return sorted({c.platform for c in self.todo if self.hosts[c] != LOCAL})


def host_of(cell: Cell, in_image: bool) -> str:
    """Where a cell runs: ``local``, or ``image:<name>`` for its platform's container image."""
    if cell.platform == native_platform() and not in_image:
        return LOCAL
    return f"image:{image_for(cell.platform).name}"


def largest_world(selection: Selection) -> int:
    return max(int(w) for w in selection.runtime.get("world_size", ("1",)))


def plan_run(options: MatrixOptions) -> Plan:
    """Fingerprints, reusable results and every input check; raises a one-line FatalError before anything is written.

    Opens the cache first: process groups that killed runs left behind are stopped before this run
    touches an entry they may still be writing."""
    orphans = options.cache.open()
    selection = options.selection
    runtime = {a: list(v) for a, v in selection.runtime.items()}
    suite = suite_digest()
    hosts = {cell: host_of(cell, options.in_image) for cell in selection.cells}
    prints = {cell: fingerprint(cell, runtime, options.patch, suite, hosts[cell], options.deepspeed_tests) for cell in selection.cells}
    final = RESUME[options.resume]
    reusable = {c: r for c in selection.cells if final and (r := find_finished(options.results, prints[c], final)) is not None}
    todo = [c for c in selection.cells if c not in reusable]
    plan = Plan(hosts, prints, reusable, todo=todo, orphans_stopped=orphans)
    local = Selection(tuple(c for c in todo if hosts[c] == LOCAL), selection.runtime)
    plan.jobs = options.jobs or auto_jobs(len(local.cells), largest_world(selection))
    try:  # first: the checks below download into the cache
        plan.disk = plan_disk(local.cells, options.cache, options.low_disk, plan.jobs)
    except DiskSpaceError:
        if options.jobs is not None or plan.jobs == 1:
            raise
        plan.jobs = 1  # auto: one set at a time fits where two did not
        plan.disk = plan_disk(local.cells, options.cache, options.low_disk, plan.jobs)
    if plan.disk.low_disk:
        plan.todo = grouped(todo)
    plan.need_gib = plan.disk.peak_gib
    for platform in plan.image_platforms:
        cells = [c for c in todo if c.platform == platform and hosts[c] != LOCAL]
        plan.need_gib += plan_disk(cells, options.cache.in_image(image_for(platform).name), "off").need_gib
    preflight(local, options.bench is not None)
    check_patch(todo, options.patch, options.cache)  # also for cells that run in an image
    if plan.image_platforms:
        image_source_tree(options.root)  # images need the suite's source tree: say so before anything runs
    return plan


@dataclass
class Outcome:
    """What a finished (or interrupted) run did."""

    run: Run
    verdicts: list[str]
    interrupted: bool

    @property
    def throughput(self) -> dict[str, str]:
        """Each cell's throughput verdict by label (``not measured`` without benchmarks)."""
        return cell_throughputs(self.run.cells)

    @property
    def exit_code(self) -> int:
        return run_exit_status(self.verdicts, self.throughput.values(), self.interrupted)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM: the run stops, keeping what it finished (a KeyboardInterrupt, so every
    handler of Ctrl-C, such as stopping a container, sees it)."""


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGINT and SIGTERM raise ``Interrupted`` once; further signals are ignored while the run cleans up."""

    def handler(signum: int, frame: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


Printer = Callable[[Cell, dict[str, Any]], None]


def run_matrix(options: MatrixOptions, plan: Plan, say: Printer, meta: Mapping[str, Any]) -> Outcome:
    """Run the planned cells: reused ones recorded (benchmarked when asked and not yet decided), local ones
    here (``plan.jobs`` at a time), the rest in their platform's image; ``say`` prints each
    finished cell, and the progress reporter where the run is."""
    selection = options.selection
    run = start_run(options.results, dict(meta))
    disk = plan.disk.describe() if plan.disk else ""
    print(
        f"dsmatrix: run {run.id}: {len(selection.cells)} cell(s) ({len(plan.reusable)} already done), "
        f"{len(selection.excluded)} excluded; patch {options.patch.source.name} ({options.patch.short}); "
        f"uv cache {cache_size()}, {disk}; results in {run.root}",
        flush=True,
    )
    outcome = Outcome(run, [], interrupted=False)
    running: dict[Cell, None] = {}  # cells started and not finished (an interrupt records them)
    reporter = progress.Reporter(len(selection.cells), plan.jobs)

    def announce(cell: Cell, result: dict[str, Any], wall_s: float | None) -> None:
        outcome.verdicts.append(result["verdict"])
        say(cell, result)
        reporter.cell_finished(wall_s)

    watch = DiskWatch(options.cache.root)

    def finished(cell: Cell, result: dict[str, Any], wall_s: float | None) -> None:
        run.meta["disk"] = _disk_facts(plan, watch)  # the peak so far, kept should the run never end
        run.add_cell(result)
        announce(cell, result, wall_s)

    with interrupts_raise(), progress.reporting(reporter), watch:
        try:
            for orphan in plan.orphans_stopped:
                print(f"dsmatrix: stopped a process group left by a killed run: {' '.join(orphan['command'])[:120]}", flush=True)
            for cell in (c for c in selection.cells if c in plan.reusable):
                running[cell] = None
                finished(cell, _reused(options, plan, cell, run), None)
                running.pop(cell)
            _run_local_cells(options, plan, run, running, finished)
            if plan.image_platforms:
                with _images_ready(plan.image_platforms, options) as client:
                    for platform in plan.image_platforms:
                        cells = [c for c in plan.todo if c.platform == platform and plan.hosts[c] != LOCAL]
                        running.update(dict.fromkeys(cells))
                        _run_image_cells(options, client, platform, cells, plan.prints, run, announce)
                        running.clear()
            # still under the handlers: a signal while the run finishes is an interrupt, never a lost summary
            run.meta["disk"] = _disk_facts(plan, watch)
            print(f"dsmatrix: disk: peak {watch.peak_gib:.1f} GiB above the run's start; uv cache now {cache_size()}", flush=True)
            run.write_summary("complete")
        except KeyboardInterrupt as exc:
            outcome.interrupted = True
            done = {c["cell"]["id"] for c in run.cells}
            for cell in (c for c in running if c.id not in done):
                result = cell_result_skeleton(
                    cell, plan.prints[cell], INTERRUPTED, f"interrupted ({exc or 'SIGINT'}) before this cell finished"
                )
                run.add_cell(result)
                outcome.verdicts.append(INTERRUPTED)
            run.meta["disk"] = _disk_facts(plan, watch)
            run.write_summary("interrupted")
            print(f"dsmatrix: interrupted; {len(done)} finished cell(s) kept in {run.root}", file=sys.stderr, flush=True)
    return outcome


def _disk_facts(plan: Plan, watch: DiskWatch) -> dict[str, Any]:
    facts: dict[str, Any] = {**watch.facts(), "low_disk": bool(plan.disk and plan.disk.low_disk)}
    if plan.disk:
        facts.update(estimate_gib=plan.disk.need_gib, planned_peak_gib=plan.disk.peak_gib, free_at_start_gib=plan.disk.free_gib)
    return facts


def _run_local_cells(
    options: MatrixOptions, plan: Plan, run: Run, running: dict[Cell, None], finished: Callable[[Cell, dict[str, Any], float | None], None]
) -> None:
    """This machine's cells, ``plan.jobs`` at a time, in ``plan.todo``'s order. In low-disk mode
    the torch sets run one after another: a new set is pruned after its last cell, before the next
    set's cells start (so at most one set's cache is on disk, as the disk plan assumed)."""
    cells = [c for c in plan.todo if plan.hosts[c] == LOCAL]
    if not cells:
        return
    selection, disk = options.selection, plan.disk
    world = largest_world(selection)
    together = builds_side_by_side(options.side_by_side, plan.jobs, world)
    how = "side by side" if together else "in turn"
    print(f"dsmatrix: {len(cells)} cell(s) here, {plan.jobs} at a time, each cell's two builds {how}", flush=True)

    def one(cell: Cell, together: bool) -> dict[str, Any]:
        key = torch_set(cell)
        running[cell] = None
        with progress.lane(cell.label), uv_cache_dir(uv_cache(options.cache, key) if disk and disk.pruned(key) else None):
            progress.stage("running")
            return run_cell(
                cell, selection, options.patch, options.cache, run, plan.prints[cell], options.bench,
                options.resume != "none", options.deepspeed_tests, together,
            )  # fmt: skip

    batches = by_set(cells) if disk and disk.low_disk else [cells]
    for batch in batches:
        key = torch_set(batch[0])
        # a set with fewer cells than jobs leaves cores idle: its builds run side by side when they fit
        batch_together = builds_side_by_side(options.side_by_side, min(plan.jobs, len(batch)), world)
        if batch_together != together:
            print(f"dsmatrix: {set_name(key)}: {len(batch)} cell(s), each cell's two builds side by side", flush=True)
        _run_batch(min(plan.jobs, len(batch)), batch, functools.partial(one, together=batch_together), running, finished)
        if disk and disk.pruned(key):
            _prune(options.cache, key, batch)


def _run_batch(
    jobs: int,
    cells: list[Cell],
    one: Callable[[Cell], dict[str, Any]],
    running: dict[Cell, None],
    finished: Callable[[Cell, dict[str, Any], float | None], None],
) -> None:
    """``one`` on each cell, ``jobs`` at a time; each result recorded as it finishes. An interrupt
    stops every child process, then waits for the workers."""
    with ThreadPoolExecutor(jobs, thread_name_prefix="dsmatrix-cell") as pool:
        futures = {pool.submit(contextvars.copy_context().run, one, cell): cell for cell in cells}
        try:
            for future in as_completed(futures):
                cell = futures[future]
                result = future.result()
                finished(cell, result, result["timings"].get("total_s"))
                running.pop(cell, None)
        except KeyboardInterrupt:
            processes.stop_all()
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _prune(cache: Cache, key: TorchSet, cells: list[Cell]) -> None:
    """Remove a finished set's uv cache, builder and environments, as a lane of its own (removing
    several GiB took minutes here: it heartbeats like a cell's stage)."""
    with progress.lane(f"low-disk: {set_name(key)}"):
        progress.stage("removing its uv cache, builder and environments")
        entries = set_entries(cache, key, cells)
        size = tree_gib(entries)
        freed = prune_set(cache, entries)
    print(f"dsmatrix: low-disk: {set_name(key)} finished: its uv cache, builder and environments held {size:.1f} GiB; "
          f"removed ({freed:.1f} GiB freed)", flush=True)  # fmt: skip


def _reused(options: MatrixOptions, plan: Plan, cell: Cell, run: Run) -> dict[str, Any]:
    found = plan.reusable[cell]
    result = {**found, "reused_from": found.get("reused_from") or found["run_id"]}
    print(f"{cell.label}: reused the result of run {result['reused_from']} (--fresh re-runs it)", flush=True)
    found_run = options.results / found["run_id"]
    if options.bench and measured_alike(found, options.bench) and keep_benchmark_files(found_run, run, found["benchmarks"]):
        # a resumed run keeps what it measured
        print(f"{cell.label}: benchmarks reused with it: throughput {found['benchmarks']['verdict']}", flush=True)
    elif options.bench and plan.hosts[cell] == LOCAL:
        print(f"{cell.label}: benchmarks ...", flush=True)
        with progress.lane(cell.label):  # its stages and heartbeats name the cell
            result = add_benchmarks(result, cell, options.selection, options.patch, options.cache, run, options.bench)
    return result


@contextlib.contextmanager
def _images_ready(platforms: list[str], options: MatrixOptions) -> Iterator[Any]:
    """A docker client with an up-to-date image for every platform in ``platforms``."""
    with docker_engine(options.cache.docker) as client:
        # always built: docker's layer cache makes an unchanged image seconds, a changed Dockerfile is never stale
        build_images(client, platforms, options.base_image, options.cache.images())
        yield client


def _run_image_cells(
    options: MatrixOptions,
    client: Any,
    platform: str,
    cells: list[Cell],
    prints: dict[Cell, str],
    run: Run,
    announce: Callable[[Cell, dict[str, Any], float | None], None],
) -> None:
    """Run ``cells`` inside ``platform``'s image and import each finished one into ``run``.

    A cell that does not come back (the container failed or was stopped) becomes an ``error``
    cell naming the image and its last line; an interrupt keeps every cell that finished.
    """
    spec = image_for(platform)
    image = client.images.get(spec.tag)
    staging = options.cache.images(spec.name) / f"results-{run.id}"
    argv = [*options.image_argv, "--platform", platform, "--fresh"] + [f"--only={c.id}" for c in cells]
    print(f"dsmatrix: {len(cells)} cell(s) in {spec.tag} ({platform}) ...", flush=True)
    started = time.monotonic()
    by_id = {c.id: c for c in cells}
    facts = {"image": {"tag": spec.tag, "id": image.id, "platform": platform}}
    code, last = INTERRUPTED_EXIT, "interrupted"

    def finish(result: dict[str, Any]) -> dict[str, Any]:
        cell = by_id.pop(result["cell"]["id"])
        announce(cell, result, (result.get("timings") or {}).get("total_s"))  # below: the fingerprint as this host computes it, for reuse
        return {**result, **facts, "fingerprint": prints[cell], "container_wall_s": round(time.monotonic() - started, 1)}

    try:
        source = image_source_tree(options.root)
        code, last = run_in_image(
            client, spec, argv, staging, options.cache.images(spec.name), source, options.matrix, options.patch.source
        )
    finally:
        import_cells(staging, run, finish, seen_as=Path("/results"))
        shutil.rmtree(staging, ignore_errors=True)
    for cell in by_id.values():  # never came back
        reason = f"{spec.tag}: `nox -s matrix` inside exited {code} before this cell finished: {last}"
        result = {**cell_result_skeleton(cell, prints[cell], ERROR, reason), **facts, "error_kind": "HostError"}
        run.add_cell(result)
        announce(cell, result, None)
