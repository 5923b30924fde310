"""The candidate-fix panel's fixtures, checked without running them: both kinds where they run, and
diffs keyed by the module attribute their release assigns."""

from __future__ import annotations

import tomllib

from panel import GATE, PANEL


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
