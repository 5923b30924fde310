from __future__ import annotations

import json
import re
from pathlib import Path

from stores import ERRORED, FIXED, PATCH, cell

from dsmatrix.infra.results import import_cells, load_run, start_run
from dsmatrix.report.qualification import load_report, write_report


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


EMULATED = {
    **cell("0.19.8", "fixed", ["stock fails all"], platform="linux/arm64"),
    "host": {"platform": "linux/arm64", "cpu_model": "cortex-a76 (qemu-user CPU model)", "cpu_count": 2, "bf16": False, "emulated": True,
             "emulator": "qemu-user"},
    "timings": {"setup_s": 500.0, "tests_s": 900.0, "total_s": 1400.0, "emulated": True},
    "builds": {"stock": {"junit": ["raw/a-stock.xml"], "logs": ["raw/a-stock.log"]}},
}  # fmt: skip


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
    run.write_summary("complete")
    target = write_report([run.root], tmp_path / "reports")
    entry = load_report(target)["cells"][0]
    assert entry["environment"]["host"] == "image dsmatrix/rpi5:latest" and entry["environment"]["emulated"]
    text = (target / "qualification.md").read_text()
    assert "| cortex-a76 (qemu-user CPU model) | no | yes (qemu-user) |" in text
    assert "- where: image dsmatrix/rpi5:latest, linux/arm64, cortex-a76 (qemu-user CPU model) (2 CPUs)" in text
    assert "set-up 500.0 s, tests 900.0 s (under emulation: how long it took, not how fast the code is)" in text


def test_resume_reuses_only_final_verdicts_of_the_same_fingerprint(tmp_path: Path) -> None:
    """fixed and not-fixed are final; undetected, error and interrupted always run again."""
    from dsmatrix.execute.schedule import FINAL, RESUME
    from dsmatrix.infra.results import find_finished

    run = start_run(tmp_path / "results", {"patch": PATCH})
    for ds, verdict in (
        ("0.19.8", "fixed"),
        ("0.19.2", "not-fixed"),
        ("0.18.9", "undetected"),
        ("0.17.6", "error"),
        ("0.16.9", "interrupted"),
    ):
        run.add_cell(cell(ds, verdict, ["r"]))
    store = tmp_path / "results"
    assert find_finished(store, "fp-0.19.8", FINAL)["verdict"] == "fixed"
    assert find_finished(store, "fp-0.19.2", FINAL)["verdict"] == "not-fixed"
    assert find_finished(store, "fp-0.19.2", RESUME["fixed-only"]) is None  # --rerun-failed
    for ds in ("0.18.9", "0.17.6", "0.16.9"):
        assert find_finished(store, f"fp-{ds}", FINAL) is None
    assert find_finished(store, "fp-0.19.8", RESUME["none"]) is None  # --fresh
    assert find_finished(store, "another suite's fingerprint", FINAL) is None


def test_a_truncated_cell_file_is_never_reused_and_loading_says_which_file(tmp_path: Path) -> None:
    import pytest

    from dsmatrix.execute.schedule import FINAL
    from dsmatrix.infra.errors import ResultsError
    from dsmatrix.infra.results import find_finished

    run = start_run(tmp_path / "results", {"patch": PATCH})
    path = run.add_cell(cell("0.19.8", "fixed", ["ok"]))
    path.write_text(path.read_text()[:100])  # a disk that filled up, a copy cut short
    assert find_finished(tmp_path / "results", "fp-0.19.8", FINAL) is None
    with pytest.raises(ResultsError, match=re.escape(f"{path}: truncated or not JSON")):
        load_run(run.root)
    path.write_text(json.dumps({"schema": 7, "cell": {}, "verdict": "fixed", "reasons": []}))
    with pytest.raises(ResultsError, match=re.escape(f"{path}: not a dsmatrix result (schema 7, expected 1)")):
        load_run(run.root)


def test_evidence_names_no_folder_interpreter_or_host_of_the_machine_that_made_it(tmp_path: Path) -> None:
    """A run's records, JUnit files, logs and benchmark JSON, and the report made from them, hold no
    absolute path of the run's folders, the working folder, home, the temporary folder or the
    interpreter, nor the host name; the patch is named by its name and sha256."""
    import socket
    import sys
    import tempfile

    results = tmp_path / "results"
    run = start_run(results, {"tier": "default", "patch": {**PATCH, "source": "zero3-release-cache"}, "matrix": str(Path.cwd() / "m.toml")})
    home, cwd, temp = Path.home(), Path.cwd(), tempfile.gettempdir()
    machine = [str(run.root), str(tmp_path), str(home), str(cwd), temp, sys.prefix, sys.base_prefix]
    cell_id = FIXED["cell"]["id"]
    said = f"exited 1: see {run.root}/raw/{cell_id}-stock.log; wheel {home}/.cache/dsmatrix/w.whl; python {sys.executable}; cwd {cwd}"
    for name, text in {
        f"raw/{cell_id}-stock-ws1-rank0.xml": f'<testsuites><testsuite hostname="{socket.gethostname()}"><testcase file="{cwd}/t.py"/>'
        f"<skipped>{temp}/x/t.py:3: skip</skipped></testsuite></testsuites>",
        f"raw/{cell_id}-stock.log": f"Traceback: {sys.base_prefix}/lib/python3.11/x.py and {run.root}/raw",
        f"bench/{cell_id}-stock.json": json.dumps({"machine_info": {"node": socket.gethostname()}, "path": f"{temp}/b"}, indent=4),
    }.items():
        (run.root / name).parent.mkdir(parents=True, exist_ok=True)
        (run.root / name).write_text(text)
    run.add_cell({**FIXED, "reasons": [said], "benchmarks": {**FIXED["benchmarks"], "files": [f"bench/{cell_id}-stock.json"]}})
    run.write_summary("complete")
    target = write_report([results], tmp_path / "reports")
    written = [
        p for p in (*run.root.rglob("*"), *target.rglob("*")) if p.is_file() and p.suffix in (".json", ".xml", ".log", ".md", ".html")
    ]
    assert len(written) >= 9
    for path in written:
        text = path.read_text()
        found = [m for m in machine if m in text] + [
            f"host {socket.gethostname()}" for h in ('hostname="', '"node": "') if h + socket.gethostname() in text
        ]
        assert not found, f"{path.relative_to(tmp_path)} names {found}"
    record = json.loads((run.root / "cells" / f"{cell_id}.json").read_text())
    python = f"<python>/{Path(sys.executable).relative_to(sys.prefix)}"
    assert record["reasons"] == [f"exited 1: see <run>/raw/{cell_id}-stock.log; wheel ~/.cache/dsmatrix/w.whl; python {python}; cwd <cwd>"]
    assert load_report(target)["patch"]["source"] == "zero3-release-cache"
