"""Unit-scaled ops told which of their operands the data-parallel batch runs through.

From shapes alone :func:`unitscale.functional.add` and :func:`unitscale.functional.embedding`
cannot tell a shared tensor that keeps a leading dimension of 1 (Hugging Face's ``(1, T)``
position ids, a ``(1, T, D)`` position embedding) from one example of a local batch of 1
(see :mod:`unitscale.data_parallel`). :func:`~unitscale.transforms.unit_scale` can: in the
captured graph a value computed from the model's inputs carries the batch, one computed from
parameters, buffers and constants alone does not. It calls these instead of ``U.add`` and
``U.embedding`` where that makes a difference. They keep the public ops' names, so that
tracked graphs and reports read the same.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._base import Constraint
from ._matmul import check_embedding_args, scaled_embedding
from ._residual import scaled_add

__all__ = ["add", "embedding"]


def add(
    input: Any,
    other: Any,
    alpha: float = 1,
    constraint: Constraint = "to_output_scale",
    *,
    shared: tuple[bool, bool] = (False, False),
) -> Any:
    """:func:`unitscale.functional.add` with ``shared[i]`` True for an operand computed from
    parameters and constants alone (shared by every example), whatever its shape."""
    return scaled_add(input, other, alpha, constraint, shared)


def embedding(
    input: Tensor,
    weight: Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    """:func:`unitscale.functional.embedding` of ids computed from parameters and constants
    alone (position ids): shared by every example, whatever their shape."""
    check_embedding_args(max_norm, norm_type, scale_grad_by_freq, sparse)
    return scaled_embedding(input, weight, padding_idx, False)
