"""Load and validate the declarative matrix file (``matrix/matrix.toml``).

The file holds the axes (every value the suite knows) and named tiers (which values of each
axis a tier runs). Cell axes are ``python``, ``torch`` and ``deepspeed``; ``dtype`` and
``checkpointing`` are runtime axes, run inside every cell by the engine tests.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from dsmatrix.errors import ConfigError

CELL_AXES = ("python", "torch", "deepspeed")
RUNTIME_AXES = ("dtype", "checkpointing")
AXES = CELL_AXES + RUNTIME_AXES
RUNTIME_VALUES = {"dtype": ("fp32", "bf16"), "checkpointing": ("off", "on")}


@dataclass(frozen=True)
class Tier:
    name: str
    description: str
    values: Mapping[str, tuple[str, ...]]


@dataclass(frozen=True)
class Matrix:
    path: Path
    axes: Mapping[str, tuple[str, ...]]
    tiers: Mapping[str, Tier]

    def tier(self, name: str) -> Tier:
        if name not in self.tiers:
            raise ConfigError(f"{self.path}: no tier {name!r} (tiers: {', '.join(self.tiers)})")
        return self.tiers[name]


def _values(path: Path, where: str, raw: object) -> tuple[str, ...]:
    if not isinstance(raw, list) or not raw or not all(isinstance(v, str) and v for v in raw):
        raise ConfigError(f"{path}: {where} must be a non-empty list of strings, got {raw!r}")
    if len(set(raw)) != len(raw):
        raise ConfigError(f"{path}: {where} lists a value twice: {raw!r}")
    return tuple(raw)


def check_value(axis: str, value: str, where: str) -> None:
    """Raise ConfigError unless ``value`` is well-formed for ``axis``."""
    if axis in RUNTIME_VALUES:
        if value not in RUNTIME_VALUES[axis]:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(RUNTIME_VALUES[axis])}")
        return
    try:
        Version(value)
    except InvalidVersion:
        raise ConfigError(f"{where}: {value!r} is not a version") from None
    if axis == "python" and len(Version(value).release) != 2:
        raise ConfigError(f"{where}: {value!r} must be a minor version such as 3.11")


def load_matrix(path: Path) -> Matrix:
    """Parse and validate ``path``; every problem is a one-line ConfigError naming the key."""
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: matrix file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    unknown = set(data) - {"axes", "tiers"}
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key(s) {sorted(unknown)}")
    raw_axes = data.get("axes")
    if not isinstance(raw_axes, dict):
        raise ConfigError(f"{path}: missing [axes] table")
    if set(raw_axes) != set(AXES):
        raise ConfigError(f"{path}: [axes] must define exactly {', '.join(AXES)}; got {', '.join(raw_axes)}")
    axes = {axis: _values(path, f"axes.{axis}", raw_axes[axis]) for axis in AXES}
    for axis, values in axes.items():
        for value in values:
            check_value(axis, value, f"{path}: axes.{axis}")
    raw_tiers = data.get("tiers")
    if not isinstance(raw_tiers, dict) or "default" not in raw_tiers:
        raise ConfigError(f"{path}: missing [tiers.default] table")
    tiers = {}
    for name, raw in raw_tiers.items():
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: tiers.{name} must be a table")
        extra = set(raw) - set(AXES) - {"description"}
        if extra:
            raise ConfigError(f"{path}: tiers.{name}: unknown key(s) {sorted(extra)}")
        values = {}
        for axis in AXES:
            chosen = _values(path, f"tiers.{name}.{axis}", raw[axis]) if axis in raw else axes[axis]
            outside = [v for v in chosen if v not in axes[axis]]
            if outside:
                raise ConfigError(f"{path}: tiers.{name}.{axis}: {outside} not in axes.{axis}")
            values[axis] = chosen
        tiers[name] = Tier(name, str(raw.get("description", "")), values)
    return Matrix(path, axes, tiers)
