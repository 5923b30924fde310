"""Cells: one (Python, torch, DeepSpeed) combination, tested stock vs patched.

A tier's cells come from its cell axes, combined as the tier says: ``product`` (every
combination), ``pairwise`` (an all-pairs covering made by allpairspy: every allowed pair of
values appears in at least one cell) or ``listed``. Compatibility rules exclude cells; excluded
cells are kept in the plan with their rule, never silently dropped. A command-line selection
narrows an axis (``--deepspeed 0.19.8``) or, in product and pairwise tiers, replaces it with a
value the tier does not list (to try a new release before adding it to the matrix file).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from packaging.version import Version

from dsmatrix.errors import ConfigError
from dsmatrix.matrix import CELL_AXES, RUNTIME_AXES, Matrix, Rule, Tier, check_value


@dataclass(frozen=True, order=True)
class Cell:
    python: str
    torch: str
    deepspeed: str

    @property
    def id(self) -> str:
        """Filesystem-safe, readable id, e.g. ``py3.11-torch2.13.0+cpu-ds0.19.8``."""
        return f"py{self.python}-torch{self.torch}-ds{self.deepspeed}"

    @property
    def label(self) -> str:
        return f"matrix(py{self.python}, torch{self.torch}, ds{self.deepspeed})"

    def sort_key(self) -> tuple[Version, Version, Version]:
        return (Version(self.python), Version(self.torch), Version(self.deepspeed))

    def values(self) -> dict[str, str]:
        return {"python": self.python, "torch": self.torch, "deepspeed": self.deepspeed}

    def as_dict(self) -> dict[str, str]:
        return {"id": self.id, **self.values()}


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


def _narrow(axis: str, tier_values: Sequence[str], wanted: Sequence[str] | None) -> tuple[str, ...]:
    if not wanted:
        return tuple(tier_values)
    for value in wanted:
        check_value(axis, value, f"--{axis}")
    return tuple(dict.fromkeys(wanted))


def _pairs(cell: Cell) -> set[tuple[tuple[str, str], tuple[str, str]]]:
    values = cell.values()
    return {((a, values[a]), (b, values[b])) for a, b in itertools.combinations(CELL_AXES, 2)}


def pairwise(values: Mapping[str, Sequence[str]], matrix: Matrix) -> list[Cell]:
    """A deterministic all-pairs covering of the cell axes that respects the rules.

    allpairspy builds the covering with the rules as its filter; a filter can leave an allowed
    pair uncovered, so any such pair is then covered greedily from the allowed product.
    """
    axes = [list(values[a]) for a in CELL_AXES]
    allowed = [c for c in (Cell(*combo) for combo in itertools.product(*axes)) if matrix.excluded_by(c.values()) is None]
    if sum(len(v) > 1 for v in axes) < 2:  # allpairspy needs two varying axes
        return allowed

    def allowed_row(row: list[str]) -> bool:
        return matrix.excluded_by(dict(zip(CELL_AXES, row, strict=False))) is None

    from allpairspy import AllPairs  # imported here: the noxfile lists cells without it

    cells = [Cell(*combo) for combo in AllPairs(axes, filter_func=allowed_row)]
    uncovered = set().union(*map(_pairs, allowed)) - set().union(*map(_pairs, cells))
    while uncovered:
        best = max(allowed, key=lambda c: len(_pairs(c) & uncovered))
        cells.append(best)
        uncovered -= _pairs(best)
    return cells


def plan_cells(matrix: Matrix, tier: Tier, wanted: Mapping[str, Sequence[str] | None]) -> Selection:
    """Expand ``tier`` into cells, narrowed by ``wanted`` (axis -> values from the CLI)."""
    values = {axis: _narrow(axis, tier.values[axis], wanted.get(axis)) for axis in CELL_AXES + RUNTIME_AXES}
    product = [Cell(*combo) for combo in itertools.product(*(values[a] for a in CELL_AXES))]
    if tier.combination == "listed":
        candidates = [Cell(*c) for c in tier.cells if all(v in values[a] for a, v in zip(CELL_AXES, c, strict=True))]
        if not candidates:
            raise ConfigError(f"tier {tier.name}: the selection matches none of its listed cells")
    elif tier.combination == "pairwise":
        candidates = pairwise(values, matrix)
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
    """Every cell some tier could run: the allowed product of the axes (``nox -l`` sessions)."""
    product = (Cell(*combo) for combo in itertools.product(*(matrix.axes[a] for a in CELL_AXES)))
    return sorted((c for c in product if matrix.excluded_by(c.values()) is None), key=Cell.sort_key)
