"""Scale tracking: statistics, the recording pass, records of a tracked graph, pruning, and
:class:`ScaleMonitor` (statistics during training, non-finite localisation).

This layer collects and returns tables and records; drawing and TensorBoard export are
:mod:`unitscale.analysis` functions of them (see :class:`ScaleMonitor`)."""

from ._coverage import TrackingCoverage, tracking_coverage
from ._join import build_scales_graph
from ._recording import TrackScalesPass
from .metrics import (
    FORMAT_KEYS,
    FORMAT_RANGES,
    STRUCTURAL_ZERO_RTOL,
    Metrics,
    structural_zero_fraction,
)
from .monitor import (
    LONG_COLUMNS,
    MonitorError,
    MonitorRecord,
    NonFiniteError,
    NonFiniteReport,
    NonFiniteWarning,
    ScaleMonitor,
)
from .prune import prune_non_float_tensors, prune_same_scale_tensors, prune_selected_nodes
from .records import METRIC_NAMES, ScaleRecord, graph_records, op_name
from .rows import TensorRow, prepare_rows

__all__ = [  # noqa: RUF022 (grouped by kind)
    # statistics
    "FORMAT_KEYS",
    "FORMAT_RANGES",
    "METRIC_NAMES",
    "Metrics",
    "STRUCTURAL_ZERO_RTOL",
    "structural_zero_fraction",
    # recording
    "TrackScalesPass",
    "build_scales_graph",
    "TrackingCoverage",
    "tracking_coverage",
    # records of a tracked graph
    "ScaleRecord",
    "TensorRow",
    "graph_records",
    "op_name",
    "prepare_rows",
    # pruning
    "prune_non_float_tensors",
    "prune_same_scale_tensors",
    "prune_selected_nodes",
    # watching scales during training
    "LONG_COLUMNS",
    "MonitorError",
    "MonitorRecord",
    "NonFiniteError",
    "NonFiniteReport",
    "NonFiniteWarning",
    "ScaleMonitor",
]
