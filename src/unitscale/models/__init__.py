"""``unitscale.models``: the name the README and docs/api/models.rst use for
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
