"""TorchDynamo, imported only when it is needed.

``import torch._dynamo`` also imports parts of Inductor and costs about a second; unitscale
needs Dynamo only when something is captured or compiled. The ops still have to be known to
Dynamo by then (kept opaque with ``allow_in_graph``, moment tables constant), whoever imports
it first (``torch.compile`` of a user's model, or a unitscale transform), so registrations
wait for that import here.

Design constraints: nothing here imports ``torch._dynamo``; a callback runs exactly once,
right after ``torch._dynamo`` has finished importing (or at once if it already has).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

__all__ = [
    "assume_constant_result",
    "disable",
    "is_optimized_module",
    "when_dynamo_imported",
]

_DYNAMO = "torch._dynamo"
_CALLBACKS: list[Callable[[], None]] = []

F = TypeVar("F", bound=Callable[..., Any])


def assume_constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result`` without importing Dynamo: the decorator only
    sets this attribute, which Dynamo reads when it traces a call of ``fn``."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def disable(fn: F) -> F:
    """``torch.compiler.disable`` without importing Dynamo now: calls go to ``fn`` until
    Dynamo is imported, then (before anything can be traced) to its disabled version, which
    a compiled caller runs eagerly after a graph break."""
    target: list[Callable[..., Any]] = [fn]

    def install() -> None:
        import torch._dynamo

        target[0] = torch._dynamo.disable(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return target[0](*args, **kwargs)

    when_dynamo_imported(install)
    return call  # type: ignore[return-value]


def is_optimized_module(module: object) -> bool:
    """Whether ``module`` was returned by ``torch.compile`` (no module compiled before Dynamo
    was imported, so the check needs no import)."""
    dynamo = sys.modules.get(_DYNAMO)
    if dynamo is None:
        return False
    return isinstance(module, dynamo.eval_frame.OptimizedModule)


def when_dynamo_imported(callback: Callable[[], None]) -> None:
    """Run ``callback`` once ``torch._dynamo`` is imported (now, if it already is)."""
    if _DYNAMO in sys.modules and hasattr(sys.modules[_DYNAMO], "allow_in_graph"):
        callback()
        return
    _CALLBACKS.append(callback)
    if not any(isinstance(finder, _AfterDynamoImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterDynamoImport())


class _AfterDynamoImport(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` as the other finders would and runs the callbacks after the
    module has executed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _RunCallbacks(spec.loader)
        return spec


class _RunCallbacks(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader...
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        callbacks, _CALLBACKS[:] = list(_CALLBACKS), []
        for callback in callbacks:
            callback()
