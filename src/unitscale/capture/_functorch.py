"""Calls of a transformed module inside a ``torch.func`` transform.

TorchDynamo, which captures the forward that unitscale's passes rewrite, cannot start
inside ``torch.func.grad``, ``vmap`` or ``jvp``: it gives up on the frame, runs it as
written and marks the frame's code to be skipped from then on. The call would return the
untransformed result, and every later call of a module of the same class (the code object
is shared) would run untransformed as well. A transformed module therefore refuses such a
call before Dynamo sees it. ``torch.func.functional_call`` alone is no transform and runs
as an ordinary call.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CaptureError

__all__ = ["FunctorchTransformError", "active_transform", "refuse_under_functorch"]

_NAMES = {"Grad": "grad", "Vmap": "vmap", "Jvp": "jvp"}


class FunctorchTransformError(CaptureError):
    """A transformed module was called inside ``torch.func.grad``, ``vmap`` or ``jvp``."""


def active_transform() -> str | None:
    """The innermost active ``torch.func`` transform that Dynamo cannot capture under
    (``"grad"``, ``"vmap"``, ``"jvp"``; ``jacrev`` and ``hessian`` are built on them), or
    None."""
    functorch: Any = getattr(torch._C, "_functorch", None)
    peek = getattr(functorch, "peek_interpreter_stack", None)
    if peek is None:  # pragma: no cover - every supported torch has it
        return None
    interpreter = peek()
    if interpreter is None:
        return None
    return _NAMES.get(interpreter.key().name)


def refuse_under_functorch(module_name: str, transforms: str) -> None:
    """Raise when a ``torch.func`` transform is active.

    Raises:
        FunctorchTransformError: naming the transform, the module and what to do instead.
    """
    name = active_transform()
    if name is None:
        return
    raise FunctorchTransformError(
        f"{module_name} (transformed by {transforms}) was called inside torch.func.{name}: "
        "TorchDynamo, which captures the forward these transforms rewrite, cannot run "
        f"inside torch.func.{name}, so the model would run untransformed. Call the model "
        "outside the torch.func transform: torch.func.functional_call alone is supported, "
        "and gradients come from loss.backward() or torch.autograd.grad. For per-example "
        "gradients, build the model from unitscale's modules (unitscale.Linear, "
        "unitscale.TransformerDecoder...), which support torch.func without a transform"
    )
