"""CompleteP's depth rule (Dey et al. 2025, "Don't be lazy: CompleteP enables
compute-efficient deep transformers", arXiv 2505.01618) beside depth-μP: ``depth_rule=`` on
TransformerDecoder, unit_scale, the residual rule and the transfer experiment."""

from __future__ import annotations

import copy
import math
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import unitscale as us
import unitscale.functional as U
from unitscale.errors import UnitScaleError, UnsupportedArgumentError
from unitscale.optim import lr_scale_func_adam, lr_scale_func_muon
from unitscale.transforms import ResidualTau, unit_scale


def completep_tau(index: int, branches: int) -> float:
    """The paper's residual in unit-scaled form, default mults: the stream
    ``h = e + Σ_k L^-1 f_k`` (``L = branches / 2`` layers, every branch multiplier ``1/L``,
    its ``α = 1``; the u-μP rule's per-branch constant ``sqrt(2 / (1 + 1))`` = 1), written
    as each add's std ratio of branch to the stream before it, the reference's ``tau``."""
    layers = branches / 2
    stream_var = 1.0 + index / layers**2
    return (1.0 / layers) / math.sqrt(stream_var)


@pytest.mark.parametrize("depth", [1, 2, 4, 8, 16])
def test_decoder_residual_weights_are_the_papers(depth: int) -> None:
    model = us.TransformerDecoder(32, depth, 1, 10, depth_rule="completep")
    taus = [t for layer in model.layers for t in (layer.attn_tau, layer.mlp_tau)]
    assert taus == pytest.approx([completep_tau(k, 2 * depth) for k in range(2 * depth)])
    rule = U.transformer_residual_scaling_rule(depth_rule="completep")
    assert taus == pytest.approx([rule(k, 2 * depth) for k in range(2 * depth)], rel=1e-12)
    mup = us.TransformerDecoder(32, depth, 1, 10)
    depth_mup = [t for layer in mup.layers for t in (layer.attn_tau, layer.mlp_tau)]
    # the same at one layer, the base depth; below depth-muP's 1/sqrt(L) deeper
    assert (taus == pytest.approx(depth_mup)) is (depth == 1)


@pytest.mark.parametrize("depth", [2, 8])
def test_decoder_adam_rates_lose_the_depth_factor(depth: int) -> None:
    # CompleteP, Adam: hidden learning rate eta L^(alpha - 1), i.e. no depth factor at
    # alpha = 1; depth-muP (u-muP): 1/sqrt(L).
    for rule, factor in (("completep", 1.0), ("depth-mup", 1.0 / math.sqrt(depth))):
        model = us.TransformerDecoder(64, depth, 2, 10, depth_rule=rule, bias=True)
        for name, param in model.named_parameters():
            in_stack = name.startswith("layers.")
            expected = (
                {"weight": 1.0 / math.sqrt(64), "bias": 1.0}[param.mup_type] if in_stack else None
            )  # type: ignore[attr-defined]
            if expected is None or "down" in name:
                continue
            assert lr_scale_func_adam(param) == pytest.approx(expected * factor), (rule, name)
            if param.dim() == 2:  # Muon: the same depth factor on sqrt(fan_out)
                fan_out = param.shape[0]
                assert lr_scale_func_muon(param) == pytest.approx(math.sqrt(fan_out) * factor)
        embedding = model.embedding.weight
        assert lr_scale_func_adam(embedding) == pytest.approx(1 / 8)  # outside the stack


def test_the_tag_survives_copies_and_is_only_on_the_stack() -> None:
    model = us.TransformerDecoder(32, 2, 1, 10, depth_rule="completep")
    rules = {n: getattr(p, "mup_depth_rule", None) for n, p in model.named_parameters()}
    assert rules["embedding.weight"] is None and rules["readout.weight"] is None
    assert {r for n, r in rules.items() if n.startswith("layers.")} == {"completep"}
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        weight = clone.layers[0].attn.qkv.weight
        assert weight.mup_depth_rule == "completep"  # type: ignore[attr-defined]


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn_norm, self.mix = nn.LayerNorm(width), nn.Linear(width, width)
        self.mlp_norm, self.up = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.mix(F.softmax(self.attn_norm(x), dim=-1))
        return x + self.up(F.gelu(self.mlp_norm(x)))


class _Stack(nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(16) for _ in range(layers))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_unit_scale_takes_the_depth_rule() -> None:
    torch.manual_seed(0)
    model = unit_scale(_Stack(), depth_rule="completep")
    model(torch.randn(4, 16))
    capture = model.capture
    assert capture is not None
    shares = [
        share
        for invocation in capture.last_trace
        for _, _, share in invocation.piece.data["unit_scale"]["residual_adds"]
    ]
    taus = [math.sqrt(s / (1 - s)) for s in shares]
    assert taus == pytest.approx([completep_tau(k, 8) for k in range(8)], rel=1e-12)
    weight = model.module.layers[0].mix.weight
    assert weight.mup_depth_rule == "completep"  # type: ignore[attr-defined]
    assert lr_scale_func_adam(weight) == pytest.approx(1 / 4)  # 1/sqrt(16), no depth factor
    default = unit_scale(_Stack())
    assert lr_scale_func_adam(default.module.layers[0].mix.weight) == pytest.approx(1 / 8)


def test_an_unknown_rule_is_refused_everywhere() -> None:
    with pytest.raises(UnsupportedArgumentError, match="'depth_rule'='complete'"):
        us.TransformerDecoder(32, 2, 1, 10, depth_rule="complete")
    with pytest.raises(UnsupportedArgumentError, match="depth-mup"):
        U.transformer_residual_scaling_rule(depth_rule="mup")
    with pytest.raises(UnitScaleError, match="depth_rule='alpha1'"):
        ResidualTau(depth_rule="alpha1")
    from unitscale.experiments.transfer import TransferConfig, TransferConfigError

    with pytest.raises(TransferConfigError, match="depth_rule='x'"):
        TransferConfig(depth_rule="x")
    with pytest.raises(TransferConfigError, match="optimizer='sgd'"):
        TransferConfig(optimizer="sgd")


def test_transfer_builds_what_its_options_say() -> None:
    from unitscale.experiments.transfer import (
        TransferConfig,
        build_model,
        build_optimiser,
        command_line,
        default_config,
    )

    config = TransferConfig(depth_rule="completep", optimizer="muon")
    model = build_model("u-muP", 64, 4, config)
    assert model.layers[0].attn.qkv.weight.mup_depth_rule == "completep"
    taus = [t for layer in model.layers for t in (layer.attn_tau, layer.mlp_tau)]
    assert taus == pytest.approx([completep_tau(k, 8) for k in range(8)])
    if hasattr(torch.optim, "Muon"):
        assert type(build_optimiser("u-muP", model, 0.5, "builtin", "muon")).__name__ == "Muon"
    standard = build_model("standard", 64, 2, config)
    assert isinstance(
        build_optimiser("standard", standard, 0.5, "builtin", "muon"), torch.optim.AdamW
    )
    line = command_line(default_config(quick=True, depth_rule="completep", optimizer="muon"))
    assert line == "unitscale transfer --optimizer muon --depth-rule completep --quick"
