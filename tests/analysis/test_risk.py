"""risk_summary: counts of tensors at risk per format and the worst ones, deterministic."""

from __future__ import annotations

import pandas as pd
import pytest

from unitscale.analysis import RISK_FRACTION, AnalysisError, risk_summary


def table() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "name": ["a", "b", "c", "lin.weight", "d"],
            "module": ["m", "m", "", "lin", "n"],
            "weight": [False, False, False, True, False],
            "direction": ["fwd", "bwd", "bwd", "bwd", "fwd"],
            "underflow_e4m3": [0.0, 0.5, RISK_FRACTION, 0.9, 0.5],
            "overflow_e4m3": [0.0, 0.0, 0.0, 0.0, 1e-4],
            "underflow_e5m2": [0.0] * 5,
            "overflow_e5m2": [0.0] * 5,
        }
    )


def test_counts_threshold_and_order() -> None:
    summary = risk_summary(table(), worst=3)
    assert summary.tensors == 5
    e4 = summary.formats["e4m3"]
    # c sits exactly at the threshold: not counted; any overflow counts.
    assert (e4.underflow, e4.overflow) == (3, 1)
    worst = [str(w) for w in summary.worst["e4m3"]]
    assert worst == [
        "n: d (value): 50.0% underflow, <0.1% overflow in E4M3",
        "lin.weight (gradient): 90.0% underflow in E4M3",
        "m: b (gradient): 50.0% underflow in E4M3",
    ]
    assert summary.worst["e5m2"] == [] and summary.formats["e5m2"].underflow == 0
    assert risk_summary(table(), threshold=0.6).formats["e4m3"].underflow == 1


def test_unknown_format() -> None:
    with pytest.raises(AnalysisError, match="no 'underflow_fp8'/'overflow_fp8' columns"):
        risk_summary(table(), formats=("fp8",))
