"""The candidate-fix panel (``tests/fixtures/panel/``): correct fixes shaped differently from the
bundled one come out ``fixed``; incomplete ones ``not-fixed``, naming the test that caught them.

Each candidate runs (one cell, fp32 with checkpointing: every bug and every reference test
applies there) on the releases its manifest lists in ``tested_on``: every test that can catch a
candidate on 0.19.8 beside a correct fix of another shape, and a correct fix on the oldest range
(0.14.5).
``DSMATRIX_PANEL=all`` (the acceptance session) runs every candidate on every release it has a diff for.
Marked ``panel`` (and ``e2e``): each candidate builds and tests a patched DeepSpeed. The landing
gate runs three of them (``GATE``, marked ``gate``) on 0.19.8: a correct fix of another shape, an
incomplete one, and a rewrite of the release computation that only settings users run show.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
from helpers import run_cli
from panel import GATE, PANEL, RELEASES

DIFFERS = "patched behaves differently from stock where stock is right: "
BEHAVIOUR = ("patched gathers per step", "peak resident numel per step", "first difference: ")


def candidates() -> list:
    params = []
    for manifest in sorted(PANEL.glob("*/manifest.toml")):
        data = tomllib.loads(manifest.read_text())
        ranges = {d["versions"] for d in data["diff"]}
        wanted = set(RELEASES) if os.environ.get("DSMATRIX_PANEL") == "all" else set(data["tested_on"])
        for release, versions in RELEASES.items():
            if versions in ranges and (release in wanted or (manifest.parent.name, release) in GATE):
                marks = [pytest.mark.e2e, pytest.mark.panel]
                if (manifest.parent.name, release) in GATE:
                    marks.append(pytest.mark.gate)
                params.append(pytest.param(manifest.parent, release, data, id=f"{manifest.parent.name}-{release}", marks=marks))
    return params


@pytest.mark.parametrize(("candidate", "release", "manifest"), candidates())
def test_candidate_gets_its_expected_verdict(warm_cache: Path, tmp_path: Path, candidate: Path, release: str, manifest: dict) -> None:
    results = tmp_path / "results"
    args = ("--deepspeed", release, "--dtype", "fp32", "--checkpointing", "on", "--no-bench", "--patch", str(candidate))
    args += ("--results", str(results))
    proc = run_cli("matrix", *args, cwd=tmp_path)
    (cell_file,) = (results / "latest" / "cells").glob("*.json")
    result = json.loads(cell_file.read_text())
    expected = "fixed" if release in manifest.get("fixed_on", {}) else manifest["expected"]  # a defect that cannot show there
    assert result["verdict"] == expected, f"{candidate.name} on {release}: {result['verdict']}: {result['reasons']}"
    assert proc.returncode == (0 if expected == "fixed" else 1)
    if expected == "not-fixed":  # caught by the named test seeing the bug, or by the crash that is its defect
        caught, crash = manifest["caught_by"], manifest.get("caught_with", "")
        by_its_defect = [r for r in result["reasons"] if caught in r and (crash in r if crash else "not the bug" not in r)]
        assert by_its_defect, result["reasons"]
        if caught.startswith("test_stock_equivalence"):  # a difference from stock is named as behaviour, first
            assert result["reasons"][0].startswith(DIFFERS) and any(b in result["reasons"][0] for b in BEHAVIOUR), result["reasons"]
