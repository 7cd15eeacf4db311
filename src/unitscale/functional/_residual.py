"""Unit-scaled addition and the residual scheme: add, residual_split, residual_add."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..constraints import apply_constraint
from ..errors import UnsupportedArgumentError
from ..scale import scale_bwd, scale_fwd
from ._base import Constraint, _finish, _is_float_tensor, _prescale, _rsqrt
from ._shared import broadcast_along_batch, shared_counts

# --------------------------------------------------------------------------------------------
# addition and residuals
# --------------------------------------------------------------------------------------------


def add(
    input: Any, other: Any, alpha: float = 1, constraint: Constraint = "to_output_scale"
) -> Any:
    """Unit-scaled addition of two independent tensors (``torch.add``).

    Scaling rule, for independent unit ``input`` and ``other``: ``input + alpha * other`` has
    std ``sqrt(1 + alpha^2)``; each operand's gradient sums the incoming gradient over the
    dimensions it was broadcast along (``numel(out) / numel(operand)`` terms) and ``other``'s
    is also multiplied by ``alpha``. Ideal scales: output ``1/sqrt(1 + alpha^2)``, input
    ``1/sqrt(numel(out)/numel(input))``, other ``1/(|alpha| sqrt(numel(out)/numel(other)))``.
    Default ``to_output_scale``: all equal the output scale (true gradients, e.g. std
    ``1/sqrt(2)`` each for same-shape operands); ``None``: all unit.

    A one-element operand added to a larger tensor (``x + torch.tensor(5.0)``, a scalar
    parameter) is a constant offset: it moves every element of the sum alike and leaves its
    standard deviation that of the other operand's term, so the output scale undoes that
    term's coefficient alone: 1 for ``x + alpha * c`` (not rescaled), ``1/|alpha|`` for
    ``c + alpha * x``. The offset's gradient is still the sum of ``numel(out)`` terms (ideal
    scale ``1/sqrt(numel(out))``). An operand of several elements broadcast against
    the other (a bias of shape ``(features,)``) varies across the elements it is added to,
    so it counts as an independent unit operand like any other: the rule above (a
    unit-initialised bias; one initialised at zero leaves the sum at std ``1/sqrt(2)`` until
    it grows). Under data
    parallelism or gradient accumulation an operand broadcast along dimension 0 of an output
    of 2 or more dimensions counts the whole batch and its gradient is multiplied by the
    data-parallel size (:mod:`unitscale.data_parallel`).

    Only an addition of two floating-point tensors is scaled. If either operand is a Python
    number, a non-float tensor or a symbolic size, this is the plain addition (adding a
    constant does not change a tensor's scale), so ``U.add`` can stand in for every
    ``operator.add`` in a captured graph. It assumes the operands are independent: adding a
    residual branch to its own input is :func:`residual_add`'s job.

    Args:
        input: left operand.
        other: right operand.
        alpha: multiplier of ``other``, as for ``torch.add``.
        constraint: a constraint taking an output and two grad scales, or None.

    Returns:
        The scaled sum (or the plain sum, see above).

    Example:
        >>> add(torch.ones(2), torch.ones(2)).tolist()  # (1 + 1) / sqrt(2)
        [1.4142135381698608, 1.4142135381698608]
        >>> add(torch.ones(2), 1.0).tolist()
        [2.0, 2.0]
        >>> add(torch.tensor(5.0), torch.ones(2)).tolist()  # a constant offset: not rescaled
        [6.0, 6.0]
    """
    return scaled_add(input, other, alpha, constraint, (False, False))


def scaled_add(
    input: Any, other: Any, alpha: float, constraint: Constraint, shared: tuple[bool, bool]
) -> Any:
    """:func:`add`, told which operands are shared by every example (computed from
    parameters and constants alone) besides those its shapes show broadcast along the batch."""
    if not (_is_float_tensor(input) and _is_float_tensor(other)):
        return input + other if alpha == 1 else torch.add(input, other, alpha=alpha)
    out_shape = torch.broadcast_shapes(input.shape, other.shape)
    out_numel = math.prod(out_shape)
    input_shards, input_size = shared_counts(
        shared[0] or broadcast_along_batch(input.shape, out_shape)
    )
    other_shards, other_size = shared_counts(
        shared[1] or broadcast_along_batch(other.shape, out_shape)
    )
    out_ideal = _sum_ideal(input.numel(), other.numel(), alpha)
    input_ideal = _rsqrt(out_numel * input_shards // max(input.numel(), 1))
    other_ideal = (
        _rsqrt(out_numel * other_shards // max(other.numel(), 1)) / abs(alpha)
        if alpha != 0
        else 1.0
    )
    out_scale, input_scale, other_scale = apply_constraint(
        constraint, out_ideal, input_ideal, other_ideal
    )
    input = _prescale(input, input_scale * input_size, out_scale)
    other = _prescale(other, other_scale * other_size, out_scale)
    summed = input + other if alpha == 1 else torch.add(input, other, alpha=alpha)
    return _finish(summed, out_scale)


def _sum_ideal(input_numel: int, other_numel: int, alpha: float) -> float:
    """The ideal output scale of ``input + alpha * other`` (see :func:`add`): a one-element
    operand beside a larger one is a constant offset, which leaves the other's scale."""
    if input_numel == 1 and other_numel > 1:
        return 1.0 / abs(alpha) if alpha != 0 else 1.0
    if other_numel == 1 and input_numel > 1:
        return 1.0
    return 1.0 / math.sqrt(1.0 + alpha * alpha)


def _check_tau(op: str, tau: float) -> None:
    if not 0.0 < tau < 1.0:
        raise UnsupportedArgumentError(
            op, "tau", tau, "tau is the residual branch's share of the variance: use 0 < tau < 1"
        )


def residual_split(input: Tensor, tau: float = 0.5) -> tuple[Tensor, Tensor]:
    """Split a residual stream into ``(residual, skip)``: the start of a residual block.

    Forward: both outputs are ``input``. Backward: the gradients of ``residual`` and
    ``skip`` are multiplied by ``sqrt(tau)`` and ``sqrt(1 - tau)`` before they are summed,
    undoing the ``1/sqrt(tau)`` and ``1/sqrt(1 - tau)`` that :func:`residual_add` puts on them.
    So, for independent unit gradients on the two outputs, the input gradient
    ``sqrt(tau) g_r + sqrt(1 - tau) g_s`` is unit; and the pair split-add together computes
    the true gradient of ``sqrt(tau) f(x) + sqrt(1 - tau) x`` while every tensor inside the
    branch ``f`` sees a unit gradient. No constraint applies.

    Args:
        input: the residual stream, assumed unit-scaled.
        tau: the residual branch's share of the variance, ``0 < tau < 1``; use the same
            value in the matching :func:`residual_add`.

    Returns:
        ``(residual, skip)``: feed ``residual`` through the branch, ``skip`` straight to
        :func:`residual_add`.

    Raises:
        UnsupportedArgumentError: ``tau`` outside (0, 1).

    Example:
        >>> x = torch.ones(3, requires_grad=True)
        >>> r, s = residual_split(x, tau=0.36)
        >>> (r + s).sum().backward()
        >>> [round(v, 2) for v in x.grad.tolist()]  # sqrt(0.36) + sqrt(0.64)
        [1.4, 1.4, 1.4]
    """
    _check_tau("residual_split", tau)
    return scale_bwd(input, math.sqrt(tau)), scale_bwd(input, math.sqrt(1.0 - tau))


def residual_add(residual: Tensor, skip: Tensor, tau: float = 0.5) -> Tensor:
    """Combine a residual branch with its skip: ``sqrt(tau) residual + sqrt(1 - tau) skip``.

    Scaling rule: for independent unit ``residual`` and ``skip`` the weighted sum has unit
    variance (``tau + (1 - tau) = 1``); ``tau`` is the branch's share. Backward: each input
    receives the incoming gradient unchanged (unit), not the true ``sqrt(tau) g`` and
    ``sqrt(1 - tau) g``; the matching :func:`residual_split` applies those factors where the
    two paths meet, so the block as a whole has true gradients. No constraint applies.

    Args:
        residual: the output of the residual branch, assumed unit-scaled.
        skip: the ``skip`` output of :func:`residual_split`.
        tau: the branch's share of the variance, ``0 < tau < 1`` (same as the split).

    Returns:
        The unit-scaled sum.

    Raises:
        UnsupportedArgumentError: ``tau`` outside (0, 1).

    Example:
        >>> y = residual_add(torch.ones(2), torch.ones(2), tau=0.36)  # 0.6 + 0.8
        >>> [round(v, 4) for v in y.tolist()]
        [1.4, 1.4]
    """
    _check_tau("residual_add", tau)
    return scale_fwd(residual, math.sqrt(tau)) + scale_fwd(skip, math.sqrt(1.0 - tau))
