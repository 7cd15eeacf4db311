"""Which transforms share the module's parameters, and an optimizer left on a replaced copy.

A transform that keeps the weights as they are (``simulate_format``, ``simulate_fp8``,
``to_fp8``, ``compile``: stages ``SIMULATE`` and ``COMPILE``) shares the module's parameters
and buffers with its result, as torchao's in-place conversion and ``torch.compile`` do: an
optimizer built before the transform (``opt = AdamW(m.parameters()); f = to_fp8(m)``) trains
the transformed model. ``unit_scale`` (which re-initialises the weights) and
``track_scales`` (whose copy is independent of the original, docs/guide/tracking.rst) keep
parameters of their own; an optimizer over the original's parameters then trains nothing,
and the first ``step()`` that finds none of them with a gradient warns, naming the
transform and the fix.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor, nn

__all__ = ["record_left_behind", "shared_memo", "shares_weights"]

#: id -> parameter of a module a copying transform was applied to (entries die with it).
_LEFT: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()
#: id(parameter) -> the transform that copied it away.
_LEFT_BY: dict[int, str] = {}
_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()
_HOOKED = [False]


def shares_weights(stage: Any) -> bool:
    """Whether a pass of ``stage`` shares the module's parameters (it leaves them as they
    are: simulating or compiling)."""
    from ._core import Stage

    return stage in (Stage.SIMULATE, Stage.COMPILE)


def shared_memo(module: nn.Module) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo under which a copy of ``module`` keeps its parameters and
    buffers (the same tensors) and copies everything else."""
    tensors = [*module.parameters(), *module.buffers()]  # tied ones once: the same object
    return {id(t): t for t in tensors}


def record_left_behind(module: nn.Module, op: str) -> None:
    """Remember ``module``'s parameters as left behind by ``op`` (which copied them), so
    that an optimizer stepped over them alone, with no gradients, is named (see
    :func:`_check_step`)."""
    for parameter in module.parameters():
        _LEFT[id(parameter)] = parameter
        _LEFT_BY[id(parameter)] = op
    if not _HOOKED[0]:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_check_step)
        _HOOKED[0] = True


def _check_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Before every ``optimizer.step()``: O(1) when a parameter has a gradient (the first
    one, in ordinary training); otherwise warn once per optimizer whose parameters were
    copied away by a transform."""
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
    why = (
        "re-initialised in its copy"
        if op == "unit_scale"
        else "copied (the transformed model's parameters are independent)"
    )
    from ._core import warn_user

    warn_user(
        f"{type(optimizer).__name__}.step(): its parameters are those of the module passed "
        f"to unitscale.transforms.{op}(), whose result has parameters of its own ({why}); "
        "none has a gradient, so nothing is trained. Build the optimizer from the returned "
        f"model: {type(optimizer).__name__}(model.parameters(), ...)"
    )
