"""How the recording pass handles the user's tensors without changing them: gradient hooks
without removable handles (cheap enough for every activation), aliases of input tensors that
require grad (so input gradients are tracked while the caller's tensors stay as they were),
and snapshots of RNG states and buffers (so a call can be replayed exactly).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor, nn
from torch._C import _functorch


def _add_grad_hook(x: Tensor, hook: Any) -> dict[Any, Any]:
    """``x.register_hook(hook)`` for the non-leaf plain tensor ``x`` without the removable
    handle, whose making costs twice the rest (~2 us, half a small tensor's statistics:
    it runs for every tracked activation at every call). Returns the tensor's hook dict,
    from which the caller removes ``hook`` (its key: it cannot collide with the integer
    keys of handles that others register) when the next call starts."""
    hooks = x._backward_hooks
    if hooks is None:
        hooks = x._backward_hooks = OrderedDict()
        grad_fn = x.grad_fn
        if grad_fn is not None:
            grad_fn._register_hook_dict(x)
    hooks[hook] = hook
    return hooks


class _RequireGrad(torch.autograd.Function):
    """The identity on ``x``, made differentiable through ``anchor`` (see
    :func:`_alias_requiring_grad`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, anchor: Tensor) -> Tensor:
        # Marked dirty, ``x`` itself is returned with a gradient history: not a leaf and not a
        # view, so the forward may modify it in place as it could the caller's tensor.
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _can_alias(tensor: Tensor) -> bool:
    return (
        type(tensor) is Tensor
        and tensor.is_floating_point()
        and not tensor.requires_grad
        and tensor.layout == torch.strided
        and not tensor.is_inference()
        and not _functorch.is_functorch_wrapped_tensor(tensor)
    )


def _alias_requiring_grad(tensor: Tensor) -> Tensor:
    """A tensor that shares ``tensor``'s storage and requires grad; ``tensor`` is untouched.

    A new tensor on the same storage has its own version counter, so making it require grad
    (which counts as an in-place change) does not bump the caller's.
    """
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    with torch.no_grad():
        alias.set_(
            tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
        )
    anchor = torch.zeros((), requires_grad=True)
    return _RequireGrad.apply(alias, anchor)


class _Snapshot:
    """RNG states and buffers of a module, to replay a call exactly."""

    def __init__(self, module: nn.Module) -> None:
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
