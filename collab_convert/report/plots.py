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


def plot_spectra(panels: list[tuple[str, list[tuple[str, list[float]]]]], path: Path,
                 rank: int | None = None) -> None:
    """Cumulative energy of spectra, one panel per (title, [(layer, singular values)]) the form gives (the CP form:
    the query and the key side of its head products), one line per layer (labelled like the CLI's tables), the
    90/95/99% levels labelled, and the rank that keeps 95% in every layer marked: the plot answers "which rank holds
    how much?". Both `analyze --plot` and compress's spectra.svg draw it; compress marks its rank."""
    from ..results import layer_labels
    from .svg import BLACK, ORANGE, Panel, colour_ramp, figure

    drawn = []
    for index, (title, layers) in enumerate(panels):
        labels = layer_labels([name for name, _ in layers])
        panel = Panel(title, "shared dimensions (rank)", "share of energy kept" if index == 0 else "",
                      y_range=(0.0, 1.0))
        curves = [_cumulative(values) for _, values in layers]
        for number, ((name, _), curve) in enumerate(zip(layers, curves)):
            colour = colour_ramp(number / max(len(layers) - 1, 1))
            panel.lines.append((labels[name], list(range(1, len(curve) + 1)), curve, colour))
        panel.levels = [(share, f"{share:.0%}") for share in SHARES]
        every_layer = max(_dimensions_for(curve, 0.95) for curve in curves) if curves else None
        if every_layer:
            panel.markers.append((every_layer, f"95% in every layer: {every_layer}", ORANGE, "6,3,2,3"))
        if rank is not None:
            panel.markers.append((rank, f"chosen rank {rank}", BLACK, "5,3"))
        drawn.append(panel)
    Path(path).write_text(figure(drawn), encoding="utf-8")


def plot_errors(result: "CompressResult", path: Path) -> None:
    """Each layer's error; the per-head truncation beside it where the form has one (the CP form's)."""
    from ..results import layer_labels
    from .svg import BLUE, LIGHT, Panel, figure

    labels = layer_labels([layer.name for layer in result.layers])
    panel = Panel(f"Per-layer error at rank {result.layers[0].rank if result.layers else '-'}", "",
                  "relative error of head products",
                  categories=[labels[layer.name] for layer in result.layers])
    panel.bars.append((result.method or result.form, [layer.relative_error for layer in result.layers], BLUE))
    truncation = [getattr(layer, "per_head_truncation_error", math.nan) for layer in result.layers]
    if not all(math.isnan(t) for t in truncation):
        panel.bars.append(("per-head truncation", truncation, LIGHT))
    Path(path).write_text(figure([panel], panel_width=max(300, 45 * len(result.layers))), encoding="utf-8")


def write_plots(result: "CompressResult", form, folder: Path) -> list[str]:
    """spectra.svg and errors.svg; `form` (forms/, the result's form) gives each layer's spectra."""
    plot_spectra(form.spectra(result.layers), folder / "spectra.svg",
                 rank=result.layers[0].rank if result.layers else None)
    plot_errors(result, folder / "errors.svg")
    return ["spectra.svg", "errors.svg"]
