"""Float8 GEMMs for ``to_fp8``: one autograd function, and the linear ops built from it.

:class:`Float8Matmul` computes ``y = x @ W.T`` as PyTorch's float8 GEMM (``torch._scaled_mm``):
forward ``x(E4M3) @ W(E4M3)``; backward ``grad_x = grad_y(E5M2) @ W(E4M3)`` and ``grad_W =
grad_y(E5M2).T @ x(E4M3)``, each accumulated in FP32 and written in the input's dtype (the
weight's for ``grad_W``). It saves for the backward the float8 tensors (one byte an element)
and their scalar scales, never a high-precision copy. Casts saturate (values beyond a format's
largest become it; NaN stays NaN), as ``unitscale.formats.E4M3.quantise`` does and as torchao's
``to_fp8_saturated`` does, so that on the CPU the result equals rounding the operands with
``E4M3``/``E5M2`` (rounded to nearest) and multiplying them in FP32.

Scales (rules in :mod:`unitscale.transforms.lowp._scaling`, shared with ``simulate_fp8``):
``"none"`` casts as is (scale 1: no amax is computed), ``"tensorwise"`` multiplies each
operand by ``format_max / amax`` before its cast and hands the inverse scales to
``_scaled_mm`` (torchao's ``addmm_float8_unwrapped`` does exactly this), ``"delayed"`` takes
``amax`` from an amax history. A unit-scaled op's output factor is folded into
``_scaled_mm``'s second scale, outside the rounding: the operands rounded are the op's own,
as in ``simulate_fp8`` of the unit-scaled op. (torch's emulated CPU kernel multiplies each
float8 operand by its scale and runs an FP32 matmul, oneDNN's scales each product, cuBLAS
the accumulator: docs/guide/fp8-real.rst says what each gives.)

Every GEMM goes through :func:`~._scaled_mm.padded_mm`: CUDA's layouts and alignment (its
rules checked on every device, the CPU included), the inner dimension and the output
columns padded with zeros to multiples of 16 (exact), so that a linear op of any shape
converts. The forward GEMM may use cuBLAS's fast float8 accumulation (``fast_accum``,
torchao's default); the backward's never do.

Under ``torch.autocast``, as torchao's ``Float8Linear``: the input is cast to autocast's
dtype, the weight is cast to float8 from its own dtype, the output is written in autocast's
dtype (the weight gradient too, then cast to the weight's dtype, as autocast's cast of the
weight would give it). Rowwise recipes run in :mod:`~._rowwise`.

Design constraints: only tensor ops and Python numbers inside (no host synchronisation, no
Python side effects), so that the ops run under ``torch.compile``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from ... import functional as U
from ...scale import scale_bwd
from ._fsdp import float8_weight
from ._ops import add_bias, addmm_weight
from ._rowwise import ROWWISE, rowwise_matmul
from ._scaled_mm import (
    E4M3_DTYPE,
    E5M2_DTYPE,
    check_float8,
    float8_build_error,
    float8_device_error,
    padded_mm,
)
from ._scaling import saturate_to, scaled_cast

__all__ = [
    "E4M3_DTYPE",
    "E5M2_DTYPE",
    "Float8Matmul",
    "addmm",
    "check_float8",
    "float8_build_error",
    "float8_device_error",
    "linear",
    "unit_addmm",
    "unit_linear",
    "unit_linear_readout",
]


def _cast(
    x: Tensor, dtype: Any, scaling: str, history: Tensor | None, record: bool
) -> tuple[Tensor, Tensor | None]:
    """``x`` cast to float8 (saturated), and the inverse scale (None for ``"none"``)."""
    fmax = torch.finfo(dtype).max
    saturate = functools.partial(saturate_to, dtype=dtype, fmax=fmax)
    return scaled_cast(x, saturate, fmax, scaling, history=history, record=record)


def _gemm_scales(
    first: Tensor | None, second: Tensor | None, factor: float, device: torch.device
) -> tuple[Tensor, Tensor]:
    """The two scale tensors of one GEMM: the operands' inverse scales (1 without), the
    second times ``factor`` (a unit-scaled op's factor on the accumulator)."""
    one = torch.ones((), device=device)
    scale_a = one if first is None else first
    scale_b = one if second is None else second
    if not isinstance(factor, float) or factor != 1.0:
        scale_b = scale_b * factor
    return scale_a, scale_b


class Float8Matmul(torch.autograd.Function):
    """``y = output_factor * x @ W.T`` as float8 GEMMs; ``grad_W`` times ``weight_grad_factor``.

    Arguments of :meth:`forward`: ``x (..., in)``, ``weight (out, in)``, the two factors
    (Python numbers), ``scaling``, the amax histories of ``x``, ``W`` and ``grad_y`` (for
    ``"delayed"``; None otherwise), whether to update the histories (while autograd
    records, as ``simulate_fp8`` does: an evaluation forward only reads them) and whether
    the forward GEMM accumulates fast. Saves ``x`` and ``W`` as float8 tensors. The output
    and ``grad_x`` are written in ``x``'s dtype, ``grad_W`` in ``x``'s dtype and then cast
    to ``W``'s (the same where they agree; autocast's where they do not).
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        output_factor: float,
        weight_grad_factor: float,
        scaling: str,
        x_history: Tensor | None,
        weight_history: Tensor | None,
        grad_history: Tensor | None,
        record: bool,
        fast_accum: bool = False,
    ) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x8, x_inverse = _cast(rows, E4M3_DTYPE, scaling, x_history, record)
        # a weight FSDP2 gathered in float8 (._fsdp) is used as it arrived, not cast again
        gathered = float8_weight(weight)
        w8, w_inverse = gathered or _cast(weight, E4M3_DTYPE, scaling, weight_history, record)
        scale_a, scale_b = _gemm_scales(x_inverse, w_inverse, output_factor, x.device)
        out = padded_mm(x8, w8.t(), scale_a, scale_b, x.dtype, fast_accum)
        saved = [x8, w8] + [s for s in (x_inverse, w_inverse) if s is not None]
        ctx.save_for_backward(*saved)
        ctx.config = (x.shape, x.dtype, weight.dtype, output_factor, weight_grad_factor)
        ctx.scaling = (scaling, grad_history)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x8, w8, *inverses = ctx.saved_tensors
        x_inverse, w_inverse = inverses if inverses else (None, None)
        x_shape, x_dtype, w_dtype, output_factor, weight_grad_factor = ctx.config
        scaling, grad_history = ctx.scaling
        g_rows = grad.reshape(-1, grad.shape[-1])
        g8, g_inverse = _cast(g_rows, E5M2_DTYPE, scaling, grad_history, True)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            scale_a, scale_b = _gemm_scales(g_inverse, w_inverse, output_factor, grad.device)
            grad_x = padded_mm(g8, w8, scale_a, scale_b, x_dtype).reshape(x_shape)
        if ctx.needs_input_grad[1]:
            scale_a, scale_b = _gemm_scales(g_inverse, x_inverse, 1.0, grad.device)
            grad_w = padded_mm(g8.t(), x8, scale_a, scale_b, x_dtype).to(w_dtype)
            if not isinstance(weight_grad_factor, float) or weight_grad_factor != 1.0:
                # after the GEMM, as the unit-scaled op scales its weight's gradient (one
                # weight-sized multiply): the same numbers as simulate_fp8 of the op
                grad_w = grad_w * weight_grad_factor
        return grad_x, grad_w, None, None, None, None, None, None, None, None


Histories = tuple[Tensor | None, Tensor | None, Tensor | None]


def autocast_input(x: Tensor) -> Tensor:
    """``x`` in ``torch.autocast``'s dtype where autocast is on for its device (as torchao's
    ``Float8Linear`` casts its input), else ``x``."""
    kind = x.device.type
    if kind in ("cpu", "cuda") and torch.is_autocast_enabled(kind) and x.is_floating_point():
        return x.to(torch.get_autocast_dtype(kind))
    return x


def _matmul(
    x: Tensor,
    weight: Tensor,
    output_factor: float,
    weight_grad_factor: float,
    scaling: str,
    histories: Histories | None,
    fast_accum: bool,
) -> Tensor:
    x = autocast_input(x)
    if scaling in ROWWISE:
        return rowwise_matmul(x, weight, output_factor, weight_grad_factor, scaling, fast_accum)
    x_history, w_history, g_history = histories or (None, None, None)
    record = torch.is_grad_enabled()  # inside the Function's forward it never is
    out: Tensor = Float8Matmul.apply(
        x,
        weight,
        output_factor,
        weight_grad_factor,
        scaling,
        x_history,
        w_history,
        g_history,
        record,
        fast_accum,
    )
    return out


def _linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    factors: U.LinearFactors | None,
    scaling: str,
    histories: Histories | None,
    fast_accum: bool,
) -> Tensor:
    """The one path of every op here: ``input @ weight.T + bias`` as float8 GEMMs; with the
    ``factors`` of a unit-scaled op, the output factor on the accumulator and the input- and
    weight-gradient factors where the op applies them."""
    if factors is None:
        out = _matmul(input, weight, 1.0, 1.0, scaling, histories, fast_accum)
        return add_bias(out, bias)
    out = _matmul(
        scale_bwd(input, factors.input_grad),
        weight,
        factors.output,
        factors.weight_grad,
        scaling,
        histories,
        fast_accum,
    )
    return add_bias(out, bias, factors.weight_grad)


def linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    scaling: str = "none",
    histories: Histories | None = None,
    fast_accum: bool = True,
) -> Tensor:
    """``F.linear`` as float8 GEMMs (what ``to_fp8`` puts in place of ``F.linear``).

    Example:
        >>> w = torch.tensor([[1000.0, 0.3]])
        >>> linear(torch.ones(1, 2), w).item()  # 448 (E4M3's max) + 0.3125
        448.3125
    """
    return _linear(input, weight, bias, None, scaling, histories, fast_accum)


def addmm(
    input: Tensor,
    mat1: Tensor,
    mat2: Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
    scaling: str = "none",
    histories: Histories | None = None,
    fast_accum: bool = True,
) -> Tensor:
    """``torch.addmm(bias, x, weight)`` (transformers' ``Conv1D``) as float8 GEMMs:
    :func:`linear` of ``(mat1, mat2.t(), input)``; ``beta`` and ``alpha`` must be 1."""
    weight = addmm_weight("addmm", mat2, beta, alpha)
    return _linear(mat1, weight, input, None, scaling, histories, fast_accum)


def unit_linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    constraint: U.Constraint = "to_output_scale",
    *,
    scaling: str = "none",
    histories: Histories | None = None,
    fast_accum: bool = True,
) -> Tensor:
    """:func:`unitscale.functional.linear` as float8 GEMMs."""
    factors = U.linear_factors(input, weight, constraint)
    return _linear(input, weight, bias, factors, scaling, histories, fast_accum)


def unit_linear_readout(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    constraint: U.Constraint = "to_grad_input_scale",
    *,
    mup: bool = True,
    scaling: str = "none",
    histories: Histories | None = None,
    fast_accum: bool = True,
) -> Tensor:
    """:func:`unitscale.functional.linear_readout` as float8 GEMMs."""
    factors = U.linear_readout_factors(input, weight, constraint, mup=mup)
    return _linear(input, weight, bias, factors, scaling, histories, fast_accum)


def unit_addmm(
    input: Tensor,
    mat1: Tensor,
    mat2: Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
    constraint: U.Constraint = "to_output_scale",
    scaling: str = "none",
    histories: Histories | None = None,
    fast_accum: bool = True,
) -> Tensor:
    """The unit-scaled ``addmm`` of ``unit_scale`` (:func:`unit_linear` of ``(mat1,
    mat2.t(), input)``) as float8 GEMMs; ``beta`` and ``alpha`` must be 1."""
    weight = addmm_weight("unit_addmm", mat2, beta, alpha)
    return unit_linear(
        mat1, weight, input, constraint, scaling=scaling, histories=histories, fast_accum=fast_accum
    )
