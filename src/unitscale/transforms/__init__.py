"""Graph transforms: scale tracking, automatic unit scaling, format simulation, real FP8,
compile."""

from ..tracking import (
    Metrics,
    TrackingCoverage,
    prune_non_float_tensors,
    prune_same_scale_tensors,
    prune_selected_nodes,
    tracking_coverage,
)
from ._compile import compile
from ._track import track_scales
from .lowp import (
    FP8_RECIPES,
    FP8Recipe,
    FP8Summary,
    ScalingCost,
    fp8_summary,
    scaling_cost,
    simulate_format,
    simulate_fp8,
    to_fp8,
)
from .unit_scaling import (
    ResidualTau,
    UnitScaleSummary,
    UnknownOpError,
    unit_scale,
    unit_scale_summary,
)

__all__ = [  # noqa: RUF022 (grouped by concern)
    # scale tracking
    "Metrics",
    "prune_non_float_tensors",
    "prune_same_scale_tensors",
    "prune_selected_nodes",
    "track_scales",
    "TrackingCoverage",
    "tracking_coverage",
    # automatic unit scaling
    "ResidualTau",
    "UnknownOpError",
    "unit_scale",
    "UnitScaleSummary",
    "unit_scale_summary",
    # number-format simulation
    "FP8_RECIPES",
    "FP8Recipe",
    "simulate_format",
    "simulate_fp8",
    "ScalingCost",
    "scaling_cost",
    "FP8Summary",
    "fp8_summary",
    # real FP8
    "to_fp8",
    # compilation
    "compile",
]
