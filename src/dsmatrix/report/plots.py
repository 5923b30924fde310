"""Plots for the report (matplotlib, headless): RSS over engine lifecycles, and step-time ratios
with their confidence intervals per cell. Each is written as PNG and SVG; the report links them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dsmatrix.judge.throughput import NO_REGRESSION, REGRESSION


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
    """RSS vs lifecycle, one panel per benchmarked cell, one line per leak line."""
    measured = [c for c in cells if c.get("benchmarks", {}).get("leak")]
    if not measured:
        return []
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(measured), figsize=(6 * len(measured), 4), squeeze=False)
    for ax, cell in zip(axes[0], measured, strict=True):
        for line in cell["benchmarks"]["leak"]:
            series = line["series"]
            ax.plot([p["lifecycle"] for p in series], [p["rss_mb"] for p in series], marker="o", markersize=3, label=line["line"])
        ax.set_title(cell["cell"]["label"], fontsize=9)
        ax.set_xlabel("engine lifecycle (destroy + gc.collect() after each)")
        ax.set_ylabel("RSS (MB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    paths = _save(fig, out_dir, "leak-rss")
    plt.close(fig)
    return paths


def ratio_plot(cells: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """patched/stock and A/A ratios with their intervals, per cell and benchmark, against 1 + margin."""
    rows = []
    margin = None
    for cell in cells:
        bench = cell.get("benchmarks", {})
        margin = bench.get("margin", margin)
        for key, kind in (("comparisons", "patched/stock"), ("calibration", "A/A")):
            for c in bench.get(key, []):
                rows.append((f"{cell['cell']['id']} {c['benchmark']} {kind}", c, kind))
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
        ax.axvline(1 + margin, color="tab:red", linestyle="--", linewidth=1, label=f"1 + margin ({margin:.0%})")
        ax.legend(fontsize=8)
    ax.set_xlabel("patched/stock (or A/A): geometric mean of per-round median ratios, anytime-valid 95% confidence sequence")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    paths = _save(fig, out_dir, "step-time-ratios")
    plt.close(fig)
    return paths
