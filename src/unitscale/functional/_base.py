"""Unit-scaled ops: drop-in counterparts of ``torch.nn.functional``, imported as ``U``.

Each op multiplies its output and its inputs' gradients by factors chosen so that, when the
inputs are i.i.d. N(0, 1) and the incoming gradient is i.i.d. N(0, 1), the output and every
input gradient have unit standard deviation at initialisation. Each docstring states the
assumptions, the ideal factors, and what the default constraint does with them.

How the factors are applied (the same recipe everywhere; scale maths lives in
:mod:`unitscale.scale` and :mod:`unitscale.constraints`): given the constrained output scale
``s`` and input-gradient scales ``g_i``, an op computes

    ``y = scale_fwd_bwd(f(scale_bwd(x_1, g_1 / s), ...), s, s)``

so the forward value is ``s * f(x)`` and the gradient of ``x_i`` is
``(g_i / s) * df/dx_i^T (s * grad_y) = g_i * df/dx_i^T grad_y``. When a constraint makes every
``g_i`` equal to ``s``, the pre-scales are free no-ops and the op is a plain multiplication
by ``s`` whose gradient is the true gradient. Weights are never constrained: their gradient
factor is applied with :func:`~unitscale.scale.scale_fwd_bwd` on the weight itself (folding
the output scale into the weight, which is cheaper than scaling the larger output).

Design constraints: every scale is a Python number computed from static shapes (never from
data), so ops compile to a single graph with ``torch.compile(fullgraph=True)``. Scales that
need the moments of a softmax (``softmax``, ``scaled_dot_product_attention``,
``cross_entropy``) are computed by numerical integration once per shape and cached; under
``torch.compile`` ``softmax`` and ``scaled_dot_product_attention`` take them from ops that
accept a dynamic length (0-dim tensor scales: one graph for every length), while
``cross_entropy`` specialises on its number of classes (fixed in practice).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..errors import UnitScaleError, UnsupportedArgumentError
from ..scale import scale_bwd, scale_fwd_bwd

Constraint = str | None


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _scale_grad(x: Tensor, scale: Tensor) -> Tensor:
    """``x`` in the forward pass (exactly); gradient multiplied by the 0-dim tensor ``scale``
    (a scale computed by an op, which ``scale_bwd``'s Python float cannot take)."""
    return x.detach() + (x - x.detach()) * scale


def _prescale(x: Tensor, grad_scale: float | Tensor, output_scale: float | Tensor) -> Tensor:
    """Scale ``x``'s gradient so that, after the output's ``scale_fwd_bwd(., s, s)``, the
    gradient of ``x`` carries ``grad_scale`` in total (a no-op when the two are equal).

    The scales may be 0-dim tensors (computed by an op from a dynamic size under
    ``torch.compile``); the forward value is then still ``x`` exactly.
    """
    if isinstance(grad_scale, Tensor) or isinstance(output_scale, Tensor):
        if grad_scale is output_scale:  # one shared (constrained) scale: nothing to do
            return x
        return _scale_grad(x, torch.as_tensor(grad_scale / output_scale).to(x.dtype))
    return scale_bwd(x, grad_scale / output_scale)


def _finish(y: Tensor, output_scale: float | Tensor, inplace: bool = True) -> Tensor:
    """Multiply the op's output by ``output_scale`` with a true gradient. In place unless the
    op's backward needs its output (softmax, attention): the output is the op's own. A 0-dim
    tensor scale (see :func:`_prescale`) is a plain multiplication."""
    if isinstance(output_scale, Tensor):
        return y * output_scale.to(y.dtype)
    return scale_fwd_bwd(y, output_scale, output_scale, inplace=inplace)


def _rsqrt(n: float) -> float:
    """``1 / sqrt(n)``, with 1 for an empty fan (nothing is summed, nothing to correct).

    A scale is never silently dropped: a NaN, infinite or negative ``n`` (a variance that
    went wrong) raises instead of leaving the tensor unscaled. A symbolic ``n`` (a count from
    a dynamic size under ``torch.compile``, at least 2) gives a symbolic scale, unchecked:
    a check would specialise the graph to one size.
    """
    # A tuple, not X | Y: TorchDynamo 2.8 cannot trace isinstance with a union type.
    if isinstance(n, (torch.SymInt, torch.SymFloat)):
        return 1.0 / torch.sym_sqrt(n)
    if not math.isfinite(n) or n < 0:
        raise UnitScaleError(
            f"unitscale.functional: a scale was computed from the variance {n!r}, which is "
            "not a finite non-negative number; this is a bug in unitscale, please report it"
        )
    return 1.0 / math.sqrt(n) if n > 0 else 1.0


def _is_float_tensor(x: object) -> bool:
    return isinstance(x, Tensor) and x.is_floating_point()


def _specialised_int(n: int) -> int:
    """Return ``n`` as a plain ``int``. Under ``torch.compile`` with dynamic shapes ``len`` of
    a ``range`` makes Dynamo specialise on the size (a guard and a recompile per value),
    which the softmax-moment scales need: they are computed numerically, not traced."""
    return len(range(n))


def _single(value: Any, op: str, argument: str) -> Any:
    """Accept ``v`` or a one-element tuple/list ``(v,)`` (what ``nn.Conv1d`` passes)."""
    if isinstance(value, tuple | list):
        if len(value) != 1:
            raise UnsupportedArgumentError(
                op, argument, value, "conv1d takes one value (or a 1-tuple) per argument"
            )
        return value[0]
    return value


def _reject(op: str, argument: str, value: object, default: object, fix: str) -> None:
    """Raise :class:`UnsupportedArgumentError` when ``value`` is not the default."""
    if value is None if default is None else value == default:
        return
    shown = f"<tensor of shape {tuple(value.shape)}>" if isinstance(value, Tensor) else value
    raise UnsupportedArgumentError(op, argument, shown, fix)
