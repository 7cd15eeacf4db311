"""Scale constraints: how one scale is chosen where several must be shared.

A unit-scaled op computes an ideal scale for its output and for the gradient of each of its
non-weight inputs. Gradients are true gradients only if those scales are equal; a
*constraint* picks the one shared value. Each constraint is a function of the ideal scales,
passed in the order ``(output_scale, *grad_input_scales)``, returning the shared scale.
:func:`apply_constraint` applies one by name (``None`` leaves the scales independent, which
keeps every tensor at unit scale but makes the backward pass a scaled, not true, gradient).

Weight gradients are never constrained: they are not passed here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch

from .errors import UnitScaleError

__all__ = [
    "CONSTRAINTS",
    "UnknownConstraintError",
    "amean",
    "apply_constraint",
    "gmean",
    "hmean",
    "to_grad_input_scale",
    "to_left_grad_scale",
    "to_output_scale",
    "to_right_grad_scale",
]


def gmean(*scales: float) -> float:
    """Geometric mean of the scales (Python numbers, or 0-dim tensors: then a 0-dim tensor).

    >>> gmean(1.0, 4.0)
    2.0
    """
    tensors = [s for s in scales if isinstance(s, torch.Tensor)]
    if tensors:
        like = cast(torch.Tensor, tensors[0])  # scales are typed as the usual Python floats
        as_tensors = [s if isinstance(s, torch.Tensor) else like.new_tensor(s) for s in scales]
        stacked = torch.stack(as_tensors)
        return stacked.log().mean().exp()  # type: ignore[return-value]
    return math.exp(sum(math.log(s) for s in scales) / len(scales))


def hmean(*scales: float) -> float:
    """Harmonic mean of the scales.

    >>> hmean(1.0, 3.0)
    1.5
    """
    return len(scales) / sum(1.0 / s for s in scales)


def amean(*scales: float) -> float:
    """Arithmetic mean of the scales.

    >>> amean(1.0, 3.0)
    2.0
    """
    return sum(scales) / len(scales)


def to_output_scale(output_scale: float, *grad_input_scales: float) -> float:
    """Keep the output at unit scale; input gradients take the output's scale.

    >>> to_output_scale(0.5, 0.25)
    0.5
    """
    return output_scale


def to_grad_input_scale(output_scale: float, grad_input_scale: float) -> float:
    """Keep the (single) input gradient at unit scale; the output takes its scale.

    >>> to_grad_input_scale(0.5, 0.25)
    0.25
    """
    return grad_input_scale


def to_left_grad_scale(
    output_scale: float, left_grad_scale: float, right_grad_scale: float
) -> float:
    """For a binary op, keep the left operand's gradient at unit scale.

    >>> to_left_grad_scale(1.0, 2.0, 3.0)
    2.0
    """
    return left_grad_scale


def to_right_grad_scale(
    output_scale: float, left_grad_scale: float, right_grad_scale: float
) -> float:
    """For a binary op, keep the right operand's gradient at unit scale.

    >>> to_right_grad_scale(1.0, 2.0, 3.0)
    3.0
    """
    return right_grad_scale


CONSTRAINTS: dict[str, Callable[..., float]] = {
    "gmean": gmean,
    "hmean": hmean,
    "amean": amean,
    "to_output_scale": to_output_scale,
    "to_grad_input_scale": to_grad_input_scale,
    "to_left_grad_scale": to_left_grad_scale,
    "to_right_grad_scale": to_right_grad_scale,
}


def apply_constraint(name: str | None, *scales: float) -> tuple[float, ...]:
    """Apply the constraint called ``name`` to ``(output_scale, *grad_input_scales)``.

    Args:
        name: one of :data:`CONSTRAINTS`, or ``None`` for no constraint.
        *scales: the ideal output scale followed by the ideal input-gradient scales: Python
            numbers, or 0-dim tensors (scales computed on the device, e.g. from a dynamic
            size under ``torch.compile``), for which every constraint is computed with
            tensor ops (no host synchronisation).

    Returns:
        The scales to use, in the same order: all equal to the constrained value, or the
        input unchanged when ``name`` is ``None``.

    Raises:
        UnitScaleError: ``name`` is not a known constraint, or the constraint does not take
            this many scales.

    Example:
        >>> apply_constraint("to_output_scale", 0.5, 0.25)
        (0.5, 0.5)
        >>> apply_constraint(None, 0.5, 0.25)
        (0.5, 0.25)
    """
    if name is None:
        return tuple(scales)
    if not isinstance(name, str) or name not in CONSTRAINTS:
        raise UnknownConstraintError(
            f"unknown constraint {name!r}; use None or one of {sorted(CONSTRAINTS)}"
        )
    if len(scales) < 2:
        raise UnknownConstraintError(
            f"constraint {name!r} needs an output scale and at least one grad-input scale, "
            f"got {len(scales)} scale(s)"
        )
    try:
        shared = CONSTRAINTS[name](*scales)
    except TypeError as error:
        raise UnknownConstraintError(
            f"constraint {name!r} does not apply to an op with {len(scales) - 1} "
            f"input gradient(s); choose another constraint or None"
        ) from error
    return (shared,) * len(scales)


class UnknownConstraintError(UnitScaleError, ValueError):
    """A constraint name that does not exist, or that does not fit the op."""
