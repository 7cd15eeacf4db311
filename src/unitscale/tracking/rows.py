"""Rows of a tracked graph for the plot, the report and ``ScaleMonitor``: which tensors to
show, in which order, and the data flow between them."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import Graph

from .prune import prune_same_scale_tensors
from .records import ScaleRecord, graph_records


@dataclass
class TensorRow:
    """One node shown as one row: its forward and backward records and what feeds it."""

    node: str
    name: str
    module: str
    op: str
    weight: bool
    shape: str
    dtype: str
    fwd: ScaleRecord | None = None
    bwd: ScaleRecord | None = None
    sources: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        """Readable label (parameters by qualified name, others as ``module: variable``)."""
        if self.weight or not self.module:
            return self.name
        return f"{self.module}: {self.name}"

    def record(self, direction: str) -> ScaleRecord | None:
        return self.fwd if direction == "fwd" else self.bwd


def prepare_rows(graph: Graph, prune_same_scale: bool, where: str) -> list[TensorRow]:
    """Rows in graph order, each with the nearest shown ancestors it reads (``sources``).

    Parameters are placed just before the first row that reads them, next to the op they feed.

    Data flow is followed through nodes that are not shown (non-float values, nodes without
    statistics), so that an arrow still connects what the user sees.
    """
    records = list(graph_records(graph, where))  # validates the graph
    if prune_same_scale:
        graph = prune_same_scale_tensors(graph)
        records = list(graph_records(graph, where))
    rows: dict[str, TensorRow] = {}
    for rec in records:
        row = rows.get(rec.node)
        if row is None:
            row = rows[rec.node] = TensorRow(
                rec.node, rec.name, rec.module, rec.op, rec.weight, rec.shape, rec.dtype
            )
        if rec.direction == "fwd":
            row.fwd = rec
        else:
            row.bwd = rec

    nodes = {n.name: n for n in graph.nodes}
    memo: dict[str, list[str]] = {}

    def shown_sources(name: str) -> list[str]:
        if name in memo:
            return memo[name]
        memo[name] = []  # guards against cycles in malformed graphs
        found: list[str] = []
        for parent in nodes[name].all_input_nodes:
            candidates = [parent.name] if parent.name in rows else shown_sources(parent.name)
            found.extend(c for c in candidates if c not in found)
        memo[name] = found
        return found

    for name, row in rows.items():
        row.sources = shown_sources(name)
    return _weights_before_first_use(list(rows.values()))


def _weights_before_first_use(rows: list[TensorRow]) -> list[TensorRow]:
    """Move each parameter (Dynamo lists them all first) to just before its first reader."""
    first_reader: dict[str, str] = {}
    for row in rows:
        for source in row.sources:
            first_reader.setdefault(source, row.node)
    placed = {r.node for r in rows if r.weight and r.node in first_reader}
    waiting: dict[str, list[TensorRow]] = {}
    for row in rows:
        if row.node in placed:
            waiting.setdefault(first_reader[row.node], []).append(row)
    ordered: list[TensorRow] = []
    for row in rows:
        if row.node in placed:
            continue
        ordered.extend(waiting.get(row.node, []))
        ordered.append(row)
    return ordered
