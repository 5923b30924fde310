"""The workflows as GitHub would run them, executed here with act: matrix.yml dispatched with the
default tier (plan -> every cells job -> report) and pr.yml's jobs. Checks what a maintainer looks
at: the plan's job matrix, one results store per cell job, and the report job's qualification
report with its headline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from act_runner import REPO, Act, ActResult

sys.path.insert(0, str(REPO / "tests"))
from deepspeed_repo import git, make_repo  # noqa: E402

TIER = "default"


@pytest.fixture(scope="module")
def matrix_run(act: Act, platforms: str) -> ActResult:
    return act.run("matrix.yml", "workflow_dispatch", inputs={"tier": TIER, "platforms": platforms, "benchmarks": "false"})


@pytest.fixture(scope="module")
def planned(platforms: str) -> list[dict]:
    """The tier's plan as the tool computes it (the job matrix the workflow must have used)."""
    command = [sys.executable, "-m", "dsmatrix", "matrix", "--tier", TIER, "--platform", platforms, "--plan", "--json"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)["include"]


def test_matrix_workflow_runs_plan_every_cell_and_report(matrix_run: ActResult, planned: list[dict]) -> None:
    assert matrix_run.returncode == 0, f"act exited {matrix_run.returncode} ({matrix_run.log}):\n{matrix_run.tail()}"
    jobs = matrix_run.job_results()
    assert jobs.get("plan") == "succeeded" and jobs.get("report") == "succeeded", jobs
    for cell in planned:
        assert any(cell["label"] in name and outcome == "succeeded" for name, outcome in jobs.items()), (cell["label"], jobs)


def test_plan_job_matrix_is_the_tiers_plan(matrix_run: ActResult, planned: list[dict]) -> None:
    (output,) = matrix_run.outputs("plan", "matrix") or [None]
    assert output is not None, f"the plan job set no matrix output ({matrix_run.log}):\n{matrix_run.tail()}"
    assert json.loads(output) == {"include": planned}


def test_one_results_store_per_cell_job(matrix_run: ActResult, act: Act, planned: list[dict]) -> None:
    for cell in planned:
        store = act.artifacts / f"results-{cell['id']}"
        assert store.is_dir(), f"{cell['label']}: no results-{cell['id']} artifact ({matrix_run.log})"
        results = {p.resolve(): json.loads(p.read_text()) for p in store.glob("*/cells/*.json") if p.parent.parent.name != "latest"}
        assert [r["cell"]["id"] for r in results.values()] == [cell["id"]], f"{store}: one cell, this job's"
        (result,) = results.values()
        assert result["verdict"] == "fixed", (cell["label"], result["reasons"])


def test_report_job_leaves_the_qualification_report(matrix_run: ActResult, act: Act, planned: list[dict]) -> None:
    reports = sorted((act.artifacts / "qualification").glob("*/qualification.json"))
    assert len(reports) == 1, f"the report job uploaded {len(reports)} qualification report(s) ({matrix_run.log})"
    folder = reports[0].parent
    assert all((folder / f"qualification.{ext}").stat().st_size > 0 for ext in ("md", "html"))
    report = json.loads(reports[0].read_text())
    # dispatched with benchmarks unticked, for acceptance time: every cell fixed, throughput not
    # measured (the report job gates with --require correct, the dispatch default)
    assert report["verdict"] == "CORRECT, THROUGHPUT NOT SHOWN", report["verdict_reasons"]
    assert report["verdict_summary"] == f"correct everywhere; throughput not measured in {len(planned)} cell(s)"
    assert sorted(c["id"] for c in report["cells"]) == sorted(c["id"] for c in planned)
    assert report["coverage"]["tier"] == TIER and report["coverage"]["finished"] == len(planned), report["coverage"]
    assert "## ⚠️ CORRECT, THROUGHPUT NOT SHOWN" in (folder / "qualification.md").read_text()
    print(f"qualification report of the act-run workflow: {folder}/qualification.{{md,html,json}}")


@pytest.mark.parametrize("job", ["lint", "tests", "pr-tier"])
def test_pr_workflow_job(act: Act, job: str, skipped_jobs: set[str]) -> None:
    """pr.yml's jobs; pr-tier runs the one-cell smoke tier here (repository variable PR_TIER=smoke), for CI time."""
    if f"pr.yml:{job}" in skipped_jobs:
        pytest.skip(f"pr.yml:{job} skipped by --skip-job")
    variables = ("PR_TIER=smoke",) if job == "pr-tier" else ()
    result = act.run("pr.yml", "pull_request", job=job, variables=variables)
    assert result.returncode == 0, f"act exited {result.returncode} ({result.log}):\n{result.tail()}"
    assert result.job_results() == {job: "succeeded"}
    if job == "pr-tier":
        uploaded = list((act.artifacts / "pr-qualification").glob("*/qualification.json"))
        assert len(uploaded) == 1 and json.loads(uploaded[0].read_text())["verdict"] == "CORRECT, THROUGHPUT NOT SHOWN"


def test_qualify_pr_workflow_on_a_local_pr(act: Act, tmp_path: Path, skipped_jobs: set[str]) -> None:
    """qualify-pr.yml dispatched on a repository made from the master snapshot: base master, head
    the branch that commits the fix; one amd64 runner, the one-cell smoke tier and the quick set of
    DeepSpeed's own tests, for CI time. ``.ci/run`` skips it (``--skip-job qualify-pr.yml:qualify``):
    its command is the PR-mode run of tests/e2e/test_git_sources.py, which ``nox -s tests`` has
    just run."""
    if "qualify-pr.yml:qualify" in skipped_jobs:
        pytest.skip("qualify-pr.yml:qualify skipped by --skip-job")
    repo = make_repo(tmp_path)
    base, head = git(repo, "rev-parse", "master"), git(repo, "rev-parse", "fix")
    inputs = {"repository": str(repo), "base": "master", "head": "fix", "tier": "smoke", "platforms": "amd64"}
    inputs["deepspeed_tests"] = "quick"
    result = act.run("qualify-pr.yml", "workflow_dispatch", inputs=inputs)
    assert result.returncode == 0, f"act exited {result.returncode} ({result.log}):\n{result.tail()}"
    assert list(result.job_results().values()) == ["succeeded"], result.job_results()
    (uploaded,) = (act.artifacts / "pr-evidence-ubuntu-24.04").glob("*/qualification.json")
    report = json.loads(uploaded.read_text())
    (cell,) = report["cells"]
    assert cell["verdict"] == "fixed", cell["reasons"]
    evidence = cell["evidence"]
    assert evidence["git"]["base"]["commit"] == base and evidence["git"]["head"]["commit"] == head
    assert evidence["coverage"]["executed_lines"] == evidence["coverage"]["changed_lines"] > 0
    assert evidence["deepspeed_tests"]["patched"]["passed"] > 0 and not evidence["deepspeed_tests"]["regressions"]
    markdown = (uploaded.parent / "qualification.md").read_text()
    assert "## Evidence without a GPU" in markdown and head in markdown
    assert (uploaded.parent / "evidence.md").read_text() in markdown, "the evidence for the PR is the report's own section"
