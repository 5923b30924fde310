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
