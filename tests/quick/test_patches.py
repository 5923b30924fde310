from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsmatrix.build.patches import apply_diff, load_patch_set
from dsmatrix.build.wheels import build_key, build_wheel
from dsmatrix.infra.cache import Cache
from dsmatrix.infra.errors import PatchDoesNotApply, PatchError
from dsmatrix.plan.cells import Cell

TARGET = "deepspeed/runtime/zero/partitioned_param_coordinator.py"
ORIGINAL = "one\ntwo\nthree\nfour\nfive\n"
DIFF = f"""--- a/{TARGET}
+++ b/{TARGET}
@@ -1,5 +1,5 @@
 one
 two
-three
+THREE
 four
 five
"""


def tree(tmp_path: Path, text: str = ORIGINAL) -> Path:
    file = tmp_path / "src" / TARGET
    file.parent.mkdir(parents=True)
    file.write_text(text)
    return tmp_path / "src"


def test_bundled_manifest_maps_every_range(repo: Path) -> None:
    patch = load_patch_set(repo / "patches" / "zero3-release-cache")
    assert patch.diff_for("0.14.5").name == "deepspeed-0.14-0.15.diff"
    assert patch.diff_for("0.16.9").name == "deepspeed-0.16-0.17.diff"
    assert patch.diff_for("0.18.9").name == "deepspeed-0.18.diff"
    assert patch.diff_for("0.19.2").name == "deepspeed-0.19.0-0.19.2.diff"
    assert patch.diff_for("0.19.8").name == "deepspeed-0.19.3-and-later.diff"
    assert len(patch.sha256) == 64


def test_version_without_a_diff_is_named(repo: Path) -> None:
    patch = load_patch_set(repo / "patches" / "zero3-release-cache")
    with pytest.raises(PatchError, match=r"DeepSpeed 0\.13\.1: no diff covers it in .*zero3-release-cache"):
        patch.diff_for("0.13.1")


def test_single_diff_covers_every_version_and_identity_follows_content(tmp_path: Path) -> None:
    diff = tmp_path / "candidate.patch"
    diff.write_text(DIFF)
    first = load_patch_set(diff)
    assert first.diff_for("0.19.8") == diff and first.diff_for("0.14.5") == diff
    diff.write_text(DIFF.replace("THREE", "Three"))
    assert load_patch_set(diff).sha256 != first.sha256


def test_apply_changes_the_tree(tmp_path: Path) -> None:
    diff = tmp_path / "fix.diff"
    diff.write_text(DIFF)
    src = tree(tmp_path)
    apply_diff(diff, src, "0.19.8")
    assert (src / TARGET).read_text() == ORIGINAL.replace("three", "THREE")


def test_hunk_that_does_not_apply_names_version_file_and_hunk(tmp_path: Path) -> None:
    diff = tmp_path / "fix.diff"
    diff.write_text(DIFF)
    src = tree(tmp_path, ORIGINAL.replace("three", "drei"))
    with pytest.raises(PatchDoesNotApply) as info:
        apply_diff(diff, src, "0.18.9")
    message = str(info.value)
    assert message.startswith("DeepSpeed 0.18.9: fix.diff does not apply:")
    assert f"{TARGET} hunk #1 FAILED" in message
    assert (src / TARGET).read_text() == ORIGINAL.replace("three", "drei"), "a failed patch must leave the tree untouched"


SYMLINK_DIFF = """diff --git a/deepspeed/escape b/deepspeed/escape
new file mode 120000
index 0000000..1111111
--- /dev/null
+++ b/deepspeed/escape
@@ -0,0 +1 @@
+{outside}
\\ No newline at end of file
"""


def test_a_diff_that_makes_a_symlink_is_refused_before_anything_is_applied(tmp_path: Path) -> None:
    """GNU patch creates a git diff's symbolic link (mode 120000), through which a later hunk, or the
    build, reaches outside the tree: such a diff does not apply, and the tree is left as it was."""
    diff = tmp_path / "link.diff"
    diff.write_text(SYMLINK_DIFF.format(outside=tmp_path) + DIFF)
    src = tree(tmp_path)
    before = sorted(p.relative_to(src) for p in src.rglob("*"))
    with pytest.raises(PatchDoesNotApply) as info:
        apply_diff(diff, src, "0.19.8")
    assert str(info.value) == (
        "DeepSpeed 0.19.8: link.diff does not apply: it makes 1 symbolic link(s) or submodule(s), which the suite never applies"
    )
    assert sorted(p.relative_to(src) for p in src.rglob("*")) == before and (src / TARGET).read_text() == ORIGINAL


def test_malformed_patch_sets(tmp_path: Path) -> None:
    not_a_diff = tmp_path / "notes.txt"
    not_a_diff.write_text("just words\n")
    with pytest.raises(PatchError, match="not a unified diff"):
        load_patch_set(not_a_diff)
    folder = tmp_path / "set"
    folder.mkdir()
    with pytest.raises(PatchError, match="neither a diff file nor a folder with manifest.toml"):
        load_patch_set(folder)
    (folder / "manifest.toml").write_text('[[diff]]\nversions = ">=0.19"\nfile = "missing.diff"\n')
    with pytest.raises(PatchError, match="missing.diff not found"):
        load_patch_set(folder)
    (folder / "manifest.toml").write_text('[[diff]]\nversions = "newest"\nfile = "x.diff"\n')
    with pytest.raises(PatchError, match="bad versions 'newest'"):
        load_patch_set(folder)


def test_a_cached_wheel_names_its_patch_by_name_whichever_checkout_built_it(tmp_path: Path) -> None:
    """A patched wheel in the shared cache, built from another checkout: the build facts a record
    keeps name the patch, not that checkout's folder (nightly part 7 published one such path)."""
    patch = load_patch_set(Path(__file__).parents[2] / "patches" / "zero3-release-cache")
    cache, cell = Cache(tmp_path / "cache"), Cell("3.11", "2.13.0+cpu", "0.19.8")
    folder = cache.wheel(cell.deepspeed, cell.python, cell.torch, build_key(patch))
    folder.mkdir(parents=True)
    (folder / "deepspeed-0.19.8+patched.whl").write_bytes(b"")
    elsewhere = "/elsewhere/checkout/patches/zero3-release-cache"
    (folder / "build.json").write_text(json.dumps({"wheel": "deepspeed-0.19.8+patched.whl", "patch_source": elsewhere}))
    assert build_wheel(cell, cache, patch).info["patch_source"] == "zero3-release-cache"
