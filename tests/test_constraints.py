"""unitscale.constraints: choosing the shared scale."""

from __future__ import annotations

import math

import pytest
import torch

from unitscale.constraints import (
    CONSTRAINTS,
    UnknownConstraintError,
    amean,
    apply_constraint,
    gmean,
    hmean,
    to_grad_input_scale,
    to_left_grad_scale,
    to_output_scale,
    to_right_grad_scale,
)
from unitscale.errors import UnitScaleError


def test_means() -> None:
    assert gmean(2.0, 8.0) == pytest.approx(4.0, rel=1e-12)
    assert gmean(1.0, 1.0, 8.0) == pytest.approx(2.0, rel=1e-12)
    assert hmean(2.0, 6.0) == pytest.approx(3.0, rel=1e-12)
    assert amean(1.0, 2.0, 6.0) == pytest.approx(3.0, rel=1e-12)
    # the three means of the same scales are ordered hmean <= gmean <= amean
    scales = (0.1, 0.5, 3.0)
    assert hmean(*scales) < gmean(*scales) < amean(*scales)


def test_selectors() -> None:
    assert to_output_scale(0.5, 0.25, 0.125) == 0.5
    assert to_grad_input_scale(0.5, 0.25) == 0.25
    assert to_left_grad_scale(1.0, 2.0, 3.0) == 2.0
    assert to_right_grad_scale(1.0, 2.0, 3.0) == 3.0


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_apply_constraint_ties_every_scale(name: str) -> None:
    scales = (0.5, 0.25, 2.0) if "left" in name or "right" in name else (0.5, 0.25)
    tied = apply_constraint(name, *scales)
    assert len(tied) == len(scales)
    assert len(set(tied)) == 1
    assert tied[0] == pytest.approx(CONSTRAINTS[name](*scales))


def test_none_keeps_scales_independent() -> None:
    assert apply_constraint(None, 0.5, 0.25, 3.0) == (0.5, 0.25, 3.0)


def test_gmean_of_linear_scales() -> None:
    fan_in, fan_out = 64, 1024
    out, grad = apply_constraint("gmean", 1 / math.sqrt(fan_in), 1 / math.sqrt(fan_out))
    assert out == grad == pytest.approx((fan_in * fan_out) ** -0.25)


def test_unknown_name_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match=r"unknown constraint 'to_ouput_scale'.*gmean"):
        apply_constraint("to_ouput_scale", 1.0, 2.0)
    with pytest.raises(UnitScaleError):
        apply_constraint(3, 1.0, 2.0)  # type: ignore[arg-type]


def test_wrong_number_of_scales() -> None:
    with pytest.raises(UnknownConstraintError, match="at least one grad-input scale"):
        apply_constraint("gmean", 1.0)
    with pytest.raises(UnknownConstraintError, match="does not apply to an op with 2 input"):
        apply_constraint("to_grad_input_scale", 1.0, 2.0, 3.0)


@pytest.mark.parametrize("name", sorted(CONSTRAINTS))
def test_constraints_of_tensor_scales_equal_those_of_floats(name: str) -> None:
    # Scales computed on the device (a softmax under torch.compile) are 0-dim tensors: every
    # constraint gives the value it gives for the same Python floats.
    floats = (0.5, 2.0, 3.0) if name.startswith(("to_left", "to_right")) else (0.5, 2.0)
    tensors = [torch.tensor(s, dtype=torch.float64) for s in floats]
    expected = apply_constraint(name, *floats)
    actual = apply_constraint(name, *tensors)
    assert all(isinstance(a, torch.Tensor) for a in actual)  # no host synchronisation
    assert [float(a) for a in actual] == pytest.approx(expected, rel=1e-12)
