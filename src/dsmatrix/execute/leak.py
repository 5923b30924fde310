"""The leak benchmark: engines built and destroyed in turn, what each lifecycle leaves alive."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dsmatrix.execute.launch import Job, free_port, supervise, test_environment
from dsmatrix.infra.locations import suite_path

BENCH = suite_path("bench")


LEAK_LINES = (
    ("stock", "stock", False),
    ("patched", "patched", False),
    ("stock, FWD_MODULE_STACK drained (diagnostic)", "stock", True),
    ("patched, FWD_MODULE_STACK drained (diagnostic)", "patched", True),
)


def run_leak(
    pythons: Mapping[str, Path], extensions: Mapping[str, Path], out_dir: Path, name: str, lifecycles: int, timeout_s: float = 1800
) -> list[dict[str, Any]]:
    """The leak benchmark's lines: stock and patched, then both with the unrelated retainer drained
    (diagnostic: what is left is what the release cache holds)."""
    lines = []
    for label, build, drain in LEAK_LINES:
        out = out_dir / f"{name}-leak-{build}{'-drained' if drain else ''}.json"
        port = free_port()
        env = test_environment(pythons[build], extensions[build], port, 0, 1)
        command = [str(pythons[build]), str(BENCH / "leak.py"), "--lifecycles", str(lifecycles), "--json", str(out)]
        started = time.monotonic()
        log = out.with_suffix(".log")
        supervise(
            [Job(f"leak benchmark ({label})", command + (["--drain"] if drain else []), env, log, ports=(port,), output=out)], timeout_s
        )
        line = {"line": label, "build": build, "drain": drain, "file": f"bench/{out.name}", **json.loads(out.read_text())}
        lines.append({**line, "duration_s": round(time.monotonic() - started, 1)})
    return lines
