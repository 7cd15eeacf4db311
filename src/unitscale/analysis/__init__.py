"""See the scales: a table, a plot and an HTML report of a tracked graph.

Collection is separate from presentation: :func:`unitscale.transforms.track_scales` records
statistics on graph nodes; :func:`graph_to_dataframe` turns them into a table; :func:`plot`
and :func:`write_report` only consume that table. matplotlib and pandas are imported inside
the functions that need them, so importing this package is cheap. ``ScaleMonitor`` (in
:mod:`unitscale.tracking`) records; :func:`scale_heatmap` and the TensorBoard export present.
"""

# DESIGN names example_batch here: the bundled corpus (unitscale.data), for examples.
from ..data import example_batch
from ..errors import AnalysisError
from .annotated import analyse_module
from .dataframe import graph_to_dataframe
from .heatmap import scale_heatmap
from .plot import plot
from .report import write_report
from .risk import (
    RISK_FRACTION,
    FormatRisk,
    RiskSummary,
    WorstTensor,
    risk_conclusion,
    risk_summary,
    structural_zeros,
)
from .tensorboard import (
    TensorBoardSink,
    tensorboard_available,
    tensorboard_sink,
    write_scalars,
    write_tensorboard,
)

__all__ = [  # noqa: RUF022 (grouped by kind)
    # errors
    "AnalysisError",
    # data and table
    "example_batch",
    "graph_to_dataframe",
    # presentation
    "analyse_module",
    "plot",
    "scale_heatmap",
    "write_report",
    # export
    "TensorBoardSink",
    "tensorboard_available",
    "tensorboard_sink",
    "write_scalars",
    "write_tensorboard",
    # risk in low-precision formats
    "RISK_FRACTION",
    "FormatRisk",
    "RiskSummary",
    "WorstTensor",
    "risk_conclusion",
    "risk_summary",
    "structural_zeros",
]
