"""Unit-scaled ops: drop-in counterparts of ``torch.nn.functional``, imported as ``U``.

``import unitscale.functional as U``. Each op multiplies its output and its inputs'
gradients by factors chosen so that, for i.i.d. N(0, 1) inputs and incoming gradient, the
output and every input gradient have unit standard deviation at initialisation; each
docstring states the assumptions, the factors and what the default constraint does.

This package is a facade: one private file per op family, each built from
:mod:`unitscale.scale` and :mod:`unitscale.constraints` (the recipe is described in
``_base.py``):

- ``_base``: the helpers every op uses (pre-scale, finish, argument checks);
- ``_moments``: the softmax moments the softmax, attention and loss scales rest on;
- ``_elementwise``: scale_elementwise, gelu, silu, silu_glu, softmax, dropout;
- ``_attention``: scaled_dot_product_attention, and attention with an explicit mask (read
  from the mask's key counts);
- ``_loss``: cross_entropy, mse_loss;
- ``_nonlinear``: re-exports of the above, where they used to live;
- ``_matmul``: matmul, linear, linear_readout, conv1d, embedding;
- ``_norm``: layer_norm, rms_norm;
- ``_residual``: add and the residual scheme; ``_residual_rule``: u-muP's depth rule for tau;
- ``_mult``: moments of the nonlinearities at a given ``mult``;
- ``_torch_map``: ``torch_map`` and the ops kept opaque to TorchDynamo.
"""

from ._attention import (
    masked_scaled_dot_product_attention,
    rotary_embedding,
    scaled_dot_product_attention,
)
from ._base import Constraint
from ._batch_hints import add as batch_hinted_add
from ._batch_hints import embedding as batch_hinted_embedding
from ._elementwise import dropout, gelu, scale_elementwise, silu, silu_glu, softmax
from ._loss import cross_entropy, mse_loss
from ._matmul import (
    LinearFactors,
    conv1d,
    embedding,
    linear,
    linear_factors,
    linear_readout,
    linear_readout_factors,
    matmul,
)
from ._mult import check_mult as check_mult  # argument check shared with the modules
from ._norm import layer_norm, rms_norm
from ._residual import add, residual_add, residual_split
from ._residual import residual_share as residual_share  # helpers for modules and transforms
from ._residual import share_to_tau as share_to_tau
from ._residual_rule import DEPTH_RULES as DEPTH_RULES
from ._residual_rule import check_depth_rule as check_depth_rule
from ._residual_rule import depth_divisor as depth_divisor
from ._residual_rule import rule_shares as rule_shares
from ._residual_rule import transformer_residual_scaling_rule
from ._torch_map import OPAQUE_OPS, torch_map

__all__ = [  # noqa: RUF022 (grouped by kind)
    # elementwise
    "dropout",
    "gelu",
    "scale_elementwise",
    "silu",
    "silu_glu",
    "softmax",
    # matmul-like
    "conv1d",
    "linear",
    "linear_readout",
    "matmul",
    "LinearFactors",
    "linear_factors",
    "linear_readout_factors",
    # normalisation
    "layer_norm",
    "rms_norm",
    # addition and residuals
    "add",
    "residual_add",
    "residual_split",
    "transformer_residual_scaling_rule",
    # embedding and attention
    "embedding",
    "masked_scaled_dot_product_attention",
    "rotary_embedding",
    "scaled_dot_product_attention",
    # losses
    "cross_entropy",
    "mse_loss",
    # graph transform support
    "OPAQUE_OPS",
    "torch_map",
    "batch_hinted_add",
    "batch_hinted_embedding",
    # types
    "Constraint",
]
