from __future__ import annotations

from pathlib import Path

import pytest

from dsmatrix.infra.errors import ConfigError
from dsmatrix.plan.cells import Cell, plan_cells
from dsmatrix.plan.matrix import load_matrix

GOOD = """
[axes]
python = ["3.11", "3.12"]
torch = ["2.13.0+cpu"]
deepspeed = ["0.19.2", "0.19.8"]
dtype = ["fp32", "bf16"]
checkpointing = ["off", "on"]
world_size = ["1", "2"]

[tiers.default]
python = ["3.11"]
deepspeed = ["0.19.8"]
world_size = ["1"]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "matrix.toml"
    path.write_text(text)
    return path


def test_bundled_matrix_default_tier(repo: Path) -> None:
    matrix = load_matrix(repo / "matrix" / "matrix.toml")
    selection = plan_cells(matrix, matrix.tier("default"), {})
    assert selection.cells == (Cell("3.11", "2.13.0+cpu", "0.19.2"), Cell("3.11", "2.13.0+cpu", "0.19.8"))
    assert selection.runtime == {"dtype": ("fp32", "bf16"), "checkpointing": ("off", "on"), "world_size": ("1",)}
    assert not selection.excluded


def test_tier_defaults_to_every_axis_value(tmp_path: Path) -> None:
    tier = load_matrix(write(tmp_path, GOOD)).tier("default")
    assert tier.values["torch"] == ("2.13.0+cpu",)
    assert tier.values["python"] == ("3.11",)


def test_selection_narrows_and_replaces(tmp_path: Path) -> None:
    matrix = load_matrix(write(tmp_path, GOOD))
    tier = matrix.tier("default")
    assert [c.deepspeed for c in plan_cells(matrix, tier, {"deepspeed": ["0.18.9"]}).cells] == ["0.18.9"]
    selection = plan_cells(matrix, tier, {"dtype": ["bf16"], "checkpointing": ["on"], "world_size": ["2"]})
    assert selection.runtime == {"dtype": ("bf16",), "checkpointing": ("on",), "world_size": ("2",)}
    assert Cell("3.11", "2.13.0+cpu", "0.19.8").label == "matrix(py3.11, torch2.13.0+cpu, ds0.19.8)"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[axes\npython=", "not valid TOML"),
        (GOOD.replace('dtype = ["fp32", "bf16"]\n', ""), ":2: axes: 'dtype' is a required property"),
        (GOOD + '[[rules]]\nid = "r"\nwhen = { torch = "newest" }\nreason = "x"\n', "rules #1 (r): bad specifier"),
        (
            GOOD + '[[rules]]\nid = "r"\nwhen = { dtype = "==bf16" }\nreason = "x"\n',
            "rules.0.when: Additional properties are not allowed ('dtype'",
        ),
        (GOOD + '[[rules]]\nid = "r"\nreason = "x"\n', ":14: rules.0: 'when' is a required property"),
        (GOOD + '[tiers.pr]\ncombination = "listed"\n', ":14: tiers.pr: 'cells' is a required property"),
        (
            GOOD + '[tiers.pr]\ncombination = "listed"\ncells = [["3.11", "2.99", "0.19.8"]]\n',
            "tiers.pr.cells: torch '2.99' not in axes.torch",
        ),
        (GOOD + '[tiers.pr]\ncombination = "random"\n', "tiers.pr.combination: 'random' is not one of"),
        (GOOD.replace('"0.19.2"', '"0.19.x"'), "axes.deepspeed: '0.19.x' is not a version"),
        (GOOD.replace('deepspeed = ["0.19.8"]', 'deepspeed = ["0.17.6"]'), "tiers.default.deepspeed: ['0.17.6'] not in axes.deepspeed"),
        (GOOD.replace('python = ["3.11", "3.12"]', 'python = ["3"]'), "must be a minor version"),
        (
            GOOD.replace('checkpointing = ["off", "on"]', 'checkpointing = ["sometimes"]'),
            "'sometimes' is not one of ['off', 'on']",
        ),
        (GOOD.replace("[tiers.default]", "[tiers.nightly]"), "tiers: 'default' is a required property"),
        (GOOD.replace('torch = ["2.13.0+cpu"]', "torch = []"), "axes.torch: [] should be non-empty"),
        ("colour = 1\n" + GOOD, "top level: Additional properties are not allowed ('colour' was unexpected)"),
        (GOOD.replace("[axes]\n", '[axes]\nplatform = ["linux/riscv64"]\n'), ":3: axes.platform.0: 'linux/riscv64' is not one of"),
        (GOOD + '[[rules]]\nid = "r"\nwhen = { platform = "arm64" }\nreason = "x"\n', ":16: rules.0.when.platform: 'arm64' is not valid"),
        (GOOD + '[tiers.default.platforms."linux/arm64"]\ntorch = ["2.9.1"]\n', "platforms.linux/arm64.torch: ['2.9.1'] not in axes.torch"),
        (
            GOOD + '[tiers.default.platforms."linux/arm64"]\ncolour = ["red"]\n',
            "Unevaluated properties are not allowed ('colour'",
        ),
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
        plan_cells(matrix, matrix.tier("default"), {"deepspeed": ["latest"]})
    with pytest.raises(ConfigError, match="--dtype: 'fp16' is not one of"):
        plan_cells(matrix, matrix.tier("default"), {"dtype": ["fp16"]})


RULES = """
[[rules]]
id = "local-torch-cp311"
when = { torch = "==2.13.0+cpu", python = "!=3.11" }
reason = "local wheel for CPython 3.11 only"

[[rules]]
id = "old-torch-no-cp313"
when = { torch = "<2.5", python = ">=3.13" }
reason = "no cp313 wheels"
"""

WIDE = (
    """
[axes]
python = ["3.10", "3.11", "3.12", "3.13"]
torch = ["2.4.1", "2.9.1", "2.13.0+cpu", "2.15.0"]
deepspeed = ["0.14.5", "0.16.9", "0.17.6", "0.18.9", "0.19.2", "0.19.8"]
dtype = ["fp32", "bf16"]
checkpointing = ["off", "on"]
world_size = ["1", "2"]

[tiers.default]
python = ["3.11"]
torch = ["2.13.0+cpu"]

[tiers.pr]
combination = "listed"
cells = [["3.11", "2.13.0+cpu", "0.19.8"], ["3.13", "2.4.1", "0.19.8"]]

[tiers.nightly]
combination = "pairwise"

[tiers.release]
"""
    + RULES
)


def test_rules_exclude_cells_and_say_why(tmp_path: Path) -> None:
    matrix = load_matrix(write(tmp_path, WIDE))
    release = plan_cells(matrix, matrix.tier("release"), {})
    assert len(release.cells) + len(release.excluded) == 4 * 4 * 6
    reasons = {(e.cell.python, e.cell.torch): e.rule.id for e in release.excluded}
    assert reasons[("3.12", "2.13.0+cpu")] == "local-torch-cp311"
    assert reasons[("3.13", "2.4.1")] == "old-torch-no-cp313"
    assert all(matrix.excluded_by(c.values()) is None for c in release.cells)
    listed = plan_cells(matrix, matrix.tier("pr"), {})
    assert [c.id for c in listed.cells] == ["py3.11-torch2.13.0+cpu-ds0.19.8"]
    assert [e.cell.id for e in listed.excluded] == ["py3.13-torch2.4.1-ds0.19.8"]


@pytest.mark.parametrize("bundled", [False, True], ids=["test-matrix", "bundled-matrix"])
def test_pairwise_covers_every_allowed_pair_with_far_fewer_cells(tmp_path: Path, repo: Path, bundled: bool) -> None:
    matrix = load_matrix(repo / "matrix" / "matrix.toml" if bundled else write(tmp_path, WIDE))
    nightly = plan_cells(matrix, matrix.tier("nightly"), {})
    release = plan_cells(matrix, matrix.tier("release"), {})
    assert nightly.cells == plan_cells(matrix, matrix.tier("nightly"), {}).cells, "deterministic"
    assert all(matrix.excluded_by(c.values()) is None for c in nightly.cells)
    axes = ("python", "torch", "deepspeed")
    allowed_pairs = {((a, c.values()[a]), (b, c.values()[b])) for c in release.cells for i, a in enumerate(axes) for b in axes[i + 1 :]}
    covered = {((a, c.values()[a]), (b, c.values()[b])) for c in nightly.cells for i, a in enumerate(axes) for b in axes[i + 1 :]}
    assert allowed_pairs <= covered
    assert len(nightly.cells) < len(release.cells) / 2


def test_listed_tier_selection_filters(tmp_path: Path) -> None:
    matrix = load_matrix(write(tmp_path, WIDE))
    with pytest.raises(ConfigError, match="tier pr: the selection matches none of its listed cells"):
        plan_cells(matrix, matrix.tier("pr"), {"deepspeed": ["0.14.5"]})


ARM = (
    GOOD.replace("[axes]\n", '[axes]\nplatform = ["linux/amd64", "linux/arm64"]\n')
    .replace('torch = ["2.13.0+cpu"]', 'torch = ["2.9.1", "2.13.0+cpu"]')
    .replace('python = ["3.11"]\n', 'python = ["3.11"]\ntorch = ["2.13.0+cpu"]\n')
    + """
[tiers.default.platforms."linux/arm64"]
torch = ["2.9.1"]

[tiers.everything]

[[rules]]
id = "cpu-wheel-is-x86"
when = { torch = "==2.13.0+cpu", platform = "linux/arm64" }
reason = "local x86_64 wheel"
"""
)


def test_platform_tier_values_rules_and_ids(tmp_path: Path) -> None:
    matrix = load_matrix(write(tmp_path, ARM))
    default = plan_cells(matrix, matrix.tier("default"), {}, ["linux/amd64", "linux/arm64"])
    assert default.cells == (Cell("3.11", "2.13.0+cpu", "0.19.8"), Cell("3.11", "2.9.1", "0.19.8", "linux/arm64"))
    assert [c.id for c in default.cells] == ["py3.11-torch2.13.0+cpu-ds0.19.8", "py3.11-torch2.9.1-ds0.19.8-arm64"]
    assert default.cells[1].label == "matrix(py3.11, torch2.9.1, ds0.19.8, arm64)"
    everything = plan_cells(matrix, matrix.tier("everything"), {}, ["linux/arm64"])
    assert {c.torch for c in everything.cells} == {"2.9.1"}
    assert {(e.cell.torch, e.rule.id) for e in everything.excluded} == {("2.13.0+cpu", "cpu-wheel-is-x86")}
    with pytest.raises(ConfigError, match="--platform: 'windows/amd64' is not a platform"):
        plan_cells(matrix, matrix.tier("default"), {}, ["windows/amd64"])


def test_bundled_arm64_cells_are_the_light_cpu_builds(repo: Path) -> None:
    matrix = load_matrix(repo / "matrix" / "matrix.toml")
    release = plan_cells(matrix, matrix.tier("release"), {}, ["linux/arm64"])
    assert {(c.python, c.torch) for c in release.cells} == {("3.11", "2.4.1"), ("3.11", "2.9.1")}
    assert {c.platform for c in release.cells} == {"linux/arm64"}


@pytest.mark.parametrize(
    ("tier", "benchmarked"), [("default", True), ("smoke", False), ("qualify", True), ("pr", True), ("nightly", True), ("release", True)]
)
def test_every_tier_but_smoke_benchmarks_by_default(repo: Path, tier: str, benchmarked: bool) -> None:
    from dsmatrix.cli import matrix_options, parse_args

    def bench(*extra: str) -> object:
        return matrix_options(parse_args(["matrix", "--root", str(repo), "--plan", "--tier", tier, *extra])).bench

    assert load_matrix(repo / "matrix" / "matrix.toml").tier(tier).benchmarks == benchmarked  # the tier says so
    assert (bench() is not None) == benchmarked
    assert bench("--bench") is not None and bench("--no-bench") is None
