"""A compiled unit-scaled model follows a change of gradient accumulation or data-parallel
size made after its first call: its gradients equal the eager model's under the new setting
(Inductor folds the factors into the compiled backward, so the model must compile again)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import Tensor, nn

import unitscale as us
from unitscale.data_parallel import set_data_parallel, set_gradient_accumulation
from unitscale.transforms import compile as unitscale_compile
from unitscale.transforms import unit_scale

pytestmark = pytest.mark.slow  # Inductor compiles each model twice


@pytest.fixture(autouse=True)
def _restore_settings() -> Iterator[None]:
    yield
    set_gradient_accumulation()
    set_data_parallel()


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.relu(self.a(x)))


def _gradients(model: nn.Module, x: Tensor) -> list[Tensor]:
    model.zero_grad()
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _unit_scaled_pair() -> tuple[nn.Module, nn.Module]:
    eager = unit_scale(Plain(), mup=False)
    return eager, unitscale_compile(eager)


def _modules_pair() -> tuple[nn.Module, nn.Module]:
    eager = nn.Sequential(us.Linear(16, 16), us.GELU(), us.Linear(16, 4))
    return eager, torch.compile(eager)


@pytest.mark.parametrize(
    "make, change, undo",
    [
        (_unit_scaled_pair, lambda: set_gradient_accumulation(4), set_gradient_accumulation),
        (_modules_pair, lambda: set_gradient_accumulation(4), set_gradient_accumulation),
        (_unit_scaled_pair, lambda: set_data_parallel(size=2), set_data_parallel),
        (_modules_pair, lambda: set_data_parallel(size=2), set_data_parallel),
    ],
    ids=[
        "unitscale.compile-accumulation",
        "torch.compile-accumulation",
        "unitscale.compile-size",
        "torch.compile-size",
    ],
)
def test_compiled_gradients_follow_later_data_parallel_settings(
    make: Callable[[], tuple[nn.Module, nn.Module]],
    change: Callable[[], None],
    undo: Callable[[], None],
) -> None:
    eager, compiled = make()
    x = torch.randn(8, 16)
    _gradients(compiled, x)  # the first compiled call, with no setting
    for step in (change, undo):  # the new setting, then back to the first call's
        step()
        expected = _gradients(eager, x)
        got = _gradients(compiled, x)
        assert len(got) == len(expected) == 4
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)
