"""Which tensors would underflow or overflow in a low-precision format: counts and the worst.

Design constraint: reads only the table from :func:`graph_to_dataframe` (collection is
separate from presentation); the command's summary and the report use the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import AnalysisError

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["RISK_FRACTION", "FormatRisk", "RiskSummary", "WorstTensor", "risk_summary"]

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


def risk_summary(
    df: pd.DataFrame,
    formats: tuple[str, ...] = ("e4m3", "e5m2"),
    threshold: float = RISK_FRACTION,
    worst: int = 3,
) -> RiskSummary:
    """Count the tensors that would underflow or overflow in each format, and find the worst.

    Args:
        df: a table from :func:`unitscale.analysis.graph_to_dataframe`.
        formats: format keys to assess.
        threshold: underflow fraction above which a tensor counts.
        worst: how many of the most affected tensors to keep per format.

    Returns:
        A :class:`RiskSummary`.

    Raises:
        AnalysisError: for a format the table has no columns for.

    Example:
        >>> import pandas as pd
        >>> df = pd.DataFrame({"name": ["a", "b"], "module": ["", "m"], "weight": [False] * 2,
        ...     "direction": ["fwd", "bwd"], "underflow_e4m3": [0.0, 0.5],
        ...     "overflow_e4m3": [0.0, 0.0]})
        >>> s = risk_summary(df, formats=("e4m3",))
        >>> s.formats["e4m3"].underflow, str(s.worst["e4m3"][0])
        (1, 'm: b (gradient): 50.0% underflow in E4M3')
    """
    counts: dict[str, FormatRisk] = {}
    worst_by_format: dict[str, list[WorstTensor]] = {}
    for key in formats:
        under_col, over_col = f"underflow_{key}", f"overflow_{key}"
        if under_col not in df.columns or over_col not in df.columns:
            raise AnalysisError(
                f"risk_summary: the table has no {under_col!r}/{over_col!r} columns; known "
                "formats are e4m3, e5m2, fp16 and bf16"
            )
        under = df[under_col] > threshold
        over = df[over_col] > 0
        counts[key] = FormatRisk(key, int(under.sum()), int(over.sum()))
        at_risk = df[under | over]
        # Overflow first (it breaks training outright), then the underflow fraction; the
        # stable sort keeps graph order among ties, so the result is deterministic.
        ranked = at_risk.assign(_o=at_risk[over_col], _u=at_risk[under_col]).sort_values(
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
                ranked[under_col],
                ranked[over_col],
                strict=True,
            )
        ][:worst]
    return RiskSummary(len(df), counts, worst_by_format)
