"""The candidate-fix panel's fixtures (``tests/fixtures/panel/``): where they live, the releases they run
on, and the candidates the landing gate runs."""

from __future__ import annotations

from helpers import FIXTURES

PANEL = FIXTURES / "panel"

RELEASES = {"0.19.8": ">=0.19.3", "0.19.2": ">=0.19,<0.19.3", "0.14.5": ">=0.14,<0.16"}

GATE = {("per-instance-lru", "0.19.8"), ("in-place-update", "0.19.8"), ("no-look-ahead", "0.19.8")}
