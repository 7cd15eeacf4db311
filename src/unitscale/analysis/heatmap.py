"""Heatmap of a ``ScaleMonitor`` table: every tensor (rows) at every recorded step (columns).

matplotlib is imported inside the functions, so importing this module is cheap.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..tracking.monitor import MonitorError

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes

__all__ = ["scale_heatmap"]


def scale_heatmap(
    table: pd.DataFrame,
    metric: str = "mean_abs",
    direction: str = "fwd",
    *,
    title: str = "",
    prune_same_scale: bool = True,
    ax: Axes | None = None,
) -> Axes:
    """Heatmap of one metric over training: a row per tensor, a column per recorded step.

    Colours are ``log2(value)`` on a diverging scale centred on 0 (unit scale, white): red
    above, blue below. Zeros and missing values are light grey; NaN and Inf are black.

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

    Returns:
        The Axes; save with ``ax.figure.savefig("heatmap.png")``.

    Raises:
        MonitorError: for a direction or metric with no rows in ``table``.

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"step": [0, 10], "tensor": ["x", "x"], "direction": "fwd",
        ...                   "metric": "rms", "value": [1.0, 4.0], "label": "x", "row": 0,
        ...                   "same_scale": False})
        >>> ax = scale_heatmap(t, "rms")
        >>> [t.get_text() for t in ax.get_yticklabels()], ax.images[0].get_array()[0].tolist()
        (['x'], [0.0, 2.0])
    """
    import numpy as np

    if direction not in ("fwd", "bwd"):
        raise MonitorError(f"scale_heatmap: direction={direction!r} must be 'fwd' or 'bwd'")
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
    values = grid.to_numpy(dtype=float)
    bad = present & ~np.isfinite(values)  # a recorded NaN or Inf (not a missing cell)
    with np.errstate(divide="ignore", invalid="ignore"):
        logs = np.where((values > 0) & np.isfinite(values), np.log2(values), np.nan)
    masked = np.ma.masked_invalid(logs)

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import ListedColormap, TwoSlopeNorm
    from matplotlib.figure import Figure

    n_rows, n_steps = values.shape
    if ax is None:
        longest = max((len(s) for s in labels), default=10)
        left_in = min(0.4 + 0.055 * longest, 4.5)
        width_in = max(7.0, left_in + 0.9 + min(0.16 * n_steps, 10.0))
        height_in = min(max(0.15 * n_rows + 1.4, 3.0), 60.0)
        fig = Figure(figsize=(width_in, height_in))
        FigureCanvasAgg(fig)
        fig.subplots_adjust(
            left=left_in / width_in, right=1 - 1.1 / width_in, top=1 - 0.8 / height_in,
            bottom=0.6 / height_in,
        )  # fmt: skip
        ax = fig.add_subplot()
    finite = masked.compressed()
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
    ax.set_yticks(range(n_rows))
    ax.set_yticklabels(labels, fontsize=7 if n_rows <= 60 else 6)
    tick_every = max(1, math.ceil(n_steps / 20))
    ticks = list(range(0, n_steps, tick_every))
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(int(steps[i])) for i in ticks], fontsize=7, rotation=90)
    ax.set_xlabel("step")
    kind = "values (forward)" if direction == "fwd" else "gradients (backward)"
    ax.set_title(title or f"{metric} of tensor {kind} over training", fontsize=10)
    return ax


def _colormap() -> Any:
    from matplotlib import colormaps

    return colormaps["RdBu_r"].with_extremes(bad="#dddddd")
