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
from conftest import FIXTURES, run_cli

PANEL = FIXTURES / "panel"
RELEASES = {"0.19.8": ">=0.19.3", "0.19.2": ">=0.19,<0.19.3", "0.14.5": ">=0.14,<0.16"}
GATE = {("per-instance-lru", "0.19.8"), ("in-place-update", "0.19.8"), ("no-look-ahead", "0.19.8")}
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


def test_panel_has_both_kinds_where_it_runs() -> None:
    """Both kinds on 0.19.8, every catching test with a candidate there; a correct fix on 0.14.5; both kinds in the gate."""
    manifests = [tomllib.loads(m.read_text()) for m in PANEL.glob("*/manifest.toml")]
    gated = {tomllib.loads((PANEL / name / "manifest.toml").read_text())["expected"] for name, _ in GATE}
    assert gated == {"fixed", "not-fixed"}, "the gate runs one correct and one incomplete candidate"
    kinds = [m["expected"] for m in manifests]
    assert kinds.count("fixed") >= 4 and kinds.count("not-fixed") >= 8
    catching = {m["caught_by"].split("::")[0] for m in manifests if m["caught_by"]}
    assert catching == {m["caught_by"].split("::")[0] for m in manifests if "0.19.8" in m["tested_on"] and m["caught_by"]}
    assert {m["expected"] for m in manifests if "0.19.8" in m["tested_on"]} == {"fixed", "not-fixed"}
    assert "fixed" in {m["expected"] for m in manifests if "0.14.5" in m["tested_on"]}


def test_panel_diffs_key_modules_by_the_attribute_their_release_assigns() -> None:
    """DeepSpeed 0.14/0.15 give modules ``id`` (parameters already ``ds_id``): a 0.14-0.15 diff keyed
    by ``submodule_to_release.ds_id`` raises AttributeError in every test and says nothing about its fix."""
    old = {path.parent.name: path.read_text() for path in PANEL.glob("*/deepspeed-0.14-0.15.diff")}
    assert old and not [name for name, diff in old.items() if "submodule_to_release.ds_id" in diff]
    new = {path.parent.name: path.read_text() for path in PANEL.glob("*/deepspeed-0.19.3-and-later.diff")}
    assert not [name for name, diff in new.items() if "submodule_to_release.id," in diff or "submodule_to_release.id)" in diff]


@pytest.mark.parametrize(("candidate", "release", "manifest"), candidates())
def test_candidate_gets_its_expected_verdict(warm_cache: Path, tmp_path: Path, candidate: Path, release: str, manifest: dict) -> None:
    results = tmp_path / "results"
    args = ("--deepspeed", release, "--dtype", "fp32", "--checkpointing", "on", "--patch", str(candidate), "--results", str(results))
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
