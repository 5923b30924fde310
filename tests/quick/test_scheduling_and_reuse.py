from __future__ import annotations

import shutil
from collections import namedtuple
from pathlib import Path

import pytest

from dsmatrix.build.patches import load_patch_set
from dsmatrix.execute import schedule
from dsmatrix.execute.launch import remove_shm_buffers
from dsmatrix.execute.reuse import fingerprint, suite_digest
from dsmatrix.infra.cache import Cache
from dsmatrix.infra.errors import DiskSpaceError
from dsmatrix.infra.hosts import LOCAL
from dsmatrix.plan.cells import Cell
from dsmatrix.plan.disk import GIB, grouped, plan_disk, prune_set, set_entries, torch_set, tree_gib, uv_cache

Usage = namedtuple("Usage", "total used free")
RUNTIME = {"dtype": ("fp32",), "checkpointing": ("off",), "world_size": ("1",)}


@pytest.fixture
def plenty_of_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """1 TiB free, whatever this machine has: the tests that take it schedule, the disk check is tested above."""
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(1024 * GIB, 0, 1024 * GIB))


def test_disk_check_refuses_a_run_that_does_not_fit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(100 * GIB, 98 * GIB, 2 * GIB))
    cuda = [Cell("3.12", "2.9.1", "0.19.8")]
    with pytest.raises(DiskSpaceError, match=r"need about 7\.2 GiB \(1 new torch set\(s\)\), only 2\.0 GiB free"):
        plan_disk(cuda, Cache(tmp_path), "off")
    with pytest.raises(DiskSpaceError, match=r"even one torch set at a time \(low-disk mode, --jobs 1\) needs about 7\.2 GiB"):
        plan_disk(cuda, Cache(tmp_path), "auto")
    (tmp_path / "builders" / "py3.12-torch2.9.1-abc" / "bin" / "python").mkdir(parents=True)  # that torch set is cached already
    assert plan_disk(cuda, Cache(tmp_path), "off").need_gib == pytest.approx(0.2)


NIGHTLY_LIKE = [
    Cell("3.10", "2.4.1", "0.14.5"),
    Cell("3.12", "2.9.1", "0.16.9"),
    Cell("3.10", "2.4.1", "0.19.8"),
    Cell("3.11", "2.13.0+cpu", "0.19.8"),
    Cell("3.12", "2.9.1", "0.19.2"),
]


def test_low_disk_mode_needs_the_largest_set_not_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(100 * GIB, 90 * GIB, 10 * GIB))
    plan = plan_disk(NIGHTLY_LIKE, Cache(tmp_path))  # auto: 15 GiB needed, 10 free
    assert plan.low_disk and plan.need_gib == pytest.approx(16.0) and plan.peak_gib == pytest.approx(7.4)
    assert "low-disk mode (~16.0 GiB needed, 10.0 GiB free)" in plan.describe()
    with pytest.raises(DiskSpaceError, match="--jobs 2"):  # two sets at once do not fit
        plan_disk(NIGHTLY_LIKE, Cache(tmp_path), "auto", jobs=2)
    assert not plan_disk(NIGHTLY_LIKE[3:4], Cache(tmp_path)).low_disk  # fits: no low-disk mode
    assert plan_disk(NIGHTLY_LIKE[3:4], Cache(tmp_path), "on").low_disk
    # a set's cells run together, sets in the order they first appear
    assert [c.id for c in grouped(NIGHTLY_LIKE)] == [NIGHTLY_LIKE[i].id for i in (0, 2, 1, 4, 3)]


@pytest.mark.usefixtures("plenty_of_disk")
def test_low_disk_mode_prunes_only_new_sets_and_everything_that_links_into_them(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    (tmp_path / "builders" / "py3.11-torch2.13.0+cpu-abc" / "bin" / "python").mkdir(parents=True)  # cached before the run
    plan = plan_disk(NIGHTLY_LIKE, cache, "on")
    key = torch_set(NIGHTLY_LIKE[0])
    assert plan.pruned(key) and not plan.pruned(torch_set(NIGHTLY_LIKE[3]))
    cells = [c for c in NIGHTLY_LIKE if torch_set(c) == key]
    blob = uv_cache(cache, key) / "archive" / "torch.so"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"x" * 1_000_000)
    for cell in cells:  # environments hardlink the uv cache's files
        env = tmp_path / "envs" / cell.id / "stock-abc" / "lib"
        env.mkdir(parents=True)
        (env / "torch.so").hardlink_to(blob)
    builder = tmp_path / "builders" / "py3.10-torch2.4.1-def"
    builder.mkdir(parents=True)
    kept = tmp_path / "wheels" / "deepspeed-0.14.5" / "py3.10-torch2.4.1" / "stock"
    kept.mkdir(parents=True)
    entries = set_entries(cache, key, cells)
    assert set(entries) == {uv_cache(cache, key), builder, *(tmp_path / "envs" / c.id for c in cells)}
    assert tree_gib(entries) == pytest.approx(1_000_000 / GIB, rel=0.05)  # one inode, counted once
    prune_set(cache, entries)
    assert not any(e.exists() for e in entries) and kept.is_dir()
    assert (tmp_path / "builders" / "py3.11-torch2.13.0+cpu-abc").is_dir()


def test_fingerprint_follows_versions_runtime_patch_and_suite(repo: Path) -> None:
    patch = load_patch_set(repo / "patches" / "zero3-release-cache")
    cell = Cell("3.11", "2.13.0+cpu", "0.19.8")
    runtime = {axis: list(v) for axis, v in RUNTIME.items()}
    base = fingerprint(cell, runtime, patch, suite_digest())
    assert base == fingerprint(cell, runtime, patch, suite_digest())
    assert base != fingerprint(Cell("3.11", "2.13.0+cpu", "0.19.2"), runtime, patch, suite_digest())
    assert base != fingerprint(cell, {**runtime, "world_size": ["1", "2"]}, patch, suite_digest())
    assert base != fingerprint(cell, runtime, patch, "another test suite")


def test_only_our_ports_shm_buffers_are_removed(tmp_path: Path) -> None:
    ours = tmp_path / "deepspeed_allreduce_buffer_0_127.0.0.1_40001_0"
    theirs = tmp_path / "deepspeed_allreduce_buffer_0_127.0.0.1_40002_0"
    for path in (ours, theirs):
        path.write_bytes(b"x")
    assert remove_shm_buffers(40001, tmp_path) == 1
    assert not ours.exists() and theirs.exists()


def test_rendezvous_ports_stay_below_the_ephemeral_range() -> None:
    """Ports the kernel hands out to connections are never picked, so three benchmark processes
    starting together cannot take each other's rendezvous port (seen: EADDRINUSE)."""
    from dsmatrix.execute.launch import _ephemeral_ports, free_port

    low, _ = _ephemeral_ports()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= p < low for p in ports) and len(ports) > 1


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="test_retrace" name="test_a[fp32-ckpt-off]" time="0.5"><properties><property name="bug" value="retrace"/>
<property name="bug_observed" value="{&quot;gathers_fresh&quot;: 14}"/></properties><failure message="Failed: differs"/></testcase>
</testsuite></testsuites>"""


def test_stock_results_are_run_once_and_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validating several patches runs the stock tests once; ``reuse=False`` (``--fresh``) runs them again."""
    from dsmatrix.execute import reuse
    from dsmatrix.execute.prepare import PreparedBuild
    from dsmatrix.judge.outcomes import TestRun, outcomes_from_junits

    calls = []

    def fake_run(python: Path, extensions: Path, runtime: dict, out: Path, name: str) -> TestRun:
        out.mkdir(parents=True, exist_ok=True)
        junit, log = out / f"{name}-ws1-rank0.xml", out / f"{name}-ws1-rank0.log"
        junit.write_text(JUNIT)
        log.write_text("log\n")
        calls.append(out)
        return TestRun(outcomes_from_junits([junit]), 1.5, (junit,), (log,))

    monkeypatch.setattr(reuse, "run_engine_tests", fake_run)
    cell = Cell("3.11", "2.13.0+cpu", "0.19.8")
    build = PreparedBuild(tmp_path / "python", tmp_path / "ext", "w.whl", {"wheel_sha256": "ab" * 32}, {}, [])
    first, reused = reuse.stock_tests(cell, build, dict(RUNTIME), Cache(tmp_path / "cache"), tmp_path / "run1" / "raw", reuse=True)
    assert reused == "" and len(calls) == 1
    second, reused = reuse.stock_tests(cell, build, dict(RUNTIME), Cache(tmp_path / "cache"), tmp_path / "run2" / "raw", reuse=True)
    assert reused == "run1" and len(calls) == 1
    assert second.outcomes == first.outcomes and second.outcomes["test_retrace::test_a[fp32-ckpt-off]@ws1"].observed
    assert all(p.parent == tmp_path / "run2" / "raw" and p.is_file() for p in (*second.junits, *second.logs))
    reuse.stock_tests(cell, build, dict(RUNTIME), Cache(tmp_path / "cache"), tmp_path / "run3" / "raw", reuse=False)
    other = PreparedBuild(tmp_path / "python", tmp_path / "ext", "w.whl", {"wheel_sha256": "cd" * 32}, {}, [])
    reuse.stock_tests(cell, other, dict(RUNTIME), Cache(tmp_path / "cache"), tmp_path / "run4" / "raw", reuse=True)
    assert len(calls) == 3


@pytest.mark.usefixtures("plenty_of_disk")
def test_low_disk_mode_prunes_a_set_before_the_next_sets_cells_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two cells at a time, but never across sets: the disk plan counts one set (times jobs) on disk."""
    import threading

    from dsmatrix.plan.cells import Selection

    cache, events, lock = Cache(tmp_path), [], threading.Lock()
    sibling_done = threading.Event()  # the set's first cell finishes last: it waits for its sibling

    def cell_work(cell: Cell, *args: object) -> dict[str, object]:
        with lock:
            events.append(("start", torch_set(cell)))
        if cell == NIGHTLY_LIKE[0]:
            assert sibling_done.wait(60), "the set's two cells did not run at once"
        elif cell == NIGHTLY_LIKE[2]:
            sibling_done.set()
        return {"verdict": "fixed", "timings": {"total_s": 0.1}}

    monkeypatch.setattr(schedule, "run_cell", cell_work)
    monkeypatch.setattr(schedule, "_prune", lambda _cache, key, cells: events.append(("prune", key)))
    selection = Selection(tuple(NIGHTLY_LIKE), RUNTIME)
    options = schedule.MatrixOptions("nightly", tmp_path, None, tmp_path / "results", cache, selection)
    todo = grouped(NIGHTLY_LIKE)
    plan = schedule.Plan({c: LOCAL for c in todo}, dict.fromkeys(todo, ""), {}, plan_disk(todo, cache, "on", 2), 2, todo=todo)
    schedule._run_local_cells(options, plan, None, {}, lambda *a: None)  # type: ignore[arg-type]
    sets = list(dict.fromkeys(torch_set(c) for c in todo))
    assert events == [e for key in sets for e in [("start", key)] * sum(torch_set(c) == key for c in todo) + [("prune", key)]]


@pytest.mark.usefixtures("plenty_of_disk")
def test_a_set_with_one_cell_runs_its_builds_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Low-disk mode runs the sets one after another: two cells at a time keep two cores busy, but a
    set of one cell would leave a core idle with its builds in turn."""
    from dsmatrix.infra import parallel
    from dsmatrix.plan.cells import Selection

    seen: dict[Cell, bool] = {}

    def cell_work(cell: Cell, *args: object) -> dict[str, object]:
        seen[cell] = bool(args[-1])  # run_cell's last argument: the builds side by side
        return {"verdict": "fixed", "timings": {"total_s": 0.1}}

    monkeypatch.setattr(schedule, "run_cell", cell_work)
    monkeypatch.setattr(schedule, "_prune", lambda *a: None)
    monkeypatch.setattr(parallel, "cores", lambda: 2)
    monkeypatch.setattr(parallel, "available_gib", lambda: 20.0)
    selection = Selection(tuple(NIGHTLY_LIKE), RUNTIME)
    options = schedule.MatrixOptions("nightly", tmp_path, None, tmp_path / "results", Cache(tmp_path), selection)
    todo = grouped(NIGHTLY_LIKE)
    plan = schedule.Plan({c: LOCAL for c in todo}, dict.fromkeys(todo, ""), {}, plan_disk(todo, Cache(tmp_path), "on", 2), 2, todo=todo)
    schedule._run_local_cells(options, plan, None, {}, lambda *a: None)  # type: ignore[arg-type]
    alone = {c for c in todo if sum(torch_set(o) == torch_set(c) for o in todo) == 1}
    assert alone == {Cell("3.11", "2.13.0+cpu", "0.19.8")}
    assert seen == {c: c in alone for c in todo}


def test_a_running_summary_keeps_the_disk_peak_so_far(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that never ends (the machine was reset) still says how much disk it took."""
    import json

    from dsmatrix.plan.cells import Selection

    cells, summaries = NIGHTLY_LIKE[:2], []

    def cell_work(cell: Cell, *args: object) -> dict[str, object]:
        return {"cell": {**cell.as_dict(), "label": cell.label}, "verdict": "fixed", "reasons": [], "timings": {"total_s": 0.1}}

    def say(cell: Cell, result: dict[str, object]) -> None:  # called once the cell's result is recorded
        (summary,) = (tmp_path / "results").glob("2*/summary.json")
        summaries.append(json.loads(summary.read_text()))

    monkeypatch.setattr(schedule, "run_cell", cell_work)
    patch = load_patch_set(Path(__file__).parents[2] / "patches" / "zero3-release-cache")
    selection = Selection(tuple(cells), RUNTIME)
    (tmp_path / "cache").mkdir()
    options = schedule.MatrixOptions("nightly", tmp_path, patch, tmp_path / "results", Cache(tmp_path / "cache"), selection)
    plan = schedule.Plan({c: LOCAL for c in cells}, dict.fromkeys(cells, ""), {}, jobs=1, todo=list(cells))
    schedule.run_matrix(options, plan, say, {"tier": "nightly"})
    assert summaries[0]["status"] == "running" and len(summaries[0]["cells"]) == 1
    assert summaries[0]["disk"]["peak_above_start_gib"] >= 0, "written with the first finished cell"


def test_ranks_get_a_jit_lock_folder_only_where_ccache_compiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ccache, the engine tests build the comm op in turn (so the second environment is a
    ccache hit); without it there is nothing to share and no lock."""
    import dsmatrix.execute.launch as run

    python = tmp_path / "env" / "bin" / "python"
    monkeypatch.setenv("CCACHE_DIR", str(tmp_path / "ccache"))
    monkeypatch.setattr(run, "CCACHE_MASQUERADE", tmp_path)
    monkeypatch.setattr(run.shutil, "which", lambda name: "/usr/bin/ccache")
    env = run.test_environment(python, tmp_path / "ext", 40000, 0, 1)
    assert env["DSMATRIX_JIT_LOCKS"] == str(tmp_path / "ccache") and (tmp_path / "ccache").is_dir()
    monkeypatch.setattr(run, "CCACHE_MASQUERADE", tmp_path / "absent")
    assert "DSMATRIX_JIT_LOCKS" not in run.test_environment(python, tmp_path / "ext", 40000, 0, 1)


STUB_BUILD = """
import time, os
def build_shm_op():
    with open(os.environ["BUILD_LOG"], "a") as log:
        log.write(f"start {time.monotonic()}\\n"); log.flush(); time.sleep(0.5); log.write(f"end {time.monotonic()}\\n")
"""


def test_two_environments_build_the_comm_op_one_after_the_other(tmp_path: Path) -> None:
    """The engine tests' build step under its lock: two processes started together never build at
    once (DeepSpeed's ``build_shm_op`` stands in by a stub that logs its start and end)."""
    import os
    import subprocess
    import sys

    from dsmatrix.execute.engine_tests import ENGINE_TESTS

    stubs = tmp_path / "stubs"
    (stubs / "deepspeed" / "comm").mkdir(parents=True)
    (stubs / "deepspeed" / "__init__.py").write_text("")
    (stubs / "deepspeed" / "comm" / "__init__.py").write_text("")
    (stubs / "deepspeed" / "comm" / "torch.py").write_text(STUB_BUILD)
    (stubs / "torch.py").write_text("__version__ = '0.0+stub'\n")
    (stubs / "pytest.py").write_text("def fixture(**kwargs):\n    return lambda f: f\n")
    locks, log = tmp_path / "locks", tmp_path / "build.log"
    locks.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(stubs), str(ENGINE_TESTS)]), "BUILD_LOG": str(log)}
    env["DSMATRIX_JIT_LOCKS"] = str(locks)
    code = "import cell_options; cell_options._build_comm_op_in_turn()"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env) for _ in range(2)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    events = [line.split() for line in log.read_text().splitlines()]
    assert [kind for kind, _ in events] == ["start", "end", "start", "end"], events
    assert list(locks.glob("jit-py*-torch0.0+stub.lock"))


def test_a_venv_or_shim_of_an_interpreter_is_found_as_the_interpreter_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """setup-python's tool cache under act is a venv of the local interpreter: environments made
    outside act must be reused inside it, so both must name the same interpreter."""
    import os
    import subprocess
    import sys

    from dsmatrix.infra.interpreters import find_interpreter

    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    real = Path(os.path.realpath(sys._base_executable))
    subprocess.run([str(real), "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    shim = tmp_path / "shims" / f"python{version}"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec "{real}" "$@"\n')
    shim.chmod(0o755)
    for first in (tmp_path / "venv" / "bin", shim.parent):
        monkeypatch.setenv("PATH", f"{first}{os.pathsep}{os.environ['PATH']}")
        assert find_interpreter(version) == real, first


@pytest.mark.parametrize(
    ("earlier", "measured_again"),
    [
        ({}, False),  # decided with today's options: kept, with the files its record names
        ({"minutes": 0.5}, True),  # another budget: measured again
        ({"verdict": "inconclusive"}, True),  # undecided: measured again
        ({"lost": "leak-patched"}, True),  # a file its record names is gone: measured again
    ],
)
def test_a_resumed_run_keeps_benchmarks_that_decided_with_the_same_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, earlier: dict, measured_again: bool
) -> None:
    """An interrupted nightly resumed: its finished cells were benchmarked again, a quarter of an hour each."""
    from dataclasses import asdict, replace

    from dsmatrix.execute.benchmarks import BenchOptions
    from dsmatrix.infra.results import start_run
    from dsmatrix.plan.cells import Selection

    cell = Cell("3.11", "2.13.0+cpu", "0.19.8")
    results = tmp_path / "results"
    first = start_run(results, {})
    names = {part: f"{cell.id}-{part}.json" for part in ("bench-stock", "instructions", "leak-patched")}
    (first.root / "bench").mkdir()
    for part, name in names.items():
        if part != earlier.get("lost"):
            (first.root / "bench" / name).write_text("{}")
    stray = f"{cell.id}-bench-r9-stock.json"  # in the run's folder, named by no record
    (first.root / "bench" / stray).write_text("{}")
    options_then = asdict(replace(BenchOptions(), **{k: v for k, v in earlier.items() if k not in ("verdict", "lost")}))
    benchmarks = {
        "verdict": earlier.get("verdict", "no-regression"),
        "options": options_then,
        "files": [f"bench/{names['bench-stock']}"],
        "instructions": {"files": [f"bench/{names['instructions']}"]},
        "leak": [{"build": "patched", "file": f"bench/{names['leak-patched']}"}],
    }
    found = {"run_id": first.id, "verdict": "fixed", "benchmarks": benchmarks}
    measured = []
    monkeypatch.setattr(schedule, "add_benchmarks", lambda result, *args: measured.append(cell) or result)
    second = start_run(results, {})
    selection = Selection((cell,), {})
    options = schedule.MatrixOptions("nightly", tmp_path, None, results, Cache(tmp_path / "cache"), selection, bench=BenchOptions())
    result = schedule._reused(options, schedule.Plan({cell: LOCAL}, {cell: ""}, {cell: found}), cell, second)
    assert bool(measured) == measured_again
    if not measured_again:
        assert sorted(p.name for p in (second.root / "bench").iterdir()) == sorted(names.values())
    assert not (second.root / "bench" / stray).exists()
    assert result["reused_from"] == first.id
