"""Which tensors would underflow or overflow in a low-precision format: counts and the worst.

Design constraint: reads only the table from :func:`graph_to_dataframe` (collection is
separate from presentation); the command's summary and the report use the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import AnalysisError

if TYPE_CHECKING:
    import pandas as pd
    from torch import fx, nn

__all__ = [
    "RISK_FRACTION",
    "FormatRisk",
    "RiskSummary",
    "WorstTensor",
    "risk_conclusion",
    "risk_summary",
    "structural_zeros",
]

#: A tensor counts as underflowing in a format when more than this fraction of its values
#: would round to zero; any overflowing value counts (it saturates or becomes Inf).
RISK_FRACTION = 0.01


@dataclass(frozen=True)
class FormatRisk:
    """Counts of tensors (value or gradient) at risk in one format.

    Attributes:
        format: the format key (``"e4m3"``, ``"e5m2"``, ``"fp16"``, ``"bf16"``).
        underflow: how many lose more than :data:`RISK_FRACTION` of their values to zero.
        overflow: how many have at least one value beyond the format's largest.
    """

    format: str
    underflow: int
    overflow: int


def _percent(fraction: float) -> str:
    return "<0.1%" if 0 < fraction < 0.001 else f"{100 * fraction:.1f}%"


@dataclass(frozen=True)
class WorstTensor:
    """One of the tensors most at risk in a format."""

    label: str
    direction: str
    format: str
    underflow: float
    overflow: float

    def __str__(self) -> str:
        kind = "gradient" if self.direction == "bwd" else "value"
        parts = []
        if self.underflow > 0:
            parts.append(f"{_percent(self.underflow)} underflow")
        if self.overflow > 0:
            parts.append(f"{_percent(self.overflow)} overflow")
        return f"{self.label} ({kind}): {', '.join(parts) or 'none'} in {self.format.upper()}"


@dataclass(frozen=True)
class RiskSummary:
    """How many tensors of a table are at risk per format, and the worst ones.

    Attributes:
        tensors: number of rows counted (one per tensor and direction).
        formats: per format key, a :class:`FormatRisk`.
        worst: per format key, the most affected tensors, worst first (only those at risk).
    """

    tensors: int
    formats: dict[str, FormatRisk]
    worst: dict[str, list[WorstTensor]]

    def __str__(self) -> str:
        lines = [f"{self.tensors} tensors (values and gradients)"]
        for key, risk in self.formats.items():
            lines.append(
                f"{key.upper()}: {risk.underflow} underflow (more than "
                f"{_percent(RISK_FRACTION)} of values flushed to zero), "
                f"{risk.overflow} overflow"
            )
            lines += [f"  {tensor}" for tensor in self.worst.get(key, [])]
        return "\n".join(lines)


def risk_summary(
    df: pd.DataFrame | fx.Graph,
    formats: tuple[str, ...] = ("e4m3", "e5m2"),
    threshold: float = RISK_FRACTION,
    worst: int = 3,
    structural_zeros: Mapping[str, float] | None = None,
) -> RiskSummary:
    """Count the tensors that would underflow or overflow in each format, and find the worst.

    Structural zeros are not a risk: a parameter gradient's elements that are rounding noise
    of a mathematically zero value (``|g| <= STRUCTURAL_ZERO_RTOL * rms(g)``, see
    :func:`unitscale.tracking.structural_zero_fraction`; the key bias of a fused QKV
    projection is the common case) lose nothing when flushed to zero. Given their fractions,
    a parameter gradient's underflow counts as ``max(0, underflow - structural)``.

    Args:
        df: a table from :func:`unitscale.analysis.graph_to_dataframe`, or the tracked
            graph itself (``tracked.scales_graph()``), which is tabulated first.
        formats: format keys to assess.
        threshold: underflow fraction above which a tensor counts.
        worst: how many of the most affected tensors to keep per format.
        structural_zeros: per parameter name (``named_parameters()``), the fraction of its
            gradient that is structural zeros, as :func:`structural_zeros` gives.

    Returns:
        A :class:`RiskSummary`.

    Raises:
        AnalysisError: for a format the table has no columns for, or an argument that is
            neither a table nor a tracked graph.

    Example:
        >>> import pandas as pd
        >>> df = pd.DataFrame({"name": ["a", "b"], "module": ["", "m"], "weight": [False] * 2,
        ...     "direction": ["fwd", "bwd"], "underflow_e4m3": [0.0, 0.5],
        ...     "overflow_e4m3": [0.0, 0.0]})
        >>> s = risk_summary(df, formats=("e4m3",))
        >>> s.formats["e4m3"].underflow, str(s.worst["e4m3"][0])
        (1, 'm: b (gradient): 50.0% underflow in E4M3')
        >>> print(s)
        2 tensors (values and gradients)
        E4M3: 1 underflow (more than 1.0% of values flushed to zero), 0 overflow
          m: b (gradient): 50.0% underflow in E4M3
    """
    from torch.fx import Graph

    from .dataframe import graph_to_dataframe

    if isinstance(df, Graph):
        df = graph_to_dataframe(df)
    if not all(hasattr(df, column) for column in ("columns", "direction", "name")):
        raise AnalysisError(
            f"risk_summary: expected a table from graph_to_dataframe() or a tracked graph "
            f"(tracked.scales_graph()), got {type(df).__name__}"
        )
    counts: dict[str, FormatRisk] = {}
    worst_by_format: dict[str, list[WorstTensor]] = {}
    for key in formats:
        under_col, over_col = f"underflow_{key}", f"overflow_{key}"
        if under_col not in df.columns or over_col not in df.columns:
            raise AnalysisError(
                f"risk_summary: the table has no {under_col!r}/{over_col!r} columns; known "
                "formats are e4m3, e5m2, fp16 and bf16"
            )
        underflow = _without_structural_zeros(df, under_col, structural_zeros or {})
        under = underflow > threshold
        over = df[over_col] > 0
        counts[key] = FormatRisk(key, int(under.sum()), int(over.sum()))
        at_risk = df[under | over]
        # Overflow first (it breaks training outright), then the underflow fraction; the
        # stable sort keeps graph order among ties, so the result is deterministic.
        ranked = at_risk.assign(_o=at_risk[over_col], _u=underflow[under | over]).sort_values(
            ["_o", "_u"], ascending=False, kind="stable"
        )
        worst_by_format[key] = [
            WorstTensor(
                label=name if weight or not module else f"{module}: {name}",
                direction=direction,
                format=key,
                underflow=float(u),
                overflow=float(o),
            )
            for name, module, weight, direction, u, o in zip(
                ranked.name,
                ranked.module,
                ranked.weight,
                ranked.direction,
                ranked._u,
                ranked[over_col],
                strict=True,
            )
        ][:worst]
    return RiskSummary(len(df), counts, worst_by_format)


def risk_conclusion(summaries: Sequence[tuple[str, RiskSummary]]) -> str:
    """One line that says which model has the fewest tensors at risk in E4M3 (underflow and
    overflow together): the last line of ``unitscale analyse``'s summary, and the verdict
    at the top of :func:`~unitscale.analysis.write_report`'s page.

    Args:
        summaries: ``(model name, risk_summary(...))`` per model, with an ``"e4m3"`` entry.

    Raises:
        AnalysisError: when ``summaries`` is empty.

    Example:
        >>> def risk(n, under): return RiskSummary(n, {"e4m3": FormatRisk("e4m3", under, 0)}, {})
        >>> print(risk_conclusion([("plain", risk(120, 77)), ("unit-scaled", risk(136, 3))]))
        conclusion: in E4M3, unit-scaled has the fewest tensors at risk (3 of 136; plain
        77 of 120).
        >>> risk_conclusion([("mine", risk(10, 0))])
        'conclusion: in E4M3, mine has no tensor at risk (of 10).'
    """
    if not summaries:
        raise AnalysisError("risk_conclusion: no model given; pass [(name, risk_summary), ...]")

    def at_risk(summary: RiskSummary) -> int:
        e4m3 = summary.formats["e4m3"]
        return e4m3.underflow + e4m3.overflow

    ranked = sorted(summaries, key=lambda item: at_risk(item[1]))
    (best, summary), others = ranked[0], ranked[1:]
    if not others:
        count = at_risk(summary)
        if count == 0:
            return f"conclusion: in E4M3, {best} has no tensor at risk (of {summary.tensors})."
        return f"conclusion: in E4M3, {best} has {count} of {summary.tensors} tensors at risk."
    if at_risk(summary) == at_risk(others[0][1]):
        tied = ", ".join(f"{name} {at_risk(s)} of {s.tensors}" for name, s in ranked)
        return f"conclusion: in E4M3, no model has fewer tensors at risk than another ({tied})."
    rest = "; ".join(f"{name} {at_risk(s)} of {s.tensors}" for name, s in others)
    return (
        f"conclusion: in E4M3, {best} has the fewest tensors at risk "
        f"({at_risk(summary)} of {summary.tensors}; {rest})."
    )


def _without_structural_zeros(
    df: pd.DataFrame, column: str, structural: Mapping[str, float]
) -> pd.Series:
    """``df[column]`` with each parameter gradient's structural zeros taken out."""
    if not structural:
        return df[column]
    gradients = (df.direction == "bwd") & df.weight
    fractions = df.name.map(structural).where(gradients, 0.0).fillna(0.0)
    return (df[column] - fractions).clip(lower=0.0)


def structural_zeros(module: nn.Module) -> dict[str, float]:
    """Per parameter of ``module`` with a gradient, the fraction of ``param.grad`` that is
    structural zeros (:func:`unitscale.tracking.structural_zero_fraction`): the argument
    :func:`risk_summary` takes. Read after the backward pass of the step whose scales are
    assessed (``.grad`` accumulates over steps until it is zeroed).

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> layer(torch.ones(1, 2)).sum().backward()
        >>> layer.bias.grad[0] = 1e-9  # rounding noise of a zero gradient
        >>> structural_zeros(layer)
        {'weight': 0.0, 'bias': 0.5}
    """
    from ..tracking import structural_zero_fraction

    return {
        name: structural_zero_fraction(param.grad)
        for name, param in module.named_parameters()
        if param.grad is not None
    }
