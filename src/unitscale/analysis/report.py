"""A self-contained interactive HTML report of one or more tracked graphs.

Design constraints: one file, with every script, style and datum inline (see
:mod:`unitscale.analysis._report_assets`); it opens with no network (a Content-Security-Policy
forbids any fetch). The data come from :func:`unitscale.analysis.dataframe.graph_records`, the
same records as the table and the plot.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch.fx import Graph

from .._version import __version__
from ..tracking.metrics import FORMAT_KEYS, FORMAT_RANGES
from ..tracking.rows import TensorRow, prepare_rows
from ._report_assets import CSS, JS, PAGE
from .dataframe import METRIC_DESCRIPTIONS, METRIC_NAMES, AnalysisError, ScaleRecord
from .plot import FORMAT_GUIDES
from .risk import RISK_FRACTION, RiskSummary, risk_conclusion, risk_summary

__all__ = ["write_report"]

_MIN_NORMAL = {"e4m3": 2.0**-6, "e5m2": 2.0**-14, "fp16": 2.0**-14, "bf16": 2.0**-126}
_COLOURS = {"e4m3": "#d62728", "e5m2": "#9467bd", "fp16": "#7f7f7f", "bf16": "#8c564b"}


def _json_number(value: float) -> float | str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value).replace("inf", "Infinity").replace("nan", "NaN")
    return value


def _record_json(rec: ScaleRecord | None, structural: float = 0.0) -> dict[str, Any] | None:
    if rec is None:
        return None
    out: dict[str, Any] = {k: _json_number(v) for k, v in rec.metrics.items()}
    out["tensor_type"] = rec.tensor_type
    if structural > 0:  # a parameter gradient's rounding noise is no underflow risk
        out["structural_zeros"] = structural
        for key, value in rec.metrics.items():
            if key.startswith("underflow_"):
                out[key] = max(0.0, value - structural)
    return out


def _row_json(row: TensorRow, structural: Mapping[str, float]) -> dict[str, Any]:
    gradient_noise = structural.get(row.name, 0.0) if row.weight else 0.0
    return {
        "node": row.node,
        "label": row.label,
        "name": row.name,
        "module": row.module,
        "op": row.op,
        "weight": row.weight,
        "shape": row.shape,
        "dtype": row.dtype,
        "sources": row.sources,
        "fwd": _record_json(row.fwd),
        "bwd": _record_json(row.bwd, gradient_noise),
    }


def _block_columns(models: list[dict[str, Any]]) -> tuple[list[str], dict[str, str]]:
    """The block-format metrics the rows carry (where tracking recorded them), in order,
    and their descriptions: shown with every other metric on hover and in the metric menu."""
    from ..tracking.blocks import block_metric_description

    keys: dict[str, str] = {}
    for model in models:
        for row in model["rows"]:
            for record in (row["fwd"], row["bwd"]):
                for key in record or ():
                    description = block_metric_description(key)
                    if description is not None:
                        keys.setdefault(key, description)
    return list(keys), keys


def _verdict_html(summaries: list[tuple[str, RiskSummary]]) -> str:
    """The page's conclusion, the counts per model and the worst tensors, as static HTML
    (read with scripts disabled): what ``unitscale analyse`` prints in ``summary.txt``."""
    keys = ("e4m3", "e5m2")
    head = "".join(
        f"<th>{k.upper()} {what}</th>" for k in keys for what in ("underflow", "overflow")
    )
    rows = []
    for name, summary in summaries:
        cells = "".join(
            f'<td class="num">{getattr(summary.formats[k], what)}</td>'
            for k in keys
            for what in ("underflow", "overflow")
        )
        rows.append(
            f'<tr><td>{html.escape(name)}</td><td class="num">{summary.tensors}</td>{cells}</tr>'
        )
    worst = [
        f"<tr><td>{html.escape(name)}</td><td>{k.upper()}</td><td>{html.escape(str(w))}</td></tr>"
        for name, summary in summaries
        for k in keys
        for w in summary.worst.get(k, [])
    ]
    worst_table = (
        '<table class="risk" id="worst-static"><tr><th>model</th><th>format</th>'
        f"<th>tensor: fraction at risk</th></tr>{''.join(worst)}</table>"
        if worst
        else '<p id="worst-static">No tensor is at risk in E4M3 or E5M2.</p>'
    )
    return (
        '<section id="verdict">\n'
        f'<p id="conclusion"><strong>{html.escape(risk_conclusion(summaries))}</strong></p>\n'
        '<table class="risk" id="counts-static"><tr><th>model</th><th>tensors</th>'
        f"{head}</tr>{''.join(rows)}</table>\n"
        f'<p class="note">Tensors: the values and gradients shown (an op\'s output and its '
        f"gradient count as two); underflow counts those with more than "
        f"{100 * RISK_FRACTION:g}% of their non-zero values flushed to zero (structural zeros "
        "of parameter gradients aside), overflow those with any value beyond the format's "
        "largest.</p>\n"
        f"<h2>Worst tensors</h2>\n{worst_table}\n"
        '<noscript><p class="note">The chart, its controls and the sortable table below '
        "need JavaScript; the conclusion and the tables above do not.</p></noscript>\n"
        "</section>"
    )


def _summaries(
    graphs: Mapping[str, Graph], prune_same_scale: bool, noise: Mapping[str, Any]
) -> list[tuple[str, RiskSummary]]:
    """:func:`risk_summary` of every graph, as ``unitscale analyse`` computes it."""
    from ..tracking import prune_same_scale_tensors
    from .dataframe import graph_to_dataframe

    out = []
    for name, g in graphs.items():
        table = graph_to_dataframe(prune_same_scale_tensors(g) if prune_same_scale else g)
        out.append((str(name), risk_summary(table, structural_zeros=noise.get(name) or {})))
    return out


def write_report(
    graph: Graph | Mapping[str, Graph],
    path: str | os.PathLike[str],
    title: str = "unitscale: tensor scales",
    prune_same_scale: bool = True,
    structural_zeros: Mapping[str, Any] | None = None,
) -> Path:
    """Write an interactive, self-contained HTML report of tracked scales.

    The page opens with its conclusion (which model has the fewest tensors at risk in E4M3,
    :func:`~unitscale.analysis.risk_conclusion`), the counts of tensors at risk per model
    and format and the worst tensors (:func:`~unitscale.analysis.risk_summary`, as
    ``unitscale analyse`` prints them), all as plain HTML that reads with scripts disabled.
    The page shows every tensor's forward and backward scale on a log2 axis (one mark per
    tensor and direction) with the E4M3, E5M2 and FP16 ranges; hovering a mark shows its module
    path, op, shape, dtype and every metric including per-format underflow and overflow (and
    the block-format metrics, where ``track_scales(..., block_formats=...)`` recorded them).
    Controls toggle forward/backward, filter by name, pick the metric and (for several graphs)
    the model; a sortable table lists the tensors most at risk in a chosen format.

    Args:
        graph: ``tracked.scales_graph()``, or ``{"model name": graph, ...}`` to compare models
            in one page.
        path: the ``.html`` file to write (parent folders are created).
        title: page title.
        prune_same_scale: hide tensors whose scale equals their single input's in both
            directions (as :func:`unitscale.analysis.plot` does).
        structural_zeros: the fraction of each parameter's gradient that is structural zeros
            (:func:`unitscale.analysis.structural_zeros`), ``{parameter: fraction}`` for one
            graph or ``{model name: {parameter: fraction}}`` for several: the report's
            underflow of those gradients leaves them out, as
            :func:`~unitscale.analysis.risk_summary` does, and shows the fraction.

    Returns:
        The path written.

    Raises:
        AnalysisError: when a graph has no metrics or no graph is given.

    Example:
        >>> import tempfile
        >>> from unitscale.tracking.metrics import Metrics
        >>> g = Graph()
        >>> x = g.placeholder("x")
        >>> x.meta.update(clean_name="x", metrics=Metrics(
        ...     fwd=Metrics.Data(1.0, 0.0, 1.2, 3.0, 0.0, 1.2, 16)))
        >>> with tempfile.TemporaryDirectory() as d:
        ...     out = write_report(g, f"{d}/scales.html", prune_same_scale=False)
        ...     "<script" in out.read_text() and "http://" not in out.read_text().replace(
        ...         "http://www.w3.org/2000/svg", "")
        True
    """
    graphs = {"model": graph} if isinstance(graph, Graph) else dict(graph)
    if not graphs:
        raise AnalysisError("write_report: no graph given; pass a graph or {name: graph}")
    noise = structural_zeros or {}
    by_model = {"model": noise} if isinstance(graph, Graph) else noise
    models = []
    for name, g in graphs.items():
        rows = prepare_rows(g, prune_same_scale, f"write_report (model {name!r})")
        structural = by_model.get(name) or {}
        models.append({"name": str(name), "rows": [_row_json(r, structural) for r in rows]})
    block_keys, block_descriptions = _block_columns(models)
    guide_labels = {k.lower() for k in FORMAT_GUIDES}
    formats = {
        key: {
            "label": key.upper(),
            "min_subnormal": FORMAT_RANGES[key][0],
            "min_normal": _MIN_NORMAL[key],
            "max": FORMAT_RANGES[key][1],
            "colour": _COLOURS[key],
            "guide": key in guide_labels,
        }
        for key in FORMAT_KEYS
    }
    data = {
        "title": title,
        "version": __version__,
        "risk_fraction": RISK_FRACTION,
        "metrics": [*METRIC_NAMES, *block_keys],
        "metric_descriptions": {**METRIC_DESCRIPTIONS, **block_descriptions},
        "scale_metrics": ["mean_abs", "rms", "std", "abs_max", "abs_min", "abs_mean"],
        "formats": formats,
        "models": models,
    }
    payload = json.dumps(data, allow_nan=False, separators=(",", ":"))
    # Inside <script>, "</script" or "<!--" in a name would end or confuse the element;
    # "\u003c" is the same JSON string with no "<" left in the page source.
    payload = payload.replace("<", "\\u003c")
    guide_legend = " of " + ", ".join(
        f'<b style="color:{f["colour"]}">{html.escape(str(f["label"]))}</b>'
        for f in formats.values()
        if f["guide"]
    )
    values = {
        "title": html.escape(title),
        "css": CSS,
        "js": JS,
        "data": payload,
        "guide_legend": guide_legend,
        "verdict": _verdict_html(_summaries(graphs, prune_same_scale, by_model)),
        "footer": html.escape(
            f"Written by unitscale {__version__}. Self-contained: no network needed."
        ),
    }
    page = re.sub(
        r"\{(title|css|js|data|guide_legend|footer|verdict)\}", lambda m: values[m[1]], PAGE
    )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out
