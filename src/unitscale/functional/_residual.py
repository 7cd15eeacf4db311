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


def residual_share(
    op: str, tau: float | None = None, share: float | None = None, default: float = 0.5
) -> float:
    """The branch's share of the variance from ``tau`` (the reference's ratio of standard
    deviations, branch over skip: ``share = tau² / (1 + tau²)``) or ``share`` itself (at most
    one given; neither: ``default``), checked; errors name ``op`` and the argument."""
    if tau is not None and share is not None:
        raise UnsupportedArgumentError(
            op,
            "tau",
            tau,
            "pass tau= (the branch's std over the skip's, as in unit_scaling) or share= "
            "(the branch's share of the variance), not both",
        )
    if tau is not None:
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not tau > 0.0:
            raise UnsupportedArgumentError(
                op,
                "tau",
                tau,
                "tau is the branch's std over the skip's (as in unit_scaling): use tau > 0, "
                "or share= for the branch's share of the variance, 0 < share < 1",
            )
        if math.isinf(tau):
            raise UnsupportedArgumentError(op, "tau", tau, "use a finite tau > 0")
        return float(tau) * float(tau) / (1.0 + float(tau) * float(tau))
    value = default if share is None else share
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < 1.0:
        raise UnsupportedArgumentError(
            op,
            "share",
            value,
            "share is the branch's share of the variance: use 0 < share < 1 (or tau=, the "
            "branch's std over the skip's)",
        )
    return float(value)


def share_to_tau(share: float) -> float:
    """The reference's ``tau`` (branch std over skip std) of a variance ``share``:
    ``sqrt(share / (1 - share))``."""
    return math.sqrt(share / (1.0 - share))


_MEANINGS = """Two spellings, one for each meaning of the weight (never both):

    * ``tau``: the residual branch's standard deviation over the skip's, as the reference
      library (graphcore's ``unit_scaling``) means it: branch weight
      ``tau / sqrt(1 + tau²)``, skip weight ``1 / sqrt(1 + tau²)``. Code ported from it,
      ``residual_add(r, s, tau)`` with a positional ``tau``, keeps its meaning.
    * ``share``: the branch's share of the variance, ``share = tau² / (1 + tau²)``: branch
      weight ``sqrt(share)``, skip weight ``sqrt(1 - share)``.

    Why ``tau`` follows the reference: the two libraries share the function names, and a
    number in (0, 1) is a valid value under both meanings, so any other choice would let
    ported code run silently with other shares. Neither given: ``share=0.5`` (``tau=1``,
    the reference's default)."""


def residual_split(
    input: Tensor, tau: float | None = None, *, share: float | None = None
) -> tuple[Tensor, Tensor]:
    """Split a residual stream into ``(residual, skip)``: the start of a residual block.

    Forward: both outputs are ``input``. Backward: the gradients of ``residual`` and
    ``skip`` are multiplied by ``sqrt(share)`` and ``sqrt(1 - share)`` before they are
    summed, undoing the ``1/sqrt(share)`` and ``1/sqrt(1 - share)`` that
    :func:`residual_add` puts on them. So, for independent unit gradients on the two
    outputs, the input gradient ``sqrt(share) g_r + sqrt(1 - share) g_s`` is unit; and the
    pair split-add together computes the true gradient of
    ``sqrt(share) f(x) + sqrt(1 - share) x`` while every tensor inside the branch ``f`` sees
    a unit gradient. No constraint applies.

    {meanings}

    Args:
        input: the residual stream, assumed unit-scaled.
        tau: the branch's std over the skip's (the reference's meaning), ``tau > 0``.
        share: the branch's share of the variance, ``0 < share < 1``. Use the same value
            in the matching :func:`residual_add`.

    Returns:
        ``(residual, skip)``: feed ``residual`` through the branch, ``skip`` straight to
        :func:`residual_add`.

    Raises:
        UnsupportedArgumentError: both given, ``tau <= 0`` or ``share`` outside (0, 1).

    Example:
        >>> x = torch.ones(3, requires_grad=True)
        >>> r, s = residual_split(x, share=0.36)
        >>> (r + s).sum().backward()
        >>> [round(v, 2) for v in x.grad.tolist()]  # sqrt(0.36) + sqrt(0.64)
        [1.4, 1.4, 1.4]
    """
    weight = residual_share("residual_split", tau, share)
    return scale_bwd(input, math.sqrt(weight)), scale_bwd(input, math.sqrt(1.0 - weight))


def residual_add(
    residual: Tensor, skip: Tensor, tau: float | None = None, *, share: float | None = None
) -> Tensor:
    """Combine a residual branch with its skip: ``sqrt(share) residual + sqrt(1 - share) skip``.

    Scaling rule: for independent unit ``residual`` and ``skip`` the weighted sum has unit
    variance (``share + (1 - share) = 1``). Backward: each input receives the incoming
    gradient unchanged (unit), not the true ``sqrt(share) g`` and ``sqrt(1 - share) g``; the
    matching :func:`residual_split` applies those factors where the two paths meet, so the
    block as a whole has true gradients. No constraint applies.

    {meanings}

    Args:
        residual: the output of the residual branch, assumed unit-scaled.
        skip: the ``skip`` output of :func:`residual_split`.
        tau: the branch's std over the skip's (the reference's meaning), ``tau > 0``.
        share: the branch's share of the variance, ``0 < share < 1`` (same as the split).

    Returns:
        The unit-scaled sum.

    Raises:
        UnsupportedArgumentError: both given, ``tau <= 0`` or ``share`` outside (0, 1).

    Example:
        >>> y = residual_add(torch.ones(2), torch.ones(2), share=0.36)  # 0.6 + 0.8
        >>> [round(v, 4) for v in y.tolist()]
        [1.4, 1.4]
        >>> y = residual_add(torch.ones(2), torch.ones(2), tau=0.75)  # (0.75 + 1) / 1.25
        >>> [round(v, 4) for v in y.tolist()]
        [1.4, 1.4]
    """
    weight = residual_share("residual_add", tau, share)
    return scale_fwd(residual, math.sqrt(weight)) + scale_fwd(skip, math.sqrt(1.0 - weight))


residual_split.__doc__ = (residual_split.__doc__ or "").replace("{meanings}", _MEANINGS)
residual_add.__doc__ = (residual_add.__doc__ or "").replace("{meanings}", _MEANINGS)
