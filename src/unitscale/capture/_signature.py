"""The wrapped module's call signature on a transformed module's ``forward``.

A :class:`~unitscale.capture.TransformedModule` takes ``forward(*args, **kwargs)`` and hands
them on to the module it wraps. Code that reads a model's arguments off
``inspect.signature(model.forward)`` (the Hugging Face ``Trainer`` keeps only the dataset
columns the forward names, and asks whether it takes ``**kwargs``) must see the wrapped
module's own arguments, as it would on the untransformed model.

Design constraints:

- the signature is the wrapped module's, read when asked (never stored: the wrapped
  module's ``forward`` may be replaced, e.g. by a training callback);
- ``model.forward`` still behaves as a bound method: callable, with ``__self__`` and
  ``__func__`` (accelerate rebinds ``model.forward.__func__`` for mixed precision);
- nothing is kept on the instance, so deep copies and pickles are unaffected, and an
  instance attribute ``forward`` (a callback's redirect) still takes precedence.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["BoundForward", "signed_forward"]


class BoundForward:
    """``forward`` bound to one transformed module; its ``__signature__`` is the wrapped
    module's ``forward``'s."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, function: Callable[..., Any], owner: Any) -> None:
        self.__func__ = function
        self.__self__ = owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        wrapped = self.__self__._modules.get("module")
        try:
            return inspect.signature(wrapped.forward)
        except (AttributeError, TypeError, ValueError):  # no readable signature: our own
            return inspect.signature(types.MethodType(self.__func__, self.__self__))

    def __getattr__(self, name: str) -> Any:
        # As a bound method does: other attributes (__name__, __qualname__...) are the
        # function's. The slots themselves are never looked up here (an instance made
        # without __init__, as a copy or a tracer makes one, would otherwise recurse).
        if name in BoundForward.__slots__:
            raise AttributeError(name)
        return getattr(self.__func__, name)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BoundForward)
            and other.__func__ is self.__func__
            and other.__self__ is self.__self__
        )

    def __hash__(self) -> int:
        return hash((self.__func__, id(self.__self__)))

    def __repr__(self) -> str:
        name = self.__func__.__qualname__
        return f"<bound method {name} of {type(self.__self__).__name__}>"


class signed_forward:  # lower case: used as a decorator, like property
    """Decorator for ``TransformedModule.forward``: on an instance, a :class:`BoundForward`
    (whose signature is the wrapped module's); on the class, the plain function."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        self.__doc__ = function.__doc__

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self.function
        if torch.compiler.is_compiling():  # traced by torch.compile: a plain bound method
            return functools.partial(self.function, instance)
        return BoundForward(self.function, instance)
