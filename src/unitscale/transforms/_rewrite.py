"""Small helpers shared by the graph-rewriting transforms (``unit_scale``, ``simulate_format``).

Every node a pass inserts must look to later passes like a node Dynamo made: it carries an
``example_value`` meta (a tensor of the right shape and dtype; the tracking pass uses it to
decide what to record) and Dynamo's source meta (``nn_module_stack``, ``stack_trace``) copied
from the node it belongs to, so that reports attribute it to the right module.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, ClassVar

import torch.fx as fx

from ..capture import (
    Capture,
    GraphPass,
    Piece,
    TransformedModule,
    identifier,
    iter_tensors,
    outside_inputs,
    received_parameters,
)

__all__ = [
    "RewritePass",
    "ancestors",
    "captured_parameters",
    "descendants",
    "insert_call",
    "parameter_nodes",
    "placeholder_names",
    "uncaptured_outputs",
    "warn_uncaptured",
]

_SOURCE_META = ("nn_module_stack", "stack_trace", "source_fn_stack")


def placeholder_names(gm: fx.GraphModule, piece: Piece) -> dict[fx.Node, tuple[str, str]]:
    """Placeholder node -> ``(kind, name)`` as the capture core classified it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return dict(zip(placeholders, piece.placeholders, strict=False))


def parameter_nodes(gm: fx.GraphModule, piece: Piece) -> set[fx.Node]:
    """Nodes holding parameters: ``param`` placeholders and ``get_attr`` nodes."""
    params = {n for n, (kind, _) in placeholder_names(gm, piece).items() if kind == "param"}
    params.update(n for n in gm.graph.nodes if n.op == "get_attr")
    return params


def _reachable(node: fx.Node, step: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(step(node))
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(step(current))
    return seen


def ancestors(node: fx.Node) -> set[fx.Node]:
    """Every node ``node`` depends on (transitively), excluding itself."""
    return _reachable(node, lambda n: n.all_input_nodes)


def descendants(node: fx.Node) -> set[fx.Node]:
    """Every node that depends on ``node`` (transitively), excluding itself."""
    return _reachable(node, lambda n: n.users)


def insert_call(
    graph: fx.Graph,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    name: str,
    value: Any,
    meta_from: fx.Node,
) -> fx.Node:
    """Create a ``call_function`` node at the graph's insertion point, with Dynamo-like meta.

    Args:
        graph: the graph (use ``graph.inserting_before/after`` to place the node).
        target: the function to call.
        args: its arguments.
        name: name candidate (made unique by fx).
        value: the ``example_value`` meta (same shape/dtype as the runtime value).
        meta_from: node whose source meta (module stack, stack trace) the new node shares.
    """
    node = graph.create_node("call_function", target, args, {}, name=identifier(name))
    for key in _SOURCE_META:
        if key in meta_from.meta:
            node.meta[key] = meta_from.meta[key]
    node.meta["example_value"] = value
    return node


def uncaptured_outputs(capture: Capture, output: Any) -> int:
    """How many float tensors in ``output`` no captured graph produced or received.

    Such tensors were computed by code TorchDynamo ran eagerly (around a graph break inside
    a loop or a nested call, or in a skipped function), which no pass has seen.
    """
    known = {i for inv in capture.trace for i in inv.input_ids}
    missing = 0
    for tensor in iter_tensors(output):
        if not tensor.is_floating_point() or id(tensor) in known:
            continue
        hit = capture.produced.get(id(tensor))
        if hit is None or hit[0]() is not tensor:
            missing += 1
    return missing


def captured_parameters(capture: Capture) -> set[str]:
    """Qualified names of the parameters a graph captured in the last call received (see
    :func:`~unitscale.capture.received_parameters`)."""
    return received_parameters(capture)


def _listed(names: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def warn_uncaptured(
    module: TransformedModule,
    capture: Capture,
    output: Any,
    op: str,
    consequence: str,
    reinitialised: Collection[str] = (),
    call_inputs: Collection[int] = (),
) -> bool:
    """Warn (once per call site; returns whether it did) about outputs, or values entering a
    later graph, computed eagerly (``call_inputs``: ids of the call's tensors).

    The message says what was transformed (the captured graphs), what was not (the
    parameters no captured graph received: their ops ran as written) and which of those
    ``reinitialised`` names (weights ``unit_scale`` re-initialised) are among them.
    """
    missing = uncaptured_outputs(capture, output)
    known: set[int] = set()

    def known_ids() -> set[int]:
        if not known:
            inner = capture.owner_module
            known.update(call_inputs, (id(p) for p in inner.parameters()))
            known.update(id(b) for b in inner.buffers())
            for other in module.passes:  # track_scales hands the forward aliases of inputs
                known.update(getattr(other, "_call_inputs", ()))
        return known

    outside = outside_inputs(capture, known_ids)
    if not missing and not outside:
        return False
    graphs = len({id(invocation.piece) for invocation in capture.trace})
    computed = []
    if missing:
        computed.append(
            f"{missing} floating-point output(s) of {type(module.module).__name__} were"
        )
    if outside:
        computed.append(
            f"{len(outside)} value(s) entering captured graphs ({_listed(outside, 4)}) were"
        )
    message = (
        f"{op}: {' and '.join(computed)} computed outside the graphs TorchDynamo captured "
        "(code it ran eagerly around a graph break, a data-dependent shape, or a skipped "
        f"function); {consequence}. "
    )
    if graphs:
        message += f"Transformed: the ops of the {graphs} captured graph(s)"
    else:
        message += "Nothing was transformed: TorchDynamo captured no graph of this call"
    captured = captured_parameters(capture)
    outside = [n for n, _ in module.module.named_parameters() if n not in captured]
    if outside:
        message += (
            f"; not transformed: the ops using {_listed(outside)} (no captured graph "
            "received these parameters)"
        )
    stale = [n for n in outside if n in reinitialised]
    if stale:
        message += (
            f". unit_scale re-initialised {_listed(stale)} (N(0, 1) weights, 0 biases, 1 for "
            "norms) for unit-scaled ops, but the ops using them run as written: fix the "
            "graph break, or load the original weights into those modules"
        )
    warnings.warn(message, UserWarning, stacklevel=7)
    return True


class RewritePass(GraphPass):
    """A graph pass that rewrites ops, and warns once per pass when a call returned outputs
    that no captured graph computed (those ops were not rewritten)."""

    #: The transform's name, for the warning (``"unit_scale"``).
    transform_name: ClassVar[str]
    #: What it means for the outputs computed outside the graphs, for the warning.
    uncaptured_consequence: ClassVar[str]

    def before_call(self, module: TransformedModule, args: tuple[Any, ...], kwargs: dict) -> None:
        self._call_inputs = [id(t) for t in iter_tensors((args, kwargs))]

    def after_call(self, module: TransformedModule, capture: Capture, output: Any) -> None:
        if not getattr(self, "_warned", False):
            self._warned = warn_uncaptured(
                module,
                capture,
                output,
                self.transform_name,
                self.uncaptured_consequence,
                reinitialised=getattr(self, "reinitialised", ()),
                call_inputs=getattr(self, "_call_inputs", ()),
            )
