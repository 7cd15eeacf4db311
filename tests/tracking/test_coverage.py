"""Every op that ran is in ``scales_graph()``, or the tracked model says which did not.

TorchDynamo runs a frame eagerly where it cannot capture it (a graph break inside a loop, a
data-dependent shape such as a mixture of experts' routing); that frame's output may still
reach the model's output through a later graph, so the outputs alone do not show it.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from unitscale import UnitScaleError
from unitscale.transforms import (
    TrackingCoverage,
    track_scales,
    tracking_coverage,
    unit_scale,
)


class Scaler(nn.Module):
    """Its frame has a graph break inside a loop: Dynamo runs it eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(8))

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(2):
            x = x * self.gain
            torch._dynamo.graph_break()
        return x


class Outer(nn.Module):
    """Its own frame is captured: the output comes from a graph, fed by the eager frame."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.scaler = Scaler()
        self.head = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.scaler(self.up(x)))


def _param_nodes(graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    return {n.meta["clean_name"]: n for n in graph.nodes if n.op == "placeholder"}


def test_a_value_computed_outside_the_graphs_is_found_and_replayed_eagerly() -> None:
    torch.manual_seed(0)
    model = Outer()
    tracked = track_scales(model)
    x = torch.randn(3, 8)
    with pytest.warns(UserWarning, match="entering captured graphs were computed outside"):
        out = tracked(x)
    assert torch.equal(out, model(x))
    out.sum().backward()
    nodes = _param_nodes(tracked.scales_graph())
    for name, _ in model.named_parameters():
        assert name in nodes, name
        assert nodes[name].meta["metrics"].bwd is not None, name
    coverage = tracking_coverage(tracked)
    assert coverage == TrackingCoverage("eager", (), ())
    assert coverage.complete


def test_a_chain_that_cannot_replay_names_what_has_no_node() -> None:
    torch.manual_seed(0)
    tracked = track_scales(unit_scale(Outer(), mup=False))
    with pytest.warns(UserWarning) as caught:
        tracked(torch.randn(3, 8))
    messages = [str(w.message) for w in caught]
    assert any("no node there: scaler.gain" in m for m in messages), messages
    # unit_scale says so too: the ops of the frame Dynamo ran eagerly are not unit-scaled
    assert any(
        m.startswith("unit_scale: 1 value(s) entering captured graphs") and "scaler.gain" in m
        for m in messages
    ), messages
    coverage = tracking_coverage(tracked)
    assert coverage.engine == "dynamo"
    assert coverage.missing_parameters == ("scaler.gain",)
    assert coverage.outside_inputs and not coverage.complete
    assert "scaler.gain" in str(coverage)


def test_a_whole_capture_is_complete_and_says_nothing() -> None:
    tracked = track_scales(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    tracked(torch.randn(2, 4))  # the suite turns unitscale's warnings into errors
    assert tracking_coverage(tracked) == TrackingCoverage("dynamo", (), ())


def test_tracking_coverage_refuses_what_it_cannot_answer() -> None:
    with pytest.raises(UnitScaleError, match="not tracked"):
        tracking_coverage(nn.Linear(2, 2))
    with pytest.raises(UnitScaleError, match="has not been called"):
        tracking_coverage(track_scales(nn.Linear(2, 2)))


@pytest.mark.slow
def test_every_parameter_of_a_tiny_dbrx_has_a_node() -> None:
    """transformers' DBRX routes tokens with data-dependent shapes (``nonzero``, ``where``)
    in a loop over experts: Dynamo runs the experts' frame, and the decoder frame around the
    layers, eagerly; the embedding, every expert weight and the final norm were in no graph."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DbrxConfig(
        d_model=32, n_heads=4, n_layers=2, max_seq_len=32, vocab_size=128,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DbrxForCausalLM(config).train()
    model.config.use_cache = False
    ids = torch.randint(0, 128, (2, 8))
    tracked = track_scales(model)
    with pytest.warns(UserWarning, match="computed outside"):
        loss = tracked(input_ids=ids, labels=ids).loss
    loss.backward()
    expected = model(input_ids=ids, labels=ids).loss
    expected.backward()
    assert torch.equal(loss, expected)
    used = [n for n, p in model.named_parameters() if p.grad is not None]
    assert any(".experts.mlp." in n for n in used) and "transformer.wte.weight" in used
    nodes = _param_nodes(tracked.scales_graph())
    for name in used:
        assert name in nodes, name
        metrics = nodes[name].meta["metrics"]
        assert metrics.fwd is not None and metrics.bwd is not None, name
    assert tracking_coverage(tracked).complete
