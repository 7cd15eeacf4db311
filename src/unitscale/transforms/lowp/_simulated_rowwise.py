"""Simulated rowwise FP8 linear ops: torchao's ``"rowwise"`` and ``"rowwise_with_gw_hp"``
recipes for ``simulate_fp8(scaling=...)``.

The recipes (torchao 0.18, ``Float8LinearConfig.from_recipe_name`` in ``config.py`` and
``matmul_with_hp_or_float8_args`` in ``float8_linear.py``) scale each operand of each of a
linear op's three GEMMs along that GEMM's reduction dimension, so the same tensor is cast
twice, differently, for the forward and the backward:

- output ``y = x @ W.T``: ``x`` per row, ``W`` per row (both along ``in``);
- input gradient ``grad_x = grad_y @ W``: ``grad_y`` per row (along ``out``), ``W`` per
  column (along ``out``); ``"rowwise_with_gw_hp"``: ``W`` with one scale for the tensor;
- weight gradient ``grad_W = grad_y.T @ x``: ``grad_y`` and ``x`` per column (along the
  rows of the batch); ``"rowwise_with_gw_hp"``: in the model's precision, not cast.

Every tensor is cast to E4M3 (gradients included: torchao's rowwise recipes choose E4M3
for ``grad_output``), with ``scale = format_max / amax`` rounded down to a power of two
(``round_scales_to_power_of_2``), saturating. Each GEMM multiplies in FP32 and writes
bfloat16 for a float32 or float16 model (torchao's ``addmm_float8_unwrapped``: the rowwise
kernel has no float32 output; the power-of-two scales make scaling exact, so where the
inverse scales are applied does not matter), then the model's dtype. The bias is added
afterwards in the output's dtype. Tested bit for bit against
``torchao.float8.convert_to_float8_training`` on the CPU (outputs and every gradient,
float32 and bfloat16 models, 3-D inputs). A unit-scaled op's output factor multiplies the
FP32 accumulator (before the output's rounding), as ``to_fp8`` folds it into the GEMM's
scale; its weight-gradient factor multiplies the weight gradient afterwards.

Design constraints: tensor ops only (no host synchronisation), so that the ops compile; the
one scaled cast is :func:`~unitscale.transforms.lowp._scaling.scaled_cast`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from ... import functional as U
from ...formats import E4M3
from ...scale import scale_bwd
from ._ops import add_bias, addmm_weight
from ._scaling import scaled_cast

__all__ = [
    "RowwiseMatmul",
    "addmm",
    "convert",
    "linear",
    "unit_addmm",
    "unit_linear",
    "unit_linear_readout",
]

_E4M3 = dataclasses.replace(E4M3, rounding="nearest")
_FMAX = _E4M3.max_absolute_value


def _cast(x: Tensor, scaling: str, dim: int | None) -> Tensor:
    """``x`` as its GEMM sees it: rounded to E4M3 with power-of-two scales along ``dim``
    (None: one for the tensor), times the inverse scales, in FP32."""
    rounded, inverse = scaled_cast(x, _E4M3.quantise, _FMAX, scaling, dim=dim)
    assert inverse is not None  # scaled: a rowwise recipe
    return rounded.mul_(inverse)


def _gemm_output(product: Tensor, dtype: torch.dtype, factor: float = 1.0) -> Tensor:
    """The FP32 ``product`` (times a unit-scaled op's ``factor``) as the GEMM writes it:
    bfloat16 for a float32 or float16 result, then ``dtype``."""
    if not isinstance(factor, float) or factor != 1.0:
        product = product * factor
    written = torch.bfloat16 if dtype in (torch.float32, torch.float16) else dtype
    return product.to(written).to(dtype)


class RowwiseMatmul(torch.autograd.Function):
    """``y = output_factor * x @ W.T`` as torchao's rowwise recipes compute it (simulated);
    ``grad_W`` times ``weight_grad_factor``. Saves ``x`` and ``W`` in their precision (torchao
    casts them again, along other dimensions, in the backward)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        output_factor: float,
        weight_grad_factor: float,
        scaling: str,
    ) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, weight)
        ctx.config = (x.shape, output_factor, weight_grad_factor, scaling)
        product = _cast(rows, scaling, -1) @ _cast(weight, scaling, -1).t()
        out = _gemm_output(product, x.dtype, output_factor)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows, weight = ctx.saved_tensors
        x_shape, output_factor, weight_grad_factor, scaling = ctx.config
        g_rows = grad.reshape(-1, grad.shape[-1])
        high_precision_gw = scaling == "rowwise_with_gw_hp"
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            w_cast = _cast(weight, scaling, None if high_precision_gw else 0)
            product = _cast(g_rows, scaling, -1) @ w_cast
            grad_x = _gemm_output(product, rows.dtype, output_factor).reshape(x_shape)
        if ctx.needs_input_grad[1]:
            if high_precision_gw:
                grad_w = torch.mm(g_rows.t(), rows)
            else:
                product = _cast(g_rows, scaling, 0).t() @ _cast(rows, scaling, 0)
                grad_w = _gemm_output(product, weight.dtype)
            if not isinstance(weight_grad_factor, float) or weight_grad_factor != 1.0:
                grad_w = grad_w * weight_grad_factor
        return grad_x, grad_w, None, None, None


def _linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    factors: U.LinearFactors | None,
    scaling: str,
) -> Tensor:
    """Every op here: ``input @ weight.T + bias`` with rowwise scales; with a unit-scaled
    op's ``factors``, as :mod:`~._gemm` applies them."""
    if factors is None:
        out: Tensor = RowwiseMatmul.apply(input, weight, 1.0, 1.0, scaling)
        return add_bias(out, bias)
    input = scale_bwd(input, factors.input_grad)
    out = RowwiseMatmul.apply(input, weight, factors.output, factors.weight_grad, scaling)
    return add_bias(out, bias, factors.weight_grad)


def linear(
    input: Tensor, weight: Tensor, bias: Tensor | None = None, *, scaling: str = "rowwise"
) -> Tensor:
    """``F.linear`` with torchao's rowwise recipe ``scaling`` (simulated).

    Example:
        >>> w = torch.tensor([[1000.0, 0.3]])
        >>> linear(torch.ones(1, 2), w).item()  # W * 0.25 (a power of 2): 1000 -> 1024, and
        ...                                     # the bfloat16 output drops 0.3125
        1024.0
    """
    return _linear(input, weight, bias, None, scaling)


def addmm(
    input: Tensor,
    mat1: Tensor,
    mat2: Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
    scaling: str = "rowwise",
) -> Tensor:
    """``torch.addmm(bias, x, weight)`` (transformers' ``Conv1D``): :func:`linear` of
    ``(mat1, mat2.t(), input)``."""
    return _linear(
        mat1, addmm_weight("simulate_fp8: addmm", mat2, beta, alpha), input, None, scaling
    )


def unit_linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    constraint: U.Constraint = "to_output_scale",
    *,
    scaling: str = "rowwise",
) -> Tensor:
    """:func:`unitscale.functional.linear` with a rowwise recipe."""
    factors = U.linear_factors(input, weight, constraint)
    return _linear(input, weight, bias, factors, scaling)


def unit_linear_readout(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    constraint: U.Constraint = "to_grad_input_scale",
    *,
    mup: bool = True,
    scaling: str = "rowwise",
) -> Tensor:
    """:func:`unitscale.functional.linear_readout` with a rowwise recipe."""
    factors = U.linear_readout_factors(input, weight, constraint, mup=mup)
    return _linear(input, weight, bias, factors, scaling)


def unit_addmm(
    input: Tensor,
    mat1: Tensor,
    mat2: Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
    constraint: U.Constraint = "to_output_scale",
    scaling: str = "rowwise",
) -> Tensor:
    """``unit_scale``'s ``addmm`` (transformers' ``Conv1D``) with a rowwise recipe."""
    weight = addmm_weight("simulate_fp8: unit_addmm", mat2, beta, alpha)
    return unit_linear(mat1, weight, input, constraint, scaling=scaling)


_LINEAR = ("input", "weight", "bias")
_ADDMM = ("input", "mat1", "mat2")


def _table() -> dict[Any, tuple[Callable[..., Tensor], tuple[str, ...]]]:
    """Each linear op: its rowwise counterpart and its leading parameters' names."""
    return {
        F.linear: (linear, _LINEAR),
        U.linear: (unit_linear, (*_LINEAR, "constraint")),
        U.linear_readout: (unit_linear_readout, (*_LINEAR, "constraint")),
        torch.addmm: (addmm, _ADDMM),
        "addmm": (addmm, _ADDMM),  # bias.addmm(x, weight)
        U.torch_map[torch.addmm]: (unit_addmm, _ADDMM),
    }


def convert(node: fx.Node, scaling: str) -> bool:
    """Make the linear op ``node`` call its rowwise counterpart, with the same arguments
    and ``scaling``; False (``node`` untouched) for an op without one."""
    try:
        entry = _table().get(node.target)
    except TypeError:  # unhashable target
        entry = None
    if entry is None:
        return False
    target, params = entry
    bound = dict(zip(params, node.args, strict=False))
    bound.update(node.kwargs)
    node.op, node.target, node.args, node.kwargs = (
        "call_function",
        target,
        (),
        {
            **bound,
            "scaling": scaling,
        },
    )
    return True
