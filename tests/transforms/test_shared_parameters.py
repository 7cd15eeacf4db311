"""Which transforms share the module's parameters, and an optimizer built before a copy.

A torchao user builds the optimizer first and converts after (``opt = AdamW(m.parameters());
f = to_fp8(m)``): the transforms that keep the weights as they are share them, so that
order trains; ``unit_scale`` and ``track_scales`` keep parameters of their own, and a step
of an optimizer left on the original's says so.
"""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from unitscale.formats import FPFormat
from unitscale.transforms import simulate_format, simulate_fp8, to_fp8, track_scales, unit_scale

SHARING: dict[str, Callable[[nn.Module], nn.Module]] = {
    "simulate_fp8": simulate_fp8,
    "simulate_format": lambda m: simulate_format(m, FPFormat(4, 3), FPFormat(5, 2)),
    "to_fp8": to_fp8,
    "simulate_fp8(unit_scale)": lambda m: simulate_fp8(unit_scale(m)),
}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _losses(model: nn.Module, optimiser: torch.optim.Optimizer, steps: int = 4) -> list[float]:
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    losses = []
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(SHARING))
def test_an_optimizer_built_before_a_transform_that_keeps_the_weights_trains(name: str) -> None:
    torch.manual_seed(0)
    model = _model()
    if name == "simulate_fp8(unit_scale)":
        model = unit_scale(model)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)  # first, as with torchao
    transform = SHARING[name] if name != "simulate_fp8(unit_scale)" else simulate_fp8
    transformed = transform(model)
    assert all(p is q for p, q in zip(transformed.parameters(), model.parameters(), strict=True))
    before = [p.detach().clone() for p in transformed.parameters()]
    losses = _losses(transformed, optimiser)
    assert losses[-1] < losses[0] - 1e-3, losses  # it stayed put (1.1149 for 5 steps) before
    assert all(not torch.equal(p, b) for p, b in zip(transformed.parameters(), before, strict=True))
    # A copy or a pickle of the transformed model is independent, with the same keys.
    for clone in (copy.deepcopy(transformed), pickle.loads(pickle.dumps(transformed))):
        assert list(clone.state_dict()) == list(model.state_dict())
        assert not any(p is q for p, q in zip(clone.parameters(), model.parameters(), strict=True))


@pytest.mark.parametrize("transform", [unit_scale, track_scales])
def test_an_optimizer_left_on_a_copied_module_warns_at_its_first_step(
    transform: Callable[[nn.Module], nn.Module],
) -> None:
    torch.manual_seed(0)
    model = _model()
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    copied = transform(model)
    assert not any(p is q for p, q in zip(copied.parameters(), model.parameters(), strict=True))
    name = transform.__name__
    expected = (
        rf"AdamW.step\(\): its parameters are those of the module passed to "
        rf"unitscale.transforms.{name}\(\).*nothing is trained. Build the optimizer from "
        r"the returned model: AdamW\(model.parameters\(\), ...\)"
    )
    with pytest.warns(UserWarning, match=expected) as caught:
        _losses(copied, optimiser, steps=3)
    assert len([w for w in caught if "step()" in str(w.message)]) == 1  # once per optimizer
    # Built from the returned model: no warning, and it trains.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*step\\(\\)")
        losses = _losses(copied, torch.optim.AdamW(copied.parameters(), lr=1e-2))
    assert losses[-1] < losses[0]


def test_training_the_original_itself_does_not_warn() -> None:
    torch.manual_seed(0)
    model = _model()
    optimiser = torch.optim.SGD(model.parameters(), lr=1e-2)
    track_scales(model)  # looked at, and the original trained: its parameters have gradients
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*step\\(\\)")
        _losses(model, optimiser, steps=2)
