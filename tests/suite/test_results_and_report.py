from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsmatrix.errors import ConfigError
from dsmatrix.report import render_markdown, write_report
from dsmatrix.results import import_cells, load_run, start_run

PATCH = {"source": "/x/patches/zero3-release-cache", "sha256": "ab" * 32, "diffs": [{"versions": ">=0.19.3", "file": "d.diff"}]}


def cell(ds: str, verdict: str, reasons: list[str], tests: dict | None = None) -> dict:
    builds = {}
    if tests is not None:
        builds = {
            build: {
                "installed": {"python": "3.11.7", "torch": "2.13.0+cpu", "deepspeed": ds + ("+patched.ab" if build == "patched" else "")},
                "tests": outcome,
            }
            for build, outcome in tests.items()
        }
    return {
        "schema": 1,
        "cell": {
            "id": f"py3.11-torch2.13.0+cpu-ds{ds}",
            "label": f"matrix(py3.11, torch2.13.0+cpu, ds{ds})",
            "python": "3.11",
            "torch": "2.13.0+cpu",
            "deepspeed": ds,
        },
        "verdict": verdict,
        "reasons": reasons,
        "builds": builds,
        "timings": {"setup_s": 1.0, "tests_s": 2.0, "total_s": 3.0},
    }


FIXED = cell(
    "0.19.8",
    "fixed",
    ["stock fails all"],
    {
        "stock": {"test_retrace::t[fp32]": {"outcome": "failed", "bug": "retrace", "message": "differs"}},
        "patched": {"test_retrace::t[fp32]": {"outcome": "passed", "bug": "retrace"}},
    },
)
NOT_FIXED = cell(
    "0.19.7",
    "not-fixed",
    ["patched failed: test_retrace::t[fp32]: differs"],
    {
        "stock": {"test_retrace::t[fp32]": {"outcome": "failed", "bug": "retrace", "message": "differs"}},
        "patched": {"test_retrace::t[fp32]": {"outcome": "failed", "bug": "retrace", "message": "differs"}},
    },
)
ERRORED = {**cell("0.19.6", "error", ["matrix(...) stock: install torch: no solution"]), "error_kind": "InstallError"}


def test_run_keeps_each_finished_cell_and_points_latest(tmp_path: Path) -> None:
    run = start_run(tmp_path, {"tier": "default", "patch": PATCH, "runtime": {}})
    assert (tmp_path / "latest").resolve() == run.root.resolve()
    run.add_cell(FIXED)
    summary, cells = load_run(tmp_path / "latest")
    assert summary["status"] == "running" and [c["verdict"] for c in summary["cells"]] == ["fixed"]
    assert cells[0]["cell"]["id"] == FIXED["cell"]["id"]
    run.add_cell(ERRORED)
    run.write_summary("interrupted")
    summary, _ = load_run(run.root)
    assert summary["status"] == "interrupted" and len(summary["cells"]) == 2
    assert not list(run.root.rglob("*.tmp")), "no temporary files left behind"
    second = start_run(tmp_path, {"tier": "default", "patch": PATCH, "runtime": {}})
    assert (tmp_path / "latest").resolve() == second.root.resolve()
    assert json.loads((run.root / "cells" / f"{FIXED['cell']['id']}.json").read_text())["verdict"] == "fixed"


def test_report_shows_every_verdict_and_test_grid() -> None:
    summary = {
        "run_id": "r1",
        "status": "complete",
        "tier": "default",
        "patch": PATCH,
        "runtime": {"dtype": ["fp32"]},
        "host": {"platform": "linux/amd64", "cpu_model": "cpu", "os_image": "Debian GNU/Linux 12 (bookworm)"},
        "excluded": [{"cell": {"label": "matrix(py3.13, torch2.4.1, ds0.19.8)"}, "rule": "no-cp313", "reason": "no wheels"}],
    }
    text = render_markdown(summary, [FIXED, NOT_FIXED, ERRORED])
    assert "**NOT QUALIFIED**" in text
    for verdict in ("**fixed**", "**not-fixed**", "**error**"):
        assert verdict in text
    assert "| `test_retrace::t[fp32]` | retrace | FAIL / pass | FAIL / FAIL | – / – |" in text
    assert "matrix(...) stock: install torch: no solution" in text
    assert "| matrix(py3.13, torch2.4.1, ds0.19.8) | `no-cp313` | no wheels |" in text
    assert 'when = { python = "==3.11", torch = "==2.13.0+cpu", deepspeed = "==0.19.6" }' in text
    assert "0.19.8+patched.ab" in text
    assert "QUALIFIED**" in render_markdown(summary, [FIXED]) and "NOT" not in render_markdown(summary, [FIXED]).split("\n")[2]


def test_report_on_missing_results_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no summary.json"):
        write_report(tmp_path / "latest", tmp_path / "reports")


EMULATED = {
    **cell("0.19.8", "fixed", ["stock fails all"]),
    "cell": {
        "id": "py3.11-torch2.9.1-ds0.19.8-arm64",
        "label": "matrix(py3.11, torch2.9.1, ds0.19.8, arm64)",
        **{"python": "3.11", "torch": "2.9.1", "deepspeed": "0.19.8", "platform": "linux/arm64"},
    },
    "host": {"platform": "linux/arm64", "cpu_model": "cortex-a76 (qemu-user CPU model)", "cpu_count": 2, "bf16": False, "emulated": True},
    "timings": {"setup_s": 500.0, "tests_s": 900.0, "total_s": 1400.0, "emulated": True},
    "builds": {"stock": {"junit": ["raw/a-stock.xml"], "logs": ["raw/a-stock.log"]}},
}


def test_cells_from_an_image_are_imported_with_their_files(tmp_path: Path) -> None:
    """A container's finished cells land in the host's run with their JUnit/log files; unfinished ones do not."""
    staging = start_run(tmp_path / "staging", {"tier": "default", "patch": PATCH, "runtime": {}})
    for name in ("raw/a-stock.xml", "raw/a-stock.log"):
        (staging.root / name).parent.mkdir(parents=True, exist_ok=True)
        (staging.root / name).write_text(name)
    staging.add_cell(EMULATED)
    (staging.root / "cells" / ".half.json.123.tmp").write_text("{")  # a write the container never finished
    (staging.root / "raw" / "b-patched.log").write_text("Segmentation fault")  # an errored cell's log, listed nowhere
    run = start_run(tmp_path / "results", {"tier": "default", "patch": PATCH, "runtime": {}})
    added = import_cells(tmp_path / "staging", run, lambda r: {**r, "image": {"tag": "dsmatrix/rpi5:latest"}})
    assert [c["cell"]["id"] for c in added] == ["py3.11-torch2.9.1-ds0.19.8-arm64"]
    assert (run.root / "raw" / "a-stock.xml").read_text() == "raw/a-stock.xml"
    assert (run.root / "raw" / "b-patched.log").read_text() == "Segmentation fault"
    summary, cells = load_run(run.root)
    assert cells[0]["image"]["tag"] == "dsmatrix/rpi5:latest" and cells[0]["run_id"] == run.id
    text = render_markdown({**summary, "host": {}}, cells)
    assert "500.0 (emulated)" in text
    row = "| matrix(py3.11, torch2.9.1, ds0.19.8, arm64) | dsmatrix/rpi5:latest | cortex-a76 (qemu-user CPU model), 2 CPU(s) | no | yes"
    assert row in text


def _comparison(name: str, ratio: float, low: float, high: float, verdict: str) -> dict:
    return {"benchmark": name, "rounds": 6, "ratio": ratio, "low": low, "high": high, "margin": 0.02, "verdict": verdict,
            "rounds_to_decide": None, "width": high - low}  # fmt: skip


def test_report_shows_throughput_leak_and_plots(tmp_path: Path) -> None:
    series = [{"lifecycle": i, "rss_mb": 900 + 32 * i, "coordinators_alive": i, "linear_submodules_alive": 4 * i, "fwd_module_stack_len": i}
              for i in range(1, 4)]  # fmt: skip
    benchmarks = {
        "rule": "ratio of medians patched/stock ...",
        "margin": 0.02,
        "verdict": "no-regression",
        "comparisons": [_comparison("test_train_step[fp32-ckpt-off]", 0.995, 0.98, 1.01, "no-regression")],
        "calibration": [_comparison("test_train_step[fp32-ckpt-off]", 1.001, 0.99, 1.012, "no-regression")],
        "leak": [{"line": "stock", "growth_mb": 64.0, "series": series}],
    }
    run = start_run(tmp_path / "results", {"tier": "default", "patch": PATCH, "runtime": {}})
    run.add_cell({**FIXED, "benchmarks": benchmarks})
    run.add_cell(
        {**FIXED, "cell": {**FIXED["cell"], "id": "x-arm64", "label": "arm64 cell"}, "benchmarks": {"verdict": "not-measured (emulated)"}}
    )
    run.write_summary("complete")
    text = write_report(run.root, tmp_path / "reports").read_text()
    row = "| `test_train_step[fp32-ckpt-off]` | 0.995 [0.980, 1.010] no-regression | 1.001 [0.990, 1.012] no-regression, 2.2% | 6 |"
    assert f"| **no-regression** {row}" in text
    assert "| arm64 cell | **not-measured (emulated)** |" in text
    assert "| stock | +64 MB over 3 | 3 | 12 | 3 |" in text
    for plot in ("leak-rss.png", "step-time-ratios.png", "leak-rss.svg"):
        assert (tmp_path / "reports" / run.id / plot).stat().st_size > 1000
    assert "[leak-rss.png](leak-rss.png)" in text
