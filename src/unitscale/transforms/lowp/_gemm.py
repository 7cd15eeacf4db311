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
as in ``simulate_fp8`` of the unit-scaled op. (The CPU kernel multiplies each float8 operand
by its scale and runs an FP32 matmul, so there the scaled weight is the simulated op's
``factor * rounded weight``, bit for bit; cuBLAS applies the scales to the accumulator.)

Layout: ``_scaled_mm`` takes a row-major first and a column-major second operand; on CUDA the
trailing dimension of the first and both of the second must be multiples of 16. The rows of
``x`` (batch times sequence) are the contraction dimension of ``grad_W``: where they are not a
multiple of 16 off the CPU, both operands of that GEMM are padded with zero rows (exact).

Design constraints: only tensor ops and Python numbers inside (no host synchronisation, no
Python side effects), so that the ops run under ``torch.compile``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ... import functional as U
from ...formats import FormatError
from ...scale import scale_bwd
from ._fsdp import float8_weight
from ._ops import add_bias
from ._scaling import scaled_cast

__all__ = [
    "E4M3_DTYPE",
    "E5M2_DTYPE",
    "Float8Matmul",
    "addmm",
    "float8_build_error",
    "float8_device_error",
    "float8_shape_error",
    "linear",
    "unit_addmm",
    "unit_linear",
    "unit_linear_readout",
]

E4M3_DTYPE: Any = getattr(torch, "float8_e4m3fn", None)
E5M2_DTYPE: Any = getattr(torch, "float8_e5m2", None)
#: The oldest torch release ``to_fp8`` runs on (the one CI tests it on).
MIN_TORCH = (2, 13)
_FALLBACK = "use unitscale.transforms.simulate_fp8, which simulates the same numerics"


def float8_build_error() -> str | None:
    """What this torch build lacks for float8 GEMMs, or None."""
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if release < MIN_TORCH:
        # Tested from 2.13 on; torch 2.8's Inductor crashed (a segmentation fault) compiling
        # a float8 GEMM on the CPU, so older releases are refused rather than trusted.
        return (
            f"torch {torch.__version__} is older than {MIN_TORCH[0]}.{MIN_TORCH[1]}, the "
            "first release unitscale's real FP8 is tested on"
        )
    missing = []
    if not hasattr(torch, "_scaled_mm"):
        missing.append("torch._scaled_mm")
    if E4M3_DTYPE is None or E5M2_DTYPE is None:
        missing.append("the dtypes torch.float8_e4m3fn and torch.float8_e5m2")
    if not missing:
        return None
    return f"torch {torch.__version__} has no {' and no '.join(missing)}"


@functools.cache
def _trial(device: str) -> str | None:
    try:
        a = torch.ones(16, 16, device=device)
        one = torch.ones((), device=device)
        for first in (E4M3_DTYPE, E5M2_DTYPE):
            _scaled_mm(a.to(first), a.to(E4M3_DTYPE).t(), one, one, torch.float32)
    except Exception as error:  # any failure means: no float8 GEMM here
        return f"a float8 GEMM (torch._scaled_mm) fails on {device}: {error}".split("\n")[0]
    return None


def float8_device_error(device: torch.device | str) -> str | None:
    """Why float8 GEMMs cannot run on ``device`` (a tiny trial call, cached), or None."""
    build = float8_build_error()
    if build is not None:
        return build
    device = torch.device(device)
    if device.type == "meta":
        return None
    return _trial(str(device))


def check_float8(device: torch.device | str, op: str) -> None:
    """Raise :class:`FormatError` if float8 GEMMs cannot run on ``device``."""
    error = float8_device_error(device)
    if error is not None:
        raise FormatError(f"unitscale.transforms.{op}: {error}; {_FALLBACK} on any device")


def float8_shape_error(fan_in: int, fan_out: int, device: torch.device) -> str | None:
    """Why a weight of ``(fan_out, fan_in)`` cannot take part in float8 GEMMs on ``device``
    (the rows of the input may be any number: :func:`_pad_rows`)."""
    if device.type == "cpu":
        return None
    odd = [f"{name}={size}" for name, size in (("in", fan_in), ("out", fan_out)) if size % 16]
    if odd:
        return (
            f"{device.type} float8 GEMMs need the weight's dimensions to be multiples of "
            f"16 ({', '.join(odd)})"
        )
    return None


def _scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, dtype: Any) -> Tensor:
    """``(a @ b) * scale_a * scale_b`` from float8 ``a`` (row-major) and ``b`` (column-major)."""
    if hasattr(torch, "_scaled_mm"):
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=dtype)
    # F.scaled_mm (torch 2.13 and later), looked up by name: older releases lack it.
    scaling = getattr(F, "ScalingType").TensorWise  # noqa: B009
    out: Tensor = getattr(F, "scaled_mm")(  # noqa: B009
        a, b, scale_a, scaling, scale_b, scaling, output_dtype=dtype
    )
    return out


def _cast(
    x: Tensor, dtype: Any, scaling: str, history: Tensor | None, record: bool
) -> tuple[Tensor, Tensor | None]:
    """``x`` cast to float8 (saturated), and the inverse scale (None for ``"none"``)."""
    fmax = torch.finfo(dtype).max
    saturate = functools.partial(_saturate, dtype=dtype, fmax=fmax)
    return scaled_cast(x, saturate, fmax, scaling, history=history, record=record)


def _saturate(x: Tensor, dtype: Any, fmax: float) -> Tensor:
    return x.clamp(-fmax, fmax).to(dtype)


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


def _column_major(x: Tensor) -> Tensor:
    return x.t().contiguous().t()


def _pad_rows(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Pad the rows of ``(M, .)`` tensors with zeros to a multiple of 16 (off the CPU)."""
    rows = tensors[0].shape[0]
    if tensors[0].device.type == "cpu" or rows % 16 == 0:
        return tensors
    extra = 16 - rows % 16
    return tuple(torch.cat([t, t.new_zeros(extra, t.shape[1])]) for t in tensors)


class Float8Matmul(torch.autograd.Function):
    """``y = output_factor * x @ W.T`` as float8 GEMMs; ``grad_W`` times ``weight_grad_factor``.

    Arguments of :meth:`forward`: ``x (..., in)``, ``weight (out, in)``, the two factors
    (Python numbers), ``scaling``, the amax histories of ``x``, ``W`` and ``grad_y`` (for
    ``"delayed"``; None otherwise) and whether to update the histories (while autograd
    records, as ``simulate_fp8`` does: an evaluation forward only reads them). Saves ``x``
    and ``W`` as float8 tensors.
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
    ) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x8, x_inverse = _cast(rows.contiguous(), E4M3_DTYPE, scaling, x_history, record)
        # a weight FSDP2 gathered in float8 (._fsdp) is used as it arrived, not cast again
        gathered = float8_weight(weight)
        w8, w_inverse = gathered or _cast(
            weight.contiguous(), E4M3_DTYPE, scaling, weight_history, record
        )
        scale_a, scale_b = _gemm_scales(x_inverse, w_inverse, output_factor, x.device)
        out = _scaled_mm(x8, w8.t(), scale_a, scale_b, x.dtype)
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
        g_rows = grad.reshape(-1, grad.shape[-1]).contiguous()
        g8, g_inverse = _cast(g_rows, E5M2_DTYPE, scaling, grad_history, True)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            scale_a, scale_b = _gemm_scales(g_inverse, w_inverse, output_factor, grad.device)
            grad_x = _scaled_mm(g8, _column_major(w8), scale_a, scale_b, x_dtype)
            grad_x = grad_x.reshape(x_shape)
        if ctx.needs_input_grad[1]:
            g8_rows, x8_rows = _pad_rows(g8, x8)
            scale_a, scale_b = _gemm_scales(g_inverse, x_inverse, 1.0, grad.device)
            grad_w = _scaled_mm(
                g8_rows.t().contiguous(), _column_major(x8_rows), scale_a, scale_b, w_dtype
            )
            if not isinstance(weight_grad_factor, float) or weight_grad_factor != 1.0:
                # after the GEMM, as the unit-scaled op scales its weight's gradient (one
                # weight-sized multiply): the same numbers as simulate_fp8 of the op
                grad_w = grad_w * weight_grad_factor
        return grad_x, grad_w, None, None, None, None, None, None, None


Histories = tuple[Tensor | None, Tensor | None, Tensor | None]


def _matmul(
    x: Tensor,
    weight: Tensor,
    output_factor: float,
    weight_grad_factor: float,
    scaling: str,
    histories: Histories | None,
) -> Tensor:
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
    )
    return out


def _linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    factors: U.LinearFactors | None,
    scaling: str,
    histories: Histories | None,
) -> Tensor:
    """The one path of every op here: ``input @ weight.T + bias`` as float8 GEMMs; with the
    ``factors`` of a unit-scaled op, the output factor on the accumulator and the input- and
    weight-gradient factors where the op applies them."""
    if factors is None:
        return add_bias(_matmul(input, weight, 1.0, 1.0, scaling, histories), bias)
    out = _matmul(
        scale_bwd(input, factors.input_grad),
        weight,
        factors.output,
        factors.weight_grad,
        scaling,
        histories,
    )
    return add_bias(out, bias, factors.weight_grad)


def _addmm_weight(op: str, mat2: Tensor, beta: float, alpha: float) -> Tensor:
    """``addmm``'s second matrix as the linear op's weight (``mat2.t()``); ``beta`` and
    ``alpha`` other than 1 are refused (``to_fp8`` converts no other addmm)."""
    if beta != 1 or alpha != 1:
        raise FormatError(
            f"unitscale.transforms.{op}: beta={beta!r}, alpha={alpha!r} are not supported "
            "(only 1, as to_fp8 converts); scale the operands, or call torch.addmm"
        )
    return mat2.t()


def linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    scaling: str = "none",
    histories: Histories | None = None,
) -> Tensor:
    """``F.linear`` as float8 GEMMs (what ``to_fp8`` puts in place of ``F.linear``).

    Example:
        >>> w = torch.tensor([[1000.0, 0.3]])
        >>> linear(torch.ones(1, 2), w).item()  # 448 (E4M3's max) + 0.3125
        448.3125
    """
    return _linear(input, weight, bias, None, scaling, histories)


def addmm(
    input: Tensor,
    mat1: Tensor,
    mat2: Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
    scaling: str = "none",
    histories: Histories | None = None,
) -> Tensor:
    """``torch.addmm(bias, x, weight)`` (transformers' ``Conv1D``) as float8 GEMMs:
    :func:`linear` of ``(mat1, mat2.t(), input)``; ``beta`` and ``alpha`` must be 1."""
    weight = _addmm_weight("addmm", mat2, beta, alpha)
    return _linear(mat1, weight, input, None, scaling, histories)


def unit_linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    constraint: U.Constraint = "to_output_scale",
    *,
    scaling: str = "none",
    histories: Histories | None = None,
) -> Tensor:
    """:func:`unitscale.functional.linear` as float8 GEMMs."""
    factors = U.linear_factors(input, weight, constraint)
    return _linear(input, weight, bias, factors, scaling, histories)


def unit_linear_readout(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    constraint: U.Constraint = "to_grad_input_scale",
    *,
    mup: bool = True,
    scaling: str = "none",
    histories: Histories | None = None,
) -> Tensor:
    """:func:`unitscale.functional.linear_readout` as float8 GEMMs."""
    factors = U.linear_readout_factors(input, weight, constraint, mup=mup)
    return _linear(input, weight, bias, factors, scaling, histories)


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
) -> Tensor:
    """The unit-scaled ``addmm`` of ``unit_scale`` (:func:`unit_linear` of ``(mat1,
    mat2.t(), input)``) as float8 GEMMs; ``beta`` and ``alpha`` must be 1."""
    weight = _addmm_weight("unit_addmm", mat2, beta, alpha)
    return unit_linear(mat1, weight, input, constraint, scaling=scaling, histories=histories)
