"""Integrations with other libraries' training loops.

Each integration imports its library on first use, so ``import unitscale.integrations`` is
cheap and needs none of them: ``from unitscale.integrations import ScaleMonitorCallback``
imports ``transformers`` (install it with ``pip install 'unitscale[hf]'``).

This package is the layer above :mod:`unitscale.analysis`: it only drives
:class:`~unitscale.tracking.ScaleMonitor` and the presentation functions from other loops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import IntegrationError

if TYPE_CHECKING:
    from .hf import ScaleMonitorCallback

__all__ = [
    # errors
    "IntegrationError",
    # Hugging Face transformers
    "ScaleMonitorCallback",
]


def __getattr__(name: str) -> Any:
    if name == "ScaleMonitorCallback":
        try:
            import transformers  # noqa: F401
        except ModuleNotFoundError as error:
            raise IntegrationError(
                "unitscale.integrations.ScaleMonitorCallback needs transformers: "
                "pip install 'unitscale[hf]'"
            ) from error
        from .hf import ScaleMonitorCallback

        return ScaleMonitorCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
