"""Plots as inline SVG, drawn on the server (one renderer: the page's first paint and its live refresh both use it):
a line per series, one <circle class="pt"> per point (with a <title> tooltip), labelled axes. No script, no assets."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from markupsafe import Markup, escape

WIDTH, HEIGHT = 640, 220
LEFT, RIGHT, TOP, BOTTOM = 64, 12, 24, 36  # margins: room for the axes' numbers and labels
COLOURS = 6  # series are classes s0..s5 (console.css), cycled


@dataclass(frozen=True)
class Series:
    label: str
    points: Sequence[tuple[float, float | None]]  # (x, y); a None y is a gap, never drawn as 0


def _number(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000 or abs(value) < 0.01:
        return f"{value:.3g}"
    return f"{value:.3f}".rstrip("0").rstrip(".")


def _bounds(values: list[float]) -> tuple[float, float]:
    low, high = min(values), max(values)
    if low == high:  # a flat line sits in the middle
        pad = abs(low) * 0.1 or 1.0
        return low - pad, high + pad
    return low, high


def line_plot(series: Sequence[Series], *, name: str, title: str, x_label: str, y_label: str,
              step: bool = False) -> Markup:
    """An <svg class="plot {name}">; `step` draws a staircase (a count that holds until it changes)."""
    drawn = [[(x, y) for x, y in s.points if y is not None and math.isfinite(y)] for s in series]
    head = (f'<svg class="plot {escape(name)}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
            f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg"><title>{escape(title)}</title>')
    if not any(drawn):
        return Markup(head + f'<text class="empty" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">'
                      'no data yet</text></svg>')
    (x0, x1), (y0, y1) = _bounds([x for d in drawn for x, _ in d]), _bounds([y for d in drawn for _, y in d])
    if step:
        y0 = min(y0, 0.0)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return round(LEFT + (x - x0) / (x1 - x0) * plot_w, 2)

    def sy(y: float) -> float:
        return round(TOP + (1 - (y - y0) / (y1 - y0)) * plot_h, 2)

    parts = [head, f'<g class="axes"><line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}"/>'
                   f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}"/></g>']
    for value in (y0, (y0 + y1) / 2, y1):
        parts.append(f'<text class="tick" x="{LEFT - 6}" y="{sy(value) + 4}" text-anchor="end">'
                     f'{_number(value)}</text>')
    for value, anchor in ((x0, "start"), (x1, "end")):
        parts.append(f'<text class="tick" x="{sx(value)}" y="{TOP + plot_h + 16}" text-anchor="{anchor}">'
                     f'{_number(value)}</text>')
    parts.append(f'<text class="label" x="{LEFT + plot_w / 2}" y="{HEIGHT - 4}" text-anchor="middle">'
                 f'{escape(x_label)}</text>')
    parts.append(f'<text class="label" x="{LEFT}" y="{TOP - 8}" text-anchor="start">{escape(y_label)}</text>')
    for i, (s, points) in enumerate(zip(series, drawn)):
        colour = f"s{i % COLOURS}"
        coords: list[str] = []
        for j, (x, y) in enumerate(points):
            if step and j:
                coords.append(f"{sx(x)},{sy(points[j - 1][1])}")
            coords.append(f"{sx(x)},{sy(y)}")
        parts.append(f'<g class="series {colour}" data-label="{escape(s.label)}">'
                     f'<polyline points="{" ".join(coords)}"/>')
        parts.extend(f'<circle class="pt" cx="{sx(x)}" cy="{sy(y)}" r="3"><title>{escape(s.label)}: '
                     f'{_number(x)}, {_number(y)}</title></circle>' for x, y in points)
        parts.append("</g>")
    parts.append("</svg>")
    return Markup("".join(parts))
