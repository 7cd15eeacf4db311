"""Graph transforms: scale tracking, automatic unit scaling, format simulation, real FP8,
compile."""

from ..tracking import (
    Metrics,
    prune_non_float_tensors,
    prune_same_scale_tensors,
    prune_selected_nodes,
)
from ._compile import compile
from ._simulate import (
    FP8_RECIPES,
    FP8Recipe,
    ScalingCost,
    scaling_cost,
    simulate_format,
    simulate_fp8,
)
from ._to_fp8 import FP8Op, FP8Summary, fp8_summary, to_fp8
from ._track import track_scales
from ._unit_scale import ResidualTau, UnknownOpError, unit_scale

__all__ = [  # noqa: RUF022 (grouped by concern, see STYLE.md)
    # scale tracking
    "Metrics",
    "prune_non_float_tensors",
    "prune_same_scale_tensors",
    "prune_selected_nodes",
    "track_scales",
    # automatic unit scaling
    "ResidualTau",
    "UnknownOpError",
    "unit_scale",
    # number-format simulation
    "FP8_RECIPES",
    "FP8Recipe",
    "simulate_format",
    "simulate_fp8",
    "ScalingCost",
    "scaling_cost",
    # real FP8
    "FP8Op",
    "FP8Summary",
    "fp8_summary",
    "to_fp8",
    # compilation
    "compile",
]
