"""The results store: ``results/<run-id>/`` with one JSON per cell, JUnit XML per build, and
``summary.json``; ``results/latest`` points at the newest run.

Every file is written atomically (temporary file, then rename), and the summary is rewritten
after each cell, so a crashed or interrupted run keeps every cell it finished. A run folder
is created only once the run has passed its preflight checks: bad input leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsmatrix.infra.errors import ResultsError
from dsmatrix.infra.hosts import describe
from dsmatrix.infra.portable import Roots, machine_roots, make_files_portable, portable_record

SCHEMA = 1


# Fault injection (the suite's own tests): "<file name>:<n>" kills this process with SIGKILL on the
# n-th write of that file, after the temporary file is written and before it is renamed into place.
KILL_AT_WRITE = "DSMATRIX_KILL_AT_WRITE"
_writes: dict[str, int] = {}


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    _fault_point(path.name)
    os.replace(tmp, path)


def _fault_point(name: str) -> None:
    target, _, nth = os.environ.get(KILL_AT_WRITE, "").partition(":")
    if target == name:
        _writes[name] = _writes.get(name, 0) + 1
        if str(_writes[name]) == nth:
            os.kill(os.getpid(), signal.SIGKILL)


def import_cells(
    staging: Path, run: Run, finish: Callable[[dict[str, Any]], dict[str, Any]], seen_as: Path | None = None
) -> list[dict[str, Any]]:
    """Add the finished cells of runs written elsewhere (a container) to ``run``, each through ``finish``.

    Every JUnit file and log those runs wrote is copied into this run first (an errored cell's
    log included), so every path a cell names resolves here; paths in reasons that the writer
    saw under ``seen_as`` are rewritten to this run. Cells are added one by one, atomically.
    """
    added = []
    for source in sorted(p for p in staging.iterdir() if p.is_dir() and not p.is_symlink()) if staging.is_dir() else []:
        if (source / "raw").is_dir():
            shutil.copytree(source / "raw", run.root / "raw", dirs_exist_ok=True)
        for path in sorted((source / "cells").glob("*.json")):
            try:
                result = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue  # never finished: not a result
            if seen_as is not None:
                inside = f"{seen_as / source.name}/"
                result["reasons"] = [r.replace(inside, f"{run.root}/") for r in result.get("reasons", [])]
            result = finish(result)
            run.add_cell(result)
            added.append(result)
    return added


@dataclass
class Run:
    """One run's folder; cells are added as they finish."""

    root: Path
    meta: dict[str, Any]
    cells: list[dict[str, Any]] = field(default_factory=list)
    roots: Roots = field(default_factory=list, repr=False, compare=False)  # what portable evidence hides (set by start_run)
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)  # cells finish in several threads

    @property
    def id(self) -> str:
        return self.root.name

    def add_cell(self, result: dict[str, Any]) -> Path:
        """Record a finished cell, its record and the files it names (JUnit, logs, benchmark JSON) made
        portable; the run's last summary makes the rest of ``raw/`` and ``bench/`` portable."""
        result = portable_record({**result, "run_id": self.id}, self.roots)
        path = self.root / "cells" / f"{result['cell']['id']}.json"
        builds = [b for b in (result.get("builds") or {}).values() if isinstance(b, dict)]
        named = [n for b in builds for n in (*b.get("junit", []), *b.get("logs", []))] + (result.get("benchmarks") or {}).get("files", [])
        inside = [self.root / n for n in named if isinstance(n, str) and not Path(n).is_absolute() and ".." not in Path(n).parts]
        make_files_portable(inside, self.roots)
        with self._lock:
            write_json(path, result)
            self.cells.append(result)
            self.write_summary("running")
        return path

    def write_summary(self, status: str) -> None:
        """The run's summary; once the run is over (any status but ``running``), every file its
        cells left in ``raw/`` and ``bench/`` is made portable first."""
        with self._lock:
            if status != "running":
                make_files_portable([p for d in ("raw", "bench") for p in sorted((self.root / d).rglob("*")) if p.is_file()], self.roots)
            self._write_summary(status)

    def _write_summary(self, status: str) -> None:
        write_json(
            self.root / "summary.json",
            {
                "schema": SCHEMA,
                "run_id": self.id,
                "status": status,
                **portable_record(self.meta, self.roots),
                "updated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "cells": [
                    {
                        "id": c["cell"]["id"],
                        "label": c["cell"]["label"],
                        "verdict": c["verdict"],
                        "reasons": c["reasons"],
                        "file": f"cells/{c['cell']['id']}.json",
                    }
                    for c in self.cells
                ],
            },
        )


def start_run(results: Path, meta: dict[str, Any], now: Callable[[], float] = time.time) -> Run:
    """Create ``results/<run-id>/`` (the UTC second ``now()`` gives, and a random tag) and point ``results/latest`` at it."""
    run_id = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now())) + "-" + secrets.token_hex(2)
    root = results / run_id
    root.mkdir(parents=True)
    run = Run(root, {**meta, "host": describe()}, roots=machine_roots({root: "<run>", results: "<results>"}))
    run.write_summary("running")
    latest = results / "latest"
    tmp = results / f".latest.{os.getpid()}"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(run_id)
    os.replace(tmp, latest)
    return run


def cell_result_skeleton(cell: Any, fingerprint: str, verdict: str, reason: str) -> dict[str, Any]:
    """The one constructor of a cell result (``pipeline.run_cell`` fills in builds, tests and
    timings); as it is, a cell that never finished: ``interrupted``, or ``error`` when its
    container did not bring it back."""
    return {
        "schema": SCHEMA,
        "fingerprint": fingerprint,
        "cell": {**cell.as_dict(), "label": cell.label},
        "verdict": verdict,
        "reasons": [reason],
        "builds": {},
        "timings": {},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def find_finished(results: Path, fingerprint: str, verdicts: tuple[str, ...]) -> dict[str, Any] | None:
    """The newest earlier cell result with this fingerprint and one of ``verdicts``, if any
    (unreadable files are skipped: a result is reused only when it is whole)."""
    found = []
    for path in results.glob("*/cells/*.json"):
        if path.parent.parent.name == "latest":
            continue
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(result, dict) and result.get("fingerprint") == fingerprint and result.get("verdict") in verdicts:
            found.append((result.get("finished_at", ""), result))
    return max(found, key=lambda item: item[0])[1] if found else None


def read_result_file(path: Path, required: tuple[str, ...]) -> dict[str, Any]:
    """One JSON file of a results store, whole and of this suite, or a one-line ResultsError."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ResultsError(f"{path}: cannot read: {exc.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{path}: truncated or not JSON ({exc}); re-run the cell or delete the file") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or any(k not in data for k in required):
        missing = [k for k in required if not isinstance(data, dict) or k not in data]
        why = f"schema {data.get('schema')!r}, expected {SCHEMA}" if isinstance(data, dict) and data.get("schema") != SCHEMA else ""
        raise ResultsError(f"{path}: not a dsmatrix result ({why or 'missing ' + ', '.join(missing)})")
    return data


# What a store may name: each becomes a folder or a file name when a report is written, so none may
# climb out of its folder (no ``/``; a name starts with a letter or digit, so never ``..``) or read as an
# option (a leading ``-``). Names are cell ids and what follows them: ``infra.cache.safe_name``'s
# characters and torch's ``+`` (a PR cell's id holds ``..`` between its two refs, inside one name).
NAME = r"[A-Za-z0-9][A-Za-z0-9_.+@\[\]-]{0,199}"
RUN_ID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{4}")
CELL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,199}")
CELL_FILE = re.compile(rf"cells/{CELL_ID.pattern}\.json")
STORED_FILES = {"junit": re.compile(rf"raw/{NAME}\.xml"), "benchmark": re.compile(rf"bench/{NAME}\.json")}


def _named(value: object, pattern: re.Pattern[str], what: str, where: Path) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ResultsError(f"{where}: {what} {str(value)[:80]!r} is not one this suite writes; the store was changed by hand or forged")
    return value


def _check_cell(cell: dict[str, Any], where: Path) -> None:
    """The names in a cell record that a report turns into paths."""
    cell_id = cell["cell"].get("id") if isinstance(cell["cell"], dict) else None
    _named(cell_id, CELL_ID, "cell id", where)
    if cell.get("reused_from") is not None:
        _named(cell["reused_from"], RUN_ID, "reused_from run id", where)
    builds, benchmarks = cell.get("builds") or {}, cell.get("benchmarks") or {}
    if not isinstance(builds, dict) or not all(isinstance(b, dict) for b in builds.values()) or not isinstance(benchmarks, dict):
        raise ResultsError(f"{where}: builds or benchmarks are not records; the store was changed by hand or forged")
    for name in [n for b in builds.values() for n in b.get("junit", [])]:
        _named(name, STORED_FILES["junit"], "JUnit file", where)
    for name in benchmarks.get("files", []):
        _named(name, STORED_FILES["benchmark"], "benchmark file", where)


def load_run(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A run's summary and its cell results, read from disk (``path`` may be ``latest``), with every
    name a report turns into a path checked to be one this suite writes."""
    summary_path = path / "summary.json"
    if not summary_path.is_file():
        raise ResultsError(f"{path}: no summary.json (run `nox -s matrix` first)")
    summary = read_result_file(summary_path, ("run_id", "status", "cells", "patch"))
    _named(summary["run_id"], RUN_ID, "run id", summary_path)
    if not isinstance(summary["cells"], list):
        raise ResultsError(f"{summary_path}: cells is not a list; the store was changed by hand or forged")
    cells = []
    for entry in summary["cells"]:
        name = _named(entry.get("file") if isinstance(entry, dict) else None, CELL_FILE, "cell file", summary_path)
        cell = read_result_file(path / name, ("cell", "verdict", "reasons"))
        _check_cell(cell, path / name)
        cells.append(cell)
    return summary, cells
