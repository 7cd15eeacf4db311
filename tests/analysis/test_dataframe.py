"""graph_to_dataframe: one row per node and direction, every metric, clear errors."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.fx import Graph, symbolic_trace

from unitscale.analysis import AnalysisError, graph_to_dataframe
from unitscale.errors import UnitScaleError
from unitscale.tracking.metrics import FORMAT_KEYS, Metrics

ID_COLUMNS = ["order", "node", "name", "module", "op", "weight", "direction", "tensor_type"]


def test_columns_and_one_row_per_node_and_direction(tracked_gpt: tuple[Graph, dict]) -> None:
    graph, _ = tracked_gpt
    df = graph_to_dataframe(graph)
    assert list(df.columns[:8]) == ID_COLUMNS
    assert {"shape", "dtype"} <= set(df.columns)
    for metric in ("mean_abs", "abs_mean", "std", "abs_max", "abs_min", "rms", "numel"):
        assert metric in df.columns
    for key in FORMAT_KEYS:
        assert {f"underflow_{key}", f"overflow_{key}"} <= set(df.columns)
    expected = []
    for node in graph.nodes:
        m = node.meta.get("metrics")
        if isinstance(m, Metrics):
            expected += [(node.name, d) for d, v in (("fwd", m.fwd), ("bwd", m.bwd)) if v]
    assert list(zip(df.node, df.direction, strict=True)) == expected
    assert df.order.is_monotonic_increasing
    # Every metric is copied exactly from the node meta.
    nodes = {n.name: n for n in graph.nodes}
    for row in df.itertuples():
        record = getattr(nodes[row.node].meta["metrics"], row.direction)
        assert record.as_dict()["mean_abs"] == row.mean_abs
        assert record.as_dict()["underflow_e4m3"] == row.underflow_e4m3


def test_weights_and_tensor_types(tracked_gpt: tuple[Graph, dict]) -> None:
    graph, params = tracked_gpt
    df = graph_to_dataframe(graph)
    weights = df[df.weight]
    assert set(weights.name) == set(params)  # every parameter, by its qualified name
    assert set(weights.tensor_type) == {"w", "grad_w"}
    assert set(df[~df.weight].tensor_type) == {"x", "grad_x"}
    assert (df.tensor_type.str.startswith("grad_") == (df.direction == "bwd")).all()
    for name, numel in params.items():
        rows = weights[weights.name == name]
        assert list(rows.direction) == ["fwd", "bwd"]
        assert (rows.numel == numel).all()
    head = df[(df.name == "lm_head.weight") & (df.direction == "fwd")].iloc[0]
    assert head["module"] == "lm_head" and head["op"] == "parameter"
    assert head["shape"] == "(256, 32)" and head["dtype"] == "float32"
    linear = df[df.op == "linear"]
    assert len(linear) > 0 and set(linear.module) >= {"lm_head", "blocks.0.attn.qkv"}


def test_forward_only_graph_has_no_backward_rows(chain_graph: Callable[..., Graph]) -> None:
    df = graph_to_dataframe(chain_graph([(1.0, None), (2.0, None)]))
    assert list(df.direction) == ["fwd", "fwd"]
    assert list(df.name) == ["t0", "t1"]
    assert list(df.op) == ["input", "mul"]
    assert list(df["shape"]) == ["", ""]  # no shape meta: left empty, not an error


def test_non_finite_metrics_are_kept(chain_graph: Callable[..., Graph]) -> None:
    df = graph_to_dataframe(chain_graph([(math.nan, math.inf)]))
    assert math.isnan(df.mean_abs[0]) and df.mean_abs[1] == math.inf


def test_clear_errors_for_graphs_without_tracking() -> None:
    with pytest.raises(AnalysisError, match=r"expected a torch.fx.Graph .* got Linear"):
        graph_to_dataframe(nn.Linear(2, 2))  # type: ignore[arg-type]
    with pytest.raises(UnitScaleError, match=r"the graph is empty; call the tracked module"):
        graph_to_dataframe(Graph())
    untracked = symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU())).graph
    with pytest.raises(AnalysisError, match=r"no scale metrics .*track_scales\(module\)"):
        graph_to_dataframe(untracked)


class _Shift(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shifted = x - 0.5  # a mean of about -0.5, values of both signs
        return shifted * 2.0


@pytest.mark.parametrize("path", ["auto", "eager"])
def test_mean_abs_and_abs_mean_are_their_own_definitions(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mean_abs`` is the mean of |x|, ``abs_mean`` is |mean of x|: different on a tensor
    with a non-zero mean, in every statistics path."""
    from unitscale.transforms import track_scales

    monkeypatch.setenv("UNITSCALE_STATS", path)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    tracked = track_scales(_Shift())
    out = tracked(x)
    df = graph_to_dataframe(tracked.scales_graph())
    row = df[(df["name"] == "shifted") & (df["direction"] == "fwd")].iloc[0]
    shifted = x - 0.5
    assert row["mean_abs"] == pytest.approx(shifted.abs().mean().item(), rel=1e-5)
    assert row["abs_mean"] == pytest.approx(shifted.mean().abs().item(), rel=1e-5)
    assert row["mean_abs"] > 1.5 * row["abs_mean"] > 0
    last = df[df["direction"] == "fwd"].iloc[-1]
    assert last["abs_mean"] == pytest.approx(out.mean().abs().item(), rel=1e-5)
    assert last["mean_abs"] == pytest.approx(out.abs().mean().item(), rel=1e-5)
