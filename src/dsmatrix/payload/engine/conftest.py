"""Engine tests run inside one cell environment (a stock or a patched DeepSpeed build).

The runner sets ``DS_ACCELERATOR=cpu``, ``LOCAL_SIZE=1``, ``TORCH_EXTENSIONS_DIR`` and the
single-rank rendezvous (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``); run by hand,
the defaults in ``cell_options.py`` give the same single-rank gloo group.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from cell_options import distributed, pytest_addoption, pytest_configure, pytest_generate_tests  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _label_tests(request: pytest.FixtureRequest, record_property) -> None:
    """Put each bug test's bug name, and each reference test's reference build, into the JUnit
    XML, where the verdict reads them."""
    marker = request.node.get_closest_marker("bug")
    record_property("bug", marker.args[0] if marker else "")
    reference = request.node.get_closest_marker("reference")
    if reference:
        record_property("reference", reference.args[0])
