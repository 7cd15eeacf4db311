"""An optimizer left on the parameters of a module that a transform copied.

Every unitscale transform returns a copy with parameters of its own (the user's module is
never touched; ``track_scales``'s copy is independent by contract, ``unit_scale``
re-initialises its weights). torchao converts in place, so its users build the optimizer
first: ``opt = AdamW(m.parameters()); f = to_fp8(m)`` then trains nothing, silently (the
loss stayed at 1.1149 for 5 steps). The parameters a transform copied are remembered
(weakly), and the first ``step()`` of an optimizer whose parameters are all among them and
none has a gradient warns, naming the transform and the fix.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor, nn

__all__ = ["record_left_behind"]

#: id -> parameter of a module a transform was applied to (entries die with it).
_LEFT: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
#: id(parameter) -> the transform that copied it.
_LEFT_BY: dict[int, str] = {}
_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()
_HOOKED = [False]

#: Why the copy's parameters are its own, per transform.
_WHY = {
    "unit_scale": "re-initialised in its copy",
    "track_scales": "the tracked copy is independent of the original",
    "to_fp8": "unlike torchao's convert_to_float8_training, which converts in place",
}


def record_left_behind(module: nn.Module, op: str) -> None:
    """Remember ``module``'s parameters as copied by ``op``, so that an optimizer stepped
    over them alone, with no gradients, is named (see :func:`_check_step`)."""
    for parameter in module.parameters():
        _LEFT[id(parameter)] = parameter
        _LEFT_BY[id(parameter)] = op
    if not _HOOKED[0]:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_check_step)
        _HOOKED[0] = True


def _check_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Before every ``optimizer.step()``: stops at the first parameter with a gradient (the
    first one, in ordinary training); otherwise warns once per optimizer whose parameters
    were copied by a transform."""
    if not _LEFT:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        return
    left = [p for p in params if _LEFT.get(id(p)) is p]
    if not left or optimizer in _WARNED:
        return
    _WARNED.add(optimizer)
    op = _LEFT_BY.get(id(left[0]), "a transform")
    why = _WHY.get(op, "as every unitscale transform returns a copy")
    name = type(optimizer).__name__
    from ._core import warn_user

    warn_user(
        f"{name}.step(): its parameters are those of the module passed to "
        f"unitscale.transforms.{op}(), which returned a copy with parameters of its own "
        f"({why}); none has a gradient, so nothing is trained. Build the optimizer from the "
        f"returned model: {name}(model.parameters(), ...)"
    )
