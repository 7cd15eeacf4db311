"""``unitscale train``'s output: comparable heatmaps across runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import unitscale.analysis
from unitscale.cli import main


def test_every_run_s_heatmap_shares_one_colour_range_per_direction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: list[tuple[str, float]] = []
    original = unitscale.analysis.scale_heatmap

    def recording(table: Any, metric: str, direction: str, **kwargs: Any) -> Any:
        ax = original(table, metric, direction, **kwargs)
        drawn.append((direction, ax.images[0].norm.vmax))
        return ax

    monkeypatch.setattr(unitscale.analysis, "scale_heatmap", recording)
    tiny = ["--steps", "4", "--width", "8", "--heads", "1", "--depth", "1", "--seq-len", "8"]
    tiny += ["--batch-size", "2", "--eval-every", "2", "--eval-batches", "1", "--no-progress"]
    runs = ["--runs", "plain-fp32,unit-scaled-fp32", "--monitor-every", "2"]
    assert main(["train", *tiny, *runs, "--out", str(tmp_path / "out")]) == 0
    by_direction: dict[str, set[float]] = {}
    for direction, vmax in drawn:
        by_direction.setdefault(direction, set()).add(vmax)
    assert len(drawn) == 4 and set(by_direction) == {"fwd", "bwd"}
    # One range per direction, wide enough for the plain model's small gradients.
    assert all(len(v) == 1 for v in by_direction.values()), by_direction
    assert by_direction["bwd"].pop() > 5
