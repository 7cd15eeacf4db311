"""Where the ops of ``_base``, ``_moments``, ``_elementwise``, ``_attention`` and ``_loss``
used to live: re-exported so that imports of ``unitscale.functional._nonlinear`` keep working.

New code imports from the file of the op's family (see the package docstring).
"""

from __future__ import annotations

from ._attention import scaled_dot_product_attention
from ._base import (
    Constraint,
    _finish,
    _is_float_tensor,
    _prescale,
    _reject,
    _rsqrt,
    _single,
    _specialised_int,
)
from ._elementwise import (
    _GELU_GRAD_RMS,
    _GELU_STD,
    _SILU_GRAD_RMS,
    _SILU_RMS,
    _SILU_STD,
    _elementwise,
    dropout,
    gelu,
    scale_elementwise,
    silu,
    silu_glu,
    softmax,
)
from ._loss import _check_reduction, cross_entropy, mse_loss
from ._moments import (
    _attention_moments,
    _softmax_moment_table,
    _softmax_moments,
    _softmax_scales,
)

__all__ = [
    "_GELU_GRAD_RMS",
    "_GELU_STD",
    "_SILU_GRAD_RMS",
    "_SILU_RMS",
    "_SILU_STD",
    "Constraint",
    "_attention_moments",
    "_check_reduction",
    "_elementwise",
    "_finish",
    "_is_float_tensor",
    "_prescale",
    "_reject",
    "_rsqrt",
    "_single",
    "_softmax_moment_table",
    "_softmax_moments",
    "_softmax_scales",
    "_specialised_int",
    "cross_entropy",
    "dropout",
    "gelu",
    "mse_loss",
    "scale_elementwise",
    "scaled_dot_product_attention",
    "silu",
    "silu_glu",
    "softmax",
]
