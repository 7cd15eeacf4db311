"""``unitscale.utils``: the name DESIGN.md and the README use for
``unitscale.analysis.annotated`` (where the code lives)."""

from .analysis.annotated import (
    analyse_module,
)

__all__ = [
    "analyse_module",
]
