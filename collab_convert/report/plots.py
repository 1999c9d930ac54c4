"""Plots of a compressed checkpoint and of an analysis: spectra and per-layer errors (matplotlib, files only)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..results import CompressResult


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a window
    import matplotlib.pyplot as plt

    return plt


SHARES = (0.90, 0.95, 0.99)


def _cumulative(values: list[float]) -> list[float]:
    energy = [v * v for v in values]
    total = sum(energy) or 1.0
    running, cumulative = 0.0, []
    for value in energy:
        running += value
        cumulative.append(running / total)
    return cumulative


def _dimensions_for(cumulative: list[float], share: float) -> int:
    return next((i + 1 for i, c in enumerate(cumulative) if c >= share - 1e-12), len(cumulative))


def plot_spectra(layers: list[tuple[str, list[float], list[float]]], path: Path, rank: int | None = None) -> None:
    """Cumulative energy of the query- and key-side spectra, one line per layer (labelled like the CLI's tables),
    the 90/95/99% levels labelled, and the rank that keeps 95% in every layer marked: the plot answers "which
    rank holds how much?". Both `analyze --plot` and compress's spectra.png draw it; compress marks its rank."""
    from ..results import layer_labels

    plt = _pyplot()
    labels = layer_labels([name for name, _, _ in layers])
    colours = plt.get_cmap("viridis")
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
    for axis, side, index in ((axes[0], "query side", 1), (axes[1], "key side", 2)):
        curves = [_cumulative(layer[index]) for layer in layers]
        for number, (layer, curve) in enumerate(zip(layers, curves)):
            colour = colours(number / max(len(layers) - 1, 1))
            axis.plot(range(1, len(curve) + 1), curve, label=labels[layer[0]], linewidth=1.3, color=colour, alpha=0.85)
        for share in SHARES:
            axis.axhline(share, color="grey", linewidth=0.6, linestyle=":")
            axis.annotate(f"{share:.0%}", xy=(1.0, share), xycoords=("axes fraction", "data"), xytext=(3, 0),
                          textcoords="offset points", va="center", fontsize=7, color="grey")
        every_layer = max(_dimensions_for(curve, 0.95) for curve in curves) if curves else None
        if every_layer:
            axis.axvline(every_layer, color="tab:orange", linewidth=1.0, linestyle="-.",
                         label=f"95% in every layer: {every_layer}")
        if rank is not None:
            axis.axvline(rank, color="black", linewidth=1.0, linestyle="--", label=f"chosen rank {rank}")
        axis.set_title(f"Stacked head products, {side}")
        axis.set_xlabel("shared dimensions (rank)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="lower right", ncol=2 if len(layers) > 8 else 1)
    axes[0].set_ylabel("share of energy kept")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_errors(result: "CompressResult", path: Path) -> None:
    from ..results import layer_labels

    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(max(5, 0.6 * len(result.layers) + 2), 3.8))
    positions = range(len(result.layers))
    truncation = [layer.per_head_truncation_error for layer in result.layers]
    axis.bar([p - 0.2 for p in positions], [layer.relative_error for layer in result.layers], 0.4, label=result.method)
    if not all(math.isnan(t) for t in truncation):
        axis.bar([p + 0.2 for p in positions], truncation, 0.4, label="per-head truncation", color="lightgrey")
    axis.set_xticks(list(positions))
    labels = layer_labels([layer.name for layer in result.layers])
    axis.set_xticklabels([labels[layer.name] for layer in result.layers], rotation=45, ha="right", fontsize=7)
    axis.set_ylabel("relative error of head products")
    axis.set_title(f"Per-layer error at rank {result.layers[0].rank if result.layers else '-'}")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_plots(result: "CompressResult", folder: Path) -> list[str]:
    layers = [(layer.name, layer.query_spectrum, layer.key_spectrum) for layer in result.layers]
    plot_spectra(layers, folder / "spectra.png", rank=result.layers[0].rank if result.layers else None)
    plot_errors(result, folder / "errors.png")
    return ["spectra.png", "errors.png"]
