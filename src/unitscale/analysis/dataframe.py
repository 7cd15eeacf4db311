"""The table of tracked scales: one row per graph node and direction.

Design constraints: the rows are the records of :mod:`unitscale.tracking.records` (the one
place that reads tracking's node meta); pandas is imported inside
:func:`graph_to_dataframe` so that ``import unitscale`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.fx import Graph

from ..errors import AnalysisError
from ..tracking.metrics import Metrics  # noqa: F401 (the example below uses it)
from ..tracking.records import ID_COLUMNS, METRIC_NAMES, ScaleRecord, graph_records, op_name

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "ID_COLUMNS",
    "METRIC_DESCRIPTIONS",
    "METRIC_NAMES",
    "AnalysisError",
    "ScaleRecord",
    "graph_records",
    "graph_to_dataframe",
    "op_name",
]


#: What each scale metric of a tensor ``x`` is (the table's columns, the report's labels).
#: ``mean_abs`` and ``abs_mean`` are different statistics: the first is the scale (the
#: average magnitude), the second only the size of the mean, near 0 for a centred tensor
#: however large its values.
METRIC_DESCRIPTIONS: dict[str, str] = {
    "mean_abs": "mean of |x| (average magnitude: the scale)",
    "abs_mean": "|mean of x| (size of the mean; 0 for a centred tensor)",
    "std": "standard deviation of x (population)",
    "rms": "sqrt(mean of x^2)",
    "abs_max": "largest |x|",
    "abs_min": "smallest |x|",
    "numel": "number of elements",
}


def graph_to_dataframe(graph: Graph) -> pd.DataFrame:
    """Tabulate a tracked graph: one row per node and direction, with every metric.

    Columns: ``order``, ``node``, ``name`` (clean name), ``module`` (module path), ``op``,
    ``weight``, ``direction`` (``"fwd"``/``"bwd"``), ``tensor_type``
    (``"x"``/``"w"``/``"grad_x"``/``"grad_w"``), ``shape``, ``dtype``, then every metric of
    ``Metrics.Data.as_dict()``, of the tensor ``x`` of the row (a value or a gradient):

    - ``mean_abs``: mean of ``|x|``, the average magnitude: the scale that plots and
      pruning use;
    - ``abs_mean``: ``|mean of x|``, the size of the mean (not of the values: 0 for any
      centred tensor, however large);
    - ``std`` (population), ``rms`` (``sqrt(mean of x**2)``), ``abs_max``, ``abs_min``
      (of ``|x|``), ``numel``;
    - ``underflow_<fmt>``/``overflow_<fmt>`` for ``e4m3``, ``e5m2``, ``fp16``, ``bf16``:
      the fraction of elements that are non-zero but round to zero in that format, and
      the fraction beyond its largest value; ``nan_count``, ``inf_count``;
    - with ``track_scales(model, block_formats=[...])``, per block-scaled format
      ``block_flushed_<format>``, ``block_scale_clipped_<format>`` and
      ``block_error_<format>`` (blocks along the tensor's last dimension; NaN where it is
      not a multiple of the block size; see :mod:`unitscale.tracking.blocks`).

    ``METRIC_DESCRIPTIONS`` holds these descriptions (the block metrics':
    ``unitscale.tracking.blocks.block_metric_description``).

    Args:
        graph: ``tracked.scales_graph()`` of a module tracked with
            :func:`unitscale.transforms.track_scales`.

    Returns:
        A pandas DataFrame in graph (execution) order, forward row before backward row.

    Raises:
        AnalysisError: when ``graph`` is not a graph, is empty, or carries no metrics.

    Example:
        >>> g = Graph()
        >>> x = g.placeholder("x")
        >>> x.meta.update(clean_name="x", metrics=Metrics(
        ...     fwd=Metrics.Data(1.0, 0.0, 1.2, 3.0, 0.0, 1.2, 16),
        ...     bwd=Metrics.Data(0.5, 0.0, 0.6, 2.0, 0.0, 0.6, 16)))
        >>> df = graph_to_dataframe(g)
        >>> df[["name", "direction", "tensor_type", "mean_abs"]].values.tolist()
        [['x', 'fwd', 'x', 1.0], ['x', 'bwd', 'grad_x', 0.5]]
    """
    import pandas as pd

    rows = [r.as_row() for r in graph_records(graph, "graph_to_dataframe")]
    known = {*ID_COLUMNS, *METRIC_NAMES}
    blocks = list(dict.fromkeys(k for row in rows for k in row if k not in known))
    df = pd.DataFrame(rows, columns=[*ID_COLUMNS, *METRIC_NAMES, *blocks])
    return df.astype({"order": "int64", "numel": "int64", "weight": "bool"})
