"""Differences between the PyTorch releases unitscale supports, in one place.

Every use of a name that changed between the lowest supported torch release and the newest
goes through this module, so that supporting another release means changing one file.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

__all__ = ["dynamo_recompile_limit"]


def dynamo_recompile_limit(limit: int, accumulated: bool = False) -> AbstractContextManager[Any]:
    """Patch TorchDynamo's per-frame recompile limit (and the accumulated one if asked).

    torch 2.6 renamed ``cache_size_limit``/``accumulated_cache_size_limit`` to
    ``recompile_limit``/``accumulated_recompile_limit``.
    """
    import torch._dynamo

    config = torch._dynamo.config
    new_names = hasattr(config, "recompile_limit")
    per_frame = "recompile_limit" if new_names else "cache_size_limit"
    total = "accumulated_recompile_limit" if new_names else "accumulated_cache_size_limit"
    settings: dict[str, Any] = {per_frame: limit}
    if accumulated:
        settings[total] = limit
    return config.patch(settings)
