"""Bad input only the real package index and sdists can show: a torch or DeepSpeed version that does not
exist, a release no diff covers, a diff that does not apply to a release or a commit; and the bundled
diffs applied to every DeepSpeed release in the matrix, exactly as a build applies them."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
from helpers import FIXTURES, REPO, check_one_line_error, run_cli

from dsmatrix.build.patches import apply_diff, load_patch_set
from dsmatrix.build.wheels import fetch_sdist, unpack_sdist
from dsmatrix.infra.cache import Cache, default_root
from dsmatrix.plan.matrix import load_matrix

COORDINATOR = "deepspeed/runtime/zero/partitioned_param_coordinator.py"
TARGET = COORDINATOR


@pytest.mark.network
@pytest.mark.gate
def test_unknown_torch_version(tmp_path: Path) -> None:
    check_one_line_error(
        tmp_path, "--torch", "9.9.9", "--deepspeed", "0.19.8", expect="torch==9.9.9 for Python 3.11: not installable here", code=4
    )


@pytest.mark.network
@pytest.mark.gate
def test_unknown_deepspeed_version(tmp_path: Path) -> None:
    check_one_line_error(tmp_path, "--deepspeed", "0.19.99", expect="DeepSpeed 0.19.99: sdist not downloadable", code=4)
    check_one_line_error(tmp_path, "--deepspeed", "0.19.99", expect="(not in matrix.toml, which knows deepspeed: 0.14.5, 0.16.9", code=4)


@pytest.mark.network
@pytest.mark.gate
def test_deepspeed_version_without_a_diff(tmp_path: Path) -> None:
    check_one_line_error(tmp_path, "--deepspeed", "0.13.1", expect="DeepSpeed 0.13.1: no diff covers it", code=6)


@pytest.mark.network
@pytest.mark.gate
def test_patch_that_does_not_apply(tmp_path: Path) -> None:
    candidate = FIXTURES / "panel" / "no-clear-on-invalidation" / "deepspeed-0.19.3-and-later.diff"  # has the 0.19.3+ union hunk
    check_one_line_error(
        tmp_path,
        "--patch",
        str(candidate),
        "--deepspeed",
        "0.19.2",
        expect=f"DeepSpeed 0.19.2: deepspeed-0.19.3-and-later.diff does not apply: {COORDINATOR} hunk #",
        code=7,
    )


@pytest.mark.network
@pytest.mark.gate
@pytest.mark.parametrize("version", load_matrix(REPO / "matrix" / "matrix.toml").axes["deepspeed"])
def test_bundled_diffs_apply_to_real_releases(repo: Path, version: str) -> None:
    """The real sdist of every DeepSpeed in the matrix, from the package index, patched exactly as a build patches it."""
    patch = load_patch_set(repo / "patches" / "zero3-release-cache")
    sdist = fetch_sdist(version, Cache(default_root()))
    with tempfile.TemporaryDirectory() as tmp:
        src = unpack_sdist(sdist, Path(tmp))
        apply_diff(patch.diff_for(version), src, version)
        patched = (src / TARGET).read_text()
        offload = (src / "deepspeed" / "runtime" / "zero" / "parameter_offload.py").read_text()
    # The cache key must use the module-id attribute this release assigns (0.14/0.15: `id`).
    (id_attribute,) = re.findall(r"module\.(ds_id|id) = my_count", offload)
    assert f"key = (submodule_to_release.{id_attribute}, step_id)" in patched
    assert "functools.lru_cache" not in patched
    assert "self.__params_to_release_cache = {}" in patched
    assert ".update(recompute_params)" not in patched


@pytest.mark.network
@pytest.mark.gate
def test_a_diff_that_does_not_apply_to_the_commit_is_one_line(fake_repo: Path, tmp_path: Path) -> None:
    args = ["--deepspeed", f"git:{fake_repo}@master", "--cache-dir", str(tmp_path / "cache"), "--results", str(tmp_path / "r")]
    proc = run_cli("matrix", "--tier", "smoke", *args, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 7 and len(lines) == 1, proc.stderr
    assert f"DeepSpeed git:{fake_repo}@master (0.19.6, " in lines[0] and "deepspeed-0.19.3-and-later.diff does not apply" in lines[0]
    assert "partitioned_param_coordinator.py: file not found" in lines[0]
