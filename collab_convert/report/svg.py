"""A small SVG chart writer: line and grouped-bar charts with axes, reference lines and a legend.

Plots are report furniture, so they must cost milliseconds, not the second a plotting library takes to lay out
and rasterise two figures (that was half of a weight-only compress of a small model). SVG is text: it opens in
any browser, renders on code hosts, and diffs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

# viridis at five stops, interpolated: distinguishable lines for up to dozens of layers
_VIRIDIS = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))
GREY, ORANGE, BLACK, BLUE, LIGHT = "#888888", "#ff7f0e", "#000000", "#1f77b4", "#cccccc"


def colour_ramp(fraction: float) -> str:
    position = min(max(fraction, 0.0), 1.0) * (len(_VIRIDIS) - 1)
    low = min(int(position), len(_VIRIDIS) - 2)
    mix = position - low
    rgb = (round(a + (b - a) * mix) for a, b in zip(_VIRIDIS[low], _VIRIDIS[low + 1]))
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About `count` round tick values (1, 2 or 5 times a power of ten apart) covering [low, high]."""
    if not high > low:
        return [low]
    raw = (high - low) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step - 1e-9) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def _number(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


@dataclass
class Panel:
    """One set of axes: series of (x, y) points, horizontal and vertical reference lines, bars."""

    title: str
    x_label: str
    y_label: str = ""
    lines: list[tuple[str, list[float], list[float], str]] = field(default_factory=list)  # label, xs, ys, colour
    levels: list[tuple[float, str]] = field(default_factory=list)  # y, label at the right edge
    markers: list[tuple[float, str, str, str]] = field(default_factory=list)  # x, label, colour, dash pattern
    bars: list[tuple[str, list[float], str]] = field(default_factory=list)  # label, one value per category, colour
    categories: list[str] = field(default_factory=list)  # bar categories (x tick labels)
    y_range: tuple[float, float] | None = None


def _bounds(panel: Panel) -> tuple[float, float, float, float]:
    if panel.bars:
        x0, x1 = -0.5, len(panel.categories) - 0.5
        values = [v for _, vs, _ in panel.bars for v in vs if not math.isnan(v)]
        y0, y1 = 0.0, max(values, default=1.0) * 1.25 or 1.0  # headroom for the legend
    else:
        xs = [x for _, line_xs, _, _ in panel.lines for x in line_xs] + [m[0] for m in panel.markers]
        ys = [y for _, _, line_ys, _ in panel.lines for y in line_ys] + [level for level, _ in panel.levels]
        x0, x1 = min(xs, default=0.0), max(xs, default=1.0)
        y0, y1 = min(ys, default=0.0), max(ys, default=1.0)
    if panel.y_range:
        y0, y1 = panel.y_range
    return x0, (x1 if x1 > x0 else x0 + 1), y0, (y1 if y1 > y0 else y0 + 1)


def _panel_svg(panel: Panel, left: float, top: float, width: float, height: float) -> list[str]:
    x0, x1, y0, y1 = _bounds(panel)
    sx = lambda x: left + (x - x0) / (x1 - x0) * width  # noqa: E731
    sy = lambda y: top + height - (y - y0) / (y1 - y0) * height  # noqa: E731
    out = [f'<rect x="{left}" y="{top}" width="{width}" height="{height}" fill="none" stroke="#444"/>',
           f'<text x="{left + width / 2}" y="{top - 8}" text-anchor="middle" font-size="13">{escape(panel.title)}</text>',
           f'<text x="{left + width / 2}" y="{top + height + 36}" text-anchor="middle" font-size="11">'
           f'{escape(panel.x_label)}</text>']
    if panel.y_label:
        out.append(f'<text transform="translate({left - 44},{top + height / 2}) rotate(-90)" text-anchor="middle" '
                   f'font-size="11">{escape(panel.y_label)}</text>')
    for y in nice_ticks(y0, y1):
        out.append(f'<line x1="{left}" x2="{left + width}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 5}" y="{sy(y) + 4:.1f}" text-anchor="end" font-size="10">{_number(y)}</text>')
    if panel.bars:
        for index, name in enumerate(panel.categories):
            out.append(f'<text transform="translate({sx(index) + 3:.1f},{top + height + 12}) rotate(45)" '
                       f'font-size="9">{escape(name)}</text>')
        slot = 0.8 / len(panel.bars)
        for number, (_, values, colour) in enumerate(panel.bars):
            for index, value in enumerate(values):
                if math.isnan(value):
                    continue
                x = sx(index - 0.4 + number * slot)
                out.append(f'<rect x="{x:.1f}" y="{sy(value):.1f}" width="{slot / (x1 - x0) * width:.1f}" '
                           f'height="{sy(y0) - sy(value):.1f}" fill="{colour}"/>')
    else:
        for x in nice_ticks(x0, x1):
            out.append(f'<text x="{sx(x):.1f}" y="{top + height + 14}" text-anchor="middle" font-size="10">'
                       f'{_number(x)}</text>')
    for level, label in panel.levels:
        out.append(f'<line x1="{left}" x2="{left + width}" y1="{sy(level):.1f}" y2="{sy(level):.1f}" stroke="{GREY}" '
                   f'stroke-dasharray="1,3"/>')
        out.append(f'<text x="{left + width + 3}" y="{sy(level) + 3:.1f}" font-size="8" fill="{GREY}">'
                   f'{escape(label)}</text>')
    for label, xs, ys, colour in panel.lines:
        points = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in zip(xs, ys))
        out.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="1.3" '
                   f'stroke-opacity="0.85"><title>{escape(label)}</title></polyline>')
    for x, label, colour, dash in panel.markers:
        out.append(f'<line x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{top}" y2="{top + height}" stroke="{colour}" '
                   f'stroke-dasharray="{dash}"/>')
    # lines rise to the right (cumulative energy): their legend sits bottom right; bars leave the top free
    if panel.bars:
        return out + _legend(panel, left + width - 6, top + 6, below=True)
    return out + _legend(panel, left + width - 6, top + height - 6)


def _legend(panel: Panel, right: float, edge: float, below: bool = False) -> list[str]:
    entries = ([(label, colour, "") for label, _, _, colour in panel.lines]
               + [(label, colour, dash) for _, label, colour, dash in panel.markers]
               + [(label, colour, "") for label, _, colour in panel.bars])
    if not entries:
        return []
    columns = 2 if len(entries) > 10 else 1
    rows = math.ceil(len(entries) / columns)
    column_width = 8 + 6 * max(len(label) for label, _, _ in entries) + 24
    left, top = right - columns * column_width, edge if below else edge - rows * 12 - 4
    out = [f'<rect x="{left:.1f}" y="{top:.1f}" width="{columns * column_width:.1f}" height="{rows * 12 + 4}" '
           f'fill="white" fill-opacity="0.85" stroke="#ccc"/>']
    for index, (label, colour, dash) in enumerate(entries):
        x = left + (index // rows) * column_width + 4
        y = top + (index % rows) * 12 + 10
        out.append(f'<line x1="{x:.1f}" x2="{x + 16:.1f}" y1="{y - 3:.1f}" y2="{y - 3:.1f}" stroke="{colour}" '
                   f'stroke-width="2" stroke-dasharray="{dash}"/>')
        out.append(f'<text x="{x + 20:.1f}" y="{y:.1f}" font-size="8">{escape(label)}</text>')
    return out


def figure(panels: list[Panel], panel_width: float = 420, panel_height: float = 300) -> str:
    """An SVG document with the panels side by side."""
    margin_left, margin_right, margin_top, margin_bottom = 60, 40, 30, 70
    width = len(panels) * (margin_left + panel_width + margin_right)
    height = margin_top + panel_height + margin_bottom
    body = []
    for index, panel in enumerate(panels):
        left = index * (margin_left + panel_width + margin_right) + margin_left
        body += _panel_svg(panel, left, margin_top, panel_width, panel_height)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n'
            + "\n".join(body) + "\n</svg>\n")
