"""Plots of a compressed checkpoint and of an analysis: spectra and per-layer errors, as SVG files (report/svg)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..results import CompressResult


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
    rank holds how much?". Both `analyze --plot` and compress's spectra.svg draw it; compress marks its rank."""
    from ..results import layer_labels
    from .svg import BLACK, ORANGE, Panel, colour_ramp, figure

    labels = layer_labels([name for name, _, _ in layers])
    panels = []
    for side, index in (("query side", 1), ("key side", 2)):
        panel = Panel(f"Stacked head products, {side}", "shared dimensions (rank)",
                      "share of energy kept" if index == 1 else "", y_range=(0.0, 1.0))
        curves = [_cumulative(layer[index]) for layer in layers]
        for number, (layer, curve) in enumerate(zip(layers, curves)):
            colour = colour_ramp(number / max(len(layers) - 1, 1))
            panel.lines.append((labels[layer[0]], list(range(1, len(curve) + 1)), curve, colour))
        panel.levels = [(share, f"{share:.0%}") for share in SHARES]
        every_layer = max(_dimensions_for(curve, 0.95) for curve in curves) if curves else None
        if every_layer:
            panel.markers.append((every_layer, f"95% in every layer: {every_layer}", ORANGE, "6,3,2,3"))
        if rank is not None:
            panel.markers.append((rank, f"chosen rank {rank}", BLACK, "5,3"))
        panels.append(panel)
    Path(path).write_text(figure(panels), encoding="utf-8")


def plot_errors(result: "CompressResult", path: Path) -> None:
    from ..results import layer_labels
    from .svg import BLUE, LIGHT, Panel, figure

    labels = layer_labels([layer.name for layer in result.layers])
    panel = Panel(f"Per-layer error at rank {result.layers[0].rank if result.layers else '-'}", "",
                  "relative error of head products",
                  categories=[labels[layer.name] for layer in result.layers])
    panel.bars.append((result.method or result.form, [layer.relative_error for layer in result.layers], BLUE))
    truncation = [layer.per_head_truncation_error for layer in result.layers]
    if not all(math.isnan(t) for t in truncation):
        panel.bars.append(("per-head truncation", truncation, LIGHT))
    Path(path).write_text(figure([panel], panel_width=max(300, 45 * len(result.layers))), encoding="utf-8")


def write_plots(result: "CompressResult", folder: Path) -> list[str]:
    layers = [(layer.name, layer.query_spectrum, layer.key_spectrum) for layer in result.layers]
    plot_spectra(layers, folder / "spectra.svg", rank=result.layers[0].rank if result.layers else None)
    plot_errors(result, folder / "errors.svg")
    return ["spectra.svg", "errors.svg"]
