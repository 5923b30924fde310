"""Cells: one (Python, torch, DeepSpeed) combination, tested stock vs patched.

A tier's cells are the product of its cell axes; a command-line selection narrows an axis
(``--deepspeed 0.19.8``) or, for a value the tier does not list, replaces the axis (so a
maintainer can try a new release before adding it to the matrix file).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dsmatrix.matrix import CELL_AXES, RUNTIME_AXES, Tier, check_value


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

    def as_dict(self) -> dict[str, str]:
        return {"id": self.id, "python": self.python, "torch": self.torch, "deepspeed": self.deepspeed}


@dataclass(frozen=True)
class Selection:
    """Cells to run plus the runtime axes the engine tests are parametrized over."""

    cells: tuple[Cell, ...]
    runtime: Mapping[str, tuple[str, ...]]


def _narrow(axis: str, tier_values: Sequence[str], wanted: Sequence[str] | None) -> tuple[str, ...]:
    if not wanted:
        return tuple(tier_values)
    for value in wanted:
        check_value(axis, value, f"--{axis}")
    return tuple(dict.fromkeys(wanted))


def select_cells(tier: Tier, wanted: Mapping[str, Sequence[str] | None]) -> Selection:
    """Expand ``tier`` into cells, narrowed by ``wanted`` (axis -> values from the CLI)."""
    values = {axis: _narrow(axis, tier.values[axis], wanted.get(axis)) for axis in CELL_AXES + RUNTIME_AXES}
    cells = tuple(Cell(*combo) for combo in itertools.product(*(values[a] for a in CELL_AXES)))
    return Selection(cells=cells, runtime={axis: values[axis] for axis in RUNTIME_AXES})
