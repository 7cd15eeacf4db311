"""The native rounding kernels as ``torch.library`` custom ops, for compiled code on a CPU.

``torch.compile`` of a quantisation used to trace the bit-manipulation path, which Inductor
fuses into one loop, but whose cost depends on what TorchDynamo makes of the format: a
function compiled once per format gets a kernel specialised to it, while one function that
sees several formats (``torch.compile(fmt.quantise)`` for E4M3 and E5M2 in one process, as
an FP8 simulation uses them) is recompiled with the format's numbers made symbolic, and the
stochastic loop hashes its random bits element by element: 1.4x to 2.6x a clone at best.
These ops hand a CPU tensor to the one-pass C kernels of :mod:`._native` instead (one read,
one write: what a clone costs) whatever Dynamo does with the numbers, which reach the op as
its arguments. Each has a fake implementation (shapes for tracing) and an autograd formula
(none: rounding is flat almost everywhere, as for :meth:`FPFormat.quantise`), so it can be
used inside any compiled graph. The results are bit for bit those of the eager kernels (the
same C code), hence of the PyTorch path for rounding to nearest, and of the hashed random
bits for the same seeds.

Design constraints: the kernels are only used where they take the tensor (CPU, float32 for
rounding to nearest; float32, float16 or bfloat16 for stochastic rounding) and where the C
kernel is built; the caller checks :func:`native_available` (a constant while compiling)
first. Other devices keep the traced path, which Inductor fuses into its own kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.library import custom_op

from .._lazy_dynamo import assume_constant_result
from ._native import rounding

__all__ = ["native_available", "round_nearest", "round_stochastic"]


@assume_constant_result
def native_available() -> bool:
    """Whether the C rounding kernels are built (building them on the first call)."""
    return rounding.available()


@custom_op("unitscale::round_nearest", mutates_args=())
def round_nearest(x: Tensor, drop: int, bound: float, min_normal_exponent: int) -> Tensor:
    """``x`` (float32, CPU, any layout) rounded to nearest, ties to even, at ``drop`` fewer
    mantissa bits than float32's, saturating at ``±bound``, subnormal below
    ``2**min_normal_exponent``: :meth:`NativeRounding.nearest` as an op."""
    return rounding.nearest(x.contiguous(), drop, bound, min_normal_exponent)


@round_nearest.register_fake
def _round_nearest_fake(x: Tensor, drop: int, bound: float, min_normal_exponent: int) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@custom_op("unitscale::round_stochastic", mutates_args=())
def round_stochastic(
    x: Tensor, drop: int, bound: float, min_normal_exponent: int, seeds: Tensor
) -> Tensor:
    """``x`` (float32, float16 or bfloat16, CPU, any layout) rounded stochastically at
    ``drop`` (1..23) fewer mantissa bits than float32's, with random bits hashed from the two
    int32 ``seeds``: :meth:`NativeRounding.stochastic` as an op, in ``x``'s dtype."""
    x32 = x.to(torch.float32).contiguous()
    return rounding.stochastic(x32, drop, bound, min_normal_exponent, seeds).to(x.dtype)


@round_stochastic.register_fake
def _round_stochastic_fake(
    x: Tensor, drop: int, bound: float, min_normal_exponent: int, seeds: Tensor
) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _no_gradient(ctx: Any, grad: Tensor) -> tuple[None, ...]:
    """Rounding is flat almost everywhere: no gradient (``quantise_fwd`` adds its own)."""
    return None, None, None, None


def _no_gradient_stochastic(ctx: Any, grad: Tensor) -> tuple[None, ...]:
    return None, None, None, None, None


round_nearest.register_autograd(_no_gradient)
round_stochastic.register_autograd(_no_gradient_stochastic)
