"""The error of the integrations, in a module of its own so that an integration
(:mod:`unitscale.integrations.hf`) and the package that loads it on first use
(:mod:`unitscale.integrations`) import it without importing each other."""

from __future__ import annotations

from ..errors import UnitScaleError

__all__ = ["IntegrationError"]


class IntegrationError(UnitScaleError, RuntimeError):
    """An integration cannot run: its library is missing or too old, or it is used wrongly."""
