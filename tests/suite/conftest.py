"""The suite's own tests: pure logic without DeepSpeed, plus CLI bad-input checks and one
end-to-end cell (marked ``e2e``) on real DeepSpeed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"


@pytest.fixture
def repo() -> Path:
    return REPO


def run_cli(*args: str, cwd: Path, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    """Run ``python -m dsmatrix`` as a user would (fresh process, real arguments)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "dsmatrix", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
