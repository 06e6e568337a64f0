"""Server-rendered charts for the admin costs page: geometry here, SVG in the template.

No JavaScript and nothing from a CDN. This module only computes numbers; the template
(`admin/costs_app/stacked_bars.svg.html`) writes the SVG elements with autoescape on, so
agent names (operator-chosen text) can never inject markup.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import date
from decimal import Decimal

# Colour-blind-friendly palette (Okabe-Ito), then grey for the remainder.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442"]
OTHERS_COLOUR = "#999999"

Number = int | float | Decimal


@dataclass
class Series:
    label: str
    values: dict[date, Number]
    colour: str = ""


@dataclass
class Bar:
    x: float
    y: float
    width: float
    height: float
    colour: str
    title: str


@dataclass
class Tick:
    position: float
    label: str


@dataclass
class Chart:
    width: int
    height: int
    left: int
    top: int
    plot_width: int
    plot_height: int
    bars: list[Bar] = field(default_factory=list)
    y_ticks: list[Tick] = field(default_factory=list)
    x_ticks: list[Tick] = field(default_factory=list)
    legend: list[Series] = field(default_factory=list)
    is_empty: bool = True

    @property
    def bottom(self) -> int:
        return self.top + self.plot_height

    @property
    def right(self) -> int:
        return self.left + self.plot_width

    @property
    def center_x(self) -> int:
        return self.left + self.plot_width // 2

    @property
    def center_y(self) -> int:
        return self.top + self.plot_height // 2


def nice_step(maximum: float, ticks: int = 4) -> float:
    """A round step (1, 2 or 5 times a power of ten) giving about `ticks` gridlines."""
    if maximum <= 0:
        return 1.0
    raw = maximum / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    for multiple in (1, 2, 5, 10):
        if raw <= multiple * magnitude:
            return multiple * magnitude
    return 10 * magnitude


def limit_series(series: list[Series], *, keep: int = len(PALETTE)) -> list[Series]:
    """The `keep` largest series in palette colours; the rest summed as one grey series."""
    ranked = sorted(series, key=lambda s: (-float(sum(s.values.values())), s.label))
    kept = [Series(s.label, s.values, PALETTE[i]) for i, s in enumerate(ranked[:keep])]
    rest = ranked[keep:]
    if rest:
        merged: dict[date, Number] = {}
        for s in rest:
            for day, value in s.values.items():
                merged[day] = merged.get(day, 0) + value
        kept.append(Series(f"{len(rest)} other agents", merged, OTHERS_COLOUR))
    return kept


def stacked_bar_chart(
    *,
    days: list[date],
    series: list[Series],
    format_value: Callable[[Number], str],
    width: int = 900,
    height: int = 260,
) -> Chart:
    """One bar per day, stacked by series (first series at the bottom)."""
    left, top, right_margin, bottom_margin = 70, 10, 10, 30
    chart = Chart(
        width=width,
        height=height,
        left=left,
        top=top,
        plot_width=width - left - right_margin,
        plot_height=height - top - bottom_margin,
        legend=series,
    )
    totals = [float(sum(s.values.get(day, 0) for s in series)) for day in days]
    maximum = max(totals, default=0.0)
    chart.is_empty = maximum <= 0
    step = nice_step(maximum)
    axis_max = step * max(1, math.ceil(maximum / step)) if maximum > 0 else step
    scale = chart.plot_height / axis_max
    slot = chart.plot_width / max(len(days), 1)
    bar_width = max(slot * 0.7, 1.0)

    value = 0.0
    while value <= axis_max + step / 2:
        chart.y_ticks.append(Tick(round(chart.bottom - value * scale, 2), format_value(value)))
        value += step

    label_every = max(1, math.ceil(len(days) / 10))
    for index, day in enumerate(days):
        x = left + index * slot + (slot - bar_width) / 2
        if index % label_every == 0 or index == len(days) - 1:
            chart.x_ticks.append(Tick(round(x + bar_width / 2, 2), day.strftime("%b %d")))
        stacked = 0.0
        for s in series:
            amount = s.values.get(day, 0)
            if not amount:
                continue
            bar_height = float(amount) * scale
            stacked += bar_height
            chart.bars.append(
                Bar(
                    x=round(x, 2),
                    y=round(chart.bottom - stacked, 2),
                    width=round(bar_width, 2),
                    height=round(max(bar_height, 0.5), 2),
                    colour=s.colour,
                    title=f"{day.isoformat()} · {s.label}: {format_value(amount)}",
                )
            )
    return chart
