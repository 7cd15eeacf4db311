"""A static picture of a tracked graph: every tensor's forward and backward scale on a log2 axis.

Design constraints: matplotlib is imported inside :func:`plot` and used through its
object-oriented API with the Agg canvas (no pyplot state, no GUI backend, no global figure
registry), so it is safe in scripts, servers and the command; the figure grows with the
number of rows and thins its labels so that a model with hundreds of tensors stays legible;
it emits no warnings.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from torch.fx import Graph

from ..tracking.rows import TensorRow, prepare_rows
from .dataframe import METRIC_NAMES, AnalysisError

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["FORMAT_GUIDES", "plot"]

#: ``label -> (smallest subnormal, smallest normal, largest finite, colour)`` of the formats
#: drawn as guide lines.
FORMAT_GUIDES: dict[str, tuple[float, float, float, str]] = {
    "E4M3": (2.0**-9, 2.0**-6, 448.0, "tab:red"),
    "E5M2": (2.0**-16, 2.0**-14, 57344.0, "tab:purple"),
    "FP16": (2.0**-24, 2.0**-14, 65504.0, "tab:gray"),
}

_SCALAR_METRICS = tuple(m for m in METRIC_NAMES if not m.endswith(("_count",)) and m != "numel")
_ROW_HEIGHT_IN = 0.17
_MAX_HEIGHT_IN = 100.0
_LABEL_PT = 7.0
_COLOURS = {"fwd": "tab:blue", "bwd": "tab:orange"}
_OFFSET = {"fwd": -0.17, "bwd": 0.17}


def _log2(value: float) -> float | None:
    if not math.isfinite(value) or value <= 0:
        return None
    return math.log2(value)


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


def plot(
    graph: Graph,
    title: str = "",
    metric: str = "mean_abs",
    prune_same_scale: bool = True,
    show_arrows: bool = True,
    show_error_bars: bool = True,
    show_zero_tensors: bool = False,
    xmin: float | None = None,
    xmax: float | None = None,
) -> Axes:
    """Plot the forward and backward scale of every tensor in a tracked graph.

    One row per tensor, in graph (execution) order from top to bottom, labelled with its module
    path and variable (parameters by their qualified name, in green: weights, parameters of two
    or more dimensions, drawn as diamonds; biases and norm scales, vectors, as squares; see
    ``parameter_marker``). Forward values
    are blue, gradients orange; the x-axis is log2 of ``metric``. Error bars span
    ``abs_min``..``abs_max``; arrows follow the data flow (forward: input to output;
    backward: output gradient to input gradient). Vertical guides mark the smallest subnormal
    (dashed), smallest normal (dotted) and largest value (solid) of E4M3, E5M2 and FP16.

    Args:
        graph: ``tracked.scales_graph()`` (see :func:`unitscale.transforms.track_scales`).
        title: figure title.
        metric: which statistic to place on the axis (``"mean_abs"``, ``"rms"``, ``"std"``,
            ``"abs_max"``, ...).
        prune_same_scale: hide tensors whose scale equals their single input's in both
            directions (views, reshapes; :func:`unitscale.transforms.prune_same_scale_tensors`).
        show_arrows: draw data-flow arrows.
        show_error_bars: draw min/max bars.
        show_zero_tensors: keep tensors whose ``metric`` is 0 in every direction (drawn at the
            left edge with an ``x``); hidden by default.
        xmin: left limit in log2 units (default: fits the data and every guide).
        xmax: right limit in log2 units.

    Returns:
        The matplotlib Axes; save it with ``ax.figure.savefig("scales.png")`` (or ``.svg``).

    Raises:
        AnalysisError: for an unknown ``metric``, an empty range or a graph without metrics.

    Example:
        >>> from torch.fx import Graph
        >>> from unitscale.tracking.metrics import Metrics
        >>> g = Graph()
        >>> x = g.placeholder("x")
        >>> x.meta.update(clean_name="x", metrics=Metrics(
        ...     fwd=Metrics.Data(1.0, 0.0, 1.2, 3.0, 0.0, 1.2, 16)))
        >>> ax = plot(g, prune_same_scale=False)
        >>> [t.get_text() for t in ax.get_yticklabels()]
        ['x']
    """
    if metric not in _SCALAR_METRICS:
        raise AnalysisError(
            f"plot: metric={metric!r} is not a scale metric; use one of {list(_SCALAR_METRICS)}"
        )
    if xmin is not None and xmax is not None and xmin >= xmax:
        raise AnalysisError(f"plot: xmin={xmin} must be smaller than xmax={xmax}")

    rows = prepare_rows(graph, prune_same_scale, "plot")
    if not show_zero_tensors:
        rows = [r for r in rows if any(_positive(v) for v in _values(r, metric) if v is not None)]
    ax, height_in, rows_height_in = _new_axes(rows)
    points, zeros = _points(rows, metric)
    lo, hi = _x_range(rows, points, show_error_bars, xmin, xmax)
    _draw_guides(ax, lo, hi)
    if show_error_bars:
        _draw_error_bars(ax, rows, lo, hi)
    arrows = _draw_arrows(ax, rows, points) if show_arrows else {"fwd": False, "bwd": False}
    markers = _draw_markers(ax, rows, points, zeros, lo)
    _draw_axes(ax, rows, metric, lo, hi, rows_height_in)
    handles = _legend_handles(metric, show_error_bars, bool(zeros), set(markers), arrows)
    legend = ax.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0 + 0.45 / max(rows_height_in, 1.0)),
        ncol=5,
        fontsize=7,
        frameon=False,
        borderaxespad=0.2,
    )
    for text in legend.get_texts():
        if text.get_text() == _PARAMETER_LABEL:
            text.set_color("darkgreen")
    heading = f"{title}: {metric}" if title else metric
    # Counted as the command's summary counts: one per tensor and direction.
    records = sum((row.fwd is not None) + (row.bwd is not None) for row in rows)
    ax.figure.suptitle(
        f"{heading}  ({records} values and gradients of {len(rows)} tensors)",
        fontsize=10,
        y=1 - 0.15 / height_in,
        va="top",
    )
    return ax


def _value(row: TensorRow, direction: str, metric: str) -> float | None:
    rec = row.record(direction)
    return None if rec is None else float(rec.metrics[metric])


def _values(row: TensorRow, metric: str) -> tuple[float | None, float | None]:
    return _value(row, "fwd", metric), _value(row, "bwd", metric)


def _new_axes(rows: list[TensorRow]) -> tuple[Axes, float, float]:
    """Axes on a new Agg figure sized for ``rows`` (taller with more rows, a left margin
    wide enough for the longest label), its height and the height of its rows, in inches."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = max(len(rows), 1)
    longest = max((len(r.label) for r in rows), default=10)
    width_in = 11.0
    left_in = min(0.3 + 0.055 * longest, 4.5)
    top_in, bottom_in, right_in = 1.5, 0.6, 0.3
    height_in = min(max(_ROW_HEIGHT_IN * n + top_in + bottom_in, 4.0), _MAX_HEIGHT_IN)
    fig = Figure(figsize=(width_in, height_in))
    FigureCanvasAgg(fig)
    fig.subplots_adjust(
        left=left_in / width_in,
        right=1 - right_in / width_in,
        top=1 - top_in / height_in,
        bottom=bottom_in / height_in,
    )
    return fig.add_subplot(), height_in, height_in - top_in - bottom_in


def _points(
    rows: list[TensorRow], metric: str
) -> tuple[dict[tuple[str, str], tuple[float, float]], list[tuple[float, str]]]:
    """The ``(log2 value, y)`` of each row and direction, and the ``(y, direction)`` of the
    values that are exactly 0 (drawn at the left edge)."""
    points: dict[tuple[str, str], tuple[float, float]] = {}
    zeros: list[tuple[float, str]] = []
    for i, row in enumerate(rows):
        for direction in ("fwd", "bwd"):
            v = _value(row, direction, metric)
            if v is None:
                continue
            lv = _log2(v)
            if lv is None:
                if v == 0:
                    zeros.append((i + _OFFSET[direction], direction))
                continue
            points[(row.node, direction)] = (lv, i + _OFFSET[direction])
    return points, zeros


def _x_range(
    rows: list[TensorRow],
    points: dict[tuple[str, str], tuple[float, float]],
    error_bars: bool,
    xmin: float | None,
    xmax: float | None,
) -> tuple[float, float]:
    """Axis limits: the data (including error bars) and every guide line, unless given."""
    candidates = [p[0] for p in points.values()]
    if error_bars:
        for row in rows:
            for rec in (row.fwd, row.bwd):
                if rec is not None:
                    # The maximum widens the axis; a minimum near zero is clipped at the edge.
                    top = _log2(rec.metrics["abs_max"])
                    if top is not None:
                        candidates.append(top)
    guides = [math.log2(v) for lo, nm, hi, _ in FORMAT_GUIDES.values() for v in (lo, nm, hi)]
    lo = math.floor(min(candidates + guides)) - 1 if xmin is None else xmin
    hi = math.ceil(max(candidates + guides)) + 1 if xmax is None else xmax
    if lo >= hi:
        raise AnalysisError(f"plot: empty x range [{lo}, {hi}]; pass a smaller xmin or larger xmax")
    return lo, hi


#: What each guide line of a format marks, as written beside the line.
_GUIDE_NAMES = ("smallest subnormal", "smallest normal", "max")


def _draw_guides(ax: Axes, lo: float, hi: float) -> None:
    """Vertical lines at each format's smallest subnormal, smallest normal and largest value,
    each labelled beside it at the top of the axes (``E4M3 max``), in the line's colour: the
    line style alone, in a small legend, was hard to read."""
    for label, (sub, normal, top, colour) in FORMAT_GUIDES.items():
        for v, style, what in zip((sub, normal, top), ("--", ":", "-"), _GUIDE_NAMES, strict=True):
            x = math.log2(v)
            ax.axvline(x, color=colour, linestyle=style, linewidth=0.8, alpha=0.55)
            if lo <= x <= hi:
                ax.text(
                    x,
                    1.0,
                    f"{label} {what}",
                    transform=ax.get_xaxis_transform(),
                    rotation=90,
                    ha="right",
                    va="top",
                    fontsize=6,
                    color=colour,
                    alpha=0.9,
                    gid="format-guide",
                )


def _draw_error_bars(ax: Axes, rows: list[TensorRow], lo: float, hi: float) -> None:
    """A bar from ``abs_min`` to ``abs_max`` per row and direction, clipped to the axis."""
    for i, row in enumerate(rows):
        for direction in ("fwd", "bwd"):
            rec = row.record(direction)
            if rec is None:
                continue
            a = _log2(rec.metrics["abs_min"])
            b = _log2(rec.metrics["abs_max"])
            if b is None:
                continue
            a = lo if a is None else a
            ax.hlines(
                i + _OFFSET[direction],
                max(a, lo),
                min(b, hi),
                color=_COLOURS[direction],
                linewidth=0.6,
                alpha=0.45,
            )


def _draw_arrows(
    ax: Axes, rows: list[TensorRow], points: dict[tuple[str, str], tuple[float, float]]
) -> dict[str, bool]:
    """Data-flow arrows between rows; returns which directions drew one (for the legend)."""
    from matplotlib.patches import FancyArrowPatch

    arrows = {"fwd": False, "bwd": False}
    weights = {r.node for r in rows if r.weight}
    for row in rows:
        if row.weight:
            continue
        # Arrows from parameters would cross the whole figure; their row sits just above
        # the op that reads them instead.
        for source in (s for s in row.sources if s not in weights):
            for direction in ("fwd", "bwd"):
                start = points.get((source, direction))
                end = points.get((row.node, direction))
                if start is None or end is None:
                    continue
                if direction == "bwd":  # gradients flow from a node back to its inputs
                    start, end = end, start
                arrows[direction] = True
                ax.add_patch(
                    FancyArrowPatch(
                        start,
                        end,
                        arrowstyle="-|>",
                        mutation_scale=5,
                        linewidth=0.4,
                        color=_COLOURS[direction],
                        alpha=0.3,
                        shrinkA=2,
                        shrinkB=2,
                    )
                )
    return arrows


def _draw_markers(
    ax: Axes,
    rows: list[TensorRow],
    points: dict[tuple[str, str], tuple[float, float]],
    zeros: list[tuple[float, str]],
    lo: float,
) -> list[str]:
    """One scatter per marker kind and direction, and the zeros at the left edge; returns
    each row's marker (see :func:`parameter_marker`)."""
    markers = [parameter_marker(r) for r in rows]
    for direction in ("fwd", "bwd"):
        for marker in ("o", "D", "s"):
            xy = [
                points[(r.node, direction)]
                for r, m in zip(rows, markers, strict=True)
                if m == marker and (r.node, direction) in points
            ]
            if xy:
                ax.scatter(
                    [p[0] for p in xy],
                    [p[1] for p in xy],
                    s=14 if marker == "o" else 16,
                    marker=marker,
                    color=_COLOURS[direction],
                    edgecolors="none" if marker == "o" else "black",
                    linewidths=0.4,
                    zorder=3,
                    gid=f"{_MARKER_KINDS[marker]}-{direction}",
                )
    if zeros:
        ax.scatter(
            [lo + 0.3] * len(zeros),
            [y for y, _ in zeros],
            marker="x",
            s=14,
            color=[_COLOURS[d] for _, d in zeros],
            zorder=3,
        )
    return markers


def _draw_axes(
    ax: Axes, rows: list[TensorRow], metric: str, lo: float, hi: float, rows_height_in: float
) -> None:
    """Rows top to bottom in graph order, their labels thinned when rows are denser than the
    font (parameters' in green); the x-axis in powers of two, on top and bottom."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    n = max(len(rows), 1)
    ax.set_ylim(n - 0.5, -0.5)
    row_pt = rows_height_in * 72 / n
    step = max(1, math.ceil((_LABEL_PT + 1.5) / row_pt))
    ticks = list(range(0, len(rows), step))
    ax.set_yticks(ticks, labels=[rows[i].label for i in ticks], fontsize=_LABEL_PT)
    for i, tick in zip(ticks, ax.get_yticklabels(), strict=True):
        if rows[i].weight:
            tick.set_color("darkgreen")
    ax.tick_params(axis="y", length=0)
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 4, 5, 10]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"$2^{{{round(v)}}}$"))
    ax.tick_params(axis="x", labelsize=8, top=True, labeltop=True)
    ax.grid(axis="x", color="0.92", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_xlabel(f"{metric} (log2 scale)", fontsize=9)


#: The legend entry whose text is green, like the labels of parameter rows.
_PARAMETER_LABEL = "green label: parameter"
#: What each marker stands for (also the ``gid`` of its scatter, with the direction).
_MARKER_KINDS = {"o": "tensor", "D": "weight", "s": "vector-parameter"}


def parameter_marker(row: TensorRow) -> str:
    """The marker of ``row``: ``"D"`` for a weight (a parameter of two or more dimensions:
    a matrix, an embedding table, a convolution kernel), ``"s"`` for a vector parameter (a
    bias or a norm's scale), ``"o"`` for every other tensor.

    Example:
        >>> from unitscale.tracking import TensorRow
        >>> [parameter_marker(TensorRow("n", "n", "", "", w, s, "float32"))
        ...  for w, s in ((True, "(4, 8)"), (True, "(8,)"), (False, "(4, 8)"))]
        ['D', 's', 'o']
    """
    if not row.weight:
        return "o"
    dimensions = row.shape.strip("()").rstrip(",").split(",") if row.shape else []
    return "D" if len(dimensions) >= 2 else "s"


def _legend_handles(
    metric: str, error_bars: bool, zeros: bool, markers: set[str], arrows: dict[str, bool]
) -> list[Any]:
    """The legend: every mark, line style and colour the plot uses, as the HTML report does."""
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], marker="o", linestyle="", color=_COLOURS["fwd"], label="forward (value)"),
        Line2D([], [], marker="o", linestyle="", color=_COLOURS["bwd"], label="backward (grad)"),
    ]
    parameter_kinds = (("D", "weight (matrix)"), ("s", "bias or norm scale (vector)"))
    for marker, label in parameter_kinds:
        if marker in markers:
            handles.append(
                Line2D(
                    [],
                    [],
                    marker=marker,
                    linestyle="",
                    color="white",
                    markeredgecolor="black",
                    label=label,
                )
            )
    flows = (("fwd", "data flow (forward)"), ("bwd", "gradient flow (backward)"))
    for direction, label in flows:
        if arrows[direction]:  # a line with an arrowhead, as the arrows are drawn
            handles.append(
                Line2D(
                    [],
                    [],
                    color=_COLOURS[direction],
                    linewidth=0.8,
                    alpha=0.6,
                    marker=">" if direction == "fwd" else "<",
                    markersize=4,
                    markevery=[1],
                    label=label,
                )
            )
    if error_bars:
        handles.append(Line2D([], [], color="0.4", linewidth=0.8, label="whisker: abs min..max"))
    if zeros:
        handles.append(
            Line2D([], [], marker="x", linestyle="", color="0.3", label=f"{metric} = 0 (left edge)")
        )
    handles += [
        Line2D([], [], color=c, linewidth=1.2, label=f"{name} [2^{math.log2(s):.0f}, {t:g}]")
        for name, (s, _, t, c) in FORMAT_GUIDES.items()
    ]
    handles += [
        Line2D([], [], color="0.3", linestyle="--", linewidth=0.8, label="smallest subnormal"),
        Line2D([], [], color="0.3", linestyle=":", linewidth=0.8, label="smallest normal"),
        Line2D([], [], color="0.3", linestyle="-", linewidth=0.8, label="largest"),
    ]
    if markers - {"o"}:
        handles.append(Line2D([], [], linestyle="", label=_PARAMETER_LABEL))
    return handles
