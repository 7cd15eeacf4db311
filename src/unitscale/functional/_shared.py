"""Gradient factors of tensors shared by every example of a data-parallel batch.

See :mod:`unitscale.data_parallel` for the semantics: dimension 0 of an op's batched operand
is the sharded dimension; a tensor broadcast along it is shared by the ranks, whose averaged
gradient must equal one process's on the concatenated batch. So a shared tensor's gradient
factor uses the global count (``size x local``) and is multiplied by ``size``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..data_parallel import data_parallel_size
from ._base import _rsqrt


def shared_size(sums_over_batch: bool) -> int:
    """The factor a shared tensor's count and gradient take: the data-parallel size when
    its gradient sums over the sharded dimension, else 1 (no call into torch.distributed)."""
    return data_parallel_size() if sums_over_batch else 1


def shared_rsqrt(count: int, sums_over_batch: bool) -> float:
    """``size / sqrt(size * count)``: the unconstrained gradient factor of a shared tensor
    whose gradient sums ``count`` local terms (``1/sqrt(count)`` on one process)."""
    size = shared_size(sums_over_batch)
    return size * _rsqrt(count * size)


def broadcast_along_batch(shape: Sequence[int], out_shape: Sequence[int]) -> bool:
    """Whether an operand of ``shape`` is broadcast along dimension 0 of ``out_shape``
    (the sharded dimension when it is larger than 1), its shapes right-aligned."""
    if len(out_shape) < 2 or out_shape[0] <= 1:
        return False
    return len(shape) < len(out_shape) or shape[0] == 1
