"""Unit-scaled elementwise ops: scale_elementwise, gelu, silu, silu_glu, softmax, dropout."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..constraints import apply_constraint
from ..errors import UnsupportedArgumentError
from ..scale import scale_fwd_bwd
from ._base import (
    Constraint,
    _finish,
    _prescale,
    _reject,
)
from ._moments import _softmax_scales, softmax_scales
from ._mult import check_mult, gelu_moments, silu_moments

# Moments of elementwise nonlinearities at x ~ N(0, 1), by numerical integration (trapezoid
# rule on [-40, 40], 8e5 points; tests/functional/test_functional.py recomputes them).
# std(f(x)), rms(f(x)) = sqrt(E[f(x)^2]) and rms(f'(x)).
_GELU_STD = {"none": 0.5879149692201956, "tanh": 0.5879183156497649}
_GELU_GRAD_RMS = {"none": 0.6751672871699427, "tanh": 0.6751428337604438}
_SILU_STD = 0.5595384678495278
_SILU_RMS = 0.5964692111326139
_SILU_GRAD_RMS = 0.6160213889512496


# --------------------------------------------------------------------------------------------
# elementwise ops
# --------------------------------------------------------------------------------------------


def scale_elementwise(
    f: Callable[..., Tensor],
    output_scale: float,
    grad_input_scale: float,
    constraint: Constraint = "to_output_scale",
) -> Callable[..., Tensor]:
    """Wrap an elementwise function ``f`` so its output and input gradient are scaled.

    Scaling rule: ``output_scale`` should be ``1 / std(f(x))`` and ``grad_input_scale``
    ``1 / rms(f'(x))`` for ``x ~ N(0, 1)``; then, for a unit input and a unit incoming
    gradient, the output and the input gradient have unit std. The two differ in general, so
    the gradient is the true gradient only if they are tied: the default ``to_output_scale``
    uses ``output_scale`` for both (output unit, gradient off by
    ``output_scale / grad_input_scale``); ``to_grad_input_scale`` uses ``grad_input_scale``
    for both; ``None`` keeps them separate (both unit, gradient scaled).

    Args:
        f: the elementwise function; extra arguments of the returned function are passed on.
        output_scale: ideal forward factor.
        grad_input_scale: ideal factor for the input's gradient.
        constraint: name of a two-scale constraint (see :mod:`unitscale.constraints`), or None.

    Returns:
        A function ``(input, *args, **kwargs) -> Tensor``.

    Raises:
        UnknownConstraintError: ``constraint`` is not a known name or needs other scales.

    Example:
        >>> double = scale_elementwise(lambda x: 2 * x, 0.5, 0.5)
        >>> double(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    return _elementwise(f, output_scale, grad_input_scale, constraint, inplace=False)


def _elementwise(
    f: Callable[..., Tensor],
    output_scale: float,
    grad_input_scale: float,
    constraint: Constraint,
    inplace: bool,
) -> Callable[..., Tensor]:
    """:func:`scale_elementwise`; ``inplace`` scales ``f``'s output in place, which is only
    right for an ``f`` whose backward does not read its output (not ``exp``, ``tanh``...)."""
    out_scale, in_scale = apply_constraint(constraint, output_scale, grad_input_scale)

    def scaled_f(input: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        output = f(_prescale(input, in_scale, out_scale), *args, **kwargs)
        return _finish(output, out_scale, inplace)

    return scaled_f


def gelu(
    input: Tensor,
    approximate: str = "none",
    constraint: Constraint = "to_output_scale",
    mult: float = 1.0,
) -> Tensor:
    """Unit-scaled GELU (``F.gelu``).

    Scaling rule, for ``x ~ N(0, 1)``: std(gelu(x)) = 0.58791 and rms(gelu'(x)) = 0.67517
    (numerical integration; the tanh approximation differs in the 5th digit), so the ideal
    output scale is 1/0.58791 = 1.7009 and the ideal grad-input scale 1/0.67517 = 1.4811.
    Default ``to_output_scale``: both use 1.7009, the output is unit and the gradient (a true
    gradient) has std 1.148. ``None``: both unit, gradient scaled by 1.4811/1.7009.

    With ``mult`` (u-μP's α): ``y = s * gelu(mult * input)``, ideal scales
    ``1 / std(gelu(mult x))`` and ``1 / rms(mult gelu'(mult x))``, computed by quadrature
    (``functional/_mult.py``; no closed form; error below 1e-9 for mult in [1/16, 16]).

    Args:
        input: the input, assumed unit-scaled.
        approximate: ``"none"`` or ``"tanh"``, as for ``F.gelu``.
        constraint: see :func:`scale_elementwise`.
        mult: positive multiplier applied to the input before the nonlinearity.

    Returns:
        ``gelu(mult * input)`` times the output scale.

    Raises:
        UnsupportedArgumentError: ``approximate`` is not ``"none"`` or ``"tanh"``, or
            ``mult`` is not positive.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(gelu(torch.randn(1000, 1000)).std().item(), 2)
        1.0
    """
    if approximate not in _GELU_STD:
        raise UnsupportedArgumentError("gelu", "approximate", approximate, 'use "none" or "tanh"')
    mult = check_mult("gelu", mult)
    if mult == 1.0:
        std, grad_rms = _GELU_STD[approximate], _GELU_GRAD_RMS[approximate]
    else:
        std, grad_rms = gelu_moments(mult, approximate)
        input = scale_fwd_bwd(input, mult, mult)  # a true gradient: d/dx f(m x) = m f'(m x)
    # gelu's backward reads its input only, so its output can be scaled in place
    return _elementwise(F.gelu, 1.0 / std, 1.0 / grad_rms, constraint, True)(
        input, approximate=approximate
    )


def silu(
    input: Tensor,
    inplace: bool = False,
    constraint: Constraint = "to_output_scale",
    mult: float = 1.0,
) -> Tensor:
    """Unit-scaled SiLU (``F.silu``).

    Scaling rule, for ``x ~ N(0, 1)``: std(silu(x)) = 0.55954 and rms(silu'(x)) = 0.61602
    (numerical integration): ideal output scale 1.7872, grad-input scale 1.6233. Default
    ``to_output_scale``: both 1.7872 (true gradient with std 1.101); ``None``: both unit.

    With ``mult`` (u-μP's α): ``y = s * silu(mult * input)``, ideal scales
    ``1 / std(silu(mult x))`` and ``1 / rms(mult silu'(mult x))`` by quadrature
    (``functional/_mult.py``; no closed form; error below 1e-9 for mult in [1/16, 16]).

    Args:
        input: the input, assumed unit-scaled.
        inplace: must be False (unit scaling returns a new tensor).
        constraint: see :func:`scale_elementwise`.
        mult: positive multiplier applied to the input before the nonlinearity.

    Returns:
        ``silu(mult * input)`` times the output scale.

    Raises:
        UnsupportedArgumentError: ``inplace=True`` or ``mult`` not positive.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(silu(torch.randn(1000, 1000)).std().item(), 2)
        1.0
    """
    _reject("silu", "inplace", inplace, False, "use inplace=False")
    mult = check_mult("silu", mult)
    if mult == 1.0:
        std, grad_rms = _SILU_STD, _SILU_GRAD_RMS
    else:
        std, _, grad_rms = silu_moments(mult)
        input = scale_fwd_bwd(input, mult, mult)  # a true gradient: d/dx f(m x) = m f'(m x)
    return _elementwise(F.silu, 1.0 / std, 1.0 / grad_rms, constraint, True)(input)


def silu_glu(
    input: Tensor, gate: Tensor, constraint: Constraint = "to_output_scale", mult: float = 1.0
) -> Tensor:
    """Unit-scaled SiLU-gated linear unit: ``input * silu(gate)`` (SwiGLU's nonlinearity).

    Scaling rule, for independent ``input, gate ~ N(0, 1)``: the output has zero mean and
    variance ``E[input^2] E[silu(gate)^2] = 0.59647^2``; the input's gradient is
    ``grad * silu(gate)`` (rms 0.59647) and the gate's ``grad * input * silu'(gate)`` (rms
    0.61602). Ideal scales: output and input 1/0.59647 = 1.6765, gate 1/0.61602 = 1.6233.
    Default ``to_output_scale``: all three 1.6765 (true gradients, gate gradient std 1.033);
    ``None``: all unit.

    With ``mult`` (u-μP's α, on the gate): ``y = s * input * silu(mult * gate)``; the same
    rule with ``rms(silu(mult g))`` (output and input) and ``rms(mult silu'(mult g))`` (gate),
    by quadrature (``functional/_mult.py``).

    Args:
        input: the linear half, assumed unit-scaled.
        gate: the gate half, assumed unit-scaled, same shape as ``input`` (or broadcastable).
        constraint: a constraint taking an output and two grad scales, or None.
        mult: positive multiplier applied to the gate before the SiLU.

    Returns:
        ``input * silu(mult * gate)`` times the output scale.

    Raises:
        UnsupportedArgumentError: ``mult`` is not positive.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> x, g = torch.randn(2, 1000, 1000)
        >>> round(silu_glu(x, g).std().item(), 2)
        1.0
    """
    mult = check_mult("silu_glu", mult)
    if mult == 1.0:
        rms, grad_rms = _SILU_RMS, _SILU_GRAD_RMS
    else:
        _, rms, grad_rms = silu_moments(mult)
        gate = scale_fwd_bwd(gate, mult, mult)  # a true gradient: d/dg silu(m g) = m silu'(m g)
    out_scale, input_scale, gate_scale = apply_constraint(
        constraint, 1.0 / rms, 1.0 / rms, 1.0 / grad_rms
    )
    input = _prescale(input, input_scale, out_scale)
    gate = _prescale(gate, gate_scale, out_scale)
    return _finish(input * F.silu(gate), out_scale)


def softmax(
    input: Tensor,
    dim: int | None = None,
    _stacklevel: int = 3,
    dtype: torch.dtype | None = None,
    constraint: Constraint = "to_output_scale",
    mult: float = 1.0,
) -> Tensor:
    """Unit-scaled softmax (``F.softmax``).

    Scaling rule, for ``n`` i.i.d. N(0, 1) logits along ``dim``: ``p = softmax(x)`` has mean
    ``1/n`` and variance ``(n v(n) - 1) / n^2`` with ``v(n) = E[sum_j p_j^2]``; the gradient
    ``p * (g - <p, g>)`` has mean square ``G(n) / n`` with
    ``G(n) = E[sum p^2 - 2 sum p^3 + (sum p^2)^2]``. ``v`` and ``G`` are computed exactly by
    numerical integration (``v(n) -> e/n`` for large ``n``, so the output scale tends to
    ``n / sqrt(e - 1)`` and the gradient scale to ``sqrt(n / e)``). Ideal scales:
    output ``n / sqrt(n v - 1)``, grad-input ``sqrt(n / G)``. Default ``to_output_scale``:
    both use the output scale (output unit; true gradient, whose std is then
    ``n / sqrt(n v - 1) * sqrt(G / n) = sqrt(n G / (n v - 1))``: above 1, e.g. 1.21 for
    n = 64, tending to ``sqrt(e / (e - 1)) ≈ 1.26`` for large ``n``); ``None``: both unit.
    The output keeps its mean: a unit-scaled softmax sums to ``n / sqrt(n v - 1)``, not 1.
    ``n = 1`` is left unscaled.

    Under ``torch.compile`` (TorchDynamo, or a symbolic length when traced with dynamic
    shapes) the same scales come from the op ``unitscale::softmax_scales`` as 0-dim tensors
    computed at run time for the concrete length, so the length stays dynamic and one graph
    serves every length; eager calls use Python floats.

    With ``mult`` (u-μP's α): ``y = s * softmax(mult * input)``. The logits ``mult x`` are
    i.i.d. N(0, mult²), so the same rule holds with ``v`` and ``G`` integrated at logit
    variance ``mult²`` (exact, as above) and the gradient ``mult`` times larger: ideal
    scales ``n / sqrt(n v - 1)`` and ``sqrt(n / G) / mult``.

    Args:
        input: the logits, assumed i.i.d. N(0, 1) along ``dim``.
        dim: the dimension to normalise over; required.
        _stacklevel: accepted for compatibility with ``F.softmax`` and ignored.
        dtype: as for ``F.softmax``.
        constraint: see :func:`scale_elementwise`.
        mult: positive multiplier applied to the logits.

    Returns:
        ``softmax(mult * input, dim)`` times the output scale.

    Raises:
        UnsupportedArgumentError: ``dim`` is None or ``mult`` not positive.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(softmax(torch.randn(1000, 256), dim=-1).std().item(), 1)
        1.0
    """
    if dim is None:
        raise UnsupportedArgumentError(
            "softmax", "dim", None, "pass the dimension to normalise over, e.g. dim=-1"
        )
    mult = check_mult("softmax", mult)
    length = input.shape[dim]
    if isinstance(length, torch.SymInt) or torch.compiler.is_dynamo_compiling():
        # A length that may vary under torch.compile (TorchDynamo shows a dynamic size to
        # isinstance as an int): the scales come from an op taking the symbolic length, as
        # 0-dim tensors, so one graph serves every length (a Python float would specialise
        # the graph to the length: a recompile per length).
        dtype_of_scales = torch.float64 if input.dtype == torch.float64 else torch.float32
        scales = softmax_scales(input.detach(), length, mult, dtype_of_scales)
        ideal: tuple[Any, Any] = (scales[0], scales[1])
    else:
        ideal = _softmax_scales(length, mult)
    out_scale, in_scale = apply_constraint(constraint, *ideal)
    if mult != 1.0:
        input = scale_fwd_bwd(input, mult, mult)  # a true gradient; in_scale includes 1/mult
    output = F.softmax(_prescale(input, in_scale, out_scale), dim, dtype=dtype)
    return _finish(output, out_scale, inplace=False)  # softmax's backward reads its output


def dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """Unit-scaled dropout (``F.dropout``).

    Scaling rule: ``F.dropout`` keeps an element with probability ``1 - p`` and divides it by
    ``1 - p``, so the output's mean square is ``E[x^2] / (1 - p)``; the gradient (same mask,
    same factor) likewise. Multiplying by ``sqrt(1 - p)`` makes both unit, with one shared
    factor, so no constraint is needed and the gradient is the true gradient. In eval mode
    (``training=False``) or with ``p = 0`` it is the identity.

    Args:
        input: the input, assumed unit-scaled.
        p: drop probability, ``0 <= p <= 1``.
        training: apply dropout only when True.
        inplace: must be False.

    Returns:
        ``dropout(input) * sqrt(1 - p)``.

    Raises:
        UnsupportedArgumentError: ``inplace=True`` or ``p`` outside [0, 1].

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(dropout(torch.randn(1000, 1000), p=0.2).std().item(), 2)
        1.0
    """
    _reject("dropout", "inplace", inplace, False, "use inplace=False")
    if not 0.0 <= p <= 1.0:
        raise UnsupportedArgumentError("dropout", "p", p, "use a probability 0 <= p <= 1")
    if not training or p == 0.0:
        return input
    return _finish(F.dropout(input, p, training), math.sqrt(1.0 - p))
