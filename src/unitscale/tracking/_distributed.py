"""Global scale statistics: reduce every tensor's statistics over the data-parallel ranks.

When ``torch.distributed`` is initialised and the tracked call ran with a data-parallel
size above 1 (inside ``DistributedDataParallel`` or :func:`unitscale.data_parallel.fully_shard`,
or after :func:`unitscale.data_parallel.set_data_parallel`: see :mod:`unitscale.data_parallel`),
reading a tracked graph (``scales_graph()``, ``ScaleMonitor``) turns each tensor's
statistics vector into sums (``sum |x|``, ``sum x``, ``sum x^2``, NaN/Inf and
under/overflow counts, ``numel``), maxima (``abs_max``) and minima (``abs_min``) and
reduces *all tensors at once*: one ``all_reduce`` SUM, one MAX and one MIN per read, plus
one tiny MAX that checks that every rank read the same number of tensors. The result is the
statistics of one process on the concatenated batch (``std`` from the pooled float64 sums).
A one-element tensor (a loss) has no batch to concatenate: its global value is the mean of
the ranks' values (the loss of the concatenated batch when the shards are equal).

Values computed from parameters and constants alone (a position embedding's output, a
weight cast to FP8: "replicated") are counted once, from rank 0; their gradients are
partial sums on each rank, so tracking keeps those gradient tensors (not activations' ones)
until the next call, and averages them in one more packed ``all_reduce`` at each read.

Parameters are special. A parameter's value is the same on every rank (FSDP2 gathers it
whole for the forward pass), so only rank 0's statistics of it count. Its gradient
statistics are those of the gradient the optimiser sees, ``param.grad`` at read time (after
DDP's all-reduce, which has finished when ``backward()`` returns; FSDP2's reduce-scatter
leaves each rank a shard, whose statistics are reduced like an activation's), not of the
local gradient the autograd hook saw. So read after ``backward()`` and before
``optimizer.zero_grad()``; with gradient accumulation the statistics are of the accumulated
gradient. One process reports the same quantity (``param.grad`` once the call's gradient is
added to it), so the two agree for the same global batch. Every rank of the group must read
(a collective), at the same point.

Design constraints: nothing here runs per op; one read costs at most five collectives whatever the
number of tensors; tensors stay on their device (gloo on CPU, NCCL on GPU).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..data_parallel import data_parallel_group, data_parallel_set, data_parallel_size
from ..errors import UnitScaleError
from .metrics import _OVERFLOW_ABOVE, _UNDERFLOW_BELOW, FORMAT_KEYS, tensor_stats

__all__ = [
    "active_group",
    "parameter_grad_stats",
    "read_group",
    "reduce_replicated_grads",
    "reduce_stats",
    "writes_files",
]

# Positions in tensor_stats' vector (see metrics._FIELDS).
_SUM_ABS, _MEAN, _VAR, _ABS_MAX, _ABS_MIN, _NAN, _INF = range(7)
_COUNTS = slice(7, 7 + 2 * len(FORMAT_KEYS))


class DistributedStatsError(UnitScaleError, RuntimeError):
    """The ranks did not read the same tracked graph."""


def active_group() -> tuple[bool, Any]:
    """``(True, group)`` when statistics must be reduced over ``group`` (None: the world):
    ``torch.distributed`` is initialised and the data-parallel size is above 1 *now* (so call
    it while the tracked forward runs, where DDP declares its group)."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return False, None
    return data_parallel_size() > 1, data_parallel_group()


def read_group(recorded: tuple[bool, Any]) -> tuple[bool, Any]:
    """The reduction of a read: :func:`active_group` now when ``set_data_parallel`` holds a
    setting (``set_data_parallel(size=1)`` reads local statistics), else ``recorded``, the
    one of the tracked call (inside DDP's forward, which declares its group)."""
    return active_group() if data_parallel_set() else recorded


def writes_files() -> bool:
    """Whether this process writes result files: rank 0 of the world, or any process when
    ``torch.distributed`` is not initialised (the statistics are global on every rank)."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return True
    return distributed.get_rank() == 0


def parameter_grad_stats(param: Tensor) -> tuple[tuple[int, Tensor] | None, bool]:
    """Statistics of the gradient the optimiser sees: ``((numel, vector), replicated)``.

    ``replicated`` is True for a plain gradient (DDP: equal on every rank) and False for an
    FSDP2 shard (a ``DTensor``: its local part, reduced over the ranks). None without a
    gradient.
    """
    grad = param.grad
    if grad is None:
        return None, True
    to_local = getattr(grad, "to_local", None)
    if to_local is not None:
        local = to_local()
        return (local.numel(), tensor_stats(local)), False
    return (grad.numel(), tensor_stats(grad)), True


def reduce_replicated_grads(
    trace: Sequence[Any], group: Any
) -> dict[tuple[int, int], tuple[int, Tensor]]:
    """Average the kept gradients of replicated values over the ranks (one ``all_reduce``
    of all of them packed into one buffer) and compute their statistics.

    A value computed from parameters alone (a position embedding's output, a weight cast to
    FP8) is equal on every rank, but each rank's gradient of it sums over its own shard
    only; the gradient one process would compute is their average (the unit-scaled ops'
    data-parallel factor makes the average, not the sum, the true one).

    Args:
        trace: the invocations of the last call (``capture.last_trace``).
        group: the process group (None: the world).

    Returns:
        ``(invocation index, slot) -> (numel, statistics vector)`` of the averaged gradients.
    """
    kept = [
        (k, slot, grad)
        for k, invocation in enumerate(trace)
        for slot, grad in sorted(invocation.data.get("replicated_grads", {}).items())
    ]
    if not kept:
        return {}
    distributed = torch.distributed
    device = kept[0][2].device
    flat = torch.cat([grad.detach().reshape(-1).to(device, torch.float64) for _, _, grad in kept])
    distributed.all_reduce(flat, op=distributed.ReduceOp.SUM, group=group)
    flat /= distributed.get_world_size(group) if group is not None else distributed.get_world_size()
    out: dict[tuple[int, int], tuple[int, Tensor]] = {}
    offset = 0
    for k, slot, grad in kept:
        part = flat[offset : offset + grad.numel()].view(grad.shape).to(grad.dtype)
        offset += grad.numel()
        out[(k, slot)] = (grad.numel(), tensor_stats(part))
    return out


def reduce_stats(
    rows: Tensor, numels: Sequence[int], replicated: Sequence[bool], group: Any
) -> tuple[Tensor, list[int]]:
    """Reduce stacked statistics ``rows`` (one per tensor) over ``group``'s ranks.

    Args:
        rows: ``(tensors, stats)`` float64, as :func:`tensor_stats` makes them.
        numels: each tensor's local element count.
        replicated: tensors equal on every rank (only this group's first rank counts).
        group: the process group (None: the world).

    Returns:
        The global rows (same layout) and the global element counts.

    Raises:
        DistributedStatsError: the ranks read different numbers of tensors.
    """
    distributed = torch.distributed
    device = rows.device
    length = torch.tensor([len(numels), -len(numels)], dtype=torch.int64, device=device)
    distributed.all_reduce(length, op=distributed.ReduceOp.MAX, group=group)
    if int(length[0]) != len(numels) or int(-length[1]) != len(numels):
        raise DistributedStatsError(
            f"unitscale: the ranks read {int(-length[1])} to {int(length[0])} tracked tensors; "
            "every rank must run the same model on the same number of calls and read "
            "scales_graph() (or ScaleMonitor.step()) at the same point"
        )
    first = (distributed.get_rank(group) if group is not None else distributed.get_rank()) == 0
    keep = torch.tensor(
        [first or not rep for rep in replicated], dtype=torch.bool, device=device
    ).unsqueeze(1)
    n = torch.tensor(numels, dtype=torch.float64, device=device).unsqueeze(1)
    n = torch.where(keep, n, torch.zeros_like(n))
    empty = n == 0
    mean, var = rows[:, _MEAN : _MEAN + 1], rows[:, _VAR : _VAR + 1]
    sums = torch.cat(
        [
            n,
            rows[:, _SUM_ABS : _SUM_ABS + 1],
            mean * n,
            (var + mean * mean) * n,
            rows[:, _NAN : _INF + 1],
            rows[:, _COUNTS],
        ],
        dim=1,
    )
    sums = torch.where(keep, sums, torch.zeros_like(sums))
    sums = torch.where(empty & ~torch.isfinite(sums), torch.zeros_like(sums), sums)
    inf = torch.full_like(n, float("inf"))
    maxima = torch.where(empty, -inf, rows[:, _ABS_MAX : _ABS_MAX + 1])
    minima = torch.where(empty, inf, rows[:, _ABS_MIN : _ABS_MIN + 1])
    distributed.all_reduce(sums, op=distributed.ReduceOp.SUM, group=group)
    distributed.all_reduce(maxima, op=distributed.ReduceOp.MAX, group=group)
    distributed.all_reduce(minima, op=distributed.ReduceOp.MIN, group=group)
    total = sums[:, :1]
    safe = torch.where(total > 0, total, torch.ones_like(total))
    global_mean = sums[:, 2:3] / safe
    global_var = sums[:, 3:4] / safe - global_mean * global_mean
    nothing = total == 0
    out = torch.cat(
        [
            sums[:, 1:2],
            global_mean,
            global_var,
            torch.where(nothing, torch.zeros_like(maxima), maxima),
            torch.where(nothing, torch.zeros_like(minima), minima),
            sums[:, 4:],
        ],
        dim=1,
    )
    scalar = torch.tensor([numel == 1 for numel in numels], dtype=torch.bool, device=device)
    out = torch.where(scalar.unsqueeze(1), _scalar_rows(sums[:, 2] / safe.squeeze(1)), out)
    counts = torch.where(scalar, torch.ones_like(total.squeeze(1)), total.squeeze(1))
    return out, [int(v) for v in counts.tolist()]


def _scalar_rows(value: Tensor) -> Tensor:
    """Statistics rows of one-element tensors holding ``value``: a one-element tensor (a
    loss) has no batch to concatenate, so its global value is the mean over the ranks (the
    loss of the concatenated batch, for equal shards)."""
    a = value.abs()
    parts = [a, value, torch.zeros_like(value), a, a]
    parts += [torch.isnan(value).double(), torch.isinf(value).double()]
    parts += [((a <= bound) & (a > 0)).double() for bound in _UNDERFLOW_BELOW]
    parts += [(a > bound).double() for bound in _OVERFLOW_ABOVE]
    return torch.stack(parts, dim=1)
