"""Graph transforms: scale tracking, automatic unit scaling, format simulation, compile."""

from ..tracking import (
    Metrics,
    prune_non_float_tensors,
    prune_same_scale_tensors,
    prune_selected_nodes,
)
from ._track import track_scales

__all__ = [
    # scale tracking
    "Metrics",
    "prune_non_float_tensors",
    "prune_same_scale_tensors",
    "prune_selected_nodes",
    "track_scales",
]
