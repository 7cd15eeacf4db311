"""A module that behaves like the module it wraps: attributes, containers, names and
``state_dict()`` keys are the wrapped module's (the base of ``TransformedModule``).

Design constraint: a parent module sees the wrapped module's tree under the wrapper's own
name (``block.weight``, never ``block.module.weight``), so that checkpoints of the original
load into the wrapper and back, and ``torch.func.functional_call`` reaches the wrapped
module's tensors by their original names.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from types import MethodType
from typing import Any

import torch
from torch import Tensor, nn

#: Attributes of the wrapper itself, never looked up on or set into the wrapped module.
_OWN_ATTRIBUTES = frozenset({"module", "passes", "_capture", "training"})
#: The view class made for each wrapped class (see :func:`_view_class`).
_VIEW_CLASSES: dict[type, type] = {}
#: Each wrapper's view of its wrapped module (weak: a view never keeps a wrapper alive).
_VIEWS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def _view_class(cls: type) -> type | None:
    """A subclass of ``cls`` whose instances are views of a wrapped module.

    A view shares the wrapped module's ``__dict__`` (its parameters, submodules, hooks and
    attributes are the module's own, so ``super()``, ``isinstance`` and every attribute
    work as on the module), and only its call and its ``forward`` differ: they are the
    wrapper's (a data descriptor, so an instance ``forward`` of the module, as accelerate's
    hooks set, does not hide it; the wrapper's forward runs that one). Nothing of the wrapped
    module is changed, so two threads can run its methods at once. None where ``cls``
    cannot be subclassed.
    """
    view = _VIEW_CLASSES.get(cls)
    if view is not None:
        return view

    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        wrapper = _wrapper_of(self)
        return (
            wrapper(*args, **kwargs) if wrapper is not None else cls.__call__(self, *args, **kwargs)
        )

    def forward(self: nn.Module) -> Any:
        wrapper = _wrapper_of(self)
        return wrapper.forward if wrapper is not None else cls.forward.__get__(self)  # type: ignore[attr-defined]

    namespace = {
        "__slots__": ("_unitscale_wrapper",),
        "__call__": call,
        "forward": property(forward),
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
    }
    try:
        view = type(cls.__name__, (cls,), namespace)
    except Exception:  # a class that refuses subclasses (final, a metaclass's rule)
        return None
    _VIEW_CLASSES[cls] = view
    return view


def _wrapper_of(view: nn.Module) -> nn.Module | None:
    ref: weakref.ref[nn.Module] = object.__getattribute__(view, "_unitscale_wrapper")
    return ref()


class _Wrapper(nn.Module):
    """Forwards attribute access, the container protocol and the parameter, buffer, module
    and ``state_dict()`` walks to ``self.module``."""

    module: nn.Module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("module", "passes", "_capture"):
                raise
            inner = self._modules["module"]
            value = getattr(inner, name)
            if (
                isinstance(value, MethodType)
                and value.__self__ is inner
                and name != "forward"
                and not torch.compiler.is_compiling()  # traced: a method is inlined as written
            ):
                return self._routed(value)
            return value

    def _view(self) -> nn.Module | None:
        """The wrapped module seen through this module: its state, this module's call."""
        view = _VIEWS.get(self)
        inner = self.module
        if view is None or view.__dict__ is not inner.__dict__:
            cls = _view_class(type(inner))  # new, or the wrapped module was replaced
            if cls is None:
                return None
            view = object.__new__(cls)
            object.__setattr__(view, "__dict__", inner.__dict__)
            object.__setattr__(view, "_unitscale_wrapper", weakref.ref(self))
            _VIEWS[self] = view
        return view

    def _routed(self, method: MethodType) -> Callable[..., Any]:
        """``method`` of the wrapped module, run so that what it calls of the module itself
        (``self(...)``, ``self.forward(...)``: transformers' ``generate()``, a user's
        ``predict()``) runs through this module's forward, not untransformed.

        The method runs on a view of the wrapped module (:func:`_view_class`) instead of
        the module: nothing is set on the module during the call, so concurrent calls and
        a hook that keeps ``self.forward`` see no temporary state. A method that returns
        the module itself returns this module.
        """
        view = self._view()
        if view is None:
            return method
        function = method.__func__

        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            result = function(view, *args, **kwargs)
            return self if result is view else result

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        # A parameter, buffer or submodule of the wrapped module is set there, so that
        # ``torch.func.functional_call`` (which swaps tensors by their names in
        # named_parameters()) reaches the root's own tensors as it reaches a submodule's.
        inner = self.__dict__.get("_modules", {}).get("module")
        if inner is not None and name not in _OWN_ATTRIBUTES and name not in self.__dict__:
            if name in inner._parameters and (
                value is None or (isinstance(value, Tensor) and not isinstance(value, nn.Parameter))
            ):
                inner._parameters[name] = value  # swapped in as functional_call does
                return
            if name in inner._parameters or name in inner._buffers or name in inner._modules:
                setattr(inner, name, value)
                return
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        inner = self.__dict__.get("_modules", {}).get("module")
        if inner is not None and name not in _OWN_ATTRIBUTES and name not in self.__dict__:
            if name in inner._parameters or name in inner._buffers or name in inner._modules:
                delattr(inner, name)
                return
        super().__delattr__(name)

    # A transformed container is a container: indexing, len(), iteration and ``in`` are the
    # wrapped module's. What they return are modules of the copy, untransformed when called
    # on their own (the transform applies to calls of this module).
    def __getitem__(self, key: Any) -> Any:
        return self._modules["module"][key]  # type: ignore[index]

    def __len__(self) -> int:
        return len(self._modules["module"])  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._modules["module"])  # type: ignore[call-overload]

    def __contains__(self, key: Any) -> bool:
        return key in self._modules["module"]  # type: ignore[operator]

    def __bool__(self) -> bool:
        # Defined because __len__ is: a module is true, however long the container it wraps.
        return True

    # A parent module sees the wrapped module's tree under this module's own name, so that its
    # named_parameters(), state_dict() and load_state_dict() agree ("block.weight", never
    # "block.module.weight"): named_modules() and state_dict() skip the "module" level, and
    # _load_from_state_dict() moves a parent's keys back to where its walk of _modules
    # looks for them.
    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Module]]:
        """This module, then the wrapped module's tree under the same names (no ``module.``)."""
        if memo is None:
            memo = set()
        if self in memo:
            return
        if remove_duplicate:
            memo.add(self)
        yield prefix, self
        yield from self.module.named_modules(memo, prefix, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's ``state_dict()``: keys are the original's."""
        result = self.module.state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")
        metadata = getattr(result, "_metadata", None)
        if prefix and isinstance(metadata, dict):
            # A parent's load_state_dict() reads the wrapped module's metadata (its version)
            # under "<prefix>module".
            base = prefix[:-1]
            for key in [k for k in metadata if k == base or k.startswith(prefix)]:
                metadata[f"{base}.module{key[len(base) :]}"] = metadata[key]
        return result

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # Called by a parent's load_state_dict() only (ours delegates to the wrapped module).
        for key in [k for k in state_dict if k.startswith(prefix)]:
            state_dict[f"{prefix}module.{key[len(prefix) :]}"] = state_dict.pop(key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's parameters, under the original's names."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Tensor]]:
        """The wrapped module's buffers, under the original's names."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a checkpoint of the original module (same keys)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
