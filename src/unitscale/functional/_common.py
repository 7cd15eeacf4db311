"""Helpers shared by the unit-scaled ops: applying a constrained scale, argument checks."""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from ..errors import UnsupportedArgumentError
from ..scale import scale_bwd, scale_fwd_bwd

Constraint = str | None

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _prescale(x: Tensor, grad_scale: float, output_scale: float) -> Tensor:
    """Scale ``x``'s gradient so that, after the output's ``scale_fwd_bwd(., s, s)``, the
    gradient of ``x`` carries ``grad_scale`` in total (a no-op when the two are equal)."""
    return scale_bwd(x, grad_scale / output_scale)


def _finish(y: Tensor, output_scale: float, inplace: bool = True) -> Tensor:
    """Multiply the op's output by ``output_scale`` with a true gradient. In place unless the
    op's backward needs its output (softmax, attention): the output is the op's own."""
    return scale_fwd_bwd(y, output_scale, output_scale, inplace=inplace)


def _rsqrt(n: float) -> float:
    """``1 / sqrt(n)``, with 1 for an empty fan (nothing is summed, nothing to correct)."""
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
