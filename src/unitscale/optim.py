"""u-μP optimisers: torch's Adam, AdamW and SGD with per-parameter learning rates from tags.

u-μP (Blake et al., ICLR 2025) sets each parameter's learning rate to ``lr * scale(p)``, with
``scale`` a rule of the parameter's u-μP tags (:mod:`unitscale.parameter`): its
``mup_type``, its fan-in and ``mup_scaling_depth``. With those rules the *change* of every
activation in one step does not depend on the model's width or depth, so the best ``lr``
found on a small model is the best one for a large model.

Fan-in: for a weight, ``prod(shape[1:])``: an ``nn.Linear`` weight's ``in_features``, a
convolution's ``in_channels/groups * kernel``, and an embedding's ``embedding_dim`` (for an
embedding this is the width it writes, which gives u-μP's embedding rule, see
:func:`lr_scale_func_adam`). A weight stored ``(in, out)`` (transformers' ``Conv1D``) says
so with the attribute ``fan_in_dim = 0``, which :func:`unitscale.transforms.unit_scale` sets.

How it works: :class:`Adam`, :class:`AdamW` and :class:`SGD` are torch's classes with the
same positional arguments and defaults (bound against torch's own signature). The parameters
are put into torch parameter groups, one per distinct rule factor: each group's ``"lr"`` is
the *base* learning rate, its ``"lr_scale"`` the factor, and ``step()`` runs torch's step with
``lr * lr_scale``. So a learning-rate scheduler, or a hand-written ``group["lr"] = ...``,
sets the base rate and every parameter keeps its ratio to it. The optimiser state and
``state_dict`` are torch's (``foreach``/``fused`` included).

Weight decay, ``independent_weight_decay=True`` (default), is the reference's *independent*
decay (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer training
instabilities", section 3.2.2): each group's ``weight_decay`` is divided by that group's
learning rate at construction, ``lr_0 * lr_scale``, so a decoupled step
(``p -= lr_t * lr_scale * (weight_decay / (lr_0 * lr_scale)) * p``) shrinks every parameter by

    ``weight_decay * lr_t / lr_0`` per step,

``weight_decay`` times the schedule's factor, whatever ``lr`` and the parameter's u-μP factor:
changing the learning rate, the width or the depth does not change the decay. ``lr_0`` is
kept in each group as ``"decay_lr"`` (the base rate when the group was made, times
``lr_scale``); ``group["weight_decay"]`` shows the value given, ``step()`` passes torch
``weight_decay / decay_lr``. ``independent_weight_decay=False``: torch's coefficient on the
parameter's own rate (a shrink of ``lr_t * lr_scale * weight_decay``). ``weight_decay``
defaults to 0 in every class (the reference's default; torch's AdamW has 0.01).

Design constraints: drop-in for ``torch.optim``'s classes (same positional arguments and
defaults, ``state_dict`` and schedulers work); a parameter without tags is an error naming
it unless ``allow_untagged=True`` (then it gets ``lr`` unscaled).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from .errors import UnitScaleError
from .parameter import has_mup_tags

__all__ = [  # noqa: RUF022 (grouped by kind)
    # optimisers
    "Adam",
    "AdamW",
    "SGD",
    # building blocks for any other optimiser
    "scaled_parameters",
    "lr_scale_func_adam",
    "lr_scale_func_sgd",
    # errors
    "UntaggedParameterError",
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


def _depth_scale(param: Tensor) -> float:
    depth = getattr(param, "mup_scaling_depth", None)
    return 1.0 / math.sqrt(depth) if depth else 1.0


def lr_scale_func_adam(param: Tensor) -> float:
    """u-μP's learning-rate scale of ``param`` for Adam-style optimisers (Adam, AdamW).

    Rule, ``d = mup_scaling_depth`` (factor 1 if None):

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


def _named(params: Any) -> list[dict[str, Any]]:
    """Normalise ``params`` (tensors, ``(name, tensor)`` pairs or group dicts) to groups of
    ``(name or None, tensor)`` pairs."""
    if isinstance(params, Tensor):
        raise TypeError(
            "unitscale.optim: params must be an iterable of tensors, (name, tensor) pairs "
            "or dicts, not a single tensor"
        )
    items = list(params)
    if items and all(isinstance(item, dict) for item in items):
        return [
            {
                **group,
                "params": [
                    pair
                    for g in _named(
                        [group["params"]]
                        if isinstance(group["params"], Tensor)
                        else group["params"]
                    )
                    for pair in g["params"]
                ],
            }
            for group in items
        ]
    pairs = []
    for index, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            pairs.append(item)
        else:
            pairs.append((f"#{index}", item))
    return [{"params": pairs}]


def scaled_parameters(
    params: Iterable[Any],
    lr_scale_func: LRScaleFunc,
    lr: float | Tensor | None = None,
    weight_decay: float = 0.0,
    independent_weight_decay: bool = True,
    allow_untagged: bool = False,
) -> list[dict[str, Any]]:
    """Torch parameter groups with each parameter's learning rate ``lr * lr_scale_func(p)``.

    For an optimiser other than these (``torch.optim.Adagrad``, a fused third-party Adam...):
    ``opt = Other(scaled_parameters(model.named_parameters(), lr_scale_func_adam, lr=1e-2))``.
    Parameters with the same scale (and group options) share one group.

    Args:
        params: tensors, ``(name, tensor)`` pairs (named in errors) or torch group dicts
            (whose own ``lr``/``weight_decay`` replace the arguments).
        lr_scale_func: the rule, e.g. :func:`lr_scale_func_adam`.
        lr: base learning rate (required unless every group dict has one); a tensor
            rate gives tensor rates (``lr * factor``, new tensors), as torch optimisers
            accept them.
        weight_decay: decay per step (independent) or torch's coefficient (not).
        independent_weight_decay: divide each group's ``weight_decay`` by its learning
            rate ``lr * lr_scale_func(p)``, so that a decoupled optimiser (AdamW, SGD
            without momentum) shrinks every parameter by ``weight_decay * lr_t / lr`` per
            step (``lr_t`` the scheduled rate), whatever ``lr`` and its u-μP factor.
        allow_untagged: give untagged parameters the base ``lr`` instead of raising.

    Returns:
        A list of group dicts for any ``torch.optim.Optimizer``.

    Raises:
        UntaggedParameterError: an untagged parameter (named, if names were passed).
        ValueError: no learning rate.

    Example:
        >>> import unitscale as us
        >>> groups = scaled_parameters(us.Linear(256, 8).parameters(), lr_scale_func_adam, lr=1.0)
        >>> [(g["lr"], len(g["params"])) for g in groups]
        [(0.0625, 1), (1.0, 1)]
    """
    out: dict[tuple[Any, ...], dict[str, Any]] = {}
    defaults = {"lr": lr, "weight_decay": weight_decay}
    for options, scale, group_params in _scaled_groups(
        params, lr_scale_func, allow_untagged, defaults
    ):
        base_lr = options.pop("lr")
        if base_lr is None:
            raise ValueError("unitscale.optim.scaled_parameters: pass lr= (the base rate)")
        decay = float(options.pop("weight_decay"))
        if independent_weight_decay and decay:
            rate = float(base_lr) * scale
            decay = decay / rate if rate else 0.0
        group_lr = _scaled_rate(base_lr, scale)
        # Groups of the same rate and options are one (whatever their base rates).
        rate_key = (id(base_lr), scale) if isinstance(base_lr, Tensor) else group_lr
        key = (rate_key, decay, *_options_key(options))
        if key not in out:
            out[key] = {"params": [], "lr": group_lr, "weight_decay": decay, **options}
        out[key]["params"].extend(group_params)
    return list(out.values())


def _options_key(options: dict[str, Any]) -> list[tuple[str, Any]]:
    """Group options as a hashable key (a tensor option by identity)."""
    return sorted((k, id(v) if isinstance(v, Tensor) else repr(v)) for k, v in options.items())


def _scaled_groups(
    params: Iterable[Any],
    lr_scale_func: LRScaleFunc,
    allow_untagged: bool,
    defaults: dict[str, Any],
) -> list[tuple[dict[str, Any], float, list[Tensor]]]:
    """The parameters of ``params`` (as :func:`scaled_parameters` takes them) grouped by
    their group's options (``defaults`` where the group sets none) and their u-μP factor
    ``lr_scale_func(p)`` (1 for an untagged one with ``allow_untagged``; else an error
    naming it): ``(options, factor, parameters)`` in first-seen order, each its own dict."""
    out: dict[tuple[Any, ...], tuple[dict[str, Any], float, list[Tensor]]] = {}
    for group in _named(params):
        options = {**defaults, **{k: v for k, v in group.items() if k != "params"}}
        for name, param in group["params"]:
            if has_mup_tags(param):
                scale = float(lr_scale_func(param))
            elif allow_untagged:
                scale = 1.0
            else:
                raise _untagged(param, None if name.startswith("#") else name)
            key = (scale, *_options_key(options))
            if key not in out:
                out[key] = (dict(options), scale, [])
            out[key][2].append(param)
    return list(out.values())


def _scaled_rate(base_lr: Any, scale: float) -> Any:
    """``base_lr * scale``: a tensor rate stays a tensor (a new one, of its dtype and
    device), as torch optimisers accept it (e.g. ``Adam(capturable=True)``); else a float."""
    if isinstance(base_lr, Tensor):
        return base_lr.detach() * scale
    return float(base_lr) * scale


def _unhooked(step: Callable[..., Any]) -> Callable[..., Any]:
    """torch's own ``step`` without the hook wrapper torch may have put on it (the subclass's
    ``step`` gets its own, so hooks run once)."""
    return step.__wrapped__ if getattr(step, "hooked", False) else step  # type: ignore[attr-defined]


class _ScaledOptimizer:
    """The u-μP part shared by :class:`Adam`, :class:`AdamW` and :class:`SGD` (a mixin in
    front of the torch class): binding torch's arguments, the groups, the scaled step."""

    _torch_class: ClassVar[Any]  # the torch optimiser class this one extends
    _rule: ClassVar[Any]  # staticmethod: the LRScaleFunc
    param_groups: list[dict[str, Any]]

    def __init__(
        self,
        params: Iterable[Any],
        *args: Any,
        independent_weight_decay: bool = True,
        allow_untagged: bool = False,
        **kwargs: Any,
    ) -> None:
        bound = inspect.signature(self._torch_class.__init__).bind(self, params, *args, **kwargs)
        bound.arguments.setdefault("weight_decay", 0.0)  # the reference's default, not torch's
        bound.apply_defaults()
        options = {k: v for k, v in bound.arguments.items() if k not in ("self", "params")}
        lr, weight_decay = options.pop("lr"), options.pop("weight_decay")
        if independent_weight_decay and weight_decay and "decoupled_weight_decay" in options:
            options["decoupled_weight_decay"] = True  # Adam: see its docstring
        # Groups of one factor each: "lr" the base rate, "lr_scale" the factor.
        defaults = {"independent_weight_decay": independent_weight_decay}
        groups = [
            {"params": group_params, **options, "lr_scale": scale}
            for options, scale, group_params in _scaled_groups(
                params, type(self)._rule, allow_untagged, defaults
            )
        ]
        self._torch_class.__init__(self, groups, lr=lr, weight_decay=weight_decay, **options)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, then the group's ``"decay_lr"``: its learning rate now (``lr * lr_scale``),
        which independent weight decay divides by (see the module docstring)."""
        self._torch_class.add_param_group(self, param_group)
        group = self.param_groups[-1]
        group.setdefault("lr_scale", 1.0)
        group.setdefault("decay_lr", float(group["lr"]) * group["lr_scale"])

    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """torch's step with each group's ``lr * lr_scale`` and, with independent weight decay,
        ``weight_decay / decay_lr`` (see the module docstring); the groups' own values are
        restored afterwards."""
        saved = [(group["lr"], group["weight_decay"]) for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] = group["lr"] * group.get("lr_scale", 1.0)
            if group.get("independent_weight_decay", False) and group["weight_decay"]:
                decay_lr = group.get("decay_lr", 0.0)
                group["weight_decay"] = group["weight_decay"] / decay_lr if decay_lr else 0.0
        try:
            return _unhooked(self._torch_class.step)(self, closure)
        finally:
            for group, (lr, weight_decay) in zip(self.param_groups, saved, strict=True):
                group["lr"], group["weight_decay"] = lr, weight_decay


_COMMON_ARGS = """
    Same positional arguments and defaults as torch's class (bound against its signature),
    plus two keyword-only ones:

    Args:
        params: parameters, ``(name, parameter)`` pairs or group dicts, all u-μP-tagged.
        args, kwargs: torch's arguments (``lr``, ``weight_decay``...). ``lr`` is the base
            rate: each parameter's group has ``"lr"`` (the base, what schedulers and you
            set) and ``"lr_scale"`` (its factor), and steps at ``lr * lr_scale``.
        independent_weight_decay: every parameter shrinks by ``weight_decay * lr_t / lr_0``
            per step (``lr_t`` the scheduled base rate, ``lr_0`` the base rate at
            construction), whatever ``lr`` and its u-μP factor (default); False: torch's
            coefficient on the parameter's own rate. ``weight_decay`` defaults to 0.
        allow_untagged: give untagged parameters ``lr`` instead of raising.

    Raises:
        UntaggedParameterError: a parameter has no u-μP tags.
        TypeError: arguments torch's class would refuse.
"""


class AdamW(_ScaledOptimizer, torch.optim.AdamW):
    """``torch.optim.AdamW`` with u-μP learning rates (:func:`lr_scale_func_adam`).
    {args}
    Example:
        >>> import unitscale as us
        >>> opt = AdamW(us.Linear(64, 8, bias=False).parameters(), 0.8, (0.9, 0.95))
        >>> group = opt.param_groups[0]
        >>> group["lr"], group["lr_scale"], group["weight_decay"]  # 1 / sqrt(64); no decay
        (0.8, 0.125, 0.0)
    """

    _torch_class = torch.optim.AdamW
    _rule = staticmethod(lr_scale_func_adam)


class Adam(_ScaledOptimizer, torch.optim.Adam):
    """``torch.optim.Adam`` with u-μP learning rates (:func:`lr_scale_func_adam`).

    Weight decay: torch's Adam adds ``weight_decay * p`` to the gradient (L2), which Adam
    then normalises, so no choice of coefficient makes it independent of the factor. With
    ``independent_weight_decay`` (default) and a non-zero ``weight_decay``, the decay is
    decoupled instead (``decoupled_weight_decay=True``: AdamW's update) and independent as
    in :class:`AdamW`; with ``independent_weight_decay=False`` it is torch's L2.
    {args}
    Example:
        >>> import unitscale as us
        >>> opt = Adam(us.LayerNorm(64).parameters(), lr=0.1)
        >>> [(g["lr"], g["lr_scale"]) for g in opt.param_groups]
        [(0.1, 1.0)]
    """

    _torch_class = torch.optim.Adam
    _rule = staticmethod(lr_scale_func_adam)


class SGD(_ScaledOptimizer, torch.optim.SGD):
    """``torch.optim.SGD`` with u-μP learning rates (:func:`lr_scale_func_sgd`).

    Learning rates: the reference's default rule for SGD (the Adam rates,
    :func:`lr_scale_func_sgd` says why they hold for a unit-scaled model).

    Weight decay: torch's SGD adds ``weight_decay * p`` to the gradient, so without momentum
    a step shrinks ``p`` by ``lr_t * lr_scale * weight_decay``; with
    ``independent_weight_decay`` (default) the coefficient is divided by the group's rate at
    construction, ``lr_0 * lr_scale``, so every parameter shrinks by
    ``weight_decay * lr_t / lr_0`` per step (with momentum, the decay is also accumulated).
    {args}
    Example:
        >>> import unitscale as us
        >>> opt = SGD(us.Linear(16, 8, bias=False).parameters(), 1.0, 0.9)  # momentum 0.9
        >>> group = opt.param_groups[0]
        >>> group["lr"] * group["lr_scale"], group["momentum"], group["weight_decay"]
        (0.25, 0.9, 0.0)
    """

    _torch_class = torch.optim.SGD
    _rule = staticmethod(lr_scale_func_sgd)


for _optimiser in (AdamW, Adam, SGD):
    _optimiser.__doc__ = (_optimiser.__doc__ or "").replace("{args}", _COMMON_ARGS)
del _optimiser
