"""scale_heatmap: comparable colours across runs, format marks, legible labels at ~100 rows."""

from __future__ import annotations

import itertools

import pandas as pd
import pytest

from unitscale.analysis import scale_heatmap
from unitscale.tracking import MonitorError


def table(rows: int, steps: int, scale: float) -> pd.DataFrame:
    """``rows`` tensors over ``steps`` recorded steps, tensor i at ``scale * 2**-(i % 8)``."""
    records = [
        {"step": 10 * s, "tensor": f"t{i}", "direction": "fwd", "metric": "rms",
         "value": scale * 2.0 ** -(i % 8), "label": f"blocks.{i}.mlp: linear_{i}", "row": i,
         "same_scale": False}
        for i in range(rows)
        for s in range(steps)
    ]  # fmt: skip
    return pd.DataFrame(records)


def test_a_shared_span_gives_both_maps_the_same_colour_range() -> None:
    healthy, failing = table(4, 3, 1.0), table(4, 3, 2.0**-20)
    own = [scale_heatmap(t, "rms").images[0].norm for t in (healthy, failing)]
    assert (own[0].vmin, own[0].vmax) == (-3.0, 3.0)  # each its own range by default
    assert (own[1].vmin, own[1].vmax) == (-23.0, 23.0)
    shared = [scale_heatmap(t, "rms", span=23.0).images[0].norm for t in (healthy, failing)]
    assert all((n.vmin, n.vmax) == (-23.0, 23.0) for n in shared)
    with pytest.raises(MonitorError, match=r"span=0 must be a positive number"):
        scale_heatmap(healthy, "rms", span=0)


def test_the_colour_bar_marks_format_thresholds_within_its_range() -> None:
    ax = scale_heatmap(table(4, 3, 2.0**-20), "rms", span=20.0)
    colorbar = ax.images[0].colorbar
    labels = [t.get_text() for t in colorbar.ax.get_yticklabels()]
    assert labels == ["-16 E5M2 min", "-9 E4M3 min", "0 (unit)", "8.81 E4M3 max", "15.8 E5M2 max"]
    narrow = scale_heatmap(table(4, 3, 1.0), "rms", span=10.0).images[0].colorbar
    assert [t.get_text() for t in narrow.ax.get_yticklabels()] == [
        "-9 E4M3 min",
        "0 (unit)",
        "8.81 E4M3 max",
    ]


def test_a_hundred_row_map_labels_every_row_legibly_and_steps_horizontally() -> None:
    ax = scale_heatmap(table(100, 60, 1.0), "rms")
    labels = ax.get_yticklabels()
    assert len(labels) == 100 and all(t.get_fontsize() >= 7 for t in labels)
    figure = ax.figure
    row_pt = ax.get_position().height * figure.get_figheight() * 72 / 100
    assert row_pt >= 8  # taller than a 7 pt label
    steps = ax.get_xticklabels()
    assert steps and all(t.get_rotation() == 0 for t in steps)
    # Horizontal labels do not overlap: each fits in its share of the axis width.
    figure.canvas.draw()
    boxes = [t.get_window_extent() for t in steps]
    assert all(a.x1 < b.x0 for a, b in itertools.pairwise(boxes))
