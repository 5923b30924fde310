"""The scheduled workflow and the plan it is fed: every cell of a tier once, with every field the
workflow reads from its matrix."""

from __future__ import annotations

import json
import re
import runpy

import pytest
from helpers import REPO, run_cli

WORKFLOWS = REPO / ".github" / "workflows"


def plan(tier: str) -> dict:
    proc = run_cli("matrix", "--tier", tier, "--platform", "linux/amd64,linux/arm64", "--plan", "--json", cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("tier", ["nightly", "pr"])
def test_plan_names_every_cell_once_with_what_the_cells_job_reads(tier: str) -> None:
    include = plan(tier)["include"]
    ids = [c["id"] for c in include]
    assert ids and len(ids) == len(set(ids)), "every cell exactly once"
    workflow = (WORKFLOWS / "matrix.yml").read_text()
    expressions = re.findall(r"\$\{\{(.*?)\}\}", workflow)
    used = {field for e in expressions for field in re.findall(r"\bmatrix\.(\w+)", e)}
    assert used >= {"id", "label", "runner", "platform", "python"}
    for cell in include:
        assert used <= set(cell), f"{cell['id']}: the workflow reads matrix.{sorted(used - set(cell))}"
        assert cell["runner"] == {"linux/amd64": "ubuntu-24.04", "linux/arm64": "ubuntu-24.04-arm"}[cell["platform"]]


def test_nightly_runs_on_both_architectures_natively() -> None:
    include = plan("nightly")["include"]
    runners = {c["runner"] for c in include}
    assert runners == {"ubuntu-24.04", "ubuntu-24.04-arm"}
    assert all(c["id"].endswith("-arm64") == (c["platform"] == "linux/arm64") for c in include)


def test_the_self_hosted_pi_never_runs_for_pull_requests() -> None:
    matrix = (WORKFLOWS / "matrix.yml").read_text()
    triggers = matrix.split("\non:", 1)[1].split("\npermissions:", 1)[0]
    assert "pull_request" not in triggers and "schedule:" in triggers and "workflow_dispatch:" in triggers
    assert "rpi5" not in (WORKFLOWS / "pr.yml").read_text()


def test_nox_cell_sessions_run_their_own_platform() -> None:
    """Every `nox -s "matrix(..., arm64)"` session plans its own arm64 cell, not the amd64 one."""
    noxfile = runpy.run_path(str(REPO / "noxfile.py"))
    cells = noxfile["_load_cells"]()
    for cell in cells:
        argv = noxfile["cell_argv"](cell)
        assert argv[argv.index("--platform") + 1] == cell.platform, cell.label
    arm = next(c for c in cells if c.platform == "linux/arm64")
    proc = run_cli(*noxfile["cell_argv"](arm), "--plan", "--json", cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (planned,) = json.loads(proc.stdout)["include"]
    assert (planned["id"], planned["platform"]) == (arm.id, "linux/arm64")


def run_blocks(workflow: str) -> list[str]:
    """The shell scripts of a workflow's ``run:`` keys (inline, or the indented block under ``run: |``)."""
    blocks, lines = [], workflow.splitlines()
    for i, line in enumerate(lines):
        found = re.match(r"^(\s*)(?:- )?run:\s*(.*)$", line)
        if not found:
            continue
        if not found.group(2).startswith("|"):
            blocks.append(found.group(2))
            continue
        indent, body = len(found.group(1)), []
        for following in lines[i + 1 :]:
            if following.strip() and len(following) - len(following.lstrip()) <= indent:
                break
            body.append(following)
        blocks.append("\n".join(body))
    return blocks


ALLOWED_RUNNERS = {"ubuntu-24.04", "ubuntu-24.04-arm"}


@pytest.mark.parametrize("name", ["matrix.yml", "pr.yml", "qualify-pr.yml"])
def test_workflows_follow_githubs_hardening_guide(name: str) -> None:
    """Inputs, matrix values and repository variables reach scripts through ``env:``, never inside
    ``run:``; no checkout keeps its credentials; a value written to ``$GITHUB_ENV`` is refused when
    it holds a line break (which would set other variables)."""
    workflow = (WORKFLOWS / name).read_text()
    scripts = run_blocks(workflow)
    assert scripts and not [s for s in scripts if "${{" in s], "an expression inside a script is a script injection"
    checkouts = workflow.split("uses: actions/checkout@")[1:]
    assert checkouts and all(re.match(r"v\d+\n\s+with:\n\s+persist-credentials: false\n", c) for c in checkouts)
    for script in scripts:
        if "GITHUB_ENV" in script:
            guard, write = script.index("*$'\\n'*"), script.index('>> "$GITHUB_ENV"')
            assert guard < write, script


def test_pr_code_never_saves_a_cache_nor_reaches_a_self_hosted_runner() -> None:
    """qualify-pr.yml runs a PR's code: its caches are restore-only, and its runners come from an
    allow-list of GitHub-hosted labels that no input can extend."""
    workflow = (WORKFLOWS / "qualify-pr.yml").read_text()
    assert "actions/cache@" not in workflow and "actions/cache/restore@" in workflow
    assert re.findall(r"runs-on:\s*(.*)", workflow) == ["${{ matrix.runner }}"]
    (expression,) = re.findall(r"^\s+runner: \$\{\{(.*)\}\}$", workflow, re.M)
    listed = {label for array in re.findall(r"'(\[.*?\])'", expression) for label in json.loads(array)}
    assert listed == ALLOWED_RUNNERS, listed
    rest = re.sub(r"inputs\.platforms == '[\w ]+'|'\[.*?\]'|fromJSON|&&|\|\||[\s()]", "", expression)
    assert rest == "", f"the runner expression holds more than choices and allowed labels: {rest!r}"


def test_a_schedule_benchmarks_as_the_tier_says() -> None:
    """Only a dispatch with benchmarks unticked passes ``--no-bench``: GitHub compares null (a
    schedule's missing input) equal to false, so the input is read as text, and on dispatches only."""
    workflow = (WORKFLOWS / "matrix.yml").read_text()
    (expression,) = re.findall(r"^\s+BENCHMARKS: \$\{\{(.*)\}\}$", workflow, re.M)
    assert "github.event_name == 'workflow_dispatch' && format('{0}', inputs.benchmarks) == 'false'" in expression
    runs = re.findall(r"nox -s matrix -- .*", workflow)
    assert runs and all(run.endswith('"${bench[@]}"') for run in runs), runs
    assert workflow.count('bench=(); if [ "$BENCHMARKS" = off ]; then bench=(--no-bench); fi') == len(runs)


@pytest.mark.parametrize("name", ["matrix.yml", "pr.yml", "qualify-pr.yml"])
def test_every_cache_key_hashes_files_that_exist(name: str) -> None:
    """``hashFiles`` of a path that is gone hashes nothing: the cache key would never change with the
    code it stands for (the build code moved from ``builds.py`` to ``build/``)."""
    workflow = (WORKFLOWS / name).read_text()
    patterns = [p for call in re.findall(r"hashFiles\(([^)]*)\)", workflow) for p in re.findall(r"'([^']+)'", call)]
    assert patterns, name
    assert [p for p in patterns if not any(REPO.glob(p))] == []
