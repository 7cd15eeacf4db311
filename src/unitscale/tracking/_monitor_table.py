"""The monitor's records and its long table (``step, tensor, direction, metric, value, ...``).

:func:`step_records` turns the tracked graph of one recorded step into
:class:`MonitorRecord` rows (the same records as ``graph_to_dataframe`` of ``track_scales``,
through :func:`~unitscale.tracking.rows.prepare_rows`); :func:`long_table` lays records out
as the long DataFrame :meth:`ScaleMonitor.table <unitscale.tracking.ScaleMonitor.table>`
returns. pandas is imported on use.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from ..errors import MonitorError
from .rows import prepare_rows

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["LONG_COLUMNS", "MonitorRecord", "long_table", "step_records"]

#: Columns of :meth:`ScaleMonitor.table <unitscale.tracking.ScaleMonitor.table>`, in order.
LONG_COLUMNS: tuple[str, ...] = (
    "step",
    "tensor",
    "direction",
    "metric",
    "value",
    "module",
    "op",
    "tensor_type",
    "label",
    "row",
    "same_scale",
)


@dataclass(frozen=True)
class MonitorRecord:
    """One tensor, direction and step of the long table (every metric of it)."""

    step: int
    tensor: str
    direction: str
    module: str
    op: str
    tensor_type: str
    label: str
    row: int
    same_scale: bool
    metrics: dict[str, float]


def step_records(graph: fx.Graph, step: int, metrics: Sequence[str]) -> list[MonitorRecord]:
    """The records of one recorded step: every tensor and direction of ``graph``, ``metrics``
    of each (none for a graph without nodes)."""
    if not any(n.op != "output" for n in graph.nodes):
        return []
    all_rows = prepare_rows(graph, prune_same_scale=False, where="ScaleMonitor")
    kept = {r.node for r in prepare_rows(graph, prune_same_scale=True, where="ScaleMonitor")}
    new: list[MonitorRecord] = []
    for position, row in enumerate(all_rows):
        for rec in (row.fwd, row.bwd):
            if rec is None:
                continue
            new.append(
                MonitorRecord(
                    step=step,
                    tensor=rec.name,
                    direction=rec.direction,
                    module=rec.module,
                    op=rec.op,
                    tensor_type=rec.tensor_type,
                    label=row.label,
                    row=position,
                    same_scale=row.node not in kept,
                    metrics={m: rec.metrics[m] for m in metrics},
                )
            )
    return new


def long_table(records: Iterable[MonitorRecord]) -> pd.DataFrame:
    """``records`` as a long DataFrame, one row per record and metric (:data:`LONG_COLUMNS`).

    Raises:
        MonitorError: when pandas is not installed.
    """
    pd = _import("pandas", "pandas")
    rows = [
        (r.step, r.tensor, r.direction, metric, value, r.module, r.op, r.tensor_type,
         r.label, r.row, r.same_scale)
        for r in records
        for metric, value in r.metrics.items()
    ]  # fmt: skip
    return pd.DataFrame(rows, columns=list(LONG_COLUMNS))


def _import(module: str, package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        raise MonitorError(f"ScaleMonitor needs {package}: pip install {package}") from error
