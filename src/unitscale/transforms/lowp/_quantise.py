"""The functions a rewritten graph calls to round a matmul operand and its gradient.

:func:`quantise_operand` rounds an operand in the forward pass and, optionally, the gradient
with respect to it in the backward pass; :func:`quantise_grad` rounds only the gradient
arriving at an op's output; :func:`fp8_scale` is the scale of a scaled cast. All three go
through one autograd function, so the rounding of a value and of its gradient lives in one
place. Formats travel in the graph as :data:`FormatSpec` tuples (generated graph code can
only embed Python literals).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ...formats import FPFormat
from ._scaling import Scaling, cast_scale, scaled_cast

__all__ = ["FormatSpec", "format_spec", "fp8_scale", "quantise_grad", "quantise_operand"]

FormatSpec = tuple[int, int, str, str] | tuple[int, int, str, str, str]
"""An :class:`FPFormat` as plain data, ``(exponent_bits, mantissa_bits, rounding,
special_values)``, with ``overflow`` appended where it is not the default ``"saturate"``:
what an inserted graph node holds, since generated graph code can only embed Python
literals."""


def format_spec(fmt: FPFormat) -> FormatSpec:
    """The :data:`FormatSpec` of ``fmt``."""
    spec = (fmt.exponent_bits, fmt.mantissa_bits, fmt.rounding, fmt.special_values)
    return spec if fmt.overflow == "saturate" else (*spec, fmt.overflow)


# The formats of the specs seen: a dict rather than functools.lru_cache, which Dynamo warns
# about when it traces a transformed graph inside a user's torch.compile (and traces through).
_FORMATS: dict[tuple[Any, ...], FPFormat] = {}


def _format_of(spec: tuple[Any, ...]) -> FPFormat:
    fmt = _FORMATS.get(spec)
    if fmt is None:
        fmt = _FORMATS[spec] = FPFormat(*spec)
    return fmt


def _as_format(spec: FPFormat | FormatSpec) -> FPFormat:
    return spec if isinstance(spec, FPFormat) else _format_of(tuple(spec))


class _ScaledQuantise(torch.autograd.Function):
    """``y = fwd(x)`` (rounded, optionally scaled; a fresh tensor either way), ``grad_x =
    bwd(grad_y)``: the one place where simulated FP8 rounds a value and its gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        fwd_format: FPFormat | None,
        scale: Tensor | None,
        bwd_format: FPFormat | None,
        grad_scaling: str,
        grad_history: Tensor | None,
    ) -> Tensor:
        ctx.bwd = (bwd_format, grad_scaling, grad_history)
        if fwd_format is None:
            # A copy, not a view: the caller may modify the result in place
            # (``y = linear(x); y += x``), which autograd forbids on a custom Function's view.
            return x.clone()
        if scale is None:
            return fwd_format.quantise(x)
        rounded, inverse = scaled_cast(x, fwd_format.quantise, 0.0, "tensorwise", scale=scale)
        return _unscaled(rounded, inverse, x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        bwd_format, grad_scaling, grad_history = ctx.bwd
        if bwd_format is not None:
            grad = _round_gradient(grad, bwd_format, grad_scaling, grad_history)
        return grad, None, None, None, None, None


def _round_gradient(grad: Tensor, fmt: FPFormat, scaling: str, history: Tensor | None) -> Tensor:
    fmax = fmt.max_absolute_value
    rounded, inverse = scaled_cast(grad, fmt.quantise, fmax, scaling, history=history, record=True)
    return _unscaled(rounded, inverse, grad.dtype)


def _unscaled(rounded: Tensor, inverse: Tensor | None, dtype: torch.dtype) -> Tensor:
    """A scaled cast's rounded value times the inverse scale, in ``dtype``: the value the
    FP8 GEMM sees (``_scaled_mm`` multiplies by the reciprocal scale)."""
    if inverse is None:
        return rounded
    return rounded.mul_(inverse).to(dtype)


def fp8_scale(x: Tensor, format_max: float, history: Tensor | None = None) -> Tensor:
    """The scale ``format_max / amax`` that a scaled cast of ``x`` multiplies it by.

    Inserted by ``scaling="tensorwise"`` (``history`` None: the amax of ``x``) and
    ``"delayed"`` (the max of ``history``, which is then updated while autograd records;
    see :mod:`unitscale.transforms.lowp._scaling` for the rules and their sources).

    Example:
        >>> fp8_scale(torch.tensor([0.5, -2.0]), 448.0).item()  # E4M3's max / amax
        224.0
    """
    scaling = "tensorwise" if history is None else "delayed"
    return cast_scale(x, format_max, scaling, history, record=torch.is_grad_enabled())


def quantise_operand(
    x: Tensor,
    fwd_format: FPFormat | FormatSpec,
    bwd_format: FPFormat | FormatSpec | None,
    scale: Tensor | None = None,
    grad_scaling: Scaling = "none",
    grad_history: Tensor | None = None,
) -> Tensor:
    """Round ``x`` to ``fwd_format``, and the gradient with respect to ``x`` to ``bwd_format``.

    Args:
        x: a floating-point tensor (an operand of a matmul-like op).
        fwd_format: the format of the forward value (an ``FPFormat`` or its
            :data:`FormatSpec`).
        bwd_format: the format of the gradient, likewise; None passes the gradient through
            unrounded.
        scale: if given, ``x`` is multiplied by it before rounding and divided after (a
            scaled cast, see :func:`fp8_scale`).
        grad_scaling: how the gradient is scaled before rounding: ``"none"``,
            ``"tensorwise"`` (by ``format_max / amax(gradient)``) or ``"delayed"`` (from
            ``grad_history``, which is updated).
        grad_history: the gradient's amax history, for ``grad_scaling="delayed"``.

    Returns:
        ``fwd_format.quantise(x)`` (scaled if asked), whose backward rounds the incoming
        gradient to ``bwd_format`` (straight through otherwise).

    Example:
        >>> import dataclasses
        >>> from unitscale.formats import E4M3, E5M2
        >>> e4m3, e5m2 = (dataclasses.replace(f, rounding="nearest") for f in (E4M3, E5M2))
        >>> x = torch.tensor([0.3, 1000.0], requires_grad=True)
        >>> y = quantise_operand(x, e4m3, e5m2)
        >>> y.backward(torch.tensor([0.3, 1e6]))
        >>> y.tolist(), x.grad.tolist()
        ([0.3125, 448.0], [0.3125, 57344.0])
    """
    bwd = None if bwd_format is None else _as_format(bwd_format)
    return _ScaledQuantise.apply(x, _as_format(fwd_format), scale, bwd, grad_scaling, grad_history)


def quantise_grad(
    y: Tensor,
    bwd_format: FPFormat | FormatSpec,
    scaling: Scaling = "none",
    history: Tensor | None = None,
) -> Tensor:
    """A copy of ``y``; the gradient with respect to it is rounded to ``bwd_format``.

    Inserted after a matmul-like op: its output gradient is what an FP8 matmul's backward
    reads (in E5M2), while the gradients it computes are accumulated in higher precision.
    The result is a new tensor (not a view), so the caller may modify it in place.

    Args:
        y: the op's output.
        bwd_format: the gradient's format.
        scaling: ``"none"``, ``"tensorwise"`` or ``"delayed"`` (see :func:`quantise_operand`).
        history: the gradient's amax history, for ``scaling="delayed"``.

    Example:
        >>> import dataclasses
        >>> from unitscale.formats import E5M2
        >>> y = torch.tensor([0.3, 1e6], requires_grad=True)
        >>> out = quantise_grad(y, dataclasses.replace(E5M2, rounding="nearest"))
        >>> out.backward(torch.tensor([0.3, 1e6]))
        >>> out.tolist(), y.grad.tolist()
        ([0.30000001192092896, 1000000.0], [0.3125, 57344.0])
    """
    return _ScaledQuantise.apply(y, None, None, _as_format(bwd_format), scaling, history)
