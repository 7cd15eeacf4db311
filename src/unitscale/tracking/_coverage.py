"""What a tracked call did not capture: values computed outside the graphs, and the
parameters no node stands for.

TorchDynamo runs some frames eagerly (a graph break inside a loop, a data-dependent shape such
as a mixture of experts' routing): their ops are in no captured graph. The output of such a
frame may still reach the model's output through a later graph (transformers' DBRX: its
decoder frame runs eagerly, so its embedding and final norm are in no graph, yet the logits
come from one), so checking the outputs alone does not find them. A later graph that
receives a value no earlier graph returned, and that is not an argument of the call, a
parameter or a buffer, shows it: :func:`outside_inputs` lists those values.

:class:`TrackingCoverage` is the public record (:func:`tracking_coverage`): which engine
recorded the last call, which parameters have no node in ``scales_graph()`` and which values
of the graph were computed outside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..capture import Capture, Piece, TransformedModule, example_value
from ..errors import UnitScaleError

__all__ = ["TrackingCoverage", "outside_inputs", "received_parameters", "tracking_coverage"]


def _is_local(node: torch.fx.Node) -> bool:
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


@dataclasses.dataclass(frozen=True)
class TrackingCoverage:
    """How much of a tracked model's last call ``scales_graph()`` covers.

    Attributes:
        engine: ``"dynamo"`` (TorchDynamo's graphs, joined) or ``"eager"`` (unitscale's
            eager tracer, which records every op: used where Dynamo ran part of the forward
            outside its graphs).
        missing_parameters: parameters of the model that have no node in ``scales_graph()``
            (used by ops that ran outside the captured graphs, or not used by the call).
        outside_inputs: values of the graph computed outside every captured graph, as
            ``"<input name> (graph <k>)"``: the ops that computed them are not in the graph.

    Example:
        >>> print(TrackingCoverage("dynamo", (), ()))
        track_scales (dynamo): every parameter has a node, no value computed outside the graph
    """

    engine: str
    missing_parameters: tuple[str, ...]
    outside_inputs: tuple[str, ...]

    @property
    def complete(self) -> bool:
        """True when every parameter has a node and no value came from outside the graph."""
        return not self.missing_parameters and not self.outside_inputs

    def __str__(self) -> str:
        head = f"track_scales ({self.engine}): "
        if self.complete:
            return head + "every parameter has a node, no value computed outside the graph"
        parts = []
        if self.missing_parameters:
            parts.append(f"no node for {', '.join(self.missing_parameters)}")
        if self.outside_inputs:
            parts.append(f"computed outside the graph: {', '.join(self.outside_inputs)}")
        return head + "; ".join(parts)


def tracking_coverage(module: nn.Module) -> TrackingCoverage:
    """What ``scales_graph()`` of a tracked model covers of its last call.

    Args:
        module: a model returned by :func:`~unitscale.transforms.track_scales`, called at
            least once.

    Returns:
        The :class:`TrackingCoverage` of the last recorded call.

    Raises:
        UnitScaleError: ``module`` is not tracked, or has not been called.

    Example:
        >>> from unitscale.transforms import track_scales
        >>> tracked = track_scales(torch.nn.Linear(4, 2))
        >>> _ = tracked(torch.ones(3, 4))
        >>> tracking_coverage(tracked).complete
        True
    """
    from ._recorder import TrackScalesPass

    track = module.pass_of_type(TrackScalesPass) if isinstance(module, TransformedModule) else None
    if track is None:
        raise UnitScaleError(
            f"tracking_coverage: {type(module).__name__} is not tracked; pass a model "
            "returned by unitscale.transforms.track_scales"
        )
    assert isinstance(track, TrackScalesPass)
    capture = module.capture
    if capture is None or not capture.last_trace:
        raise UnitScaleError(
            "tracking_coverage: the model has not been called yet; call it once, since the "
            "coverage is that of the last call"
        )
    graph = module.scales_graph()
    names = {n.meta.get("clean_name") for n in graph.nodes if n.op == "placeholder"}
    missing = tuple(n for n, _ in module.named_parameters() if n not in names)
    return TrackingCoverage(track.engine, missing, tuple(track.outside))
