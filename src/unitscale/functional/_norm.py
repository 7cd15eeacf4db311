"""Unit-scaled normalisation: layer_norm, rms_norm."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..scale import scale_bwd
from ._shared import shared_rsqrt

# --------------------------------------------------------------------------------------------
# normalisation
# --------------------------------------------------------------------------------------------


def _norm_param_scale(input: Tensor, normalized_shape: Any) -> float:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    batched = input.dim() > len(shape)
    return shared_rsqrt(input.numel() // max(math.prod(shape), 1), batched)


def layer_norm(
    input: Tensor,
    normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Unit-scaled layer norm (``F.layer_norm``).

    Scaling rule: the normalised output has unit std per row by construction (with the
    weight at its initial 1 and bias 0), so no forward factor. The input gradient
    ``(g - mean(g) - x̂ mean(g x̂)) / σ`` has std ``sqrt(1 - 2/n) / σ``: unit for a unit
    input (``σ = 1``) up to ``O(1/n)``, so no factor and no constraint: the input gradient is
    the true gradient. The weight and bias gradients sum over the ``batch`` rows
    (``input.numel() / prod(normalized_shape)``) and are scaled by ``1/sqrt(batch)``, which
    assumes the rows' incoming gradients are independent. A norm in front of attention
    breaks that: attention averages rows, so the gradient of a shift shared by all rows
    adds up instead of cancelling, and those weight and bias gradients come out larger
    (about 2x for 128 causal positions). Under data parallelism and gradient accumulation
    ``batch`` is the whole step's batch and the factor is multiplied by the data-parallel
    size (:mod:`unitscale.data_parallel`).

    Args:
        input: the input; unit-scaled rows give unit input gradients.
        normalized_shape: trailing shape to normalise over.
        weight: optional elementwise scale (initialise to ones).
        bias: optional elementwise shift (initialise to zeros).
        eps: as for ``F.layer_norm``.

    Returns:
        The normalised input, same shape.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(layer_norm(3 * torch.randn(64, 512), (512,)).std().item(), 2)
        1.0
    """
    param_scale = _norm_param_scale(input, normalized_shape)
    if weight is not None:
        weight = scale_bwd(weight, param_scale)
    if bias is not None:
        bias = scale_bwd(bias, param_scale)
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    return F.layer_norm(input, shape, weight, bias, eps)


def rms_norm(
    input: Tensor,
    normalized_shape: int | list[int] | tuple[int, ...] | torch.Size,
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    """Unit-scaled RMS norm (``F.rms_norm``).

    Scaling rule: the output has unit rms per row by construction (weight at its initial
    1), so no forward factor; the input gradient ``(g - x̂ mean(g x̂)) / rms(x)`` has std
    ``sqrt(1 - 1/n)`` for a unit input, so no factor and no constraint (true gradient). The
    weight gradient sums over the ``batch`` rows and is scaled by ``1/sqrt(batch)``.

    Args:
        input: the input; unit-scaled rows give unit input gradients.
        normalized_shape: trailing shape to normalise over.
        weight: optional elementwise scale (initialise to ones).
        eps: as for ``F.rms_norm``.

    Returns:
        The normalised input, same shape.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(rms_norm(0.1 * torch.randn(64, 512), (512,)).std().item(), 2)
        1.0
    """
    if weight is not None:
        weight = scale_bwd(weight, _norm_param_scale(input, normalized_shape))
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    return F.rms_norm(input, shape, weight, eps)
