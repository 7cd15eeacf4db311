"""An optimizer built before a transform, on the original's parameters, is named.

A torchao user builds the optimizer first and converts after (``opt = AdamW(m.parameters());
f = to_fp8(m)``): torchao converts in place, unitscale returns a copy with parameters of
its own, and that order trained nothing, silently (the loss stayed at 1.1149 for 5 steps).
The first step of such an optimizer now warns, naming the transform and the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from unitscale.formats import FPFormat
from unitscale.transforms import simulate_format, simulate_fp8, to_fp8, track_scales, unit_scale

TRANSFORMS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "to_fp8": to_fp8,
    "simulate_fp8": simulate_fp8,
    "simulate_format": lambda m: simulate_format(m, FPFormat(4, 3), FPFormat(5, 2)),
    "unit_scale": unit_scale,
    "track_scales": track_scales,
}


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _losses(model: nn.Module, optimiser: torch.optim.Optimizer, steps: int = 3) -> list[float]:
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    losses = []
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_an_optimizer_left_on_the_original_warns_at_its_first_step(name: str) -> None:
    from unitscale.transforms.lowp import _gemm

    if name == "to_fp8" and _gemm.float8_device_error("cpu") is not None:
        pytest.skip(f"no float8 GEMM on this CPU: {_gemm.float8_device_error('cpu')}")
    torch.manual_seed(0)
    model = _model()
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)  # first, as with torchao
    copied = TRANSFORMS[name](model)
    assert not any(p is q for p, q in zip(copied.parameters(), model.parameters(), strict=True))
    op = "simulate_format" if name == "simulate_format" else name
    expected = (
        rf"AdamW.step\(\): its parameters are those of the module passed to "
        rf"unitscale.transforms.{op}\(\), which returned a copy with parameters of its own.*"
        r"nothing is trained. Build the optimizer from the returned model: "
        r"AdamW\(model.parameters\(\), ...\)"
    )
    with pytest.warns(UserWarning, match=expected) as caught:
        _losses(copied, optimiser)
    assert len([w for w in caught if "step()" in str(w.message)]) == 1  # once per optimizer
    if name == "to_fp8":
        (left_behind,) = [w for w in caught if "step()" in str(w.message)]
        assert "unlike torchao's convert_to_float8_training" in str(left_behind.message)
    # Built from the returned model: no warning, and it trains.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*step\\(\\)")
        losses = _losses(copied, torch.optim.AdamW(copied.parameters(), lr=1e-2), steps=4)
    assert losses[-1] < losses[0]


def test_training_the_original_itself_does_not_warn() -> None:
    torch.manual_seed(0)
    model = _model()
    optimiser = torch.optim.SGD(model.parameters(), lr=1e-2)
    track_scales(model)  # looked at, and the original trained: its parameters have gradients
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*step\\(\\)")
        _losses(model, optimiser, steps=2)
