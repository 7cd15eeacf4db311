"""The loss curves of ``unitscale train``'s runs (:mod:`unitscale.experiments.training`):
:func:`plot_losses`, smoothed, with the y-range of :func:`zoom_limits`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import _train_config
from ._train_config import _family, _kind
from ._train_loop import RunResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure


SMOOTHING_WINDOW = 10


def _smoothed(losses: Sequence[float]) -> list[float]:
    """The ``SMOOTHING_WINDOW``-step moving average of ``losses`` (shorter at the start)."""
    values = torch.tensor(list(losses), dtype=torch.float64)
    return [
        float(values[max(0, i - SMOOTHING_WINDOW + 1) : i + 1].mean()) for i in range(len(values))
    ]


def zoom_limits(
    results: dict[str, RunResult],
) -> tuple[tuple[int, int], tuple[float, float]] | None:
    """The zoomed panel's ``(x range, y range)``: the last quarter of the steps, and the span
    of the unit-scaled runs' curves there (their smoothed training loss and held-out points;
    every run's when there is no unit-scaled run), padded by 10%. None: nothing finite.

    Derived from the curves' final parts, so that the gap between a unit-scaled run in FP8
    and in FP32 (a percent or two) fills the panel, not the distance to a run that did not
    train (plain FP8 without loss scaling stays near 3.3 nats, the start is 5.5).
    """
    steps = max((len(r.train_losses) for r in results.values()), default=0)
    if steps == 0:
        return None
    first = steps - max(steps // 4, 1)
    focus = [n for n in results if _family(n) == "unit-scaled"] or list(results)
    values = []
    for name in focus:
        r = results[name]
        values += _smoothed(r.train_losses)[first:]
        values += [v for s, v in r.heldout.items() if s >= first]
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    low, high = min(finite), max(finite)
    pad = 0.1 * (high - low) + 1e-3
    return (first, steps), (low - pad, high + pad)


#: Line styles of a family's FP8 kinds, in :data:`RUN_KINDS` order (its FP32 run is solid).
_FP8_STYLES: tuple[Any, ...] = (
    "--",
    ":",
    "-.",
    (0, (5, 1, 1, 1, 1, 1)),
    (0, (8, 2)),
    (0, (3, 1, 1, 1)),
    (0, (1, 3)),
    (0, (6, 2, 1, 2)),
    (0, (2, 2)),
    (0, (10, 3, 2, 3)),
    (0, (4, 1, 1, 1, 1, 1, 1, 1)),
    (0, (12, 4)),
    (0, (1, 1)),
    (0, (7, 1, 3, 1)),
    (0, (2, 4, 6, 4)),
    (0, (9, 1, 1, 1, 1, 1)),
)


def _line_style(run: str) -> Any:
    """Solid for a family's FP32 run; its FP8 kinds dashed, dotted, dash-dotted... in turn."""
    kind = _kind(run)
    if not kind.fp8:
        return "-"
    siblings = [k.name for k in _train_config.RUN_KINDS if k.family == kind.family and k.fp8]
    return _FP8_STYLES[siblings.index(run) % len(_FP8_STYLES)]


def plot_losses(results: dict[str, RunResult], title: str = "") -> Figure:
    """Training loss (a 10-step moving average) and held-out loss of every run, per step:
    the whole run, and the last quarter zoomed onto the unit-scaled runs (:func:`zoom_limits`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.0, 4.6))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    colours = {"plain": "tab:blue", "unit-scaled": "tab:red"}
    for name, r in results.items():
        colour = colours[_family(name)]
        style = _line_style(name)
        smoothed = _smoothed(r.train_losses)
        steps = sorted(r.heldout)
        for ax in (left, right):
            ax.plot(range(len(smoothed)), smoothed, linestyle=style, color=colour, lw=1.2,
                    label=name)  # fmt: skip
            if steps:
                ax.plot(steps, [r.heldout[s] for s in steps], linestyle=style, color=colour,
                        marker="o", ms=3.5, lw=0.8, alpha=0.6)  # fmt: skip
    left.set_title("whole run", fontsize=10)
    focus = "unit-scaled runs" if any(_family(n) == "unit-scaled" for n in results) else "all runs"
    right.set_title(f"last quarter, zoomed onto the {focus}", fontsize=10)
    limits = zoom_limits(results)
    if limits is not None:
        right.set_xlim(*limits[0])
        right.set_ylim(*limits[1])
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per byte)")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8, title="line: train (10-step mean); dots: held-out", title_fontsize=7)
    fig.suptitle(title or "unitscale train: loss curves", fontsize=11)
    fig.tight_layout()
    return fig
