"""Forward and backward scaling: the one primitive every unit-scaled op is built from.

Unit scaling multiplies an op's output by one factor in the forward pass and the gradients
of its inputs by other factors in the backward pass. Both are done by a single autograd
function, :func:`scale_fwd_bwd`, which multiplies its input by ``fwd_scale`` and the incoming
gradient by ``bwd_scale``. When the two differ, the gradient it passes back is *not* the true
gradient of its forward computation; constraints (:mod:`unitscale.constraints`) decide where
that is allowed.

Design constraints: scales are Python floats, so that they fold into compiled graphs as
constants; a scale of exactly 1 costs nothing (the tensor itself, or a view, is returned), and
equal forward and backward scales are a plain multiplication (no autograd function). Under
``torch.compile`` with dynamic shapes a scale computed from a size that varies is a symbolic
float (``torch.SymFloat``): it is used as it is, never compared or converted, since either
would specialise the graph to one size (a recompile per length).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["scale_bwd", "scale_fwd", "scale_fwd_bwd"]


class _ScaleFwdBwd(torch.autograd.Function):
    """``y = x * fwd_scale``; ``grad_x = grad_y * bwd_scale``.

    Written for :mod:`torch.func` too (``setup_context``; vmap's rule generated from the
    forward, which is one PyTorch op): ``grad``, ``vmap(grad)``, ``jacrev``. No ``jvp``
    (TorchDynamo cannot trace a Function that has one): under ``torch.func.jvp`` no input
    needs a gradient, so the scaling is a plain multiplication (a tangent times
    ``fwd_scale``).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, fwd_scale: float, bwd_scale: float) -> Tensor:
        if _is_one(fwd_scale):
            return x.view_as(x)
        return x * fwd_scale

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.bwd_scale = inputs[2]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        if _is_one(ctx.bwd_scale):
            return grad, None, None
        return grad * ctx.bwd_scale, None, None


def _is_symbolic(scale: object) -> bool:
    """Whether ``scale`` was computed from a dynamic size while being compiled."""
    # A tuple, not X | Y: TorchDynamo 2.8 cannot trace isinstance with a union type.
    return isinstance(scale, (torch.SymFloat, torch.SymInt))


def _is_one(scale: float) -> bool:
    """``scale == 1``, False for a symbolic scale (comparing it would specialise the graph)."""
    return not _is_symbolic(scale) and scale == 1.0


def _check_scale(name: str, scale: float) -> float:
    if isinstance(scale, Tensor):
        raise TypeError(
            f"unitscale.scale: {name} must be a Python number, got a Tensor; use float(...)"
        )
    if _is_symbolic(scale):
        return scale  # a SymInt stays one: Inductor handles it as a size
    return float(scale)


def scale_fwd_bwd(
    x: Tensor, fwd_scale: float, bwd_scale: float, *, inplace: bool = False
) -> Tensor:
    """Multiply ``x`` by ``fwd_scale`` in the forward pass and its gradient by ``bwd_scale``.

    Args:
        x: the tensor to scale.
        fwd_scale: factor applied to ``x`` in the forward pass.
        bwd_scale: factor applied to the gradient of the result in the backward pass.
        inplace: the caller owns ``x`` (an op's fresh result that nothing else refers to
            and whose value autograd has not saved): when the scales are equal, multiply it
            in place. This saves an allocation and a pass over memory, which is most of the
            eager cost of scaling an activation.

    Returns:
        ``x * fwd_scale``, whose backward multiplies the incoming gradient by ``bwd_scale``.
        The same under :mod:`torch.func` (``grad``, ``vmap(grad)`` for per-sample
        gradients, ``jacrev``); forward mode (``torch.func.jvp``) sees ``x * fwd_scale``.

    Example:
        >>> x = torch.ones(3, requires_grad=True)
        >>> y = scale_fwd_bwd(x, 2.0, 0.5)
        >>> y.sum().backward()
        >>> y.tolist(), x.grad.tolist()
        ([2.0, 2.0, 2.0], [0.5, 0.5, 0.5])
    """
    fwd = _check_scale("fwd_scale", fwd_scale)
    bwd = _check_scale("bwd_scale", bwd_scale)
    if _is_symbolic(fwd) or _is_symbolic(bwd):
        if fwd is bwd:  # one symbolic scale: a true gradient
            return x * fwd
        if not (x.requires_grad and torch.is_grad_enabled()):
            return x if _is_one(fwd) else x * fwd
        return _ScaleFwdBwd.apply(x, fwd, bwd)
    if fwd == bwd:
        # Equal scales are an ordinary multiplication, whose true gradient is grad * bwd: no
        # autograd.Function needed (cheaper in eager, and nothing for Dynamo to trace).
        if fwd == 1.0:
            return x
        return x.mul_(fwd) if inplace else x * fwd
    if not (x.requires_grad and torch.is_grad_enabled()):
        return x if fwd == 1.0 else x * fwd
    return _ScaleFwdBwd.apply(x, fwd, bwd)


def scale_fwd(x: Tensor, scale: float) -> Tensor:
    """Multiply ``x`` by ``scale`` in the forward pass only; the gradient passes unchanged.

    Args:
        x: the tensor to scale.
        scale: forward factor.

    Returns:
        ``x * scale`` with an identity backward.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> scale_fwd(x, 3.0).sum().backward()
        >>> x.grad.tolist()
        [1.0, 1.0]
    """
    return scale_fwd_bwd(x, scale, 1.0)


def scale_bwd(x: Tensor, scale: float) -> Tensor:
    """Leave ``x`` unchanged in the forward pass; multiply its gradient by ``scale``.

    Args:
        x: the tensor whose gradient is scaled.
        scale: backward factor.

    Returns:
        ``x`` (a view), whose backward multiplies the incoming gradient by ``scale``.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> y = scale_bwd(x, 0.25)
        >>> y.sum().backward()
        >>> y.tolist(), x.grad.tolist()
        ([1.0, 1.0], [0.25, 0.25])
    """
    return scale_fwd_bwd(x, 1.0, scale)
