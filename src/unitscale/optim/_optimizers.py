"""u-μP's Adam, AdamW and SGD: torch's classes with per-parameter learning rates."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch

from ._groups import _named, _scaled_groups, parameter_names
from ._rules import lr_scale_func_adam, lr_scale_func_sgd

__all__ = ["SGD", "Adam", "AdamW"]


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
        params = _named(params)  # a generator (named_parameters()) is read once, here
        self._unitscale_names = parameter_names(params)
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
