"""What every process run inside a cell environment shares (engine tests and benchmarks alike):
the ``--dtype``/``--checkpointing`` options, the single-rank rendezvous defaults and one gloo
process group per session. Imported by ``payload/engine/conftest.py`` and ``payload/bench/conftest.py``.
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


def _build_comm_op_in_turn() -> None:
    """Build DeepSpeed's CPU comm op before the rendezvous, one process at a time per Python × torch
    where the runner asks for it (``DSMATRIX_JIT_LOCKS``: the folder of ccache's cache). The stock
    and patched environments of a cell compile the same sources: built side by side, both miss
    ccache and share the cores; in turn, the second is answered from ccache. The op is the one
    ``init_distributed`` builds anyway; a DeepSpeed without it builds nothing here."""
    folder = os.environ.get("DSMATRIX_JIT_LOCKS")
    if not folder:
        return
    try:
        from deepspeed.comm.torch import build_shm_op
    except ImportError:
        return
    import fcntl
    import sys

    import torch

    name = f"jit-py{sys.version_info.major}.{sys.version_info.minor}-torch{torch.__version__}.lock"
    with open(os.path.join(folder, name), "a") as lock:  # noqa: PTH123 - a lock file, held while building
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        build_shm_op()


@pytest.fixture(scope="session", autouse=True)
def distributed() -> None:
    """One single-rank gloo process group for the whole session."""
    from datetime import timedelta

    import deepspeed

    _build_comm_op_in_turn()
    # A rank that stops early must not leave its peers waiting forever in a collective.
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(minutes=5))
