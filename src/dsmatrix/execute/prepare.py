"""A cell's two builds made ready to run: wheels built, each installed in its own environment."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsmatrix.build.environments import ensure_environment, pip_freeze
from dsmatrix.build.patches import PatchSet
from dsmatrix.build.wheels import build_key, build_wheel
from dsmatrix.infra import parallel, progress
from dsmatrix.infra.cache import Cache, extensions_folder
from dsmatrix.infra.interpreters import find_interpreter
from dsmatrix.plan.cells import Cell

BUILDS = ("stock", "patched")

# setuptools: torch.utils.cpp_extension imports it to JIT-build DeepSpeed's comm op (torch 2.4)
TEST_REQUIREMENTS = ("pytest", "packaging", "setuptools", "pytest-benchmark")
COVERAGE_REQUIREMENT = "coverage>=7.10"  # patch = fork and _exit (changed-line coverage)
# DeepSpeed's requirements-dev.txt pins pytest below 8.4; pytest-forked and pytest-xdist run them as their workflow does.
DEEPSPEED_TESTS_REQUIREMENTS = ("pytest>=7.2.0,<8.4.0", "pytest-forked", "pytest-xdist")


@dataclass(frozen=True)
class PreparedBuild:
    """One build of a cell, ready to run: its environment, wheel and torch-extensions folder."""

    python: Path
    extensions: Path
    wheel: str
    info: dict[str, Any]
    installed: dict[str, str]
    freeze: list[str]

    def facts(self) -> dict[str, Any]:
        return {"wheel": self.wheel, "build_info": self.info, "installed": self.installed, "freeze": self.freeze}


def build_requirements(cell: Cell, build: str) -> list[str]:
    """What a build's environment holds besides torch and the wheel: the engine tests' needs,
    coverage.py in the patched build (changed-line coverage), and for a git source DeepSpeed's
    own test runner."""
    requirements = list(TEST_REQUIREMENTS)
    if build == "patched":
        requirements.append(COVERAGE_REQUIREMENT)
    if cell.source:
        requirements += DEEPSPEED_TESTS_REQUIREMENTS
    return requirements


def build_lane(cell: Cell) -> Callable[[str], str]:
    """The progress lane of one build of ``cell`` while both run side by side."""
    return lambda build: f"{cell.label} [{build}]"


def prepare_builds(cell: Cell, patch: PatchSet, cache: Cache, together: bool = False) -> dict[str, PreparedBuild]:
    """Stock and patched wheels built and installed, each in its own environment (all cached);
    ``together``: both builds at once."""
    interpreter = find_interpreter(cell.python)

    def prepare(build: str) -> PreparedBuild:
        build_patch = patch if build == "patched" else None
        progress.stage(f"{build} wheel")
        wheel = build_wheel(cell, cache, build_patch)
        progress.stage(f"{build} environment")
        requirements = [f"torch=={cell.torch}", str(wheel.wheel), *build_requirements(cell, build)]
        request = {"interpreter": str(interpreter), "requirements": requirements}
        path = cache.environment(cell.stock_id if build == "stock" else cell.id, build_key(build_patch), request)
        env = ensure_environment(path, interpreter, requirements, f"{cell.label} {build}")
        extensions = extensions_folder(env.path)
        return PreparedBuild(env.python, extensions, wheel.wheel.name, wheel.info, env.installed, pip_freeze(env.python))

    return parallel.each(BUILDS, prepare, together, build_lane(cell))
