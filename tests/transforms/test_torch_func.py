"""Transformed modules under ``torch.func``: ``functional_call`` runs the transformed model
with the tensors it is given (the root's own included); ``grad``, ``vmap`` and ``jvp`` are
refused before TorchDynamo sees the call, and later calls are still transformed."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from unitscale.errors import CaptureError
from unitscale.transforms import simulate_fp8, track_scales, unit_scale


class RootTensors(nn.Module):
    """A parameter and a buffer owned by the root, and a submodule's."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.register_buffer("shift", torch.zeros(16))
        self.out = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(x @ self.w + self.shift))


def _new_tensors() -> dict[str, Tensor]:
    return {
        "w": torch.randn(16, 16),
        "shift": torch.ones(16),
        "out.weight": torch.randn(16, 16),
        "out.bias": torch.randn(16),
    }


def test_functional_call_of_a_tracked_model_uses_the_root_tensors_given() -> None:
    model, x, new = RootTensors(), torch.randn(8, 16), _new_tensors()
    tracked = track_scales(model)
    tracked(x)
    expected = torch.func.functional_call(model, new, (x,))
    assert torch.equal(torch.func.functional_call(tracked, new, (x,)), expected)
    # A root buffer alone (no parameter given) is used too, and put back afterwards.
    only_buffer = torch.func.functional_call(tracked, {"shift": new["shift"]}, (x,))
    assert torch.equal(
        only_buffer, torch.func.functional_call(model, {"shift": new["shift"]}, (x,))
    )
    assert torch.equal(tracked(x), model(x))
    assert isinstance(tracked.w, nn.Parameter) and torch.equal(tracked.shift, model.shift)


def test_functional_call_of_a_unit_scaled_model_equals_loading_the_tensors() -> None:
    model, x, new = RootTensors(), torch.randn(8, 16), _new_tensors()
    scaled = unit_scale(model, mup=False)
    before = scaled(x)
    got = torch.func.functional_call(scaled, new, (x,))
    loaded = copy.deepcopy(scaled)
    loaded.load_state_dict(new)
    torch.testing.assert_close(got, loaded(x), rtol=0, atol=0)
    assert not torch.allclose(got, before)
    assert torch.equal(scaled(x), before)  # the model's own tensors are back


def _transforms() -> list[tuple[str, Callable[[nn.Module], nn.Module]]]:
    return [
        ("unit_scale", lambda m: unit_scale(m, mup=False)),
        ("track_scales", track_scales),
        ("simulate_fp8", simulate_fp8),
    ]


@pytest.mark.parametrize("name, transform", _transforms(), ids=[name for name, _ in _transforms()])
def test_torch_func_transforms_are_refused_and_leave_later_calls_transformed(
    name: str, transform: Callable[[nn.Module], nn.Module]
) -> None:
    class Fresh(nn.Module):  # a class of its own: Dynamo's skip marks are per code object
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 16)
            self.b = nn.Linear(16, 16)

        def forward(self, x: Tensor) -> Tensor:
            return self.b(torch.relu(self.a(x))).pow(2).mean()

    x = torch.randn(8, 16)
    model = transform(Fresh())
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, Tensor], inputs: Tensor) -> Tensor:
        return torch.func.functional_call(model, p, (inputs,))

    calls: dict[str, Callable[[], object]] = {
        "grad": lambda: torch.func.grad(loss)(params, x),
        "vmap": lambda: torch.vmap(lambda row: model(row[None]))(x),
        "jvp": lambda: torch.func.jvp(lambda t: model(t), (x,), (torch.ones_like(x),)),
        "grad(forward)": lambda: torch.func.grad(lambda t: model(t))(x),
    }
    for transform_name, call in calls.items():
        kind = transform_name.split("(")[0]
        with pytest.raises(CaptureError, match=rf"inside torch\.func\.{kind}.*functional_call"):
            call()
    # Not poisoned: this model and a new transform of the same class still run through the
    # transform (a unit-scaled or rounded model differs from its plain twin).
    reference = transform(Fresh())
    plain = copy.deepcopy(reference.module)
    expected = loss(params, x)
    assert torch.equal(model(x), expected)
    if name == "track_scales":
        assert torch.equal(reference(x), plain(x))
        assert len(reference.scales_graph().nodes) > 0
    else:
        assert not torch.allclose(reference(x), plain(x))
