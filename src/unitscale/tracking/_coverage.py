"""What a tracked call did not capture: :class:`TrackingCoverage` and :func:`tracking_coverage`.

The record says which engine recorded the last call, which parameters have no node in
``scales_graph()`` and which values of the graph were computed outside every captured graph
(:func:`unitscale.capture.outside_inputs`: code TorchDynamo ran eagerly).
"""

from __future__ import annotations

import dataclasses

from torch import nn

from ..capture import TransformedModule, unwrap_compiled
from ..errors import UnitScaleError

__all__ = ["TrackingCoverage", "tracking_coverage"]


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
        >>> import torch
        >>> tracked = track_scales(torch.nn.Linear(4, 2))
        >>> _ = tracked(torch.ones(3, 4))
        >>> tracking_coverage(tracked).complete
        True
    """
    from ._recording._pass import TrackScalesPass

    module = unwrap_compiled(module)  # torch.compile's OptimizedModule: its _orig_mod
    track = module.pass_of_type(TrackScalesPass) if isinstance(module, TransformedModule) else None
    if not isinstance(module, TransformedModule) or not isinstance(track, TrackScalesPass):
        raise UnitScaleError(
            f"tracking_coverage: {type(module).__name__} is not tracked; pass a model "
            "returned by unitscale.transforms.track_scales"
        )
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
