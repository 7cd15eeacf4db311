"""torchao's rowwise float8 recipes for ``to_fp8``: ``scaling="rowwise"`` and
``"rowwise_with_gw_hp"``.

The numerics of torchao's ``Float8Linear`` with ``Float8LinearConfig.from_recipe_name``
(``torchao/float8/config.py``, ``float8_linear.py``, ``float8_ops.py``), GEMM by GEMM:

- every cast is E4M3 (the output gradient too), saturated, with a scale per row or column
  ``2**floor(log2(448 / amax))`` (torchao's ``round_scales_to_power_of_2``), amax over the
  row or column in the operand's dtype;
- forward ``y = x @ W.T``: ``x`` scaled per row, ``W`` per output feature, ``_scaled_mm``
  with those scales (fast accumulation as configured);
- ``grad_x = grad_y @ W``: ``grad_y`` per row, ``W`` per input feature (``"rowwise"``) or
  one scale (``"rowwise_with_gw_hp"``, repeated along the row as torchao does);
- ``grad_W = grad_y.T @ x``: ``grad_y`` per column, ``x`` per column (``"rowwise"``), or in
  high precision, ``grad_y.T @ x`` unrounded (``"rowwise_with_gw_hp"``);
- a GEMM with rowwise scales writes bfloat16 (CUDA's rowwise kernel writes nothing else):
  for a float32 or float16 operand the result is written in bfloat16 and then cast, as
  torchao does; without fast accumulation (the backward) the GEMM runs with unit scales
  and the bfloat16 result is multiplied by the outer product of the inverse scales.

The backward casts from the high-precision ``x`` and ``W`` (each GEMM scales along its own
axis), so they are saved as they are, as torchao saves them. A unit-scaled op's factors
multiply the results (``y`` and ``grad_x`` by the output factor, ``grad_W`` by the
weight-gradient factor), 1 for a plain linear op.

Design constraints: tensor ops only (no host synchronisation), as in :mod:`._gemm`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from ._scaled_mm import E4M3_DTYPE, padded_mm
from ._scaling import saturate_to, scaled_cast

__all__ = ["ROWWISE", "RowwiseMatmul", "rowwise_matmul"]

#: The rowwise recipes' names (``scaling=`` of ``to_fp8``).
ROWWISE = ("rowwise", "rowwise_with_gw_hp")


def _cast(x: Tensor, dim: int | None) -> tuple[Tensor, Tensor]:
    """``x`` in E4M3 scaled along ``dim`` (amax over ``dim``, kept; None: one scale), and
    the inverse scale, a power of two: the one scaled cast (:func:`~._scaling.scaled_cast`)."""
    fmax = torch.finfo(E4M3_DTYPE).max
    saturate = functools.partial(saturate_to, dtype=E4M3_DTYPE, fmax=fmax)
    x8, inverse = scaled_cast(x, saturate, fmax, "rowwise", dim=dim)
    assert inverse is not None  # rowwise scaling always scales
    return x8, inverse


def _mm(a: Tensor, a_inverse: Tensor, b: Tensor, b_inverse: Tensor, out: Any, fast: bool) -> Tensor:
    """torchao's ``addmm_float8_unwrapped`` of rowwise-scaled ``a (M, K)`` (inverse scales
    ``(M, 1)``) and ``b (K, N)`` (inverse scales ``(1, N)``), written in ``out``."""
    post = None
    if not fast:
        post = a_inverse * b_inverse
        a_inverse = b_inverse = a_inverse.new_ones(())
    written = torch.bfloat16 if out in (torch.float16, torch.float32) else out
    result = padded_mm(a, b, a_inverse, b_inverse, written, fast)
    if post is not None:
        result *= post
    return result.to(out)


def _times(x: Tensor, factor: float) -> Tensor:
    return x if isinstance(factor, float) and factor == 1.0 else x * factor


class RowwiseMatmul(torch.autograd.Function):
    """``y = output_factor * x @ W.T`` by torchao's rowwise recipe ``recipe``; ``grad_W``
    times ``weight_grad_factor``. Saves ``x`` and ``W`` in high precision."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        output_factor: float,
        weight_grad_factor: float,
        recipe: str,
        fast_accum: bool,
    ) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x8, x_scale = _cast(rows, -1)
        w8, w_scale = _cast(weight.t(), 0)
        out = _mm(x8, x_scale, w8, w_scale, x.dtype, fast_accum)
        ctx.save_for_backward(rows, weight)
        ctx.config = (x.shape, output_factor, weight_grad_factor, recipe)
        return _times(out, output_factor).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows, weight = ctx.saved_tensors
        x_shape, output_factor, weight_grad_factor, recipe = ctx.config
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g8, g_scale = _cast(g, -1)
            if recipe == "rowwise":
                w8, w_scale = _cast(weight.t(), -1)  # (in, 1)
                w_scale = w_scale.t()
            else:
                w8, w_scale = _cast(weight.t(), None)
                w_scale = w_scale.repeat(weight.shape[1]).reshape(1, -1)
            grad_x = _mm(g8, g_scale, w8.t(), w_scale, g.dtype, False)
            grad_x = _times(grad_x, output_factor).reshape(x_shape)
        if ctx.needs_input_grad[1]:
            if recipe == "rowwise":
                g8, g_scale = _cast(g, 0)  # (1, out)
                x8, x_scale = _cast(rows, 0)  # (1, in)
                grad_w = _mm(g8.t(), g_scale.t(), x8, x_scale, g.dtype, False)
            else:
                grad_w = g.t() @ rows.to(g.dtype)
            grad_w = _times(grad_w.to(weight.dtype), weight_grad_factor)
        return grad_x, grad_w, None, None, None, None


def rowwise_matmul(
    x: Tensor,
    weight: Tensor,
    output_factor: float,
    weight_grad_factor: float,
    recipe: str,
    fast_accum: bool,
) -> Tensor:
    """:class:`RowwiseMatmul` of ``x (..., in)`` and ``weight (out, in)``."""
    out: Tensor = RowwiseMatmul.apply(
        x, weight, output_factor, weight_grad_factor, recipe, fast_accum
    )
    return out
