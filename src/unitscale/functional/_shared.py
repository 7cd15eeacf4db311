"""Gradient factors of tensors shared by every example of a data-parallel batch.

See :mod:`unitscale.data_parallel` for the semantics: dimension 0 of an op's batched operand
is the sharded dimension; a tensor broadcast along it is shared by the ranks and by the
micro-batches of an accumulated step, whose averaged (over ranks) and summed (over
micro-batches) gradient must equal one process's on the whole batch. So a shared tensor's
gradient factor counts the whole batch (``size x steps x local``) and is multiplied by
``size``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..data_parallel import data_parallel_size, gradient_accumulation_steps
from ._base import _rsqrt


def shared_counts(sums_over_batch: bool) -> tuple[int, int]:
    """``(shards, size)`` for a shared tensor whose gradient sums over the sharded dimension:
    the whole batch is ``shards`` local batches (data-parallel size x accumulation steps) and
    the gradient is multiplied by ``size`` (the ranks' average divides it out again);
    ``(1, 1)`` otherwise (no call into torch.distributed)."""
    if not sums_over_batch:
        return 1, 1
    size = data_parallel_size()
    return size * gradient_accumulation_steps(), size


def shared_rsqrt(count: int, sums_over_batch: bool) -> float:
    """``size / sqrt(shards * count)``: the unconstrained gradient factor of a shared tensor
    whose gradient sums ``count`` local terms (``1/sqrt(count)`` on one process)."""
    shards, size = shared_counts(sums_over_batch)
    return size * _rsqrt(count * shards)


def broadcast_along_batch(shape: Sequence[int], out_shape: Sequence[int]) -> bool:
    """Whether an operand of ``shape`` is broadcast along dimension 0 of ``out_shape`` (the
    sharded dimension when ``out_shape`` has 2 or more dimensions, whatever its size), their
    shapes right-aligned: it lacks that dimension, or has size 1 where the output's is larger.
    An operand of size 1 there when the output's is 1 too (a local batch of 1) counts as an
    example."""
    if len(out_shape) < 2:
        return False
    return len(shape) < len(out_shape) or (shape[0] == 1 and out_shape[0] > 1)
