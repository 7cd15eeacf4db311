"""Unit-scaled losses: cross_entropy and mse_loss (gradient-scaled; the loss value is not)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UnsupportedArgumentError
from ..scale import scale_bwd, scale_fwd_bwd
from ._base import (
    _reject,
    _specialised_int,
)
from ._moments import _attention_moments
from ._mult import check_mult

# --------------------------------------------------------------------------------------------
# losses
# --------------------------------------------------------------------------------------------


def _check_reduction(op: str, reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise UnsupportedArgumentError(op, "reduction", reduction, 'use "mean", "sum" or "none"')


def cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    mult: float = 1.0,
) -> Tensor:
    """Cross-entropy loss (``F.cross_entropy``) with a unit-scaled gradient.

    The loss value is never scaled (it is what you report and compare). Scaling rule for
    the gradient, for ``C`` classes, ``batch`` rows, unit logits and targets independent of
    them: row gradient ``p - y`` (``y`` the smoothed one-hot) has zero mean and mean square
    ``(v(C) - 2/C + Σ y²) / C`` per element, ``v`` as in :func:`softmax` (about ``1/C``);
    ``reduction="mean"`` divides it by ``batch``. So the input gradient is scaled by
    ``sqrt(C / (v - 2/C + Σ y²))``, times ``batch`` for ``"mean"``: unit std for a loss
    whose gradient is 1 (``loss.backward()``), or, with ``"none"``, for a unit incoming
    gradient. There is no constraint: the gradient is the true one times that factor.
    ``batch`` counts every row, so with ignored targets the remaining rows' gradients are
    ``batch / kept`` times larger than unit (a static scale cannot know ``kept``).

    With ``mult`` (u-μP's α_loss): the loss is ``cross_entropy(mult * input)`` (a softmax
    temperature of ``1 / mult``). Its gradient is ``mult (p - y)`` with ``p`` the softmax of
    logits of variance ``mult²``, so ``v`` is integrated at that variance and the scale
    divided by ``mult``: ``sqrt(C / (v - 2/C + Σ y²)) / mult``.

    Args:
        input: logits ``(batch, C)``, ``(C,)`` or ``(batch, C, d1, ...)``.
        target: class indices (``int64``), as for ``F.cross_entropy``.
        weight: unsupported; must be None.
        size_average: deprecated in PyTorch; must be None.
        ignore_index: target value that contributes no loss and no gradient.
        reduce: deprecated in PyTorch; must be None.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        label_smoothing: as for ``F.cross_entropy``.
        mult: positive multiplier of the logits.

    Returns:
        The (unscaled) loss of ``mult * input``.

    Raises:
        UnsupportedArgumentError: an unsupported argument, probability targets, or ``mult``
            not positive.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> logits = torch.randn(512, 1000, requires_grad=True)
        >>> cross_entropy(logits, torch.randint(0, 1000, (512,))).backward()
        >>> round(logits.grad.std().item(), 1)
        1.0
    """
    op = "cross_entropy"
    _reject(op, "weight", weight, None, "class weights are not supported")
    _reject(op, "size_average", size_average, None, "use reduction=")
    _reject(op, "reduce", reduce, None, "use reduction=")
    _check_reduction(op, reduction)
    if target.is_floating_point():
        raise UnsupportedArgumentError(
            op,
            "target",
            f"<{target.dtype} tensor>",
            "pass class indices (int64), not probabilities",
        )
    classes = _specialised_int(input.shape[1] if input.dim() >= 2 else input.shape[0])
    batch = input.numel() // max(classes, 1)
    mult = check_mult(op, mult)
    v, _ = _attention_moments(1, classes, False, mult * mult)
    eps = float(label_smoothing)
    target_sq = (1.0 - eps) ** 2 + 2.0 * eps * (1.0 - eps) / classes + eps * eps / classes
    grad_scale = math.sqrt(classes / max(v - 2.0 / classes + target_sq, 1e-12)) / mult
    if reduction == "mean" and isinstance(batch, torch.SymInt):
        # A dynamic size (torch.compile): kept an integer factor of its own, which Inductor
        # treats as a size; a float product with it would be specialised to one size.
        input = scale_bwd(input, batch)
    elif reduction == "mean":
        grad_scale *= batch
    if mult != 1.0:
        input = scale_fwd_bwd(input, mult, mult)  # a true gradient; grad_scale has 1/mult
    return F.cross_entropy(
        scale_bwd(input, grad_scale),
        target,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )


def mse_loss(
    input: Tensor,
    target: Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    weight: Tensor | None = None,
) -> Tensor:
    """Mean squared error (``F.mse_loss``) with unit-scaled gradients.

    The loss value is never scaled. Scaling rule for the gradients, for independent unit
    ``input`` and ``target``: ``d/dinput (input - target)^2 = 2 (input - target)`` has std
    ``2 sqrt(2)``, divided by ``N = numel`` for ``"mean"``; so both gradients are scaled by
    ``1/(2 sqrt(2))``, times ``N`` for ``"mean"`` (``N`` the numel of the broadcast
    shape). An operand broadcast against the other (a target shared by every example)
    receives the sum of ``R = N / numel(operand)`` terms ``2 (input - target)`` in which its
    own value recurs: with a scalar loss (``"mean"``, ``"sum"``) the incoming gradient is
    the same for every term, so that part adds up coherently and the sum has std
    ``2 sqrt(R (1 + R))``; with ``"none"`` each term has its own unit incoming gradient and
    the sum has std ``2 sqrt(2 R)``. Both are ``2 sqrt(2)`` for ``R = 1``, and the
    operand's gradient is scaled by their inverse. No constraint (the gradients are the
    true ones times these factors).

    Args:
        input: predictions, assumed unit-scaled.
        target: targets, assumed unit-scaled; gets a gradient if it requires one.
        size_average: deprecated in PyTorch; must be None.
        reduce: deprecated in PyTorch; must be None.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        weight: unsupported; must be None.

    Returns:
        The (unscaled) loss.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(1000, 1000, requires_grad=True)
        >>> mse_loss(x, torch.randn(1000, 1000)).backward()
        >>> round(x.grad.std().item(), 2)
        1.0
    """
    op = "mse_loss"
    _reject(op, "size_average", size_average, None, "use reduction=")
    _reject(op, "reduce", reduce, None, "use reduction=")
    _reject(op, "weight", weight, None, "elementwise weights are not supported")
    _check_reduction(op, reduction)
    out_numel = math.prod(torch.broadcast_shapes(input.shape, target.shape))

    def grad_scale(operand: Tensor) -> float:
        repeats = max(out_numel, 1) / max(operand.numel(), 1)
        if reduction == "none":
            grad_std = 2.0 * math.sqrt(2.0 * repeats)
        else:
            grad_std = 2.0 * math.sqrt(repeats * (1.0 + repeats))
        return (out_numel if reduction == "mean" else 1.0) / grad_std

    return F.mse_loss(
        scale_bwd(input, grad_scale(input)),
        scale_bwd(target, grad_scale(target)),
        reduction=reduction,
    )
