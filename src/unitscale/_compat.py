"""Differences between the PyTorch releases unitscale supports, in one place.

Every use of a name that changed between the lowest supported torch release and the newest
goes through this module, so that supporting another release means changing one file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["compile_module", "dynamo_recompile_limit"]


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


def compile_module(module: nn.Module, **options: Any) -> Callable[..., Any]:
    """``torch.compile(module, **options)``, with a top frame whose code is its own.

    TorchDynamo keeps what it learnt about a frame (compiled code, and a mark to skip the
    frame when it captured nothing there) on the frame's code object. A module whose
    ``forward`` Dynamo does not start a frame on (a ``torch.nn`` class: ``Sequential``,
    ``LSTM``...) is compiled through one wrapper function that every such compiled module
    shares (``OptimizedModule._initialize``, torch/_dynamo/eval_frame.py). One of them that
    Dynamo gives up on at the top (an ``nn.LSTM``) marks that shared code to be skipped, and
    every ``torch.nn`` module compiled after it in the process then runs eagerly: under
    unitscale, untransformed. Each module compiled here gets a copy of that code instead,
    as torch does itself where it wants caches apart (``config.debug_force_nested_calls``).
    """
    if torch.compiler.is_compiling():  # traced by an outer torch.compile: as torch builds it
        return torch.compile(module, **options)
    with _own_top_frame():
        return torch.compile(module, **options)


@contextmanager
def _own_top_frame() -> Iterator[None]:
    from torch._dynamo import external_utils

    shared = external_utils.wrap_inline

    def wrap_inline(fn: Callable[..., Any]) -> Callable[..., Any]:
        wrapped = shared(fn)
        code = wrapped.__code__
        wrapped.__code__ = code.replace(co_varnames=code.co_varnames)  # a new code object
        return wrapped

    external_utils.wrap_inline = wrap_inline
    try:
        yield
    finally:
        external_utils.wrap_inline = shared
