"""Code TorchDynamo ran outside the captured graphs, found from the graphs' inputs.

TorchDynamo runs some frames eagerly (a graph break inside a loop, a data-dependent shape such
as a mixture of experts' routing): their ops are in no captured graph, so no pass sees them.
The output of such a frame may still reach the model's output through a later graph
(transformers' DBRX: its decoder frame runs eagerly, so its embedding and final norm are in
no graph, yet the logits come from one), so checking the outputs alone does not find them. A
later graph that receives a value no earlier graph returned, and that is not an argument of
the call, a parameter or a buffer, shows it: :func:`outside_inputs` lists those values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx
from torch import Tensor

from ._core import Capture, Piece, example_value

__all__ = ["outside_inputs", "received_parameters"]


def _is_local(node: fx.Node) -> bool:
    """Whether the placeholder's value is a local of the captured frame (an argument or a
    variable live across a graph break), not an attribute or global read by the frame."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    if source is None:
        return True
    return type(source).__name__ == "LocalSource"


def _candidates(piece: Piece) -> list[int]:
    """Indices of the piece's placeholders that a value computed outside the graphs could
    fill: float tensor inputs (not parameters or buffers) that are locals of the frame.
    Cached in ``piece.data``: this runs at every call."""
    cached = piece.data.get("coverage_candidates")
    if cached is None:
        placeholders = [n for n in piece.graph.nodes if n.op == "placeholder"]
        cached = []
        for i, (node, (kind, _)) in enumerate(zip(placeholders, piece.placeholders, strict=False)):
            value = example_value(node)
            if (
                kind == "input"
                and isinstance(value, Tensor)
                and value.is_floating_point()
                and _is_local(node)
            ):
                cached.append(i)
        piece.data["coverage_candidates"] = cached
    return cached


def outside_inputs(capture: Capture, known: Callable[[], set[int]]) -> list[str]:
    """Inputs of the running call's graphs (after the first) that received a floating-point
    tensor computed outside every captured graph, as ``"<input name> (graph <k>)"``.

    ``known()``: ids of the tensors alive for the whole call that it did not compute (its
    arguments, the parameters and buffers), built only if needed. The first graph's inputs
    are the call's arguments, which Dynamo may have re-wrapped (marked dynamic). Call before
    ``capture.produced`` is cleared.
    """
    found: list[str] = []
    for k, invocation in enumerate(capture.trace):
        if k == 0:
            continue
        piece = invocation.piece
        for i in _candidates(piece):
            if i >= len(invocation.sources) or invocation.sources[i] is not None:
                continue
            if invocation.input_ids[i] not in known():
                found.append(f"{piece.placeholders[i][1]} (graph {k})")
    return found


def received_parameters(capture: Capture) -> set[str]:
    """Qualified names of the parameters that a graph of the last call received: by name
    where captured, and by identity (Dynamo may run one layer's graph with another layer's
    parameters)."""
    received = {i for invocation in capture.trace for i in invocation.input_ids}
    names = {
        name
        for invocation in capture.trace
        for kind, name in invocation.piece.placeholders
        if kind == "param"
    }
    for name, parameter in capture.owner_module.named_parameters(remove_duplicate=False):
        if id(parameter) in received:
            names.add(name)
    return names
