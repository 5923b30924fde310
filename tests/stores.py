"""Cell results and results stores built from fixtures, as ``nox -s matrix`` writes them
(``results.start_run`` / ``Run.add_cell``), for the report and store tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsmatrix.infra.results import Run, start_run

PATCH = {"source": "/x/patches/zero3-release-cache", "sha256": "ab" * 32, "diffs": [{"versions": ">=0.19.3", "file": "d.diff"}]}
HOST = {
    "platform": "linux/amd64", "machine": "x86_64", "cpu_model": "AMD EPYC", "cpu_count": 2, "cpu_features": ["avx2", "avx512_bf16"],
    "bf16": True, "emulated": False, "emulator": None, "kernel": "6.1.0", "os_image": "Debian GNU/Linux 12 (bookworm)",
}  # fmt: skip
ARM_HOST = {**HOST, "platform": "linux/arm64", "machine": "aarch64", "cpu_model": "Neoverse-N2", "cpu_features": ["asimd", "bf16"]}
BUG_TEST, CONTROL_TEST = "test_retrace::t[fp32]@ws1", "test_control::t[fp32]@ws1"


def cell(ds: str, verdict: str, reasons: list[str], tests: dict | None = None, platform: str = "linux/amd64", **extra: Any) -> dict:
    """One cell's result; ``tests`` maps build -> test id -> outcome."""
    suffix = "-arm64" if platform == "linux/arm64" else ""
    torch = "2.9.1" if suffix else "2.13.0+cpu"
    builds = {}
    for build, outcomes in (tests or {}).items():
        installed = {"python": "3.11.7", "torch": torch, "deepspeed": ds + ("+zfix.ab" if build == "patched" else "")}
        builds[build] = {
            "installed": installed,
            "wheel": f"deepspeed-{ds}-py3-none-any.whl",
            "freeze": [f"deepspeed=={installed['deepspeed']}", f"torch=={torch}", "numpy==2.4.6"],
            "junit": [f"raw/ds{ds}{suffix}-{build}.xml"],
            "tests": outcomes,
        }
    return {
        "schema": 1,
        "fingerprint": f"fp-{ds}{suffix}",
        "cell": {
            "id": f"py3.11-torch{torch}-ds{ds}{suffix}",
            "label": f"matrix(py3.11, torch{torch}, ds{ds}{', arm64' if suffix else ''})",
            **{"python": "3.11", "torch": torch, "deepspeed": ds, "platform": platform},
        },
        "host": ARM_HOST if suffix else HOST,
        "verdict": verdict,
        "reasons": reasons,
        "builds": builds,
        "timings": {"setup_s": 1.0, "tests_s": 2.0, "total_s": 3.0, "emulated": False},
        "finished_at": "2026-11-30T10:00:00Z",
        **extra,
    }


def outcome(result: str, bug: str | None, message: str = "") -> dict:
    """A test's result in a cell JSON; a failing bug test observed its bug (figures recorded)."""
    observed = {"bug_observed": {"gathers_retraced": 16, "gathers_fresh": 14}} if bug and result == "failed" else {}
    return {"outcome": result, **({"bug": bug} if bug else {}), **({"message": message} if message else {}), **observed}


def pair(stock_bug: str, patched_bug: str) -> dict:
    """Both builds' outcomes of the bug test and of a control that passes on both."""
    return {
        "stock": {BUG_TEST: outcome(stock_bug, "retrace", "release decisions differ"), CONTROL_TEST: outcome("passed", None)},
        "patched": {BUG_TEST: outcome(patched_bug, "retrace", "release decisions differ"), CONTROL_TEST: outcome("passed", None)},
    }


def comparison(name: str, ratio: float, low: float, high: float, verdict: str) -> dict:
    return {"benchmark": name, "kind": "step", "rounds": 6, "ratio": ratio, "low": low, "high": high, "margin": 0.02,
            "verdict": verdict, "stock_s": 0.030, "patched_s": 0.030 * ratio, "width": high - low}  # fmt: skip


def instructions(verdict: str = "no-regression", ratio: float = 1.0004, aa: float = 1.00002) -> dict:
    step = {"benchmark": "test_train_step[fp32-ckpt-off]", "kind": "step", "stock": 65_000_000, "patched": 65_000_000 * ratio,
            "stock_again": 65_000_000 * aa, "ratio": ratio, "aa": aa, "uncertainty": abs(aa - 1), "verdict": verdict}  # fmt: skip
    release = {**step, "benchmark": "test_release_path[fp32-ckpt-off]", "kind": "release-path", "stock": 800_000, "patched": 840_000,
               "stock_again": 800_100, "ratio": 1.05, "aa": 1.000125, "uncertainty": 0.000125, "verdict": "regression"}  # fmt: skip
    return {"metric": "instructions", "tool": "valgrind-3.19.0 callgrind", "margin": 0.005, "tolerance": 0.0025, "steps": 5,
            "rule": "per benchmark, the median instructions ...", "comparisons": [step, release], "verdict": verdict,
            "calibration": "pass" if abs(aa - 1) <= 0.0025 else "fail", "duration_s": 280.0}  # fmt: skip


def benchmarks(verdict: str = "no-regression", ratio: float = 0.995, counted: str | None = "no-regression") -> dict:
    """A cell's benchmarks: step time decided ``verdict``; instructions ``counted`` (None: not counted)."""
    series = [{"lifecycle": i, "rss_mb": 900 + 32 * i, "coordinators_alive": i, "linear_submodules_alive": 4 * i, "fwd_module_stack_len": i}
              for i in range(1, 4)]  # fmt: skip
    low, high = ratio - 0.015, ratio + 0.015
    return {
        "rule": "per round, patched/stock ...",
        "rounds": 6,
        "margin": 0.02,
        "verdict": verdict if counted is None or verdict == "regression" else counted,
        "time_verdict": verdict,
        "decided_by": "step time" if counted is None or verdict == "regression" else "instructions",
        "headline_rule": "a cell's throughput is decided on the training step by executed instructions ...",
        "stopped": "decided",
        "max_rounds": 45,
        "rounds_duration_s": 400.0,
        **({"instructions": instructions(counted)} if counted else {}),
        "comparisons": [comparison("test_train_step[fp32-ckpt-off]", ratio, low, high, verdict)],
        "calibration": [comparison("test_train_step[fp32-ckpt-off]", 1.001, 0.99, 1.012, "no-regression")],
        "calibration_verdict": "no-regression",
        "certifiable_margin": 0.012,
        "leak": [{"line": "stock", "build": "stock", "drain": False, "growth_mb": 64.0, "series": series}],
    }


FIXED = cell("0.19.8", "fixed", ["stock fails all 1 applicable bug tests (retrace); patched passes all 2"], pair("failed", "passed"),
             benchmarks=benchmarks())  # fmt: skip
NOT_FIXED = cell("0.19.7", "not-fixed", ["patched failed: test_retrace::t[fp32]@ws1: release decisions differ"], pair("failed", "failed"))
ERRORED = cell("0.19.6", "error", ["matrix(py3.11, torch2.13.0+cpu, ds0.19.6) stock: install torch: no solution"],
               error_kind="InstallError")  # fmt: skip
ARM_FIXED = cell("0.19.8", "fixed", ["stock fails all 1 applicable bug tests (retrace); patched passes all 2"], pair("failed", "passed"),
                 platform="linux/arm64")  # fmt: skip
EXCLUDED = {
    "cell": {"id": "py3.13-torch2.4.1-ds0.19.8", "label": "matrix(py3.13, torch2.4.1, ds0.19.8)", "python": "3.13", "torch": "2.4.1",
             "deepspeed": "0.19.8", "platform": "linux/amd64"},
    "rule": "torch-2.4-has-no-cp313",
    "reason": "torch 2.4.1 publishes no CPython 3.13 wheels",
}  # fmt: skip


def store(
    root: Path,
    cells: list[dict],
    status: str = "complete",
    patch: dict = PATCH,
    excluded: list | None = None,
    planned: list | None = None,
    at: float | None = None,
) -> Run:
    """A results store at ``root`` with one run holding ``cells`` (and their JUnit files); ``planned``
    (cell dicts) is recorded as the run's plan when given, as a matrix run records it; ``at``
    (seconds since the epoch) is the moment the run starts, its id's time, when given."""
    meta = {"tier": "default", "patch": patch, "runtime": {"dtype": ["fp32"]}, "excluded": excluded or []}
    if planned is not None:
        meta["planned"] = planned
    run = start_run(root, meta) if at is None else start_run(root, meta, now=lambda: at)
    for result in cells:
        for build in result.get("builds", {}).values():
            for name in build.get("junit", []):
                (run.root / name).parent.mkdir(parents=True, exist_ok=True)
                (run.root / name).write_text(f'<testsuites><testsuite name="{name}" tests="2"/></testsuites>')
        run.add_cell(result)
    run.write_summary(status)
    return run
