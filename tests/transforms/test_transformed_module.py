"""A transformed module behaves like the module it wraps: containers stay containers, valid
code that changes a tensor in place runs, and a user's own error comes first."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from unitscale.transforms import simulate_fp8, track_scales, unit_scale


def test_a_transformed_sequential_indexes_iterates_and_has_a_length() -> None:
    sequential = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    scaled = unit_scale(sequential, mup=False)
    assert len(scaled) == 3
    assert scaled[0] is scaled.module[0] and isinstance(scaled[0], nn.Linear)
    assert isinstance(scaled[-1], nn.Linear) and scaled[-1].out_features == 4
    assert [type(m) for m in scaled] == [nn.Linear, nn.ReLU, nn.Linear]
    assert scaled[0] in list(scaled)
    assert len(scaled[0:2]) == 2
    assert bool(unit_scale(nn.Sequential(), mup=False))  # a module is true, even when empty


def test_a_transformed_module_list_and_dict_are_containers() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

        def forward(self, x: Tensor) -> Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    tracked = track_scales(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    assert len(tracked) == 2 and [m.in_features for m in tracked] == [4, 4]
    by_name = track_scales(nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.ReLU()}))
    assert "a" in by_name and "c" not in by_name
    assert isinstance(by_name["b"], nn.ReLU) and list(by_name) == ["a", "b"]
    assert len(by_name) == 2
    # A module that is no container says so, as the module itself does.
    holder = unit_scale(Holder(), mup=False)
    with pytest.raises(TypeError, match="Holder"):
        len(holder)
    with pytest.raises(TypeError, match="Holder"):
        holder[0]


class InPlaceResidual(nn.Module):
    """Valid code that changes the residual stream in place: ``skip`` is the same tensor as
    ``x``, so it sees ``+= 1`` and ``*= 2`` too."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        x = self.a(x)
        skip = x
        x += 1
        x.mul_(2)
        return self.b(x) + skip


class OutOfPlaceResidual(InPlaceResidual):
    def forward(self, x: Tensor) -> Tensor:
        x = (self.a(x) + 1) * 2
        return self.b(x) + x


def test_unit_scale_runs_in_place_changes_of_the_residual_stream() -> None:
    plain = InPlaceResidual()
    x = torch.randn(8, 16)
    twin = OutOfPlaceResidual()
    twin.load_state_dict(plain.state_dict())
    assert torch.equal(plain(x), twin(x))  # the out-of-place twin computes the same values
    scaled, scaled_twin = unit_scale(plain, mup=False), unit_scale(twin, mup=False)
    scaled_twin.load_state_dict(scaled.state_dict())
    inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    out, expected = scaled(inputs[0]), scaled_twin(inputs[1])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not torch.allclose(out, plain(x))  # unit-scaled, not run as written
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(inputs[0].grad, inputs[1].grad, rtol=0, atol=0)
    for (name, p), q in zip(scaled.named_parameters(), scaled_twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_in_place_changes_of_an_input_stay_in_place() -> None:
    class AddsToInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            x += 1
            return self.a(x)

    x = torch.zeros(2, 4)
    unit_scale(AddsToInput(), mup=False)(x)
    assert torch.equal(x, torch.ones(2, 4))  # the caller sees the change, as in plain torch


def test_unit_scale_after_simulate_fp8_is_refused_with_the_order_and_the_reason() -> None:
    from unitscale.errors import CaptureError
    from unitscale.transforms import simulate_fp8

    model = nn.Sequential(nn.Linear(4, 4))
    reason = r"the other order has no meaning, as unit_scale would replace the ops"
    with pytest.raises(CaptureError, match=rf"simulate_fp8\(unit_scale\(model\)\); {reason}"):
        unit_scale(simulate_fp8(model))
    outer = nn.Sequential(simulate_fp8(nn.Linear(4, 4)))
    with pytest.raises(CaptureError, match=rf"submodule '0'.*{reason}"):
        unit_scale(outer)


class WrongShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x.view(3, 5))  # the user's own mistake


@pytest.mark.parametrize("transform", [unit_scale, track_scales])
def test_a_users_own_error_comes_first_and_alone(transform: object) -> None:
    import traceback

    model = transform(WrongShape())  # type: ignore[operator]
    with pytest.raises(RuntimeError, match=r"shape '\[3, 5\]' is invalid") as caught:
        model(torch.randn(8, 16))
    error = caught.value
    from unitscale.errors import CaptureError

    assert not isinstance(error, CaptureError)
    assert error.__cause__ is None and error.__suppress_context__
    text = "".join(traceback.format_exception(error))
    assert "_dynamo" not in text and "fake" not in text.lower()
    assert "x.view(3, 5)" in text  # the user's source line, last in the traceback
    assert text.rstrip().splitlines()[-1].startswith(("RuntimeError", "(raised by WrongShape"))


def test_torch_compile_of_a_transformed_module_matches_eager() -> None:
    # torch.compile traces the transformed module's forward (whose signature is the wrapped
    # module's, for code that reads it): it must trace it as a plain bound method.
    torch.manual_seed(0)
    model = simulate_fp8(unit_scale(nn.Sequential(nn.Linear(16, 32), nn.GELU())))
    x = torch.randn(4, 16)
    torch.testing.assert_close(torch.compile(model)(x), model(x), rtol=0, atol=0)
