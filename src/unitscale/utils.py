"""``unitscale.utils``: the name the README and docs/api/utils.rst use for
``unitscale.analysis.annotated`` (where the code lives)."""

from .analysis.annotated import (
    analyse_module,
)

__all__ = [
    "analyse_module",
]
