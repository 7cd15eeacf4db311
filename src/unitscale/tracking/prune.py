"""Pruning of tracked graphs: drop nodes that add nothing to a picture of the scales.

Each function returns a new graph and leaves its argument unchanged. A pruned node's users
are rewired to the pruned node's nearest kept inputs, so data flow (``all_input_nodes``) stays
connected through what was removed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch.fx as fx

from ..errors import UnitScaleError
from .metrics import Metrics

__all__ = ["prune_non_float_tensors", "prune_same_scale_tensors", "prune_selected_nodes"]


def _check_tracked(graph: fx.Graph, op: str) -> None:
    if not isinstance(graph, fx.Graph):
        raise UnitScaleError(
            f"{op}: expected a torch.fx.Graph from tracked.scales_graph(), got "
            f"{type(graph).__name__}"
        )
    for node in graph.nodes:
        if node.op != "output" and "clean_name" not in node.meta:
            raise UnitScaleError(
                f"{op}: node {node.name!r} has no scale-tracking meta; pass the graph returned by "
                "unitscale.transforms.track_scales(module).scales_graph() after a forward call"
            )


def _copy_meta(meta: dict[str, Any]) -> dict[str, Any]:
    out = dict(meta)
    metrics = out.get("metrics")
    if isinstance(metrics, Metrics):
        out["metrics"] = Metrics(fwd=metrics.fwd, bwd=metrics.bwd, blocks=metrics.blocks)
    return out


def _prune(graph: fx.Graph, should_prune: Callable[[fx.Node], bool]) -> fx.Graph:
    new_graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for node in graph.nodes:
        if node.op != "output" and should_prune(node):
            kept: list[fx.Node] = []
            for arg in node.all_input_nodes:
                mapped = env[arg]
                for n in mapped if isinstance(mapped, tuple) else (mapped,):
                    if isinstance(n, fx.Node) and n not in kept:
                        kept.append(n)
            env[node] = kept[0] if len(kept) == 1 else (tuple(kept) if kept else None)
            continue
        new = new_graph.node_copy(node, lambda n: env[n])
        new.meta = _copy_meta(node.meta)
        env[node] = new
    return new_graph


def prune_non_float_tensors(graph: fx.Graph) -> fx.Graph:
    """Remove every node whose value is not a floating-point tensor.

    Args:
        graph: a graph from ``track_scales(...).scales_graph()``.

    Returns:
        A new graph; ``graph`` is unchanged.

    Raises:
        UnitScaleError: ``graph`` does not carry tracking meta.
    """
    _check_tracked(graph, "prune_non_float_tensors")
    return _prune(graph, lambda n: not n.meta.get("outputs_float_tensor", False))


def _same(a: float, b: float, rtol: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= rtol * max(abs(a), abs(b))


def _same_scale(node: fx.Node, source: fx.Node, rtol: float) -> bool:
    m, s = node.meta.get("metrics"), source.meta.get("metrics")
    if not isinstance(m, Metrics) or not isinstance(s, Metrics) or m.fwd is None or s.fwd is None:
        return False
    if not _same(m.fwd.mean_abs, s.fwd.mean_abs, rtol):
        return False
    if (m.bwd is None) != (s.bwd is None):
        return False
    return m.bwd is None or s.bwd is None or _same(m.bwd.mean_abs, s.bwd.mean_abs, rtol)


def prune_same_scale_tensors(graph: fx.Graph, rtol: float = 2**-16) -> fx.Graph:
    """Remove nodes whose single float input has the same scale, forward and backward.

    A node is pruned when exactly one of its inputs is a floating-point tensor and that
    input's ``mean_abs`` equals the node's within ``rtol``, both for the values and for the
    gradients (or neither has a gradient). Nodes with two or more float inputs are never
    pruned: they combine scales.

    Args:
        graph: a graph from ``track_scales(...).scales_graph()``.
        rtol: relative tolerance for "the same scale".

    Returns:
        A new graph; ``graph`` is unchanged.

    Raises:
        UnitScaleError: ``graph`` does not carry tracking meta, or ``rtol`` is negative.
    """
    _check_tracked(graph, "prune_same_scale_tensors")
    if not rtol >= 0:
        raise UnitScaleError(f"prune_same_scale_tensors: rtol must be >= 0, got {rtol!r}")

    def should_prune(node: fx.Node) -> bool:
        floats = [n for n in node.all_input_nodes if n.meta.get("outputs_float_tensor")]
        return len(floats) == 1 and _same_scale(node, floats[0], rtol)

    return _prune(graph, should_prune)


def prune_selected_nodes(graph: fx.Graph, targets: Iterable[Any]) -> fx.Graph:
    """Remove nodes whose target (function, or method name) is one of ``targets``.

    Args:
        graph: a graph from ``track_scales(...).scales_graph()``.
        targets: node targets to remove, e.g. ``[torch.Tensor.view, "flatten", F.softmax]``
            (``torch.Tensor`` methods match the method-name targets Dynamo records).

    Returns:
        A new graph; ``graph`` is unchanged.

    Raises:
        UnitScaleError: ``graph`` does not carry tracking meta.
    """
    _check_tracked(graph, "prune_selected_nodes")
    wanted: set[Any] = set()
    for target in targets:
        wanted.add(target)
        name = getattr(target, "__name__", None)
        if getattr(target, "__objclass__", None) is not None and name:
            wanted.add(name)  # torch.Tensor.view -> "view" (call_method targets)
    return _prune(graph, lambda n: n.op != "placeholder" and n.target in wanted)
