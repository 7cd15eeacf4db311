"""The transfer figure: final held-out loss against learning rate."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ._config import TransferConfig
from ._frames import _size_column, best_points, seed_mean
from ._models import PARAMETRISATIONS, describe

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure


def plot_transfer(final: pd.DataFrame, config: TransferConfig) -> Figure:
    """Final held-out loss against learning rate: one panel per parametrisation, one curve
    per size, each curve's optimum starred; u-μP's FP8 runs as crosses; the default learning
    rate (grid step 0) dotted. Over several seeds, the means over seeds."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    final = seed_mean(final)
    size = _size_column(final)
    best = best_points(final)
    fig = Figure(figsize=(11.0, 4.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PARAMETRISATIONS), sharey=True)
    values = sorted(final[size].unique())
    colours = colormaps["viridis"]([i / max(len(values) - 1, 1) * 0.9 for i in range(len(values))])
    finite = [float(v) for v in final["heldout_loss"] if math.isfinite(float(v))]
    for ax, p in zip(axes, PARAMETRISATIONS, strict=True):
        chosen = final[final["parametrisation"] == p]
        for colour, value in zip(colours, values, strict=True):
            runs = chosen[chosen[size] == value]
            fp32 = runs[runs["precision"] == "fp32"].sort_values("lr")
            ax.plot(fp32["lr"], fp32["heldout_loss"], "o-", color=colour, ms=4, lw=1.4,
                    label=f"{size} {value}")  # fmt: skip
            b = best[(best.parametrisation == p) & (best[size] == value)]
            if len(b) and math.isfinite(b["lr"].iloc[0]):
                ax.plot(b["lr"], b["heldout_loss"], "*", color=colour, ms=15, mec="black", mew=0.6)
            fp8 = runs[runs["precision"] == "fp8"]
            if len(fp8):
                ax.plot(fp8["lr"], fp8["heldout_loss"], "x", color=colour, ms=9, mew=2)
        ax.axvline(dict(config.grid(p))[0], color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(
            "peak learning rate (log2 axis)" + (", base lr of every rule" if p == "u-muP" else "")
        )
        # Every panel names its axes: a panel cropped out of the figure still reads.
        ax.set_ylabel("final held-out loss (nats per byte)")
        title = describe(p, config)
        ax.set_title(title if p == "standard" else f"{title}; x: FP8 at best lr", fontsize=8)
        ax.grid(alpha=0.3)
    if finite:
        low, high = min(finite), min(max(finite), math.log(256))
        pad = 0.05 * (high - low) + 1e-3
        axes[0].set_ylim(low - pad, high + pad)
    axes[0].legend(fontsize=8, title="star: best; dotted: default / centre", title_fontsize=7)
    fig.suptitle(
        f"unitscale transfer (model {config.model}): {config.steps} steps, batch "
        f"{config.batch_size} x "
        f"{config.seq_len}, "
        + (f"seed {config.seed}" if config.seeds == 1 else f"mean of {config.seeds} seeds"),
        fontsize=11,
    )
    fig.tight_layout()
    return fig
