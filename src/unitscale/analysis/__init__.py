"""See the scales: a table, a plot and an HTML report of a tracked graph.

Collection is separate from presentation: :func:`unitscale.transforms.track_scales` records
statistics on graph nodes; :func:`graph_to_dataframe` turns them into a table; :func:`plot`
and :func:`write_report` only consume that table. matplotlib and pandas are imported inside
the functions that need them, so importing this package is cheap.
"""

from ..data import example_batch
from .dataframe import AnalysisError, graph_to_dataframe
from .plot import plot
from .report import write_report
from .risk import RISK_FRACTION, RiskSummary, risk_summary

__all__ = [  # noqa: RUF022 (grouped by kind, see STYLE.md)
    # errors
    "AnalysisError",
    # data and table
    "example_batch",
    "graph_to_dataframe",
    # presentation
    "plot",
    "write_report",
    # risk in low-precision formats
    "RISK_FRACTION",
    "RiskSummary",
    "risk_summary",
]
