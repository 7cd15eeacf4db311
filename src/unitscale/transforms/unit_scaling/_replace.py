"""The ``replace`` argument of ``unit_scale``: which ops may be replaced, by what, and the
error that names an op it does not replace (:class:`UnknownOpError`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ...errors import UnitScaleError
from ._user_ops import is_user_function

__all__ = ["UnknownOpError"]


class UnknownOpError(UnitScaleError, ValueError):
    """A ``replace`` entry of ``unit_scale`` names an op it does not replace, or is not callable."""


def _op_name(fn: Any) -> str:
    """The name users write for ``fn`` (``torch.nn.functional.gelu``, ``torch.sin``...)."""
    name = getattr(fn, "__name__", None)
    if isinstance(name, str):
        for prefix, namespace in _NAMESPACES:
            if getattr(namespace, name, None) is fn:
                return f"{prefix}.{name}"
    module = getattr(fn, "__module__", None) or ""
    qualname = getattr(fn, "__qualname__", None) or name or repr(fn)
    return f"{module}.{qualname}" if module else str(qualname)


_NAMESPACES: tuple[tuple[str, Any], ...] = (
    ("torch.nn.functional", F),
    ("torch", torch),
    ("torch.Tensor", torch.Tensor),
    ("operator", operator),
)


def _torch_map() -> dict[Callable[..., Any], Callable[..., Any]]:
    from ... import functional as U

    return dict(U.torch_map)


def _check_replace(
    replace: Mapping[Any, Any] | None,
) -> dict[Callable[..., Any], Callable[..., Any]]:
    if replace is None:
        return {}
    if not isinstance(replace, Mapping):
        raise UnknownOpError(
            f"unitscale.unit_scale: replace must be a dict {{torch function: replacement}}, "
            f"got {type(replace).__name__}"
        )
    domain = _torch_map()
    checked: dict[Callable[..., Any], Callable[..., Any]] = {}
    for key, value in replace.items():
        try:
            known = key in domain
        except TypeError:  # unhashable
            known = False
        if not known and not is_user_function(key):
            raise UnknownOpError(
                f"unitscale.unit_scale: replace key {_op_name(key)} is not an op that "
                "unit_scale replaces; use a key of unitscale.functional.torch_map, e.g. "
                "torch.nn.functional.gelu, or a Python function of your own (kept as one op)"
            )
        if not callable(value):
            raise UnknownOpError(
                f"unitscale.unit_scale: replace[{_op_name(key)}]={value!r} is not callable; "
                "map it to a function that takes the same arguments"
            )
        checked[key] = _unit_scaled(key, value, domain)
    return checked


def _unit_scaled(
    key: Any, value: Callable[..., Any], domain: Mapping[Any, Callable[..., Any]]
) -> Callable[..., Any]:
    """The replacement ``unit_scale`` uses for ``replace[key] = value``: a torch op (a key of
    ``torch_map``, ``F.gelu``) becomes its unit-scaled counterpart (``U.gelu``), as in the
    reference library, since the torch op itself would keep the op unscaled; an op mapped
    to itself (``{F.gelu: F.gelu}``) is kept as it is."""
    if value is key:
        return value
    try:
        return domain.get(value, value)
    except TypeError:  # unhashable callable: not a torch op
        return value
