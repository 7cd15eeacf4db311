"""u-μP's learning-rate rules: a factor on the base rate from a parameter's tags."""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor

from ..errors import UnitScaleError
from ..parameter import DEPTH_RULE, EMBEDDING, has_mup_tags

__all__ = [
    "LRScaleFunc",
    "UntaggedParameterError",
    "is_muon_matrix",
    "lr_scale_func_adam",
    "lr_scale_func_muon",
    "lr_scale_func_sgd",
    "rule_text",
]

LRScaleFunc = Callable[[Tensor], float]


class UntaggedParameterError(UnitScaleError, ValueError):
    """A parameter handed to a u-μP optimiser has no u-μP tags."""


def _fan_in(param: Tensor) -> int:
    if param.dim() < 2:
        return 1
    if getattr(param, "fan_in_dim", None) == 0:  # stored (in, out): transformers' Conv1D
        return int(param.shape[0])
    return math.prod(param.shape[1:])


def _depth_rule(param: Tensor) -> str:
    return str(getattr(param, DEPTH_RULE, "depth-mup"))


def _depth_scale(param: Tensor) -> float:
    """The depth factor of an Adam-style rate: ``1/sqrt(d)`` (depth-μP), or 1 where the
    parameter's stack follows CompleteP (``mup_depth_rule = "completep"``: the paper's
    ``L^(α-1)`` at ``α = 1``, Dey et al. 2025, arXiv 2505.01618, Table 1)."""
    depth = getattr(param, "mup_scaling_depth", None)
    if not depth or _depth_rule(param) == "completep":
        return 1.0
    return 1.0 / math.sqrt(depth)


def lr_scale_func_adam(param: Tensor) -> float:
    """u-μP's learning-rate scale of ``param`` for Adam-style optimisers (Adam, AdamW).

    Rule, ``d = mup_scaling_depth`` (factor 1 if None, or if the parameter carries
    ``mup_depth_rule = "completep"``: CompleteP's ``d^(α-1) = 1``, see
    :class:`~unitscale.TransformerDecoder`'s ``depth_rule``):

    * ``"weight"``: ``1 / sqrt(fan_in) / sqrt(d)``;
    * ``"output"``: ``1`` (no depth factor: the readout is outside the residual stack);
    * ``"bias"`` and ``"norm"``: ``1 / sqrt(d)``.

    Reason. Adam's update has entries of size about ``lr`` whatever the gradient's scale,
    and after a step it is correlated with the layer's input. A hidden weight is applied as
    ``W x / sqrt(fan_in)`` (unit scaling), so the update changes the output by
    ``lr * fan_in / sqrt(fan_in) = lr sqrt(fan_in)``: the ``1/sqrt(fan_in)`` keeps it O(1).
    For an embedding, ``fan_in`` here is its width (``shape[1]``): u-μP's empirically better
    ``1/sqrt(fan_out)`` embedding rule. The readout is applied as ``W x / fan_in`` (μP's
    multiplier, :func:`~unitscale.functional.linear_readout` with ``mup=True``), so its update
    changes the logits by ``lr fan_in / fan_in = lr``: scale 1. Biases and norm scales are
    added or multiplied elementwise: a change of ``lr`` is a change of O(1), scale 1. Depth
    (depth-μP): each of the ``d`` residual branches enters the stream with weight about
    ``1/sqrt(d)``, and the ``d`` branch updates are correlated, so together they move the
    stream by ``lr d / sqrt(d) = lr sqrt(d)``; ``1/sqrt(d)`` keeps that O(1).

    Args:
        param: a tagged parameter.

    Returns:
        The factor on the base learning rate.

    Raises:
        UntaggedParameterError: ``param`` has no u-μP tags.

    Example:
        >>> import torch
        >>> from unitscale import Parameter
        >>> lr_scale_func_adam(Parameter(torch.empty(64, 256), "weight", mup_scaling_depth=4))
        0.03125
    """
    mup_type = _mup_type(param)
    if mup_type == "output":
        return 1.0
    if mup_type == "weight":
        return _depth_scale(param) / math.sqrt(_fan_in(param))
    return _depth_scale(param)


def lr_scale_func_sgd(param: Tensor) -> float:
    """u-μP's learning-rate scale of ``param`` for SGD, in a unit-scaled model.

    Rule: the same numbers as :func:`lr_scale_func_adam`: ``"weight"``
    ``1 / sqrt(fan_in) / sqrt(d)``, ``"output"`` 1, ``"bias"``/``"norm"`` ``1 / sqrt(d)``.

    Reason. In μP with *true* gradients SGD needs other rules than Adam, because the
    gradients' size depends on width. A unit-scaled model does not hand SGD true gradients:
    every op scales its backward pass so that each weight's gradient has entries of size
    O(1) at any width (a weight's gradient is ``grad_y^T x / sqrt(batch)``, with the
    ``1/sqrt(fan_in)`` of the forward not applied; the residual split gives each branch a
    unit gradient, not the true ``1/sqrt(d)``). An SGD step ``lr * grad`` therefore has
    entries of size ``lr``, correlated with the input, exactly like Adam's, and the
    derivation of :func:`lr_scale_func_adam` carries over term by term.

    Args:
        param: a tagged parameter.

    Returns:
        The factor on the base learning rate.

    Raises:
        UntaggedParameterError: ``param`` has no u-μP tags.

    Example:
        >>> import torch
        >>> from unitscale import Parameter
        >>> lr_scale_func_sgd(Parameter(torch.empty(10), "bias", mup_scaling_depth=4))
        0.5
    """
    return lr_scale_func_adam(param)


def _mup_type(param: Tensor, name: str | None = None) -> str:
    if not has_mup_tags(param):
        raise _untagged(param, name)
    return str(param.mup_type)  # type: ignore[attr-defined]


def _untagged(param: Tensor, name: str | None) -> UntaggedParameterError:
    what = f"parameter {name!r}" if name else "a parameter"
    return UntaggedParameterError(
        f"unitscale.optim: {what} of shape {tuple(param.shape)} has no u-μP tags, so its "
        "learning rate is unknown; build the model from unitscale modules, call "
        "unitscale.parameter.tag_module(model) or tag_parameter(p, mup_type), or pass "
        "allow_untagged=True to give it the base learning rate"
    )


def _fan_out(param: Tensor) -> int:
    if getattr(param, "fan_in_dim", None) == 0:  # stored (in, out): transformers' Conv1D
        return int(param.shape[1])
    return int(param.shape[0])


def is_muon_matrix(param: Tensor) -> bool:
    """Whether :class:`~unitscale.optim.Muon` updates ``param`` with Muon: a hidden matrix,
    tagged ``"weight"``, 2-D, not an embedding's table (``mup_embedding``, set by
    :func:`~unitscale.parameter.tag_module` on an ``nn.Embedding``'s weight)."""
    return (
        has_mup_tags(param)
        and param.mup_type == "weight"  # type: ignore[attr-defined]
        and param.dim() == 2
        and not getattr(param, EMBEDDING, False)
    )


def lr_scale_func_muon(param: Tensor) -> float:
    """u-μP's learning-rate scale of a hidden matrix updated by Muon, for unit-scaled weights.

    Rule: ``sqrt(fan_out) / sqrt(d)`` (``d = mup_scaling_depth``; depth factor 1 if None or
    with CompleteP, as :func:`lr_scale_func_adam`). Only for hidden matrices (tagged
    ``"weight"``, 2-D, not an embedding's table); :class:`~unitscale.optim.Muon` gives every
    other parameter :func:`lr_scale_func_adam`.

    Reason (the spectral condition for feature learning, Yang, Simon & Bernstein 2023,
    "A spectral condition for feature learning", Condition 1: a layer's weight update
    should have spectral norm ``Θ(sqrt(fan_out / fan_in))`` in the weight as applied). A
    unit-scaled weight ``W`` (entries of std 1) is applied as ``W x / sqrt(fan_in)``, so the
    applied update is ``ΔW / sqrt(fan_in)``: the condition asks for
    ``||ΔW||_* = Θ(sqrt(fan_out))``. Muon's update ``η O`` is orthogonalised, ``||O||_* ≈ 1``,
    so ``η = lr sqrt(fan_out)``. Then, for an input ``x`` of unit entries
    (``||x|| = sqrt(fan_in)``) aligned with the update, as it is after a step,
    ``||ΔW x|| / sqrt(fan_in) = lr sqrt(fan_out)``: entries of size ``lr`` at any width,
    the size :func:`lr_scale_func_adam` gives an Adam step, so ``lr`` means the same for the
    two. Depth: the argument of :func:`lr_scale_func_adam` (``d`` correlated branch updates,
    each weighted ``1/sqrt(d)``). Derivation in docs/guide/umup.rst.

    Example:
        >>> import torch
        >>> from unitscale import Parameter
        >>> lr_scale_func_muon(Parameter(torch.empty(256, 64), "weight", mup_scaling_depth=4))
        8.0
    """
    return math.sqrt(_fan_out(param)) * _depth_scale(param)


def rule_text(param: Tensor, algorithm: str = "Adam") -> str:
    """The rule that gives ``param`` its learning-rate factor, in words, for
    :func:`~unitscale.optim.effective_rates`: e.g.
    ``"weight: lr * 1/sqrt(fan_in=256) * 1/sqrt(depth=4) (Adam)"``; ``algorithm`` is
    ``"Adam"``, ``"SGD"`` or ``"Muon"``."""
    if not has_mup_tags(param):
        return f"untagged: lr (allow_untagged) ({algorithm})"
    mup_type = str(param.mup_type)  # type: ignore[attr-defined]
    depth = getattr(param, "mup_scaling_depth", None)
    if not depth or mup_type == "output":
        depth_part = ""
    elif _depth_rule(param) == "completep":
        depth_part = f" * depth^0 (depth={depth}, CompleteP)"
    else:
        depth_part = f" * 1/sqrt(depth={depth})"
    if mup_type == "output":
        factor = "lr"
    elif mup_type == "weight" and algorithm == "Muon":
        factor = f"lr * sqrt(fan_out={_fan_out(param)})"
    elif mup_type == "weight":
        what = "width" if getattr(param, EMBEDDING, False) else "fan_in"
        factor = f"lr * 1/sqrt({what}={_fan_in(param)})"
    else:
        factor = "lr"
    return f"{mup_type}: {factor}{depth_part} ({algorithm})"
