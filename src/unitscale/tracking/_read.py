"""Read the statistics of a tracked call: one host transfer per device.

The pass (:mod:`unitscale.tracking._recording._pass`) leaves, per invocation of a piece, a
statistics vector per slot (on the device, or already on the host for small CPU tensors).
:func:`_resolved` gives each slot its statistics (shared slots and aliases resolved);
:func:`_read_stats` stacks every pending vector and reads it at once (reducing over the ranks
first under data parallelism, :mod:`unitscale.tracking._distributed`), then writes
``Metrics.fwd``/``Metrics.bwd`` of each node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from ..capture import (
    Invocation,
    Piece,
)
from . import _distributed
from .metrics import Stats, host_stats, stats_to_data

_Stats = tuple[int, Stats]  # (numel, statistics: see metrics.deferred_stats)


def _resolved(
    invocation: Invocation, adjust: Callable[[dict, dict], None] | None = None
) -> tuple[dict[Any, _Stats], dict[Any, _Stats]]:
    """The forward and gradient statistics of each slot of one invocation, those a slot shares
    with another (the same tensor seen again; a reshape) included. ``adjust`` may change them
    before aliases are resolved (data parallelism)."""
    piece = invocation.piece
    fwd = dict(invocation.data.get("fwd", {}))
    bwd = dict(invocation.data.get("bwd", {}))
    for slot, (other, source) in invocation.data.get("same", {}).items():
        for stats, direction in ((fwd, "fwd"), (bwd, "bwd")):
            same = other.data.get(direction, {}).get(source)
            if same is not None:
                stats[slot] = same
    if adjust is not None:
        adjust(fwd, bwd)
    full_aliases = piece.data.get("full_aliases", set())
    for slot, source in piece.data.get("aliases", {}).items():
        if source in fwd:
            fwd[slot] = fwd[source]
        if slot in full_aliases and source in bwd:
            bwd[slot] = bwd[source]
    return fwd, bwd


def _replication(
    k: int, piece: Piece, reduced_grads: dict[tuple[int, Any], Any], replicated: set[int]
) -> Callable[[dict, dict], None]:
    """Under data parallelism: note the statistics equal on every rank (``replicated``) and
    put the averaged gradients of replicated values in place."""

    def adjust(fwd: dict, bwd: dict) -> None:
        for slot in piece.data.get("replicated_slots", ()):
            if slot in fwd:
                replicated.add(id(fwd[slot]))
        for (index, slot), averaged in reduced_grads.items():
            if index == k:
                bwd[slot] = averaged
                replicated.add(id(averaged))

    return adjust


def _queue(
    pending: list[tuple[fx.Node, str, _Stats]],
    node: fx.Node,
    fwd: _Stats | None,
    bwd: _Stats | None,
) -> None:
    if fwd is not None:
        pending.append((node, "fwd", fwd))
    if bwd is not None:
        pending.append((node, "bwd", bwd))


def _read_stats(
    pending: Sequence[tuple[fx.Node, str, _Stats]], reduce: tuple[Any, set[int]] | None = None
) -> None:
    """Read every statistics vector: those on the host as they are, those on a device in one
    transfer per device; with ``reduce`` (``(group, ids of replicated statistics)``), reduce
    them over the ranks first."""
    if reduce is None:
        # Statistics on the host (every one on the CPU) are written as they come, in one
        # pass: this runs for every tracked tensor at every read.
        on_devices = []
        for entry in pending:
            node, direction, (numel, stats) = entry
            values = host_stats(stats)
            if values is None:
                on_devices.append(entry)
                continue
            metrics = node.meta.get("metrics")
            if metrics is not None:
                setattr(metrics, direction, stats_to_data(values, numel))
        if not on_devices:
            return
        pending = on_devices
    rows: list[list[float] | None] = [None] * len(pending)
    pending_tensors: dict[int, Tensor] = {}
    numels = [numel for _, _, (numel, _) in pending]
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, _, (_, stats)) in enumerate(pending):
        values = host_stats(stats)
        if values is not None and reduce is None:
            rows[i] = values
            continue
        tensor = torch.tensor(values, dtype=torch.float64) if values is not None else stats
        if not isinstance(tensor, Tensor):  # pragma: no cover - host_stats read the rest
            raise TypeError(f"unitscale: unexpected statistics {type(stats).__name__}")
        by_device.setdefault(tensor.device, []).append(i)
        pending_tensors[i] = tensor
    if reduce is not None and len(by_device) > 1:
        # The ranks must issue the same collectives: one device's worth, in one order.
        device = next(iter(by_device))
        by_device = {device: list(range(len(pending)))}
    for device, indices in by_device.items():
        stacked = torch.stack([pending_tensors[i].to(device) for i in indices])
        counts = [numels[i] for i in indices]
        if reduce is not None:
            group, replicated = reduce
            same = [id(pending[i][2]) in replicated for i in indices]
            stacked, counts = _distributed.reduce_stats(stacked, counts, same, group)
        for i, row, numel in zip(indices, stacked.tolist(), counts, strict=True):
            rows[i] = row
            numels[i] = numel
    for (node, direction, _), row, numel in zip(pending, rows, numels, strict=True):
        metrics = node.meta.get("metrics")
        if metrics is None or row is None:
            continue
        setattr(metrics, direction, stats_to_data(row, numel))
