"""Cells: one (Python, torch, DeepSpeed) combination on one platform, tested stock vs patched.

A tier's cells come from its cell axes, combined as the tier says: ``product`` (every
combination), ``pairwise`` (an all-pairs covering made by allpairspy: every allowed pair of
values appears in at least one cell) or ``listed``. Compatibility rules exclude cells; excluded
cells are kept in the plan with their rule, never silently dropped. A command-line selection
narrows an axis (``--deepspeed 0.19.8``) or, in product and pairwise tiers, replaces it with a
value the tier does not list (to try a new release before adding it to the matrix file), or
with a git source (``sources.GitSource``, resolved first): such a cell's ``deepspeed`` is the
commit's ``version.txt`` (what rules and the patch manifest see) and its id names ref and commit.
Each platform is planned on its own, with the tier's values for that platform.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from packaging.version import Version

from dsmatrix.infra.errors import ConfigError
from dsmatrix.plan.git_source import GitSource
from dsmatrix.plan.matrix import CELL_AXES, PLATFORM, PLATFORMS, RUNTIME_AXES, Matrix, Rule, Tier, check_value

DEFAULT_PLATFORM = PLATFORMS[0]  # unmarked in cell ids and labels


@dataclass(frozen=True, order=True)
class Cell:
    python: str
    torch: str
    deepspeed: str  # a release, or a git source's version.txt
    platform: str = DEFAULT_PLATFORM
    source: GitSource | None = None  # DeepSpeed from git instead of the release's sdist

    @property
    def arch(self) -> str:
        return self.platform.split("/", 1)[1]

    @property
    def id(self) -> str:
        """Filesystem-safe, readable id, e.g. ``py3.11-torch2.13.0+cpu-ds0.19.8`` (``-arm64`` on arm64;
        ``-git.master.edaa722126`` for a git source)."""
        suffix = "" if self.platform == DEFAULT_PLATFORM else f"-{self.arch}"
        git = f"-{self.source.tag}" if self.source else ""
        return f"py{self.python}-torch{self.torch}-ds{self.deepspeed}{git}{suffix}"

    @property
    def label(self) -> str:
        suffix = "" if self.platform == DEFAULT_PLATFORM else f", {self.arch}"
        git = f" {self.source.describe}" if self.source else ""
        return f"matrix(py{self.python}, torch{self.torch}, ds{self.deepspeed}{git}{suffix})"

    @property
    def stock_id(self) -> str:
        """The id of this cell's stock build: for a git source only its base commit counts (patch
        and PR mode on one base, whatever the ref was called, share the stock build and its results)."""
        if not self.source:
            return self.id
        suffix = "" if self.platform == DEFAULT_PLATFORM else f"-{self.arch}"
        return f"py{self.python}-torch{self.torch}-ds{self.deepspeed}-git.{self.source.base.short}{suffix}"

    def stock_values(self) -> dict[str, str]:
        """``values()`` of the stock build alone (its base commit, not the head)."""
        values = self.values()
        if self.source:
            values["deepspeed_source"] = self.source.base.key
        return values

    @property
    def source_key(self) -> str:
        """What the stock build's source is cached by: the release, or the base commit."""
        return self.source.base.key if self.source else self.deepspeed

    def sort_key(self) -> tuple[str, Version, Version, Version]:
        return (self.platform, Version(self.python), Version(self.torch), Version(self.deepspeed))

    def values(self) -> dict[str, str]:
        """The axis values (what rules match), and for a git source its commits (``git-<commit>[..<commit>]``:
        a commit names its tree wherever it was fetched from, so results and builds are shared by commit)."""
        values = {"python": self.python, "torch": self.torch, "deepspeed": self.deepspeed, PLATFORM: self.platform}
        if self.source:
            head = f"..{self.source.head.commit}" if self.source.head else ""
            values["deepspeed_source"] = f"git-{self.source.base.commit}{head}"
        return values

    def as_dict(self) -> dict[str, object]:
        data: dict[str, object] = {"id": self.id, **self.values()}
        if self.source:
            data["git"] = self.source.as_dict()
        return data


@dataclass(frozen=True)
class Excluded:
    cell: Cell
    rule: Rule


@dataclass(frozen=True)
class Selection:
    """Cells to run, cells excluded by a rule, and the runtime axes run inside every cell."""

    cells: tuple[Cell, ...]
    runtime: Mapping[str, tuple[str, ...]]
    excluded: tuple[Excluded, ...] = ()

    def planned_records(self) -> list[dict[str, object]]:
        """The cells as a run's summary records its plan (a merged report checks each one finished somewhere)."""
        return [{**c.as_dict(), "label": c.label} for c in self.cells]

    def excluded_records(self) -> list[dict[str, object]]:
        """The exclusions as a run's summary records them: the cell, the rule's id and its reason."""
        return [{"cell": {**e.cell.as_dict(), "label": e.cell.label}, "rule": e.rule.id, "reason": e.rule.reason} for e in self.excluded]


Wanted = Sequence["str | GitSource"]


def _narrow(axis: str, tier_values: Sequence[str], wanted: Wanted | None) -> tuple[str | GitSource, ...]:
    if not wanted:
        return tuple(tier_values)
    for value in wanted:
        if not isinstance(value, GitSource):
            check_value(axis, value, f"--{axis}")
    return tuple(dict.fromkeys(wanted))


def make_cell(python: str, torch: str, deepspeed: str | GitSource, platform: str = DEFAULT_PLATFORM) -> Cell:
    """A cell; a git source gives it the base commit's version."""
    if isinstance(deepspeed, GitSource):
        return Cell(python, torch, deepspeed.base.version, platform, deepspeed)
    return Cell(python, torch, deepspeed, platform)


def _pairs(cell: Cell) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    values = cell.values()
    return {((a, values[a]), (b, values[b])) for a, b in itertools.combinations(CELL_AXES, 2)}


def pairwise(values: Mapping[str, Sequence[str]], matrix: Matrix, platform: str = DEFAULT_PLATFORM) -> list[Cell]:
    """A deterministic all-pairs covering of the cell axes that respects the rules.

    allpairspy builds the covering with the rules as its filter; a filter can leave an allowed
    pair uncovered, so any such pair is then covered greedily from the allowed product.
    """
    axes = [list(values[a]) for a in CELL_AXES]
    product = (make_cell(*combo, platform=platform) for combo in itertools.product(*axes))
    allowed = [c for c in product if matrix.excluded_by(c.values()) is None]
    if sum(len(v) > 1 for v in axes) < 2:  # allpairspy needs two varying axes
        return allowed

    def allowed_row(row: list[str | GitSource]) -> bool:
        values = {a: v.base.version if isinstance(v, GitSource) else v for a, v in zip(CELL_AXES, row, strict=False)}
        return matrix.excluded_by({**values, PLATFORM: platform}) is None

    from allpairspy import AllPairs  # imported here: the noxfile lists cells without it

    cells = [make_cell(*combo, platform=platform) for combo in AllPairs(axes, filter_func=allowed_row)]
    uncovered = set().union(*map(_pairs, allowed)) - set().union(*map(_pairs, cells))
    while uncovered:
        best = max(allowed, key=lambda c: len(_pairs(c) & uncovered))
        cells.append(best)
        uncovered -= _pairs(best)
    return cells


def plan_cells(matrix: Matrix, tier: Tier, wanted: Mapping[str, Wanted | None], platforms: Sequence[str] = ()) -> Selection:
    """Expand ``tier`` into cells on each of ``platforms``, narrowed by ``wanted`` (axis -> values from the CLI).

    The runtime axes are the tier's (or the CLI's) on the first platform.
    """
    platforms = tuple(dict.fromkeys(platforms)) or (DEFAULT_PLATFORM,)
    for platform in platforms:
        check_value(PLATFORM, platform, "--platform")
    plans = [_plan_platform(matrix, tier.on(platform), wanted, platform) for platform in platforms]
    listed = [p for p in plans if p.cells or p.excluded]
    if tier.combination == "listed" and not listed:
        raise ConfigError(f"tier {tier.name}: the selection matches none of its listed cells")
    return Selection(
        cells=tuple(c for p in plans for c in p.cells),
        runtime=plans[0].runtime,
        excluded=tuple(e for p in plans for e in p.excluded),
    )


def _plan_platform(matrix: Matrix, tier: Tier, wanted: Mapping[str, Wanted | None], platform: str) -> Selection:
    values = {axis: _narrow(axis, tier.values[axis], wanted.get(axis)) for axis in CELL_AXES + RUNTIME_AXES}
    product = [make_cell(*combo, platform=platform) for combo in itertools.product(*(values[a] for a in CELL_AXES))]
    if tier.combination == "listed" and any(isinstance(v, GitSource) for v in values["deepspeed"]):
        raise ConfigError(f"tier {tier.name}: lists its cells; a git source needs a tier that combines its axes (product or pairwise)")
    if tier.combination == "listed":
        candidates = [Cell(*c, platform=platform) for c in tier.cells if all(v in values[a] for a, v in zip(CELL_AXES, c, strict=True))]
    elif tier.combination == "pairwise":
        candidates = pairwise(values, matrix, platform)
    else:
        candidates = product
    excluded = {}
    for cell in (*candidates, *product) if tier.combination != "listed" else candidates:
        rule = matrix.excluded_by(cell.values())
        if rule is not None:
            excluded.setdefault(cell, Excluded(cell, rule))
    cells = tuple(c for c in candidates if c not in excluded)
    return Selection(cells=cells, runtime={axis: values[axis] for axis in RUNTIME_AXES}, excluded=tuple(excluded.values()))


def all_cells(matrix: Matrix) -> list[Cell]:
    """Every cell some tier could run: the allowed product of the axes on every platform (``nox -l`` sessions)."""
    axes = [matrix.axes[a] for a in CELL_AXES] + [matrix.platforms]
    product = (Cell(*combo) for combo in itertools.product(*axes))
    return sorted((c for c in product if matrix.excluded_by(c.values()) is None), key=Cell.sort_key)
