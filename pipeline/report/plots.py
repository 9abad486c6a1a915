"""Building blocks of the page: `Section` and `Plot`, matplotlib figure helpers, and HTML tables."""

from __future__ import annotations

import dataclasses
import html
import io
from collections.abc import Iterable, Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator


@dataclasses.dataclass
class Plot:
    """One PNG figure of a section."""

    name: str
    png: bytes
    caption: str


@dataclasses.dataclass
class Section:
    """One titled part of the page: HTML fragments and plots."""

    title: str
    body: list[str] = dataclasses.field(default_factory=list)
    plots: list[Plot] = dataclasses.field(default_factory=list)
    grid: bool = False
    """Lay the plots out side by side (small multiples) instead of one per row."""

    def no_data(self, what: str) -> Section:
        """Add a 'no data' note naming what was looked for."""
        self.body.append(f'<p class="nodata">no data: {html.escape(what)}</p>')
        return self


def fmt(value: Any) -> str:
    """How the report prints a value: floats with 4 significant digits, others as text."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def new_figure(n_axes: int, width: float = 11.0, height: float = 3.6) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, n_axes, i + 1) for i in range(n_axes)]
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # most x axes are steps
    return fig, axes


def to_png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def add_legend(ax: Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")


def html_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(fmt(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
