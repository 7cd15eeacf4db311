"""Block-format metrics of tracked tensors: only when asked for, equal to BlockFormat's own
statistics of the same tensors, in the table, the report and ``unitscale analyse``."""

from __future__ import annotations

import math
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch import nn

from unitscale.analysis import graph_to_dataframe, write_report
from unitscale.cli import main
from unitscale.errors import UnitScaleError
from unitscale.formats import get_format
from unitscale.tracking import blocks as _blocks
from unitscale.transforms import track_scales


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def test_metrics_equal_block_stats_of_the_tracked_tensors() -> None:
    tracked = track_scales(_model(), block_formats=["mxfp8_e4m3", "nvfp4"])
    x = torch.randn(32, 64)
    tracked(x).sum().backward()
    df = graph_to_dataframe(tracked.scales_graph())
    layer = tracked.module[0]
    for fmt_name, direction, tensor in (
        ("nvfp4", "fwd", layer.weight.detach()),
        ("mxfp8_e4m3", "bwd", layer.weight.grad),
        ("mxfp8_e4m3", "fwd", x),
    ):
        name = "0.weight" if tensor is not x else "input"
        row = df[(df.name == name) & (df.direction == direction)].iloc[0]
        stats = get_format(fmt_name).block_stats(tensor)
        assert row[f"block_flushed_{fmt_name}"] == stats.flushed
        assert row[f"block_scale_clipped_{fmt_name}"] == stats.scale_clipped
        assert row[f"block_error_{fmt_name}"] == stats.error
    # the output (last dimension 10) does not block in 32 or 16: NaN, not an error
    out = df[df["shape"] == "(32, 10)"]
    assert not out.empty and out["block_error_nvfp4"].isna().all()
    # a second call refills the graph with that call's metrics
    tracked(x * 1e-3).sum().backward()
    again = graph_to_dataframe(tracked.scales_graph())
    row = again[(again.name == "input") & (again.direction == "fwd")].iloc[0]
    assert row["block_error_nvfp4"] == get_format("nvfp4").block_stats(x * 1e-3).error


def test_not_computed_unless_asked_for() -> None:
    from unitscale.tracking._recording import _pass

    with mock.patch.object(_pass, "block_metrics", side_effect=AssertionError("computed")):
        tracked = track_scales(_model())
        tracked(torch.randn(4, 64)).sum().backward()
        df = graph_to_dataframe(tracked.scales_graph())
    assert not any(c.startswith("block_") for c in df.columns)
    assert tracked.passes[-1].block_formats == ()


def test_bad_names_are_refused() -> None:
    with pytest.raises(UnitScaleError, match=r"e4m3.*not a block-scaled format"):
        track_scales(_model(), block_formats=["e4m3"])


def test_block_metric_kinds_on_an_edge() -> None:
    formats = _blocks.check_block_formats(["mxfp8_e4m3"], "test")
    tiny = _blocks.block_metrics(torch.full((2, 32), 2.0**-140), formats)
    assert tiny["block_scale_clipped_mxfp8_e4m3"] == 1.0
    assert math.isnan(_blocks.block_metrics(torch.ones(3), formats)["block_error_mxfp8_e4m3"])


def test_report_lists_the_block_metrics(tmp_path: Path) -> None:
    tracked = track_scales(_model(), block_formats=["mxfp4_e2m1"])
    tracked(torch.randn(32, 64)).sum().backward()
    page = write_report(tracked.scales_graph(), tmp_path / "r.html").read_text()
    assert '"block_error_mxfp4_e2m1"' in page and "MXFP4_E2M1 block" in page


@pytest.mark.slow
def test_analyse_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["analyse", "--batch-size", "2", "--seq-len", "32", "--out", str(tmp_path)]
    assert main([*args, "--block-formats", "mxfp8_e4m3"]) == 0
    text = capsys.readouterr().out
    assert "unit-scaled, mxfp8_e4m3: error median" in text
    assert "block_error_mxfp8_e4m3" in (tmp_path / "scales.csv").read_text().splitlines()[0]
    assert main([*args, "--overwrite", "--block-formats", "mxfp9"]) == 2
    assert "unknown block-scaled format(s) mxfp9" in capsys.readouterr().err
