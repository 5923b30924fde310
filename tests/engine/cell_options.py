"""What every process run inside a cell environment shares (engine tests and benchmarks alike):
the ``--dtype``/``--checkpointing`` options, the single-rank rendezvous defaults and one gloo
process group per session. Imported by ``tests/engine/conftest.py`` and ``tests/bench/conftest.py``.
"""

from __future__ import annotations

import os
import socket

import pytest

DTYPES = ("fp32", "bf16")
CHECKPOINTING = ("off", "on")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dsmatrix engine tests")
    group.addoption("--dtype", default=",".join(DTYPES), help="comma list of fp32,bf16")
    group.addoption("--checkpointing", default=",".join(CHECKPOINTING), help="comma list of off,on")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "bug(name): a test that must fail on a build with that bug")
    config.addinivalue_line("markers", "reference(build): records behaviour the verdict compares with that build's")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


def _option_values(config: pytest.Config, name: str, allowed: tuple[str, ...]) -> list[str]:
    values = [v.strip() for v in config.getoption(name).split(",") if v.strip()]
    unknown = sorted(set(values) - set(allowed))
    if unknown:
        raise pytest.UsageError(f"--{name}: unknown value(s) {unknown}; allowed: {allowed}")
    return values


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dtype" in metafunc.fixturenames:
        metafunc.parametrize("dtype", _option_values(metafunc.config, "dtype", DTYPES))
    if "checkpointing" in metafunc.fixturenames:
        values = _option_values(metafunc.config, "checkpointing", CHECKPOINTING)
        metafunc.parametrize("checkpointing", values, ids=[f"ckpt-{v}" for v in values])


@pytest.fixture(scope="session", autouse=True)
def distributed() -> None:
    """One single-rank gloo process group for the whole session."""
    from datetime import timedelta

    import deepspeed

    # A rank that stops early must not leave its peers waiting forever in a collective.
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(minutes=5))
