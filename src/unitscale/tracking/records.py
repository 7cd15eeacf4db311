"""The records of a tracked graph: one :class:`ScaleRecord` per graph node and direction.

Design constraints: this is the one place that reads the node meta written by
:func:`unitscale.transforms.track_scales` (``metrics``, ``clean_name``, ``module_path``,
``requires_grad``, ``shape``/``dtype`` or Dynamo's ``example_value``); the table
(:func:`unitscale.analysis.graph_to_dataframe`), the plot, the HTML report, ``ScaleMonitor``
and the command only consume these records.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.fx import Graph, Node

from ..errors import AnalysisError
from .metrics import FORMAT_KEYS, Metrics

__all__ = [
    "ID_COLUMNS",
    "METRIC_NAMES",
    "ScaleRecord",
    "graph_records",
    "op_name",
]


#: Every metric column in order (the scalar fields of ``Metrics.Data``, then
#: ``underflow_<fmt>``/``overflow_<fmt>`` per format, the keys of ``Metrics.Data.as_dict()``).
METRIC_NAMES: tuple[str, ...] = (
    *(f.name for f in fields(Metrics.Data) if f.name not in ("underflow", "overflow")),
    *(f"{kind}_{key}" for key in FORMAT_KEYS for kind in ("underflow", "overflow")),
)

#: Columns that describe a row, before the metrics.
ID_COLUMNS: tuple[str, ...] = (
    "order",
    "node",
    "name",
    "module",
    "op",
    "weight",
    "direction",
    "tensor_type",
    "shape",
    "dtype",
)


@dataclass(frozen=True)
class ScaleRecord:
    """One tensor in one direction: the statistics of a node's value or of its gradient.

    Attributes:
        order: the node's position in the graph (execution order).
        node: the fx node's name (unique; used to connect data flow).
        name: the clean name (source variable, parameter or argument name).
        module: qualified name of the innermost module that produced it ("" at top level).
        op: what computed it, readable (``"linear"``, ``"add"``, ``"view"``, ``"parameter"``).
        weight: True for a trainable parameter.
        direction: ``"fwd"`` (the value) or ``"bwd"`` (its gradient).
        tensor_type: ``"x"``, ``"w"``, ``"grad_x"`` or ``"grad_w"``.
        shape: the value's shape as text, e.g. ``"(8, 64, 128)"`` ("" when unknown).
        dtype: the value's dtype without ``torch.``, e.g. ``"float32"`` ("" when unknown).
        inputs: ``node`` names of the nodes this one reads (data flow).
        metrics: every metric of ``Metrics.Data.as_dict()``, then the block-format metrics
            where tracking recorded them (``block_flushed_<format>`` and the like, see
            :mod:`unitscale.tracking.blocks`).
    """

    order: int
    node: str
    name: str
    module: str
    op: str
    weight: bool
    direction: str
    tensor_type: str
    shape: str
    dtype: str
    inputs: tuple[str, ...]
    metrics: dict[str, float]

    def as_row(self) -> dict[str, Any]:
        """The record as one flat table row (without ``inputs``)."""
        row: dict[str, Any] = {c: getattr(self, c) for c in ID_COLUMNS}
        for key in METRIC_NAMES:
            row[key] = self.metrics.get(key, math.nan)
        for key, value in self.metrics.items():  # block-format metrics, where recorded
            if key not in row:
                row[key] = value
        return row


def op_name(node: Node) -> str:
    """A readable name for what a node computes.

    Example:
        >>> import operator
        >>> g = Graph()
        >>> a = g.placeholder("a")
        >>> op_name(g.call_function(operator.add, (a, a)))
        'add'
    """
    if node.op == "placeholder":
        return "parameter" if node.meta.get("requires_grad") else "input"
    if node.op == "get_attr":
        return "parameter" if node.meta.get("requires_grad") else "buffer"
    target = node.target
    if isinstance(target, str):
        return target
    name = getattr(target, "__name__", None) or str(target)
    return name.removeprefix("_").removesuffix("_") if name.startswith("__") else name


def _value_meta(node: Node) -> tuple[str, str]:
    shape = node.meta.get("shape")
    dtype = node.meta.get("dtype")
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.Tensor):
        shape = value.shape if shape is None else shape
        dtype = value.dtype if dtype is None else dtype
    shape_text = "" if shape is None else "(" + ", ".join(str(int(s)) for s in shape) + ")"
    if shape is not None and len(tuple(shape)) == 1:
        shape_text = shape_text[:-1] + ",)"
    dtype_text = "" if dtype is None else str(dtype).removeprefix("torch.")
    return shape_text, dtype_text


def _check_graph(graph: object, where: str) -> Graph:
    if not isinstance(graph, Graph):
        raise AnalysisError(
            f"{where}: expected a torch.fx.Graph from tracked.scales_graph(), got "
            f"{type(graph).__name__}"
        )
    nodes = [n for n in graph.nodes if n.op != "output"]
    if not nodes:
        raise AnalysisError(
            f"{where}: the graph is empty; call the tracked module (and backward()) before "
            "tracked.scales_graph()"
        )
    if not any(isinstance(n.meta.get("metrics"), Metrics) for n in nodes):
        raise AnalysisError(
            f"{where}: the graph has no scale metrics (node.meta['metrics']); build it with "
            "tracked = unitscale.transforms.track_scales(module), run tracked(...) and "
            "backward(), then pass tracked.scales_graph()"
        )
    return graph


def graph_records(graph: Graph, where: str = "graph_records") -> Iterator[ScaleRecord]:
    """Yield a :class:`ScaleRecord` per tracked node and direction, in graph order.

    Nodes without metrics (non-float values) are skipped, and so is a direction that has no
    statistics (``bwd`` where no gradient flowed).

    Raises:
        AnalysisError: when ``graph`` is not a tracked scales graph.
    """
    _check_graph(graph, where)
    for order, node in enumerate(graph.nodes):
        metrics = node.meta.get("metrics")
        if not isinstance(metrics, Metrics):
            continue
        weight = bool(node.meta.get("requires_grad", False)) and node.op in (
            "placeholder",
            "get_attr",
        )
        shape, dtype = _value_meta(node)
        inputs = tuple(n.name for n in node.all_input_nodes)
        blocks = metrics.blocks
        for direction, data in (("fwd", metrics.fwd), ("bwd", metrics.bwd)):
            if data is None:
                continue
            values = dict(data.as_dict())
            if blocks is not None:
                values.update(blocks.get(direction, {}))
            base = "w" if weight else "x"
            yield ScaleRecord(
                order=order,
                node=node.name,
                name=str(node.meta.get("clean_name", node.name)),
                module=str(node.meta.get("module_path", "")),
                op=op_name(node),
                weight=weight,
                direction=direction,
                tensor_type=base if direction == "fwd" else f"grad_{base}",
                shape=shape,
                dtype=dtype,
                inputs=inputs,
                metrics=values,
            )
