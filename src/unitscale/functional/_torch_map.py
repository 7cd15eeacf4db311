"""``torch_map``: what a captured graph calls -> the unit-scaled op."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._lazy_dynamo import when_dynamo_imported
from ..errors import UnsupportedArgumentError
from ._attention import scaled_dot_product_attention
from ._base import Constraint
from ._batch_hints import add as batch_hinted_add
from ._batch_hints import embedding as batch_hinted_embedding
from ._elementwise import dropout, gelu, silu, silu_glu, softmax
from ._loss import cross_entropy, mse_loss
from ._matmul import conv1d, embedding, linear, linear_readout, matmul
from ._norm import layer_norm, rms_norm
from ._residual import add, residual_add, residual_split

# --------------------------------------------------------------------------------------------
# torch_map: what a captured graph calls -> the unit-scaled op
# --------------------------------------------------------------------------------------------


def _torch_softmax(input: Tensor, dim: int, dtype: torch.dtype | None = None) -> Tensor:
    """``torch.softmax`` / ``Tensor.softmax`` take ``dtype`` third, ``F.softmax`` does not."""
    return softmax(input, dim, dtype=dtype)


def _addmm(
    input: Tensor,
    mat1: Tensor,
    mat2: Tensor,
    *,
    beta: float = 1,
    alpha: float = 1,
    constraint: Constraint = "to_output_scale",
) -> Tensor:
    """``torch.addmm(bias, x, w)`` as HF's ``Conv1D`` uses it: a linear with ``w.T`` weight."""
    if beta != 1:
        raise UnsupportedArgumentError("addmm", "beta", beta, "only beta=1 is supported")
    if alpha != 1:
        raise UnsupportedArgumentError("addmm", "alpha", alpha, "only alpha=1 is supported")
    return linear(mat1, mat2.t(), input, constraint=constraint)


torch_map: dict[Callable[..., Any], Callable[..., Any]] = {
    # activations
    F.gelu: gelu,
    F.silu: silu,
    F.softmax: softmax,
    torch.softmax: _torch_softmax,
    torch.Tensor.softmax: _torch_softmax,
    F.dropout: dropout,
    # matmul-like (F.linear is torch._C._nn.linear, what Dynamo records for nn.Linear;
    # F.conv1d is torch.conv1d)
    F.linear: linear,
    F.conv1d: conv1d,
    torch.matmul: matmul,
    torch.Tensor.matmul: matmul,
    operator.matmul: matmul,
    torch.bmm: matmul,
    torch.mm: matmul,
    torch.addmm: _addmm,
    # normalisation (nn.RMSNorm records torch.rms_norm)
    F.layer_norm: layer_norm,
    F.rms_norm: rms_norm,
    torch.rms_norm: rms_norm,
    # embedding, attention, losses
    F.embedding: embedding,
    F.scaled_dot_product_attention: scaled_dot_product_attention,
    F.cross_entropy: cross_entropy,
    F.mse_loss: mse_loss,
    # additions: U.add scales only float-tensor + float-tensor and is the plain add otherwise,
    # so it is safe for the adds that remain once residual adds have been found.
    torch.add: add,
    torch.Tensor.add: add,
    operator.add: add,
}
"""Maps each ``torch`` / ``torch.nn.functional`` function (and the ``torch.Tensor`` method or
``operator`` function a captured graph may call instead) to its unit-scaled equivalent,
which accepts the same arguments. Used by :func:`unitscale.transforms.unit_scale` on the
``call_function`` targets of a Dynamo graph; for a ``call_method`` node look up
``getattr(torch.Tensor, node.target)``.

Not included: residual adds (found by dependency analysis in ``unit_scale`` and replaced by
:func:`residual_split` / :func:`residual_add`), and ops whose scale is unchanged.
``operator.add``/``torch.add`` map to :func:`add`, which only scales the sum of two
floating-point tensors (as ``1/sqrt(2)`` for two same-shape independent unit tensors) and
is otherwise the plain addition, so sizes, integer tensors and ``x + 1`` are untouched.
Caveat: an additive mask (``scores + mask``) is scaled with the scores (masked entries stay
masked, the scores shrink by ``1/sqrt(2)``); prefer ``is_causal``/``masked_fill``.
"""


# Each unit-scaled op is one node in a TorchDynamo graph rather than the primitives it is
# made of: a tracked unit-scaled model then shows `linear`, `gelu`, ... at their unit-scaled
# output, not the internal scaling steps (whose gradients, before scaling, are not tensors a
# unit-scaled model would hold in low precision). Inductor still traces through them.
OPAQUE_OPS: tuple[Callable[..., Any], ...] = (
    dropout, gelu, silu, silu_glu, softmax, conv1d, linear, linear_readout, matmul, layer_norm,
    rms_norm, add, residual_add, residual_split, embedding, scaled_dot_product_attention,
    cross_entropy, mse_loss, _torch_softmax, _addmm, batch_hinted_add, batch_hinted_embedding,
)  # fmt: skip


def _allow_opaque_ops_in_graph() -> None:
    import torch._dynamo

    for op in OPAQUE_OPS:
        torch._dynamo.allow_in_graph(op)


# Registered when TorchDynamo is first imported (by torch.compile or a transform), so that
# `import unitscale` does not import Dynamo and Inductor (about a second).
when_dynamo_imported(_allow_opaque_ops_in_graph)
