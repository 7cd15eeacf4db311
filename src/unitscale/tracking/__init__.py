"""Scale tracking: metrics records, the recording pass and pruning."""

from ._recorder import TrackScalesPass, build_scales_graph
from .metrics import FORMAT_KEYS, FORMAT_RANGES, Metrics
from .prune import prune_non_float_tensors, prune_same_scale_tensors, prune_selected_nodes

__all__ = [
    # records
    "FORMAT_KEYS",
    "FORMAT_RANGES",
    "Metrics",
    # recording
    "TrackScalesPass",
    "build_scales_graph",
    # pruning
    "prune_non_float_tensors",
    "prune_same_scale_tensors",
    "prune_selected_nodes",
]
