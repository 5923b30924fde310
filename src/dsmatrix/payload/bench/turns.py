"""Strict turn-taking between the benchmark processes of one round (driven by ``dsmatrix.execute.step_time``).

The round's stock, patched and stock-again processes live at the same time on one CPU, and
exactly one of them runs at any moment: each parks (``park``) when it starts and before every
timed step, and runs again only when the coordinator hands it the turn. Their steps are thus
interleaved a few milliseconds apart, so slow drifts of this shared machine hit all builds
alike. Outside such a round (``DSMATRIX_BENCH_TURNS`` unset) ``park`` does nothing.
"""

from __future__ import annotations

import os

_FDS = os.environ.get("DSMATRIX_BENCH_TURNS")


def park() -> None:
    """Give the turn back and wait until the coordinator hands it to this process again."""
    if not _FDS:
        return
    go, parked = (int(fd) for fd in _FDS.split(","))
    os.write(parked, b".")
    if os.read(go, 1) != b"g":
        raise SystemExit("dsmatrix benchmark: the round's coordinator went away")
