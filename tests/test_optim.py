"""unitscale.optim: per-parameter learning rates from u-μP tags, independent weight decay."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

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


def effective_lrs(opt: torch.optim.Optimizer) -> dict[int, float]:
    """Parameter id -> the rate it steps at: its group's base ``lr`` times ``lr_scale``."""
    return {id(p): g["lr"] * g["lr_scale"] for g in opt.param_groups for p in g["params"]}


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
    # the GPT-style block: every kind of parameter (LayerNorm biases too), fan-ins of 4^k
    model = us.TransformerDecoder(
        64, depth=4, heads=4, vocab_size=100, bias=True, trainable_norms=True, block="gpt"
    )
    opt = optimiser(model.parameters(), lr=0.5)  # type: ignore[call-arg]
    lr_of = effective_lrs(opt)
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


@pytest.mark.parametrize("capturable", [False, True])
def test_scaled_parameters_keeps_a_tensor_learning_rate(capturable: bool) -> None:
    """A tensor ``lr`` gives tensor group rates (``lr * factor``), one group per factor, that
    a torch optimiser takes: its steps equal those of the same rates as floats."""
    device = "cuda" if capturable else "cpu"
    if capturable and not torch.cuda.is_available():
        pytest.skip("Adam(capturable=True) runs on an accelerator only")
    torch.manual_seed(0)
    model = nn.Sequential(us.Linear(16, 64), us.Linear(64, 8)).to(device)
    twin = copy.deepcopy(model)
    lr = torch.tensor(0.01, device=device)
    groups = scaled_parameters(model.parameters(), lr_scale_func_adam, lr=lr)
    assert len(groups) == len({lr_scale_func_adam(p) for p in model.parameters()})
    for group in groups:
        assert isinstance(group["lr"], torch.Tensor) and group["lr"].device == lr.device
        scale = lr_scale_func_adam(group["params"][0])
        assert group["lr"].item() == pytest.approx(0.01 * scale, rel=1e-6)
    floats = scaled_parameters(twin.parameters(), lr_scale_func_adam, lr=0.01)
    options = {"capturable": True} if capturable else {"foreach": False}
    optimisers = [torch.optim.Adam(groups, **options), torch.optim.Adam(floats, foreach=False)]
    x = torch.randn(4, 16, device=device)
    for net, optimiser in zip((model, twin), optimisers, strict=True):
        for _ in range(2):
            net(x).pow(2).mean().backward()
            optimiser.step()
            optimiser.zero_grad()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)


def test_untagged_parameter_is_an_error_naming_it() -> None:
    model = nn.Sequential(us.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(UntaggedParameterError, match=r"'1\.weight' of shape \(2, 4\)"):
        AdamW(model.named_parameters(), lr=0.1)
    with pytest.raises(UntaggedParameterError, match=r"allow_untagged=True"):
        SGD(model.parameters(), lr=0.1)
    opt = Adam(model.parameters(), lr=0.1, allow_untagged=True)
    lr_of = effective_lrs(opt)
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
    lrs = sorted(effective_lrs(opt).values())
    assert lrs == pytest.approx([1.0 / 4, 4.0 / 8])
    assert all(g["betas"] == (0.8, 0.9) for g in opt.param_groups)


# The published rules, written out here independently of unitscale.optim:
# u-muP's Adam learning rates (Blake et al. 2024, Table 3, and the reference's documented
# rule): a hidden weight lr / sqrt(fan_in), the embedding lr / sqrt(width) (its fan-out), the
# readout lr, biases and norms lr; every parameter inside the residual layers also
# / sqrt(depth) (depth-muP). SGD: the reference's default rule, the same rates.
# Independent weight decay (Wortsman et al. 2023; the reference divides each group's decay by
# its learning rate): a parameter shrinks by weight_decay * lr_t / lr_0 per step.
WIDTH, DEPTH, VOCAB = 32, 4, 50
SCHEDULE = [1.0, 0.5, 0.25, 0.8, 0.1]  # lr_t / lr_0 over the 5 steps


def paper_lr(name: str, shape: torch.Size, lr: float) -> float:
    depth = 1.0 / math.sqrt(DEPTH) if name.startswith("layers.") else 1.0
    if name == "embedding.weight":
        return lr / math.sqrt(WIDTH)
    if name == "readout.weight":
        return lr
    if name.endswith(".weight") and len(shape) == 2:
        return lr / math.sqrt(shape[1]) * depth
    return lr * depth  # biases and norm scales


def _decoder() -> nn.Module:
    torch.manual_seed(0)
    model = us.TransformerDecoder(
        WIDTH, depth=DEPTH, heads=4, vocab_size=VOCAB, bias=True, trainable_norms=True
    ).double()
    with torch.no_grad():  # no zero entries (biases): the decay tests divide by the values
        for param in model.parameters():
            param.uniform_(0.5, 1.5)
    return model


def _make(kind: str, model: nn.Module, lr: float, weight_decay: float) -> Any:
    if kind == "scaled_parameters":
        groups = scaled_parameters(
            model.named_parameters(), lr_scale_func_adam, lr=lr, weight_decay=weight_decay
        )
        return torch.optim.AdamW(groups, lr=lr)
    optimiser = {"Adam": Adam, "AdamW": AdamW, "SGD": SGD}[kind]
    return optimiser(model.parameters(), lr=lr, weight_decay=weight_decay)  # type: ignore[call-arg]


def _five_steps(kind: str, lr: float, weight_decay: float, grad: float) -> list[dict[str, Any]]:
    """Each parameter's change over 5 scheduled steps with a constant gradient ``grad``."""
    model = _decoder()
    opt = _make(kind, model, lr, weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: SCHEDULE[min(step, 4)])
    steps = []
    for _ in SCHEDULE:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        for param in model.parameters():
            param.grad = torch.full_like(param, grad)
        opt.step()
        scheduler.step()
        steps.append({n: (before[n], p.detach().clone()) for n, p in model.named_parameters()})
    return steps


KINDS = ["Adam", "AdamW", "SGD", "scaled_parameters"]


@pytest.mark.parametrize("kind", KINDS)
def test_effective_learning_rate_over_a_schedule_is_the_papers(kind: str) -> None:
    # a constant gradient of ones: SGD moves each entry by its rate, Adam too (m / sqrt(v) = 1
    # for a constant gradient, bias-corrected), up to eps.
    lr = 0.3
    for step, changes in enumerate(_five_steps(kind, lr, 0.0, grad=1.0)):
        for name, (before, after) in changes.items():
            expected = paper_lr(name, before.shape, lr) * SCHEDULE[step]
            moved = (before - after).mean().item()
            assert moved == pytest.approx(expected, rel=1e-6), (kind, step, name)


@pytest.mark.parametrize("kind", KINDS)
def test_independent_weight_decay_over_a_schedule_is_the_references(kind: str) -> None:
    # a zero gradient: only the decay moves a parameter; it shrinks by
    # weight_decay * lr_t / lr_0 whatever lr_0 and the parameter's u-muP factor.
    weight_decay = 0.01
    for lr in (1e-3, 0.5, 10.0):
        for step, changes in enumerate(_five_steps(kind, lr, weight_decay, grad=0.0)):
            for name, (before, after) in changes.items():
                shrink = 1.0 - (after / before).mean().item()
                expected = weight_decay * SCHEDULE[step]
                assert shrink == pytest.approx(expected, rel=1e-6), (kind, lr, step, name)


@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_coupled_weight_decay_follows_torch(kind: str) -> None:
    # independent_weight_decay=False: torch's coefficient on the parameter's own rate.
    model = _decoder()
    optimiser = AdamW if kind == "AdamW" else SGD
    opt = optimiser(model.parameters(), lr=0.8, weight_decay=0.01, independent_weight_decay=False)  # type: ignore[call-arg]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()
    for name, param in model.named_parameters():
        shrink = 1.0 - (param.detach() / before[name]).mean().item()
        assert shrink == pytest.approx(paper_lr(name, param.shape, 0.8) * 0.01, rel=1e-6), name


@pytest.mark.parametrize("kind", KINDS)
def test_weight_decay_defaults_to_zero(kind: str) -> None:
    # the reference's default (torch's AdamW has 0.01): nothing decays unless asked
    model = _decoder()
    if kind == "scaled_parameters":
        opt = torch.optim.SGD(scaled_parameters(model.parameters(), lr_scale_func_adam, lr=1.0))
    else:
        optimiser = {"Adam": Adam, "AdamW": AdamW, "SGD": SGD}[kind]
        opt = optimiser(model.parameters(), lr=1.0)  # type: ignore[call-arg]
    assert all(group["weight_decay"] == 0 for group in opt.param_groups)
    before = [p.detach().clone() for p in model.parameters()]
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("optimiser", [Adam, AdamW, SGD])
def test_mup_decoder_trains(optimiser: type[torch.optim.Optimizer]) -> None:
    model = us.TransformerDecoder(32, depth=2, heads=4, vocab_size=64, mup=True)
    opt = optimiser(model.parameters(), lr=0.05 if optimiser is SGD else 0.3, weight_decay=0.0)  # type: ignore[call-arg]
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


# --------------------------------------------------------------------------------------------
# drop-in for torch.optim: positional arguments, defaults, schedulers, hand-set rates
# --------------------------------------------------------------------------------------------

TORCH_TWIN = {Adam: torch.optim.Adam, AdamW: torch.optim.AdamW, SGD: torch.optim.SGD}


@pytest.mark.parametrize("optimiser", [Adam, AdamW, SGD])
def test_defaults_are_torchs(optimiser: type[torch.optim.Optimizer]) -> None:
    ours = optimiser(us.Linear(4, 4).parameters())  # type: ignore[call-arg]
    theirs = TORCH_TWIN[optimiser](nn.Linear(4, 4).parameters())  # type: ignore[index]
    skip = ("decoupled_weight_decay", "weight_decay")
    mine = {k: v for k, v in ours.defaults.items() if k not in skip}
    assert mine == {k: v for k, v in theirs.defaults.items() if k not in skip}
    assert ours.defaults["weight_decay"] == 0  # the reference's default


def test_positional_arguments_are_torchs() -> None:
    layer = us.Linear(16, 16, bias=False)
    sgd = SGD(layer.parameters(), 0.1, 0.9)
    assert sgd.param_groups[0]["momentum"] == 0.9 and sgd.param_groups[0]["weight_decay"] == 0
    # a zero gradient and no weight decay: the weight does not move (a positional 0.9
    # was once taken as weight decay and the norm fell from 12.0 to 1.2)
    before = layer.weight.detach().clone()
    layer.weight.grad = torch.zeros_like(layer.weight)
    sgd.step()
    assert torch.equal(layer.weight.detach(), before)
    adamw = AdamW(layer.parameters(), 1e-3, (0.9, 0.95))
    assert adamw.param_groups[0]["betas"] == (0.9, 0.95)
    assert adamw.param_groups[0]["weight_decay"] == 0  # the reference's default, not torch's
    adam = Adam(layer.parameters(), 1e-3, (0.8, 0.9), 1e-6, 0.0, True)
    assert adam.param_groups[0]["eps"] == 1e-6 and adam.param_groups[0]["amsgrad"]
    with pytest.raises(TypeError):
        SGD(layer.parameters(), 0.1, 0.9, 0.0, 0.0, False, True)  # maximize is keyword-only


def _two_group_model() -> nn.Module:
    return nn.Sequential(us.Linear(16, 32, bias=False), us.Linear(64 // 2, 8, bias=False))


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
    ],
)
def test_schedulers_keep_the_per_parameter_ratios(make_scheduler: Callable[[Any], Any]) -> None:
    model = _two_group_model()
    opt = SGD(model.parameters(), lr=0.4)
    scheduler = make_scheduler(opt)
    expected_ratio = (1 / math.sqrt(16)) / (1 / math.sqrt(32))
    for _ in range(5):
        for layer in model:
            layer.weight.grad = torch.ones_like(layer.weight)
        before = [layer.weight.detach().clone() for layer in model]
        base = opt.param_groups[0]["lr"]
        opt.step()
        scheduler.step()
        # the step moved each weight by its own rate: base * factor (SGD, unit gradient)
        moves = [
            (b - layer.weight.detach()).mean().item()
            for b, layer in zip(before, model, strict=True)
        ]
        assert moves == pytest.approx([base / math.sqrt(16), base / math.sqrt(32)], rel=1e-5)
        assert moves[0] / moves[1] == pytest.approx(expected_ratio, rel=1e-5)
    assert opt.param_groups[0]["lr"] < 0.4  # the schedule did act


def test_hand_set_lr_keeps_the_per_parameter_scales() -> None:
    model = _two_group_model()
    opt = SGD(model.parameters(), lr=1.0)
    for group in opt.param_groups:
        group["lr"] = 0.05
    for layer in model:
        layer.weight.grad = torch.ones_like(layer.weight)
    before = [layer.weight.detach().clone() for layer in model]
    opt.step()
    moves = [
        (b - layer.weight.detach()).mean().item() for b, layer in zip(before, model, strict=True)
    ]
    assert moves == pytest.approx([0.05 / math.sqrt(16), 0.05 / math.sqrt(32)], rel=1e-5)
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.05]  # the step restores them


@pytest.mark.parametrize("optimiser", [Adam, AdamW, SGD])
def test_step_equals_torch_with_per_parameter_groups(
    optimiser: type[torch.optim.Optimizer],
) -> None:
    torch.manual_seed(0)
    model = us.TransformerDecoder(32, depth=2, heads=4, vocab_size=50, trainable_norms=True)
    twin = copy.deepcopy(model)
    ours = optimiser(model.parameters(), 0.3, weight_decay=0.01)  # type: ignore[call-arg]
    # torch's class with one group per parameter at lr * factor, decay / factor
    rule = lr_scale_func_sgd if optimiser is SGD else lr_scale_func_adam
    extra = {} if optimiser is not Adam else {"decoupled_weight_decay": True}
    theirs = TORCH_TWIN[optimiser](  # type: ignore[index]
        [
            {"params": [p], "lr": 0.3 * rule(p), "weight_decay": 0.01 / (0.3 * rule(p))}
            for p in twin.parameters()
        ],
        **extra,
    )
    ids = torch.randint(0, 50, (2, 17))
    for _ in range(3):
        for net, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            net(ids[:, :-1], ids[:, 1:]).backward()
            opt.step()
    for (name, mine), theirs_p in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs_p, msg=name)
