"""How report plots tell series apart and where their legends go.

Series get a colour from a 40-colour cycle (tab10's, then the light shades of tab20 and the 20 of
tab20b, so a plot of up to 40 series gives each its own colour: a 10-colour cycle had 15 strong-scaling
series share 5 colours) and a marker from a 9-marker cycle at the same index: 40 and 9 are coprime, so no
two of the first 360 series share both (and the first 9 differ in both); a line style changes every 360
series after that. Legends sit outside the axes (in the figure margin
that constrained layout keeps for them), so no legend hides a line, a bar or a title.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure

COLORS: tuple[tuple[float, float, float], ...] = (
    *colormaps["tab10"].colors, *colormaps["tab20"].colors[1::2], *colormaps["tab20b"].colors)
"""40 distinct colours, the ten strongest first (tab20's even colours are tab10's, so only its odd ones)."""
MARKERS: tuple[str, ...] = ("o", "s", "^", "D", "v", "P", "X", "*", "h")
LINESTYLES: tuple[str, ...] = ("-", "--", ":", "-.")
AREA_COLORS: tuple[tuple[float, float, float], ...] = (*colormaps["tab20"].colors, *colormaps["tab20b"].colors)
"""Colours of filled areas (stacked bars, timeline lanes), one per category, none repeated under 40."""

CP_AXIS_LABEL = "CP degree (ranks)"
"""Axis label of CP degrees: ranks, not GPUs, since a CPU run has ranks too."""

LEGEND_COLUMN_ROWS = 20
"""Entries per legend column before another column is started."""


@dataclass(frozen=True)
class SeriesStyle:
    """Colour, marker and line style of one series."""

    color: tuple[float, float, float]
    marker: str
    linestyle: str

    def kwargs(self) -> dict[str, object]:
        """Keyword arguments of ``Axes.plot`` (``Axes.scatter`` takes ``color`` and ``marker``)."""
        return {"color": self.color, "marker": self.marker, "linestyle": self.linestyle}


def series_style(index: int) -> SeriesStyle:
    """The style of the ``index``-th series of a plot (0-based)."""
    if index < 0:
        raise ValueError(f"index: must be >= 0, got {index}")
    return SeriesStyle(COLORS[index % len(COLORS)], MARKERS[index % len(MARKERS)],
                       LINESTYLES[(index // (len(COLORS) * len(MARKERS))) % len(LINESTYLES)])


def area_color(index: int) -> tuple[float, float, float]:
    """The fill colour of the ``index``-th category of a plot."""
    return AREA_COLORS[index % len(AREA_COLORS)]


CHAR_WIDTH_EM = 0.6
"""Average width of a legend character in ems (of the font size), to size the margin it needs."""


def outside_legend(fig: Figure, ax: Axes | Sequence[Axes], *, fontsize: float = 7, title: str | None = None) -> None:
    """One legend of ``ax``'s labelled artists (of several axes: all of them) in the figure's right
    margin (more columns past :data:`LEGEND_COLUMN_ROWS` entries), the figure widened and heightened by
    what the legend needs so the axes keep their size; nothing when no artist is labelled. Needs a
    constrained-layout figure."""
    handles, labels = [], []
    for one in [ax] if isinstance(ax, Axes) else ax:
        more_handles, more_labels = one.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    if not handles:
        return
    columns = 1 + (len(handles) - 1) // LEGEND_COLUMN_ROWS
    rows = -(-len(handles) // columns)
    em = fontsize / 72.0  # inches
    longest = max(len(label) for label in [*labels, title or ""])
    width, height = fig.get_size_inches()
    fig.set_size_inches(width + columns * (longest * CHAR_WIDTH_EM + 3.0) * em,
                        max(height, (rows + (1 if title else 0) + 6) * 1.5 * em))
    fig.legend(handles, labels, loc="outside right upper", fontsize=fontsize, ncols=columns, title=title,
               title_fontsize=fontsize)


def cp_label(cp: object) -> str:
    """``cp=2`` from 2, 2.0 or "2" (a records column of floats after a NaN); the value as given otherwise."""
    try:
        number = float(cp)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return f"cp={cp}"
    return f"cp={int(number)}" if number.is_integer() else f"cp={cp}"
