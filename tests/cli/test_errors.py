"""Failures the command used to hide: each now ends the command with a one-line reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from unitscale.cli import main
from unitscale.tracking import ScaleMonitor

FACTORY = """
import torch
from torch import nn
from unitscale.transforms import simulate_fp8


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.head = nn.Linear(16, 256)

    def forward(self, input_ids, **unused):
        return self.head(torch.tanh(self.emb(input_ids)))


def simulated():
    # Trackable, but unit_scale refuses a model already simulate_fp8'd ("unit-scale first").
    return simulate_fp8(Tiny())
"""


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if not line.startswith("[")]


def test_analyse_fails_when_the_unit_scaled_twin_cannot_be_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "mine.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("UNITSCALE_DEBUG", raising=False)
    args = ["analyse", "--model", "mine.py:simulated", "--forward-only", "--seq-len", "8"]
    assert main([*args, "--batch-size", "2", "--out", "out"]) == 1
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1, errors
    assert errors[0].startswith("unitscale analyse: error: unit_scale(mine.simulated) failed: ")
    assert "unit-scale first" in errors[0]
    assert not (tmp_path / "out").exists()


def test_train_does_not_turn_a_heatmap_bug_into_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken_heatmap(self: ScaleMonitor, *args: object, **kwargs: object) -> None:
        raise ValueError("a bug in the heatmap")

    monkeypatch.setattr(ScaleMonitor, "heatmap", broken_heatmap)
    monkeypatch.delenv("UNITSCALE_DEBUG", raising=False)
    tiny = ["--steps", "2", "--width", "8", "--heads", "1", "--depth", "1", "--seq-len", "8"]
    tiny += ["--batch-size", "2", "--eval-every", "1", "--eval-batches", "1", "--no-progress"]
    args = ["train", *tiny, "--runs", "plain-fp32", "--monitor-every", "1"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 1
    errors = _errors(capsys.readouterr().err)
    assert errors == ["unitscale train: error: ValueError: a bug in the heatmap"]
