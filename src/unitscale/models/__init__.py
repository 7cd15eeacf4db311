"""``unitscale.models``: the name DESIGN.md and the README use for
``unitscale.experiments.models`` (where the code lives)."""

from ..experiments.models import (
    GPTConfig,
    ModelConfigError,
    PlainGPT,
    UnitScaledGPT,
    plain_gpt,
    unit_scaled_gpt,
)

__all__ = [
    "GPTConfig",
    "ModelConfigError",
    "PlainGPT",
    "UnitScaledGPT",
    "plain_gpt",
    "unit_scaled_gpt",
]
