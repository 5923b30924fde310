"""Load and validate the declarative matrix file (``matrix/matrix.toml``).

The file holds the axes (every value the suite knows), compatibility rules (combinations that
cannot work, each with the reason a reader needs) and named tiers (which values of each axis a
tier runs and how they are combined). Cell axes are ``python``, ``torch`` and ``deepspeed``;
``dtype``, ``checkpointing`` and ``world_size`` are runtime axes, run inside every cell.
``platform`` (``linux/amd64``, ``linux/arm64``) says where a cell runs: cells run on this
machine's platform unless ``--platform`` asks for another; a tier may give other axis values
for a platform (``[tiers.<name>.platforms."linux/arm64"]``), and rules may name a platform.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from dsmatrix.infra.errors import ConfigError

CELL_AXES = ("python", "torch", "deepspeed")
RUNTIME_AXES = ("dtype", "checkpointing", "world_size")
PLATFORM = "platform"
PLATFORMS = ("linux/amd64", "linux/arm64")
AXES = CELL_AXES + RUNTIME_AXES
RUNTIME_VALUES = {"dtype": ("fp32", "bf16"), "checkpointing": ("off", "on"), "world_size": ("1", "2")}
COMBINATIONS = ("product", "pairwise", "listed")
SCHEMA_FILE = Path(__file__).parent / "matrix.schema.json"


@dataclass(frozen=True)
class Rule:
    """Cells whose every named axis matches its specifier are excluded, for ``reason``."""

    id: str
    when: Mapping[str, SpecifierSet | frozenset[str]]  # platform: the platforms it names
    reason: str

    def matches(self, values: Mapping[str, str]) -> bool:
        """True when ``values`` (possibly partial) has every axis of the rule and matches it."""
        return all(axis in values and _matches(spec, values[axis]) for axis, spec in self.when.items())


def _matches(spec: SpecifierSet | frozenset[str], value: str) -> bool:
    return value in spec if isinstance(spec, frozenset) else spec.contains(value, prereleases=True)


@dataclass(frozen=True)
class Tier:
    name: str
    description: str
    values: Mapping[str, tuple[str, ...]]
    combination: str = "product"
    cells: tuple[tuple[str, str, str], ...] = ()  # for combination = "listed"
    platforms: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)  # per-platform values
    benchmarks: bool = True  # whether the tier benchmarks unless --no-bench

    def on(self, platform: str) -> Tier:
        """This tier as it runs on ``platform`` (its per-platform values applied)."""
        override = self.platforms.get(platform)
        return replace(self, values={**self.values, **override}) if override else self


@dataclass(frozen=True)
class Matrix:
    path: Path
    axes: Mapping[str, tuple[str, ...]]
    tiers: Mapping[str, Tier]
    rules: tuple[Rule, ...] = ()
    platforms: tuple[str, ...] = PLATFORMS[:1]

    def tier(self, name: str) -> Tier:
        if name not in self.tiers:
            raise ConfigError(f"{self.path}: no tier {name!r} (tiers: {', '.join(self.tiers)})")
        return self.tiers[name]

    def excluded_by(self, values: Mapping[str, str]) -> Rule | None:
        """The first rule that excludes ``values``, if any."""
        return next((rule for rule in self.rules if rule.matches(values)), None)


def _values(path: Path, where: str, raw: object) -> tuple[str, ...]:
    if not isinstance(raw, list) or not raw or not all(isinstance(v, str) and v for v in raw):
        raise ConfigError(f"{path}: {where} must be a non-empty list of strings, got {raw!r}")
    if len(set(raw)) != len(raw):
        raise ConfigError(f"{path}: {where} lists a value twice: {raw!r}")
    return tuple(raw)


MAX_VERSION_LENGTH = 40  # a version of Python, torch or DeepSpeed is about 10 characters


def check_value(axis: str, value: str, where: str) -> None:
    """Raise ConfigError unless ``value`` is well-formed for ``axis``."""
    if axis == PLATFORM:
        if value not in PLATFORMS:
            raise ConfigError(f"{where}: {value!r} is not a platform ({', '.join(PLATFORMS)})")
        return
    if axis in RUNTIME_VALUES:
        if value not in RUNTIME_VALUES[axis]:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(RUNTIME_VALUES[axis])}")
        return
    try:  # the length first: a 5000-digit release number is beyond int() itself
        if len(value) > MAX_VERSION_LENGTH:
            raise InvalidVersion(value)
        Version(value)
    except InvalidVersion:
        shown = value if len(value) <= MAX_VERSION_LENGTH else f"{value[:MAX_VERSION_LENGTH]}... ({len(value)} characters)"
        raise ConfigError(f"{where}: {shown!r} is not a version") from None
    if axis == "python" and len(Version(value).release) != 2:
        raise ConfigError(f"{where}: {value!r} must be a minor version such as 3.11")


def _rules(path: Path, raw: object) -> tuple[Rule, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"{path}: rules must be an array of [[rules]] tables")
    rules = []
    for i, entry in enumerate(raw):
        where = f"{path}: rules #{i + 1}"
        if not isinstance(entry, dict) or not {"id", "when", "reason"} <= set(entry):
            raise ConfigError(f"{where}: needs id, when and reason")
        if not isinstance(entry["when"], dict) or not entry["when"] or set(entry["when"]) - {*CELL_AXES, PLATFORM}:
            raise ConfigError(
                f"{where} ({entry['id']}): when must map cell axes ({', '.join(CELL_AXES)}) to version specifiers, or platform to platforms"
            )
        try:
            when = {axis: _condition(axis, spec, where) for axis, spec in entry["when"].items()}
        except (InvalidSpecifier, TypeError):
            raise ConfigError(f"{where} ({entry['id']}): bad specifier in when = {entry['when']!r}") from None
        rules.append(Rule(str(entry["id"]), when, str(entry["reason"])))
    ids = [r.id for r in rules]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{path}: rule ids must be unique: {ids}")
    return tuple(rules)


def _condition(axis: str, raw: object, where: str) -> SpecifierSet | frozenset[str]:
    if axis != PLATFORM:
        return SpecifierSet(raw)  # type: ignore[arg-type]
    names = [raw] if isinstance(raw, str) else raw
    if not isinstance(names, list) or not names:
        raise ConfigError(f"{where}: when.platform must be a platform or a list of them")
    for name in names:
        check_value(PLATFORM, name, f"{where}: when.platform")
    return frozenset(names)


def _axis_values(
    path: Path, where: str, raw: dict, axes: Mapping[str, tuple[str, ...]], default: Mapping[str, tuple[str, ...]]
) -> dict[str, tuple[str, ...]]:
    values = {}
    for axis in AXES:
        chosen = _values(path, f"{where}.{axis}", raw[axis]) if axis in raw else default[axis]
        outside = [v for v in chosen if v not in axes[axis]]
        if outside:
            raise ConfigError(f"{path}: {where}.{axis}: {outside} not in axes.{axis}")
        values[axis] = chosen
    return values


def _tier(path: Path, name: str, raw: dict, axes: Mapping[str, tuple[str, ...]]) -> Tier:
    combination = raw.get("combination", "product")
    values = _axis_values(path, f"tiers.{name}", raw, axes, axes)
    platforms = {}
    for platform, override in raw.get("platforms", {}).items():
        where = f"tiers.{name}.platforms.{platform}"
        check_value(PLATFORM, platform, f"{path}: {where}")
        if not isinstance(override, dict) or set(override) - set(AXES):
            raise ConfigError(f"{path}: {where}: must be a table of axis values ({', '.join(AXES)})")
        platforms[platform] = {a: v for a, v in _axis_values(path, where, override, axes, values).items() if a in override}
    cells: list[tuple[str, str, str]] = []
    if combination == "listed":
        listed = raw.get("cells")
        if not isinstance(listed, list) or not listed:
            raise ConfigError(f"{path}: tiers.{name}: combination = 'listed' needs cells = [[python, torch, deepspeed], ...]")
        for cell in listed:
            if not isinstance(cell, list) or len(cell) != 3:
                raise ConfigError(f"{path}: tiers.{name}.cells: {cell!r} is not [python, torch, deepspeed]")
            for axis, value in zip(CELL_AXES, cell, strict=True):
                if value not in axes[axis]:
                    raise ConfigError(f"{path}: tiers.{name}.cells: {axis} {value!r} not in axes.{axis}")
            cells.append((cell[0], cell[1], cell[2]))
    elif "cells" in raw:
        raise ConfigError(f"{path}: tiers.{name}: cells only goes with combination = 'listed'")
    return Tier(name, str(raw.get("description", "")), values, combination, tuple(cells), platforms, bool(raw.get("benchmarks", True)))


def _line_of(text: str, where: Sequence[str | int]) -> int | None:
    """The line (1-based) of the key at JSON path ``where`` in a TOML file's ``text``: the deepest
    table header or key of the path that can be found (enough to point an editor at it)."""
    lines = text.splitlines()
    found, start = None, 0
    tables = [str(p) for p in where if isinstance(p, str)]
    for depth in range(len(tables), 0, -1):  # the longest [a.b.c] / [[a]] header that exists
        keys = (re.escape(t) if re.match(r"^[\w-]+$", t) else f'"{re.escape(t)}"' for t in tables[:depth])
        header = re.compile(r"^\s*\[\[?\s*" + r"\s*\.\s*".join(keys) + r"\s*\]\]?")
        hits = [i for i, line in enumerate(lines) if header.match(line)]
        if hits:
            index = next((p for p in where if isinstance(p, int)), 0) if lines[hits[0]].lstrip().startswith("[[") else 0
            start = hits[min(index, len(hits) - 1)]
            found = start + 1
            keys = tables[depth:]
            break
    else:
        keys = tables
    for key in keys:  # then the key itself, below that header, before the next one
        pattern = re.compile(rf"^\s*\"?{re.escape(key)}\"?\s*=")
        for i in range(start + (1 if found else 0), len(lines)):
            if i > start and lines[i].lstrip().startswith("[") and found:
                break
            if pattern.match(lines[i]):
                found, start = i + 1, i
                break
    return found


def _validate(path: Path, text: str, data: dict) -> None:
    """The file's structure against ``plan/matrix.schema.json``: the first error, with its line.

    jsonschema is a dependency of the package; only the noxfile, importing this module from nox's
    own environment to list the cell sessions, may lack it (the CLI then checks the file)."""
    try:
        import jsonschema
    except ImportError:
        return
    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text()))
    errors = sorted(validator.iter_errors(data), key=lambda e: (len(e.absolute_path), list(map(str, e.absolute_path))))
    if not errors:
        return
    error = jsonschema.exceptions.best_match(errors) or errors[0]
    where = list(error.absolute_path)
    line = _line_of(text, where)
    key = ".".join(str(p) for p in where) or "top level"
    raise ConfigError(f"{path}{f':{line}' if line else ''}: {key}: {error.message}")


def load_matrix(path: Path) -> Matrix:
    """Parse and validate ``path``; every problem is a one-line ConfigError naming the file, line and key."""
    try:
        text = path.read_text()
        data = tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"{path}: matrix file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the matrix file: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    _validate(path, text, data)
    raw_axes = data["axes"]
    axes = {axis: _values(path, f"axes.{axis}", raw_axes[axis]) for axis in AXES}
    platforms = _values(path, "axes.platform", raw_axes[PLATFORM]) if PLATFORM in raw_axes else PLATFORMS[:1]
    for axis, values in axes.items():
        for value in values:
            check_value(axis, value, f"{path}:{_line_of(text, ['axes', axis])}: axes.{axis}")
    tiers = {name: _tier(path, name, raw, axes) for name, raw in data["tiers"].items()}
    return Matrix(path, axes, tiers, _rules(path, data.get("rules")), platforms)
