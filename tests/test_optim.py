"""unitscale.optim: per-parameter learning rates from u-μP tags, independent weight decay."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import unitscale as us
from unitscale.optim import (
    SGD,
    Adam,
    AdamW,
    UntaggedParameterError,
    lr_scale_func_adam,
    lr_scale_func_sgd,
    scaled_parameters,
)


def expected_scale(name: str, param: torch.Tensor) -> float:
    """The rule, written out independently of the implementation."""
    depth = getattr(param, "mup_scaling_depth", None) or 1
    kind = param.mup_type  # type: ignore[attr-defined]
    if kind == "output":
        return 1.0
    if kind == "weight":
        return 1.0 / math.sqrt(math.prod(param.shape[1:])) / math.sqrt(depth)
    return 1.0 / math.sqrt(depth)


@pytest.mark.parametrize("optimiser", [Adam, AdamW, SGD])
def test_each_parameter_gets_its_rule(optimiser: type[torch.optim.Optimizer]) -> None:
    model = us.TransformerDecoder(
        64, depth=4, heads=4, vocab_size=100, bias=True, trainable_norms=True
    )
    opt = optimiser(model.parameters(), lr=0.5)  # type: ignore[call-arg]
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert len(lr_of) == len(list(model.parameters()))
    for name, param in model.named_parameters():
        assert lr_of[id(param)] == pytest.approx(0.5 * expected_scale(name, param)), name
    # spot checks of the rule's numbers
    assert lr_of[id(model.layers[0].mlp.down.weight)] == pytest.approx(0.5 / 16 / 2)
    assert lr_of[id(model.embedding.weight)] == pytest.approx(0.5 / 8)
    assert lr_of[id(model.readout.weight)] == pytest.approx(0.5)
    assert lr_of[id(model.final_norm.weight)] == pytest.approx(0.5)
    assert lr_of[id(model.layers[1].attn_norm.bias)] == pytest.approx(0.25)


def test_sgd_and_adam_rules_agree_and_groups_are_shared() -> None:
    model = us.TransformerDecoder(32, depth=2, heads=4, vocab_size=50, mup=True)
    for p in model.parameters():
        assert lr_scale_func_sgd(p) == lr_scale_func_adam(p)
    groups = scaled_parameters(model.parameters(), lr_scale_func_adam, lr=1.0)
    assert len(groups) == len({lr_scale_func_adam(p) for p in model.parameters()})


def test_untagged_parameter_is_an_error_naming_it() -> None:
    model = nn.Sequential(us.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(UntaggedParameterError, match=r"'1\.weight' of shape \(2, 4\)"):
        AdamW(model.named_parameters(), lr=0.1)
    with pytest.raises(UntaggedParameterError, match=r"allow_untagged=True"):
        SGD(model.parameters(), lr=0.1)
    opt = Adam(model.parameters(), lr=0.1, allow_untagged=True)
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    assert lr_of[id(model[1].weight)] == 0.1 and lr_of[id(model[0].weight)] == 0.05


def test_group_dicts_keep_their_options() -> None:
    model = us.MLP(16)
    opt = AdamW(
        [
            {"params": model.up.parameters(), "lr": 1.0},
            {"params": model.down.parameters()},
        ],  # fan-in 16, 64
        lr=4.0,
        betas=(0.8, 0.9),
    )
    lrs = sorted(g["lr"] for g in opt.param_groups)
    assert lrs == pytest.approx([1.0 / 4, 4.0 / 8])
    assert all(g["betas"] == (0.8, 0.9) for g in opt.param_groups)


def _shrink_per_step(optimiser: type[torch.optim.Optimizer], lr: float, **kwargs: float) -> float:
    """Relative shrink of a weight in one step with a zero gradient (decay only)."""
    layer = us.Linear(64, 64, bias=False)
    before = layer.weight.detach().clone()
    opt = optimiser(layer.parameters(), lr=lr, weight_decay=0.01, **kwargs)  # type: ignore[call-arg]
    layer.weight.grad = torch.zeros_like(layer.weight)
    opt.step()
    return 1.0 - (layer.weight.detach() / before).mean().item()


@pytest.mark.parametrize("optimiser", [Adam, AdamW, SGD])
def test_independent_weight_decay_does_not_depend_on_lr(
    optimiser: type[torch.optim.Optimizer],
) -> None:
    shrinks = [_shrink_per_step(optimiser, lr) for lr in (1e-3, 0.1, 10.0)]
    assert shrinks == pytest.approx([0.01] * 3, rel=1e-4)


def test_coupled_weight_decay_follows_torch() -> None:
    # AdamW with independent_weight_decay=False: torch's lr_group * wd.
    shrink = _shrink_per_step(AdamW, 0.8, independent_weight_decay=False)  # type: ignore[arg-type]
    assert shrink == pytest.approx(0.8 / 8 * 0.01, rel=1e-3)


def test_scheduler_scales_independent_decay_with_the_schedule() -> None:
    layer = us.Linear(16, 16, bias=False)
    opt = AdamW(layer.parameters(), lr=1.0, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step == 0 else 0.5)
    before = layer.weight.detach().clone()
    layer.weight.grad = torch.zeros_like(layer.weight)
    opt.step()
    scheduler.step()
    assert (layer.weight.detach() / before).mean().item() == pytest.approx(0.9)
    before = layer.weight.detach().clone()
    opt.step()
    assert (layer.weight.detach() / before).mean().item() == pytest.approx(0.95)


@pytest.mark.parametrize("optimiser", [Adam, AdamW, SGD])
def test_mup_decoder_trains(optimiser: type[torch.optim.Optimizer]) -> None:
    model = us.TransformerDecoder(32, depth=2, heads=4, vocab_size=64, mup=True)
    opt = optimiser(model.parameters(), lr=0.05 if optimiser is SGD else 0.3)  # type: ignore[call-arg]
    tokens = torch.randint(0, 64, (8, 33))
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert min(losses[-3:]) < losses[0] - 0.4, losses


def test_optimiser_state_dict_round_trip() -> None:
    model = us.MLP(16)
    opt = AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    again = AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    again.load_state_dict(opt.state_dict())
    assert [g["lr"] for g in again.param_groups] == [g["lr"] for g in opt.param_groups]
