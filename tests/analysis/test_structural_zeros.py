"""Structural zeros are not underflow risk.

A gradient that is mathematically zero (the key bias of a fused QKV projection: softmax
cancels it) comes out as rounding noise; flushing it to zero loses nothing, so it must not top
the verdict. The rule: non-zero elements with ``|g| <= STRUCTURAL_ZERO_RTOL * rms(g)``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from unitscale.analysis import AnalysisError, graph_to_dataframe, risk_summary, structural_zeros
from unitscale.models import GPTConfig, unit_scaled_gpt
from unitscale.tracking import STRUCTURAL_ZERO_RTOL, structural_zero_fraction
from unitscale.transforms import track_scales


def test_structural_zero_fraction_counts_noise_but_not_zeros_or_small_signal() -> None:
    g = torch.randn(300).abs() + 0.5
    rms = float(g.square().mean().sqrt())
    g[:30] = 0.0  # exact zeros: not underflow, not structural zeros either
    g[30:60] = 1e-9  # rounding noise of a zero
    g[60:90] = 4 * STRUCTURAL_ZERO_RTOL * rms  # small but signal: stays a risk
    rms = float(g.square().mean().sqrt())
    expected = float(((g > 0) & (g <= STRUCTURAL_ZERO_RTOL * rms)).double().mean())
    assert structural_zero_fraction(g) == pytest.approx(expected)
    assert structural_zero_fraction(g) == pytest.approx(0.1)
    assert structural_zero_fraction(torch.zeros(0)) == 0.0


def _table() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "name": ["qkv.bias", "qkv.bias", "h"],
            "module": ["qkv", "qkv", "m"],
            "weight": [True, True, False],
            "direction": ["fwd", "bwd", "bwd"],
            "underflow_e4m3": [0.4, 0.34, 0.34],
            "overflow_e4m3": [0.0, 0.0, 0.0],
        }
    )


def test_risk_summary_takes_structural_zeros_out_of_parameter_gradients_only() -> None:
    before = risk_summary(_table(), formats=("e4m3",))
    assert before.formats["e4m3"].underflow == 3
    after = risk_summary(_table(), formats=("e4m3",), structural_zeros={"qkv.bias": 1 / 3})
    # The bias's gradient keeps 0.7% underflow once its noise third is out: under 1%.
    assert after.formats["e4m3"].underflow == 2
    worst = [str(w) for w in after.worst["e4m3"]]
    assert worst == [
        "qkv.bias (value): 40.0% underflow in E4M3",
        "m: h (gradient): 34.0% underflow in E4M3",
    ]


@pytest.fixture(scope="module")
def unit_scaled_step() -> torch.nn.Module:
    """A tracked unit-scaled GPT (fused QKV projection with a bias) after one step."""
    config = GPTConfig(hidden_size=32, depth=1, heads=2, seq_len=16)
    tracked = track_scales(unit_scaled_gpt(config, 0))
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    tracked(ids, labels=ids).backward()
    return tracked


def test_the_key_bias_gradient_is_not_the_unit_scaled_models_worst_tensor(
    unit_scaled_step: torch.nn.Module,
) -> None:
    tracked = unit_scaled_step
    zeros = structural_zeros(tracked)
    assert zeros["blocks.0.attn.qkv.bias"] == pytest.approx(1 / 3)  # the key third
    assert zeros["blocks.0.attn.qkv.weight"] == 0.0
    table = graph_to_dataframe(tracked.scales_graph())
    flagged = {str(w).split(" ")[0] for w in risk_summary(table).worst["e4m3"]}
    assert "blocks.0.attn.qkv.bias" in flagged  # the false alarm, without the rule
    cleared = risk_summary(table, structural_zeros=zeros).worst["e4m3"]
    assert "blocks.0.attn.qkv.bias" not in {str(w).split(" ")[0] for w in cleared}


def test_risk_summary_of_a_graph_prints_readably() -> None:
    tracked = track_scales(torch.nn.Linear(4, 4))
    tracked(torch.randn(2, 4)).sum().backward()
    summary = risk_summary(tracked.scales_graph())  # the graph itself, as the guide shows
    text = str(summary)
    assert text.splitlines()[0] == f"{summary.tensors} tensors (values and gradients)"
    assert "E4M3: " in text and "E5M2: " in text and "RiskSummary(" not in text
    with pytest.raises(AnalysisError, match="expected a table from graph_to_dataframe"):
        risk_summary([1, 2, 3])  # type: ignore[arg-type]


def test_the_report_leaves_structural_zeros_out_of_underflow(
    unit_scaled_step: torch.nn.Module, tmp_path: Path
) -> None:
    import json
    import re

    from unitscale.analysis import write_report

    def bias_gradient(**kwargs: object) -> dict[str, float]:
        path = write_report(unit_scaled_step.scales_graph(), tmp_path / "r.html", **kwargs)  # type: ignore[attr-defined]
        page = path.read_text()
        data = json.loads(re.search(r'id="unitscale-data">(.*?)</script>', page, re.S)[1])  # type: ignore[index]
        rows = data["models"][0]["rows"]
        return next(r for r in rows if r["name"] == "blocks.0.attn.qkv.bias")["bwd"]

    before = bias_gradient()
    assert before["underflow_e4m3"] > 0.3 and "structural_zeros" not in before
    after = bias_gradient(structural_zeros=structural_zeros(unit_scaled_step))
    assert after["structural_zeros"] == pytest.approx(1 / 3)
    assert after["underflow_e4m3"] == pytest.approx(max(0.0, before["underflow_e4m3"] - 1 / 3))
    assert after["underflow_e4m3"] < 0.01
