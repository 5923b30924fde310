from __future__ import annotations

from pathlib import Path

import pytest

from dsmatrix.cells import Cell, select_cells
from dsmatrix.errors import ConfigError
from dsmatrix.matrix import load_matrix

GOOD = """
[axes]
python = ["3.11", "3.12"]
torch = ["2.13.0+cpu"]
deepspeed = ["0.19.2", "0.19.8"]
dtype = ["fp32", "bf16"]
checkpointing = ["off", "on"]

[tiers.default]
python = ["3.11"]
deepspeed = ["0.19.8"]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "matrix.toml"
    path.write_text(text)
    return path


def test_bundled_matrix_default_tier(repo: Path) -> None:
    matrix = load_matrix(repo / "matrix" / "matrix.toml")
    selection = select_cells(matrix.tier("default"), {})
    assert selection.cells == (Cell("3.11", "2.13.0+cpu", "0.19.2"), Cell("3.11", "2.13.0+cpu", "0.19.8"))
    assert selection.runtime == {"dtype": ("fp32", "bf16"), "checkpointing": ("off", "on")}


def test_tier_defaults_to_every_axis_value(tmp_path: Path) -> None:
    tier = load_matrix(write(tmp_path, GOOD)).tier("default")
    assert tier.values["torch"] == ("2.13.0+cpu",)
    assert tier.values["python"] == ("3.11",)


def test_selection_narrows_and_replaces(tmp_path: Path) -> None:
    tier = load_matrix(write(tmp_path, GOOD)).tier("default")
    assert [c.deepspeed for c in select_cells(tier, {"deepspeed": ["0.18.9"]}).cells] == ["0.18.9"]
    selection = select_cells(tier, {"dtype": ["bf16"], "checkpointing": ["on"]})
    assert selection.runtime == {"dtype": ("bf16",), "checkpointing": ("on",)}
    assert Cell("3.11", "2.13.0+cpu", "0.19.8").label == "matrix(py3.11, torch2.13.0+cpu, ds0.19.8)"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[axes\npython=", "not valid TOML"),
        (GOOD.replace('dtype = ["fp32", "bf16"]\n', ""), "must define exactly"),
        (GOOD.replace('"0.19.2"', '"0.19.x"'), "axes.deepspeed: '0.19.x' is not a version"),
        (GOOD.replace('deepspeed = ["0.19.8"]', 'deepspeed = ["0.17.6"]'), "tiers.default.deepspeed: ['0.17.6'] not in axes.deepspeed"),
        (GOOD.replace('python = ["3.11", "3.12"]', 'python = ["3"]'), "must be a minor version"),
        (GOOD.replace('checkpointing = ["off", "on"]', 'checkpointing = ["sometimes"]'), "'sometimes' is not one of off, on"),
        (GOOD.replace("[tiers.default]", "[tiers.nightly]"), "missing [tiers.default]"),
        (GOOD.replace('torch = ["2.13.0+cpu"]', "torch = []"), "axes.torch must be a non-empty list"),
        ("colour = 1\n" + GOOD, "unknown top-level key"),
    ],
)
def test_malformed_matrix_is_one_clear_line(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_matrix(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_tier_and_bad_selection(tmp_path: Path) -> None:
    matrix = load_matrix(write(tmp_path, GOOD))
    with pytest.raises(ConfigError, match="no tier 'weekly'"):
        matrix.tier("weekly")
    with pytest.raises(ConfigError, match="--deepspeed: 'latest' is not a version"):
        select_cells(matrix.tier("default"), {"deepspeed": ["latest"]})
    with pytest.raises(ConfigError, match="--dtype: 'fp16' is not one of"):
        select_cells(matrix.tier("default"), {"dtype": ["fp16"]})
