"""Plots for the report (matplotlib, headless): RSS over engine lifecycles, and step-time ratios
with their confidence intervals per cell. Each is written as PNG and SVG; the report links them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsmatrix.judge.throughput import NO_REGRESSION, REGRESSION

MAX_RATIO_ROWS = 64  # a tall figure stays readable; beyond it, one benchmark per cell


LEFT_OUT = "figures left out: matplotlib is not installed (pip install 'dsmatrix[plots]'; nox -s report installs it)"


def left_out() -> str | None:
    """Why no figure can be drawn here, or None: matplotlib is an extra (``dsmatrix[plots]``) that
    only the report needs; the tables hold every figure's numbers."""
    import importlib.util

    return None if importlib.util.find_spec("matplotlib") else LEFT_OUT


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, out_dir: Path, stem: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.png", out_dir / f"{stem}.svg"]
    for path in paths:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return paths


def leak_plot(cells: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """RSS growth from the first engine lifecycle to the last, one row per benchmarked cell, one
    marker per leak line (one axes whatever the number of cells)."""
    measured = [c for c in cells if c.get("benchmarks", {}).get("leak")]
    if not measured:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(measured) + 1.5))
    colours: dict[str, str] = {}
    for y, cell in enumerate(measured):
        for line in cell["benchmarks"]["leak"]:
            first = line["line"] not in colours
            colour = colours.setdefault(line["line"], f"C{len(colours)}")
            label = f"{line['line']} ({len(line['series'])} lifecycles)" if first else None
            ax.plot(line["growth_mb"], y, marker="o", linestyle="", color=colour, label=label)
    ax.set_yticks(range(len(measured)), [c["cell"]["label"] for c in measured], fontsize=7)
    ax.axvline(0.0, color="grey", linewidth=1)
    ax.set_xlabel("RSS growth, first to last engine lifecycle (MB; destroy + gc.collect() after each)")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=8)
    paths = _save(fig, out_dir, "leak-rss")
    plt.close(fig)
    return paths


def ratio_plot(cells: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """patched/stock and A/A ratios with their intervals, per cell and benchmark, against 1 + margin;
    past ``MAX_RATIO_ROWS`` rows, each cell's step benchmark with the highest upper bound only."""
    rows = []
    margin = None
    for cell in cells:
        bench = cell.get("benchmarks", {})
        margin = bench.get("margin", margin)
        for key, kind in (("comparisons", "patched/stock"), ("calibration", "A/A")):
            for c in bench.get(key, []):
                rows.append((f"{cell['cell']['id']} {c['benchmark']} {kind}", c, kind))
    if len(rows) > MAX_RATIO_ROWS:
        rows = []
        for cell in cells:
            bench = cell.get("benchmarks", {})
            pairs = list(zip(bench.get("comparisons", []), bench.get("calibration", []), strict=False))
            if pairs:
                worst, aa = max(pairs, key=lambda pair: pair[0]["high"])
                name = f"{cell['cell']['id']} {worst['benchmark']}"
                rows += [(f"{name} {kind}", c, kind) for c, kind in ((worst, "patched/stock"), (aa, "A/A"))]
    if not rows:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    for y, (_, c, kind) in enumerate(rows):
        color = {NO_REGRESSION: "tab:green", REGRESSION: "tab:red"}.get(c["verdict"], "tab:orange")
        ax.errorbar(c["ratio"], y, xerr=[[c["ratio"] - c["low"]], [c["high"] - c["ratio"]]], fmt="o" if kind != "A/A" else "s", color=color)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in rows], fontsize=7)
    ax.axvline(1.0, color="grey", linewidth=1)
    if margin is not None:
        ax.axvline(1 + margin, color="tab:red", linestyle="--", linewidth=1, label=f"1 + margin ({margin * 100:g}%)")
        ax.legend(fontsize=8)
    ax.set_xlabel("patched/stock (or A/A): geometric mean of per-round median ratios, anytime-valid 95% confidence sequence")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    paths = _save(fig, out_dir, "step-time-ratios")
    plt.close(fig)
    return paths
