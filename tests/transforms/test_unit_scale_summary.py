"""``unit_scale`` says which ops it left as they are: once, at capture, and on request."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import Tensor, nn

from unitscale import UnitScaleError
from unitscale.transforms import (
    UnitScaleSummary,
    track_scales,
    unit_scale,
    unit_scale_summary,
)


class ReluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(256, 256)
        self.down = nn.Linear(256, 256)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.up(x))  # no unit-scaled rule: std 0.58 for a unit input
        h = h.view(-1, 256).transpose(0, 1).transpose(0, 1)  # scale-neutral
        return self.down(h * 2.0)  # a constant factor: left as it is


def _left_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "unitscale.unit_scale"]


def test_ops_left_as_they_are_are_logged_once_and_listed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    model = unit_scale(ReluMLP(), mup=False)
    with caplog.at_level(logging.WARNING, logger="unitscale"):
        out = model(torch.randn(64, 256))
    lines = _left_lines(caplog)
    assert len(lines) == 1, lines
    assert "left 2 op(s)" in lines[0]
    assert "torch.relu" in lines[0] and "operator.mul" in lines[0]
    assert [r.levelno for r in caplog.records if r.name == "unitscale.unit_scale"] == [
        logging.WARNING
    ]
    summary = unit_scale_summary(model)
    assert isinstance(summary, UnitScaleSummary)
    assert summary.left_as_is == (("h", "torch.relu"), ("mul", "operator.mul"))
    assert len(summary.replaced) == 2  # the two linears
    assert len(summary.scale_neutral) == 3  # view, transpose, transpose
    table = str(summary).splitlines()
    assert table[0] == "unit_scale: 2 op(s) replaced, 3 scale-neutral, 2 left as is"
    assert table[1].split() == ["count", "op", "outcome"]
    assert table[2].split() == [
        "1",
        "torch.relu",
        "left",
        "as",
        "is",
        "(scale",
        "not",
        "unit):",
        "h",
    ]
    assert table[3].split()[:3] == ["1", "operator.mul", "left"]
    assert table[4].split() == [
        "2",
        "torch.nn.functional.linear",
        "->",
        "unitscale.functional.linear:",
        "linear,",
        "linear_1",
    ]
    assert table[5].split()[:3] == ["3", "(scale-neutral)", "scale"]
    assert len(table) == 6  # one row per op and outcome, counts first
    assert out.shape == (64, 256)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="unitscale"):
        model(torch.randn(64, 256))  # the same graph: said once
    assert not _left_lines(caplog)


def test_a_model_of_unit_scaled_ops_only_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    model = unit_scale(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), mup=False)
    with caplog.at_level(logging.WARNING, logger="unitscale"):
        model(torch.randn(4, 8))
    assert not _left_lines(caplog)
    summary = unit_scale_summary(model)
    assert summary.left_as_is == () and len(summary.replaced) == 3
    assert str(summary).splitlines()[0].endswith("none left as is")


def test_the_summary_reads_through_a_chain() -> None:
    tracked = track_scales(unit_scale(ReluMLP(), mup=False))
    tracked(torch.randn(4, 256))
    assert [op for _, op in unit_scale_summary(tracked).left_as_is] == [
        "torch.relu",
        "operator.mul",
    ]


def test_unit_scale_summary_refuses_what_it_cannot_answer() -> None:
    with pytest.raises(UnitScaleError, match="not unit-scaled"):
        unit_scale_summary(track_scales(nn.Linear(2, 2)))
    with pytest.raises(UnitScaleError, match="has not been called"):
        unit_scale_summary(unit_scale(nn.Linear(2, 2)))


class Decoder(nn.Module):
    """A model called again and again with new sequence lengths (as generate() does)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.up(x)) * 2.0


def test_ops_left_as_they_are_are_logged_once_per_model_not_per_graph(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # generate() captured a graph per step, and each logged "unit_scale left 45 op(s)" again.
    model = unit_scale(Decoder(), mup=False)
    with caplog.at_level(logging.WARNING, logger="unitscale"):
        for length in (3, 4, 5, 6, 7):  # static shapes, then dynamic: several graphs
            model(torch.randn(2, length, 16))
    lines = _left_lines(caplog)
    assert len(lines) == 1 and "torch.relu" in lines[0] and "operator.mul" in lines[0], lines
    assert len(model.capture.pieces) > 1  # type: ignore[union-attr]
    caplog.clear()
    other = unit_scale(Decoder(), mup=False)  # another model says it again, once
    with caplog.at_level(logging.WARNING, logger="unitscale"):
        other(torch.randn(2, 3, 16))
    assert len(_left_lines(caplog)) == 1
