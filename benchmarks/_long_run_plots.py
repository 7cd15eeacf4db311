"""The figures of ``benchmarks/long_run.py``: the monitored run's overflow and underflow
fractions over steps, per linear op, and the loss curves of every run."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from _long_run_report import ROLE_FORMATS

from unitscale.experiments.report import save_png

#: A seed's line style (seeds beyond these reuse them in turn).
SEED_STYLES = ("-", "--", ":", "-.")
#: Fractions at or below this are drawn on a linear scale (zero stays visible).
LINEAR_BELOW = 1e-6
_ROLE_TITLES = {"input": "input operand", "weight": "weight operand", "output_grad": "output grad"}


def plot_fractions(frames: dict[int, pd.DataFrame], run: str, path: Path) -> Path:
    """Overflow (left) and underflow (right) fractions over steps: a row per role and format
    (input and weight operands in E4M3, the output gradient in E5M2 and in E4M3), a colour
    per linear op, a line style per seed. ``frames``: each seed's ``linear_op_rows``."""
    rows = [(role, fmt) for role, formats in ROLE_FORMATS.items() for fmt in formats]
    fig, axes = plt.subplots(len(rows), 2, figsize=(13, 3.2 * len(rows)), squeeze=False)
    ops = sorted({op for frame in frames.values() for op in frame["op"].unique()})
    colours = plt.get_cmap("tab10" if len(ops) <= 10 else "tab20")
    for i, (role, fmt) in enumerate(rows):
        for j, kind in enumerate(("overflow", "underflow")):
            ax = axes[i][j]
            metric = f"{kind}_{fmt}"
            for s, (_, frame) in enumerate(sorted(frames.items())):
                chosen = frame[(frame["role"] == role) & (frame["metric"] == metric)]
                for k, op in enumerate(ops):
                    line = chosen[chosen["op"] == op].sort_values("step")
                    if line.empty:
                        continue
                    ax.plot(line["step"], line["value"], SEED_STYLES[s % len(SEED_STYLES)],
                            color=colours(k), lw=1.1,
                            label=op if s == 0 else None)  # fmt: skip
            ax.set_yscale("symlog", linthresh=LINEAR_BELOW)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{_ROLE_TITLES[role]}: {kind} fraction in {fmt.upper()}", fontsize=10)
            ax.grid(alpha=0.3)
        axes[i][0].set_ylabel("fraction of elements")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    seeds = ", ".join(f"seed {seed} {SEED_STYLES[s % len(SEED_STYLES)]}"
                      for s, seed in enumerate(sorted(frames)))  # fmt: skip
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(ops), 5), fontsize=8,
               bbox_to_anchor=(0.5, 0.995))  # fmt: skip
    fig.suptitle(f"{run}: unrounded GEMM tensors of each linear op ({seeds})", y=0.955)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    out = save_png(fig, path)
    plt.close(fig)
    return out


def _smoothed(values: pd.Series, window: int) -> pd.Series:
    return values.rolling(window, min_periods=1).mean()


def plot_losses(losses: dict[int, dict[str, pd.DataFrame]], path: Path) -> Path:
    """Training loss (moving mean over 1% of the steps) and held-out loss of every run, a
    colour per run and a line style per seed; the right panel zooms on the last half.
    ``losses``: per seed, per run, the job's ``losses.csv``."""
    runs = sorted({run for by_run in losses.values() for run in by_run})
    colours = plt.get_cmap("tab10")
    fig, (full, zoom) = plt.subplots(1, 2, figsize=(14, 5.5))
    low, high, last = float("inf"), float("-inf"), 0
    for s, (seed, by_run) in enumerate(sorted(losses.items())):
        style = SEED_STYLES[s % len(SEED_STYLES)]
        for k, run in enumerate(runs):
            if run not in by_run:
                continue
            frame = by_run[run]
            train = frame.dropna(subset=["train_loss"])
            held = frame.dropna(subset=["heldout_loss"])
            smooth = _smoothed(train["train_loss"], max(1, len(train) // 100))
            label = f"{run} (seed {seed})"
            for ax in (full, zoom):
                ax.plot(train["step"], smooth, style, color=colours(k), lw=1.0, label=label)
                ax.plot(held["step"], held["heldout_loss"], "o", color=colours(k), ms=2)
            last = max(last, int(frame["step"].max()))
            half = int(frame["step"].max()) // 2
            tail = pd.concat([held[held["step"] >= half]["heldout_loss"],
                              smooth[train["step"] >= half]])  # fmt: skip
            if len(tail):
                low, high = min(low, tail.min()), max(high, tail.max())
    if last and low < high:
        pad = 0.1 * (high - low)
        zoom.set_xlim(last // 2, last)
        zoom.set_ylim(low - pad, high + pad)
    full.set_title("training loss (moving mean) and held-out loss (dots)")
    zoom.set_title("the second half, zoomed on the held-out losses")
    for ax in (full, zoom):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    full.set_ylabel("next-byte cross-entropy (nats)")
    full.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = save_png(fig, path)
    plt.close(fig)
    return out
