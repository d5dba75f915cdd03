"""Line charts as inline SVG, drawn on the server: the page fetches no script, font or image from anywhere.

Each point carries a ``<title>`` (its exact value, shown on hover) and ``data-x``/``data-y`` attributes, so the
numbers a chart shows can be read back (and tested) as the numbers of the files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

#: colours that stay apart for the colour-blind (Okabe-Ito), in order of use
PALETTE = ("#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442")


@dataclass
class Series:
    """One line: (x, y) points; a y of None or NaN leaves a gap."""

    label: str
    points: list[tuple[float, float | None]] = field(default_factory=list)


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round numbers (1, 2 or 5 times a power of ten apart) covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return [0.0, 1.0]
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.floor(low / step + 1e-9) * step
    ticks = [round(first, 12)]
    while ticks[-1] < high - step * 1e-9:  # up to the first tick at or above the highest value
        ticks.append(round(first + len(ticks) * step, 12))
    return ticks if len(ticks) >= 2 else [ticks[0], round(ticks[0] + step, 12)]


def number(value: float) -> str:
    """A tick or tooltip label: short, no trailing zeros."""
    if value == 0:
        return "0"
    if abs(value) >= 1e5 or abs(value) < 1e-3:
        return f"{value:.3g}"
    return f"{value:.4g}"


def line_chart(series: list[Series], *, title: str, x_label: str, y_label: str, limit: float | None = None,
               limit_label: str = "", width: int = 640, height: int = 260, integer_x: bool = True,
               from_zero: bool = False, max_marks: int = 300) -> str:
    """An SVG line chart of ``series``; ``limit``: a dashed horizontal line (a budget) labelled ``limit_label``;
    ``from_zero``: the y axis starts at 0; ``max_marks``: points marked (with their numbers) per line, evenly
    spread, the first and last always (the line goes through every point; a table beside the chart holds them
    all). Returns the SVG text (escaped: labels and values may come from files)."""
    left, right, top, bottom = 62, 16, 30, 44
    legend_rows = 1 if len(series) > 1 else 0
    plot_w, plot_h = width - left - right, height - top - bottom - 18 * legend_rows
    xs = [x for s in series for x, y in s.points if _finite(y)]
    ys = [y for s in series for _, y in s.points if _finite(y)]
    if limit is not None and math.isfinite(limit):
        ys.append(limit)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" aria-label="{escape(title)}">',
             f'<title>{escape(title)}</title>',
             f'<text x="{left}" y="18" class="chart-title">{escape(title)}</text>']
    if not xs:
        parts.append(f'<text x="{left}" y="{top + plot_h / 2:.0f}" class="chart-empty">nothing recorded yet</text>')
        parts.append("</svg>")
        return "".join(parts)
    x_ticks = nice_ticks(min(xs), max(xs), min(8, max(1, len(set(xs)) - 1)))
    if integer_x:
        x_ticks = sorted({int(round(t)) for t in x_ticks if abs(t - round(t)) < 1e-9}) or [int(min(xs))]
    y_low = min(0.0, min(ys)) if from_zero or (0 <= min(ys) < 0.35 * max(ys)) else min(ys)
    y_ticks = nice_ticks(y_low, max(ys))
    x0, x1 = min(min(xs), x_ticks[0]), max(max(xs), x_ticks[-1])
    y0, y1 = y_ticks[0], y_ticks[-1]

    def px(x: float) -> float:
        return left + (plot_w * (x - x0) / (x1 - x0) if x1 > x0 else plot_w / 2)

    def py(y: float) -> float:
        return top + plot_h - (plot_h * (y - y0) / (y1 - y0) if y1 > y0 else plot_h / 2)

    parts.append(f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" class="chart-area"/>')
    for tick in y_ticks:
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(tick):.1f}" y2="{py(tick):.1f}" class="grid"/>'
                     f'<text x="{left - 6}" y="{py(tick) + 4:.1f}" class="tick" text-anchor="end">'
                     f'{number(tick)}</text>')
    for tick in x_ticks:
        parts.append(f'<text x="{px(tick):.1f}" y="{top + plot_h + 16}" class="tick" text-anchor="middle">'
                     f'{number(tick)}</text>')
    parts.append(f'<text x="{left + plot_w / 2:.0f}" y="{top + plot_h + 32}" class="axis-label" '
                 f'text-anchor="middle">{escape(x_label)}</text>')
    parts.append(f'<text transform="translate(14 {top + plot_h / 2:.0f}) rotate(-90)" class="axis-label" '
                 f'text-anchor="middle">{escape(y_label)}</text>')
    if limit is not None and math.isfinite(limit):
        parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{py(limit):.1f}" y2="{py(limit):.1f}" '
                     f'class="limit" data-limit="{limit!r}"/>'
                     f'<text x="{left + plot_w - 4}" y="{py(limit) - 5:.1f}" class="limit-label" text-anchor="end">'
                     f'{escape(limit_label or number(limit))}</text>')
    for index, line in enumerate(series):
        colour = PALETTE[index % len(PALETTE)]
        runs: list[list[tuple[float, float]]] = [[]]
        for x, y in line.points:
            if _finite(y):
                runs[-1].append((x, float(y)))
            elif runs[-1]:
                runs.append([])
        for run in runs:
            if len(run) > 1:
                path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run)
                parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        finite = [(x, y) for x, y in line.points if _finite(y)]
        step = max(1, math.ceil(len(finite) / max_marks))
        for index_, (x, y) in enumerate(finite):
            if index_ % step == 0 or index_ == len(finite) - 1:
                parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3.2" fill="{colour}" class="point" '
                             f'data-series="{escape(line.label)}" data-x="{x!r}" data-y="{float(y)!r}">'
                             f'<title>{escape(line.label)}: {number(x)} → {number(float(y))}</title></circle>')
    if legend_rows:
        cursor = left
        for index, line in enumerate(series):
            colour = PALETTE[index % len(PALETTE)]
            y = height - 10
            parts.append(f'<rect x="{cursor}" y="{y - 9}" width="12" height="4" fill="{colour}"/>'
                         f'<text x="{cursor + 16}" y="{y - 4}" class="legend">{escape(line.label)}</text>')
            cursor += 28 + 7 * len(line.label)
    parts.append("</svg>")
    return "".join(parts)


def _finite(value: float | None) -> bool:
    return value is not None and isinstance(value, (int, float)) and math.isfinite(value)
