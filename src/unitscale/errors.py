"""Errors raised by unitscale.

Every error the library raises on bad input derives from :class:`UnitScaleError`, so that
``except unitscale.UnitScaleError`` catches them all. Messages name the op, node, module,
format or argument concerned and say what to do about it.
"""

from __future__ import annotations

__all__ = [
    "AnalysisError",
    "CaptureError",
    "MonitorError",
    "UnitScaleError",
    "UnsupportedArgumentError",
]


class UnitScaleError(Exception):
    """Base class of every error unitscale raises on bad input."""


class UnsupportedArgumentError(UnitScaleError, ValueError):
    """An argument of a unit-scaled op (``linear``) or module (``Linear``) has a value it does
    not support."""

    def __init__(self, op: str, argument: str, value: object, fix: str = "") -> None:
        # Ops live in unitscale.functional (``linear``); modules at top level (``Linear``).
        where = f"unitscale.{op}" if op[:1].isupper() else f"unitscale.functional.{op}"
        message = f"{where}: argument {argument!r}={value!r} is not supported"
        if fix:
            message += f"; {fix}"
        super().__init__(message)
        self.op = op
        self.argument = argument


class CaptureError(UnitScaleError, RuntimeError):
    """A module's forward pass could not be captured as a graph."""


class AnalysisError(UnitScaleError, ValueError):
    """A graph or an argument given to an analysis function cannot be used."""


class MonitorError(UnitScaleError, ValueError):
    """A :class:`~unitscale.tracking.ScaleMonitor` was built or used the wrong way, or its
    table cannot be presented (a metric not kept, a missing optional package). Here so that
    the monitor (``tracking``) and the heatmap and TensorBoard export (``analysis``) share it
    without importing each other; re-exported by :mod:`unitscale.tracking`."""
