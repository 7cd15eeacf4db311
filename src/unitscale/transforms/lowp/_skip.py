"""Which layers an FP8 transform keeps in high precision: the ``skip=`` option of
``simulate_format``, ``simulate_fp8`` and ``to_fp8``.

``skip`` names modules by their qualified names (as ``named_modules()`` gives them, e.g.
``"layers.0.mlp.down"``), or is a predicate ``skip(name, module) -> bool`` called on every
module (torchao's ``convert_to_float8_training(module_filter_fn=...)`` is the same idea with
the opposite sense: it returns True for the modules to convert). Every matmul-like op of a
skipped module, or of a module inside one, runs in the model's own precision and is listed in
:func:`~unitscale.transforms.fp8_summary` with the reason :data:`SKIPPED`.

Design constraints: the option is resolved to a set of module names when the transform is
called (a predicate is not kept, so the pass pickles), and a name that matches no module is
an error naming the closest ones, never a silent no-op.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection
from typing import Any, TypeAlias

from torch import nn

from ...capture import TransformedModule
from ...formats import FormatError

__all__ = ["SKIPPED", "Skip", "is_skipped", "resolve_skip"]

Skip: TypeAlias = str | Collection[str] | Callable[[str, nn.Module], bool] | None
"""Module names, or a predicate ``(qualified name, module) -> bool`` (True: keep it in high
precision)."""

SKIPPED = "skipped by skip="
"""Summary reason of a matmul-like op of a module the user asked to keep in high precision."""


def resolve_skip(op: str, module: Any, skip: Any) -> frozenset[str]:
    """The qualified names of the modules of ``module`` that ``skip`` chooses.

    Raises:
        FormatError: ``skip`` is neither names nor a predicate, a name matches no module
            (the closest names are given), or the predicate raised.

    Example:
        >>> mlp = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> sorted(resolve_skip("to_fp8", mlp, "2"))
        ['2']
        >>> sorted(resolve_skip("to_fp8", mlp, lambda name, m: isinstance(m, nn.Linear)))
        ['0', '2']
    """
    if skip is None or not isinstance(module, nn.Module):
        return frozenset()  # not a module: the transform itself says so
    target = module.module if isinstance(module, TransformedModule) else module
    modules = dict(target.named_modules())
    if callable(skip):
        return frozenset(_chosen_by(op, skip, modules))
    names = [skip] if isinstance(skip, str) else skip
    if not isinstance(names, (list, tuple, set, frozenset)) or not all(
        isinstance(name, str) for name in names
    ):
        raise FormatError(
            f"unitscale.transforms.{op}: skip={skip!r} is neither module names nor a "
            "predicate; pass a qualified module name, a list of them (e.g. ['readout']), "
            "or a function (name, module) -> bool"
        )
    for name in names:
        if name not in modules:
            close = difflib.get_close_matches(name, [n for n in modules if n], n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise FormatError(
                f"unitscale.transforms.{op}: skip={name!r} names no module of "
                f"{type(target).__name__}{hint} skip takes qualified names as "
                "model.named_modules() gives them (e.g. 'layers.0.mlp.down'), or a predicate "
                "(name, module) -> bool"
            )
    return frozenset(names)


def _chosen_by(
    op: str, skip: Callable[[str, nn.Module], Any], modules: dict[str, nn.Module]
) -> list[str]:
    chosen = []
    for name, child in modules.items():
        try:
            hit = skip(name, child)
        except Exception as error:
            raise FormatError(
                f"unitscale.transforms.{op}: the skip predicate raised on module {name!r} "
                f"({type(child).__name__}): {error}; it is called as skip(name, module) on "
                "every module, the root ('') included"
            ) from error
        if hit:
            chosen.append(name)
    return chosen


def is_skipped(path: str, skipped: frozenset[str], scope: str = "") -> bool:
    """Whether the module ``path`` (in the captured model) is, or is inside, one of
    ``skipped`` (names in the module the transform was given, which is the captured model's
    submodule ``scope`` when the transform is nested in another)."""
    for name in skipped:
        full = ".".join(part for part in (scope, name) if part)
        if not full or path == full or path.startswith(full + "."):
            return True
    return False
