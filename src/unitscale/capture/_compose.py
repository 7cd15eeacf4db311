"""How transforms compose: a new :class:`~unitscale.capture.TransformedModule` per transform,
its pass chain kept in :class:`~unitscale.capture.Stage` order, transformed submodules
absorbed into the copy (their passes scoped to them) or refused by name.
"""

from __future__ import annotations

import copy
from typing import cast

from torch import nn

from .._lazy_dynamo import is_optimized_module
from ..errors import CaptureError
from ._core import GraphPass, Stage, TransformedModule
from ._sharing import record_left_behind

__all__ = ["check_order", "transformed", "unwrap_compiled"]


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """The model ``torch.compile`` wrapped (its ``_orig_mod``), or ``module`` itself: what a
    report of a transformed model (``fp8_summary``, ``unit_scale_summary``,
    ``tracking_coverage``...) reads, for a model passed compiled or not."""
    while is_optimized_module(module):
        module = cast("nn.Module", module._orig_mod)
    return module


def _strip(module: nn.Module) -> tuple[nn.Module, tuple[GraphPass, ...]]:
    """The user module inside ``module`` and the passes already applied to it."""
    if isinstance(module, TransformedModule):
        return module.module, module.passes
    return module, ()


def check_order(earlier: GraphPass, new_pass: GraphPass, op: str) -> None:
    """Raise unless ``new_pass`` (applied by ``unitscale.<op>``) may follow ``earlier``.

    Raises:
        CaptureError: ``new_pass`` belongs to an earlier :class:`Stage`; it repeats a pass
            that is not :attr:`~GraphPass.repeatable`; or it compiles a tracked chain.
    """
    if earlier.stage is Stage.COMPILE:
        raise CaptureError(f"unitscale.{op}: the module {earlier.applied}; {earlier.order_fix}")
    if new_pass.stage is Stage.COMPILE and earlier.stage is Stage.TRACK:
        raise CaptureError(
            f"unitscale.{op}: the module {earlier.applied}, whose statistics cannot be "
            "gathered from compiled code; compile the untracked module, or track it without "
            "compile"
        )
    if new_pass.stage < earlier.stage:
        fix = earlier.order_fix.format(op=op)
        raise CaptureError(f"unitscale.{op}: the module {earlier.applied}; {fix}")
    if type(new_pass) is type(earlier) and not new_pass.repeatable:
        raise CaptureError(f"unitscale.{op}: the module {earlier.applied}; apply {op} once")


def transformed(module: nn.Module, new_pass: GraphPass, op: str) -> TransformedModule:
    """A new :class:`TransformedModule`: a copy of ``module`` with ``new_pass`` appended.

    The copy's parameters are its own: an optimizer over ``module``'s that steps with none
    of them holding a gradient warns, naming the transform (``_sharing.py``).

    A transformed submodule of ``module`` (``model.block = unit_scale(model.block)``) is
    absorbed: its ops are captured with the rest of the model, its own passes transform
    them alone, and ``new_pass`` transforms them with the rest
    (:func:`_absorb_transformed_children`).

    Raises:
        CaptureError: ``module`` is not an ``nn.Module``, was compiled by ``torch.compile``,
            ``new_pass`` cannot follow its passes (:func:`check_order`), or it holds a
            transformed submodule that cannot be absorbed (the error names it).
    """
    if not isinstance(module, nn.Module):
        raise CaptureError(
            f"unitscale.{op}: expected a torch.nn.Module, got {type(module).__name__}"
        )
    if is_optimized_module(module):
        raise CaptureError(
            f"unitscale.{op}: the module is already torch.compile'd; pass the original module "
            "(module._orig_mod) and apply unitscale.transforms.compile last"
        )
    inner, passes = _strip(module)
    for earlier in passes:
        check_order(earlier, new_pass, op)
    copied = copy.deepcopy(inner)
    record_left_behind(inner, op)  # an optimizer left on them is named at its first step
    absorbed = _absorb_transformed_children(copied, new_pass, op)
    # Stage order (stable): a child's unit_scale runs before the parent's simulate_format.
    chain = sorted([*(p.without_state() for p in passes), *absorbed], key=lambda p: p.stage)
    return TransformedModule(copied, (*chain, new_pass))


def _absorb_transformed_children(
    module: nn.Module, new_pass: GraphPass, op: str
) -> list[GraphPass]:
    """Replace, in place, each transformed submodule of ``module`` (a copy) by the module it
    wraps, and return its passes scoped to its qualified name.

    Dynamo cannot trace into a transformed module's own capture, so the parent's graphs
    would stop at it (its ops neither recorded nor transformed by the parent's passes).
    Absorbed, the child's ops are captured in the parent's graphs under its name, its own
    passes transform them alone (:meth:`GraphPass.scoped`), and ``new_pass`` transforms
    them with the rest of the model.

    Raises:
        CaptureError: a child that cannot be absorbed (see :func:`_check_child`).
    """
    absorbed: list[GraphPass] = []
    while True:
        found = next(
            (
                (name, sub)
                for name, sub in module.named_modules(remove_duplicate=False)
                if name and isinstance(sub, TransformedModule)
            ),
            None,
        )
        if found is None:
            return absorbed
        name, child = found
        _check_child(name, child, new_pass, op)
        owner_name, _, attribute = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        setattr(owner, attribute, child.module)
        absorbed.extend(p.scoped(name) for p in child.passes)


def _check_child(name: str, child: TransformedModule, new_pass: GraphPass, op: str) -> None:
    """Raise unless the transformed child ``name`` can be absorbed by ``op`` of its parent:
    its passes can apply to its own ops (not ``track_scales``, whose statistics are the
    child's own, nor ``compile``, which applies to a whole model, last) and ``new_pass`` may
    follow them (:func:`check_order`).

    Raises:
        CaptureError: naming the child and what to do instead.
    """
    where = f"unitscale.{op}: the submodule {name!r}"
    plain = f"put the plain module at {name!r}"
    for earlier in child.passes:
        if earlier.stage in (Stage.COMPILE, Stage.TRACK):
            raise CaptureError(f"{where} {earlier.applied}; {_nested_fix(earlier, name, op)}")
        if type(new_pass) is type(earlier) and not new_pass.repeatable:
            raise CaptureError(f"{where} {earlier.applied}; {op}(model) transforms it too: {plain}")
        if new_pass.stage < earlier.stage:
            raise CaptureError(
                f"{where} {earlier.applied}, which {op} cannot follow "
                f"({earlier.order_fix.format(op=op)}): {plain} and apply both transforms to "
                "the outer model, in that order"
            )
        if not earlier.scopable:
            raise CaptureError(
                f"{where} {earlier.applied}, which cannot apply to a submodule: {plain} and "
                "apply its transform to the outer model"
            )


def _nested_fix(earlier: GraphPass, name: str, op: str) -> str:
    """What to do instead of ``op`` of a model whose submodule ``name`` is compiled or
    tracked by ``earlier`` (neither can apply to a part of a model)."""
    plain = f"put the plain module at {name!r}"
    if earlier.stage is Stage.COMPILE:
        if op == "compile":
            return f"compile(model) compiles it too: {plain}"
        if op == "track_scales":
            return f"statistics cannot be gathered from compiled code: {plain}"
        return f"compile applies to a whole model, last: {plain}, then compile({op}(model))"
    if op == "track_scales":
        return f"track_scales(model) records the {name}.* ops too: {plain}"
    if op == "compile":
        return (
            "a tracked module cannot be compiled, its statistics are gathered in Python: "
            f"{plain}, then compile the model (or track it, without compile)"
        )
    return (
        "its statistics would miss the outer transform: "
        f"{plain}, then track_scales({op}(model)) records the {name}.* ops"
    )
