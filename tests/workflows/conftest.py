"""Options and the act fixture of ``nox -s workflows`` (see act_runner.py)."""

from __future__ import annotations

import platform
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from act_runner import REPO, Act, seed_tool_cache

NATIVE = {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}.get(platform.machine(), "linux/amd64")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("workflows")
    group.addoption(
        "--platforms",
        default=NATIVE,
        help="matrix.yml's `platforms` input (default: this machine's; linux/arm64 on x86_64 runs the rpi5 image emulated)",
    )
    group.addoption("--skip-job", action="append", default=[], metavar="WORKFLOW:JOB", help="do not run this job, e.g. pr.yml:tests")
    group.addoption("--act-out", type=Path, default=REPO / "act-run", help="logs, artifacts and act's caches of this run")


@pytest.fixture(scope="session")
def act(request: pytest.FixtureRequest) -> Iterator[Act]:
    out = request.config.getoption("--act-out").resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    seeded = seed_tool_cache()
    print(f"act tool cache: {', '.join(f'{v} -> {full}' for v, full in seeded.items())}")
    yield Act(out)
    shutil.rmtree(out / "actcache", ignore_errors=True)  # act's cache server: GBs of uv cache, of no use afterwards


@pytest.fixture(scope="session")
def platforms(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--platforms")


@pytest.fixture(scope="session")
def skipped_jobs(request: pytest.FixtureRequest) -> set[str]:
    return set(request.config.getoption("--skip-job"))
