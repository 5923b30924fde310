"""DeepSpeed's own ZeRO-3 unit tests, run on the stock and the patched build of a git source.

Which tests: a named set of ``dsmatrix/payload/deepspeed_tests/selection.toml`` (``--deepspeed-tests core``, the
default, or ``full``; what each holds and how it was chosen is written there).

How: as DeepSpeed's CPU workflow runs them (``cd tests; pytest --forked -n N <paths>``), with
their ``conftest.py`` and ``pytest.ini``, from a copy of the patched source's ``tests/`` folder
(the same tests on both builds, so a test the change adds runs on stock too). The copy sits
outside the source tree on purpose: their conftest puts the folder above ``tests/`` first on
``sys.path`` (for checkouts), which in the tree would import the unbuilt sources instead of the
installed wheel. ``LOCAL_SIZE=2``: DeepSpeed's CPU accelerator counts its devices from it (else
from NUMA nodes, one here), so their two-rank tests run as two CPU ranks instead of skipping.
"""

from __future__ import annotations

import shutil
import time
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from dsmatrix.execute.launch import Job, supervise, test_environment
from dsmatrix.infra.errors import ConfigError
from dsmatrix.infra.locations import suite_path
from dsmatrix.judge.outcomes import PYTEST_OK, TestRun, read_junit

SELECTION_FILE = "selection.toml"
DEVICES = 2
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_PORT", "MASTER_ADDR")


@dataclass(frozen=True)
class DeepSpeedTests:
    """One named set of test files or node ids (relative to the source's ``tests/``) and how to run them."""

    name: str
    paths: tuple[str, ...]
    workers: int
    timeout_s: float
    source: Path


def selection_file() -> Path:
    return suite_path("deepspeed_tests") / SELECTION_FILE


def set_names(path: Path | None = None) -> list[str]:
    return list(_read(path or selection_file()).get("sets", {}))


def _read(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: not a DeepSpeed test selection: {exc}") from None


def load_selection(name: str, path: Path | None = None) -> DeepSpeedTests:
    """The set ``name`` of ``selection.toml`` ([sets.<name>] paths = [...]; workers, timeout_minutes)."""
    path = path or selection_file()
    data = _read(path)
    sets = data.get("sets", {})
    if name not in sets:
        raise ConfigError(f"--deepspeed-tests {name}: not a set of {path} ({', '.join(sets) or 'none'}, or none)")
    try:
        paths = tuple(str(p) for p in sets[name]["paths"])
        return DeepSpeedTests(name, paths, int(data.get("workers", 2)), float(data.get("timeout_minutes", 30)) * 60, path)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: sets.{name}: needs paths = [...] ({exc})") from None


def copy_tests(tree: Path, into: Path, selection: DeepSpeedTests) -> tuple[Path | None, DeepSpeedTests, list[str]]:
    """Copy ``tree/tests`` to ``into/tests``: the copy (None when the source has none of the selected
    files, as a release sdist has no tests), the selection narrowed to the paths the source has,
    and the paths it lacks (an older commit may predate a test file)."""
    tests = tree / "tests"
    present = tuple(p for p in selection.paths if (tests / p.split("::", 1)[0]).exists())
    missing = [p for p in selection.paths if p not in present]
    if not present:
        return None, selection, missing
    target = into / "tests"
    shutil.copytree(tests, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target, replace(selection, paths=present), missing


def run_deepspeed_tests(
    python: Path,
    extensions_dir: Path,
    tests_dir: Path,
    selection: DeepSpeedTests,
    out_dir: Path,
    name: str,
    env_extra: Mapping[str, str] | None = None,
) -> TestRun:
    """Run the selected files in ``tests_dir`` with ``python`` (``env_extra``: e.g. coverage's
    ``COVERAGE_PROCESS_START``); RunError unless pytest ran them and wrote its JUnit XML."""
    out_dir.mkdir(parents=True, exist_ok=True)
    junit = out_dir / f"{name}.xml"
    log = out_dir / f"{name}.log"
    command = [
        str(python), "-m", "pytest", "--forked", "-n", str(selection.workers), "-p", "no:cacheprovider", "-p", "no:randomly",
        "-o", "junit_family=xunit1", f"--junitxml={junit}", "-rfE", *selection.paths,
    ]  # fmt: skip
    env = {k: v for k, v in test_environment(python, extensions_dir, 0, 0, 1).items() if k not in RANK_VARIABLES}
    env.update(env_extra or {})
    env["DS_UNITTEST_TIMEOUT"] = str(int(selection.timeout_s))  # their per-test hang guard
    env["LOCAL_SIZE"] = str(DEVICES)  # the CPU accelerator's device count: two-rank tests run
    started = time.monotonic()
    supervise([Job("DeepSpeed's tests", command, env, log, cwd=tests_dir, output=junit, ok=PYTEST_OK)], selection.timeout_s)
    return TestRun(read_junit(junit, full_ids=True), time.monotonic() - started, (junit,), (log,))


DEFAULT_SET = "core"  # the default set of DeepSpeed's own tests for a git source (dsmatrix/payload/deepspeed_tests/selection.toml)
