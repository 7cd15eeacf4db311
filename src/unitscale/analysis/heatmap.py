"""Heatmap of a ``ScaleMonitor`` table: every tensor (rows) at every recorded step (columns).

matplotlib is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

from ..errors import MonitorError

if TYPE_CHECKING:
    import numpy as np
    import pandas as pd
    from matplotlib.axes import Axes

__all__ = ["scale_heatmap"]

_ROW_IN = 0.16  # row height: a 7 pt label with room to spare
_MAX_HEIGHT_IN = 60.0


def scale_heatmap(
    table: pd.DataFrame,
    metric: str = "mean_abs",
    direction: str = "fwd",
    *,
    title: str = "",
    prune_same_scale: bool = True,
    ax: Axes | None = None,
    span: float | None = None,
) -> Axes:
    """Heatmap of one metric over training: a row per tensor, a column per recorded step.

    Colours are ``log2(value)`` on a diverging scale centred on 0 (unit scale, white): red
    above, blue below, from ``-span`` to ``span``. Zeros and missing values are light grey;
    NaN and Inf are black. The colour bar marks the smallest subnormal and the largest value
    of E4M3 and E5M2 (where they fall in the range). Every row is labelled, at a legible
    size: the figure grows with the rows (up to 60 inches; beyond, every k-th row).

    Args:
        table: a long table as :meth:`ScaleMonitor.table
            <unitscale.tracking.ScaleMonitor.table>` returns (columns ``step``, ``tensor``,
            ``direction``, ``metric``, ``value``, ``label``, ``row`` and
            ``same_scale``).
        metric: the metric shown (``"mean_abs"``, ``"rms"``, ``"abs_max"``, ...).
        direction: ``"fwd"`` (values) or ``"bwd"`` (gradients).
        title: the title (default: the metric and direction).
        prune_same_scale: hide tensors that always have their single input's scale (views).
        ax: draw into this Axes (default: a new figure sized to the number of rows).
        span: half-width of the colour range in log2 units (default: this table's largest
            ``|log2(value)|``, at least 1). Give maps that are compared the same ``span``, so
            that equal colours mean equal scales.

    Returns:
        The Axes; save with ``ax.figure.savefig("heatmap.png")``.

    Raises:
        MonitorError: for a direction or metric with no rows in ``table``, or a ``span``
            that is not a positive number.

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"step": [0, 10], "tensor": ["x", "x"], "direction": "fwd",
        ...                   "metric": "rms", "value": [1.0, 4.0], "label": "x", "row": 0,
        ...                   "same_scale": False})
        >>> ax = scale_heatmap(t, "rms")
        >>> [t.get_text() for t in ax.get_yticklabels()], ax.images[0].get_array()[0].tolist()
        (['x'], [0.0, 2.0])
    """
    if direction not in ("fwd", "bwd"):
        raise MonitorError(f"scale_heatmap: direction={direction!r} must be 'fwd' or 'bwd'")
    if span is not None and not (isinstance(span, (int, float)) and 0 < span < math.inf):
        raise MonitorError(f"scale_heatmap: span={span!r} must be a positive number (log2 units)")
    rows = _selected_rows(table, metric, direction, prune_same_scale)
    labels, steps, values, present = _grid(rows)
    if ax is None:
        ax = _new_axes(labels, *values.shape)
    _draw_cells(ax, values, present, metric, span)
    _label_axes(ax, labels, steps)
    kind = "values (forward)" if direction == "fwd" else "gradients (backward)"
    ax.set_title(title or f"{metric} of tensor {kind} over training", fontsize=10)
    return ax


def _selected_rows(
    table: pd.DataFrame, metric: str, direction: str, prune_same_scale: bool
) -> pd.DataFrame:
    """The rows of ``metric`` in ``direction``, less the tensors that always have their
    input's scale where ``prune_same_scale``; raises if none is left."""
    rows = table[(table["metric"] == metric) & (table["direction"] == direction)]
    if prune_same_scale and "same_scale" in rows:
        # A tensor shown at any step is shown at every step.
        shown = set(rows.loc[~rows["same_scale"].astype(bool), "tensor"])
        rows = rows[rows["tensor"].isin(shown)]
    if rows.empty:
        raise MonitorError(
            f"scale_heatmap: no {direction} values of metric {metric!r} in the table; record "
            "some steps first, and check the metric name"
        )
    return rows


def _grid(rows: pd.DataFrame) -> tuple[list[str], list[Any], np.ndarray, np.ndarray]:
    """The row labels (tensors in graph order), the steps, the values as a tensor x step
    array (NaN where missing) and which cells were recorded."""
    order = rows.groupby("tensor", sort=False)["row"].min().sort_values(kind="stable")
    steps = sorted(rows["step"].unique())
    grid = rows.pivot(index="tensor", columns="step", values="value").reindex(
        index=order.index, columns=steps
    )
    present = (
        rows.assign(_present=1.0)
        .pivot(index="tensor", columns="step", values="_present")
        .reindex(index=order.index, columns=steps)
        .notna()
        .to_numpy()
    )
    labels_by_tensor = rows.groupby("tensor", sort=False)["label"].last()
    labels = [str(labels_by_tensor[t]) for t in order.index]
    return labels, steps, grid.to_numpy(dtype=float), present


def _new_axes(labels: list[str], n_rows: int, n_steps: int) -> Axes:
    """Axes on a new Agg figure sized to the rows, the steps and the longest label."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    longest = max((len(s) for s in labels), default=10)
    left_in = min(0.4 + 0.06 * longest, 4.5)
    width_in = max(7.0, left_in + 1.6 + min(0.16 * n_steps, 10.0))
    height_in = min(max(_ROW_IN * n_rows + 1.4, 3.0), _MAX_HEIGHT_IN)
    fig = Figure(figsize=(width_in, height_in))
    FigureCanvasAgg(fig)
    fig.subplots_adjust(
        left=left_in / width_in, right=1 - 1.6 / width_in, top=1 - 0.8 / height_in,
        bottom=0.6 / height_in,
    )  # fmt: skip
    return fig.add_subplot()


def _draw_cells(
    ax: Axes, values: np.ndarray, present: np.ndarray, metric: str, span: float | None
) -> None:
    """The cells coloured by ``log2(value)`` (recorded NaN and Inf in black) and the colour
    bar, from ``-span`` to ``span`` (default: the largest ``|log2(value)|``, at least 1)."""
    import numpy as np
    from matplotlib.colors import ListedColormap, TwoSlopeNorm

    bad = present & ~np.isfinite(values)  # a recorded NaN or Inf (not a missing cell)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where((values > 0) & np.isfinite(values), np.log2(values), np.nan)
    masked = np.ma.masked_invalid(logs)
    finite = masked.compressed()
    if span is None:
        span = float(max(np.abs(finite).max(), 1.0)) if finite.size else 1.0
    cmap = _colormap()
    image = ax.imshow(
        masked,
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        norm=TwoSlopeNorm(vcenter=0.0, vmin=-span, vmax=span),
    )
    if bad.any():
        overlay = np.ma.masked_where(~bad, np.ones_like(values))
        ax.imshow(overlay, aspect="auto", interpolation="nearest", cmap=ListedColormap(["black"]))
    colorbar = ax.figure.colorbar(image, ax=ax, fraction=0.04, pad=0.02)
    colorbar.set_label(f"log2({metric})")
    _mark_formats(colorbar, span)


def _label_axes(ax: Axes, labels: list[str], steps: list[Any]) -> None:
    """Every row labelled when rows are at least as tall as the font (else every k-th), and
    horizontal step labels spaced so that they do not overlap."""
    from matplotlib.figure import Figure

    n_rows, n_steps = len(labels), len(steps)
    label_pt = 7.0
    figure = cast(Figure, ax.figure)
    axes_height_pt = ax.get_position().height * figure.get_figheight() * 72
    every = max(1, math.ceil((label_pt + 1.0) / (axes_height_pt / max(n_rows, 1))))
    labelled = list(range(0, n_rows, every))
    ax.set_yticks(labelled)
    ax.set_yticklabels([labels[i] for i in labelled], fontsize=label_pt)
    axes_width_in = ax.get_position().width * figure.get_figwidth()
    widest = max(len(str(int(s))) for s in steps)
    fit = max(1, int(axes_width_in * 72 / ((widest + 2) * 7 * 0.6)))
    tick_every = max(1, math.ceil(n_steps / min(fit, 20)))
    ticks = list(range(0, n_steps, tick_every))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(int(steps[i])) for i in ticks], fontsize=7, rotation=0)
    ax.set_xlabel("step")


def _mark_formats(colorbar: Any, span: float) -> None:
    """Mark E4M3's and E5M2's smallest subnormal and largest value on the colour bar."""
    from .plot import FORMAT_GUIDES

    ticks: dict[float, str] = {0.0: "0 (unit)"}
    for name in ("E4M3", "E5M2"):
        smallest, _, largest, colour = FORMAT_GUIDES[name]
        for value, what in ((smallest, "min"), (largest, "max")):
            level = math.log2(value)
            if -span <= level <= span:
                colorbar.ax.axhline(level, color=colour, linewidth=1.2)
                ticks[level] = f"{level:.3g} {name} {what}"
    colorbar.set_ticks(sorted(ticks), labels=[ticks[t] for t in sorted(ticks)], fontsize=7)


def _colormap() -> Any:
    from matplotlib import colormaps

    return colormaps["RdBu_r"].with_extremes(bad="#dddddd")
