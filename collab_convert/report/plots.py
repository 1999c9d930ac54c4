"""Plots of a compressed checkpoint and of an analysis: spectra and per-layer errors (matplotlib, files only)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..results import CompressResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


def plot_spectra(layers: list[tuple[str, list[float], list[float]]], path: Path, rank: int | None = None) -> None:
    """Cumulative energy of the query- and key-side spectra per layer, with the chosen rank marked."""
    plt = _pyplot()
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for axis, side, index in ((axes[0], "query side", 1), (axes[1], "key side", 2)):
        for layer in layers:
            energy = [v * v for v in layer[index]]
            total = sum(energy) or 1.0
            running, cumulative = 0.0, []
            for value in energy:
                running += value
                cumulative.append(running / total)
            axis.plot(range(1, len(cumulative) + 1), cumulative, label=layer[0], linewidth=1.2)
        for share in (0.90, 0.95, 0.99):
            axis.axhline(share, color="grey", linewidth=0.6, linestyle=":")
        if rank is not None:
            axis.axvline(rank, color="black", linewidth=1.0, linestyle="--", label=f"rank {rank}")
        axis.set_title(f"Stacked head products, {side}")
        axis.set_xlabel("shared dimensions")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("share of energy")
    axes[1].legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_errors(result: "CompressResult", path: Path) -> None:
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(max(5, 0.6 * len(result.layers) + 2), 3.8))
    positions = range(len(result.layers))
    truncation = [layer.per_head_truncation_error for layer in result.layers]
    axis.bar([p - 0.2 for p in positions], [layer.relative_error for layer in result.layers], 0.4, label=result.method)
    if not all(math.isnan(t) for t in truncation):
        axis.bar([p + 0.2 for p in positions], truncation, 0.4, label="per-head truncation", color="lightgrey")
    axis.set_xticks(list(positions))
    axis.set_xticklabels([_short_name(layer.name) for layer in result.layers], rotation=45, ha="right", fontsize=7)
    axis.set_ylabel("relative error of head products")
    axis.set_title(f"Per-layer error at rank {result.layers[0].rank if result.layers else '-'}")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _short_name(name: str) -> str:

    numbers = re.findall(r"\d+", name)
    return f"layer {'.'.join(numbers)}" if numbers else name


def write_plots(result: "CompressResult", folder: Path) -> list[str]:
    layers = [(_short_name(layer.name), layer.query_spectrum, layer.key_spectrum) for layer in result.layers]
    plot_spectra(layers, folder / "spectra.png", rank=result.layers[0].rank if result.layers else None)
    plot_errors(result, folder / "errors.png")
    return ["spectra.png", "errors.png"]
