"""Low precision: format simulation (``simulate_format``/``simulate_fp8``) and real FP8
(``to_fp8``).

Modules: which ops a transform covers and how their operands are found (``_ops``,
``_operands``); the scaling recipes (``_scaling``); the rounding of operands and gradients
(``_quantise``); the simulation's graph pass and transforms (``_pass``, ``_simulate``), its
form of torchao's rowwise recipes (``_simulated_rowwise``) and its block-scaled GEMMs
(``_blocks``: MX, NVFP4); the layers kept in high precision (``_skip``); the float8 GEMMs and
the transform that issues them (``_gemm``, ``_to_fp8``), the one call of ``torch._scaled_mm``
with CUDA's rules and padding (``_scaled_mm``) and torchao's rowwise recipes as float8 GEMMs
(``_rowwise``); FSDP2's float8 all-gather of their weights (``_fsdp``); the report of what
each transform converted (``_summary``).
"""

from ._simulate import (
    FP8_RECIPES,
    FP8Recipe,
    ScalingCost,
    scaling_cost,
    simulate_format,
    simulate_fp8,
)
from ._summary import FP8Summary, fp8_summary
from ._to_fp8 import to_fp8

__all__ = [  # noqa: RUF022 (grouped by concern)
    # simulation
    "FP8_RECIPES",
    "FP8Recipe",
    "simulate_format",
    "simulate_fp8",
    "ScalingCost",
    "scaling_cost",
    # real FP8
    "to_fp8",
    # what was converted
    "FP8Summary",
    "fp8_summary",
]
