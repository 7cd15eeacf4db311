"""Torch parameter groups with u-μP's per-parameter learning rates."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from ..parameter import has_mup_tags
from ._rules import LRScaleFunc, _untagged

__all__ = ["scaled_parameters"]


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


def parameter_names(groups: list[dict[str, Any]]) -> dict[int, str]:
    """``{id(parameter): name}`` of the named parameters of ``groups`` (as :func:`_named`
    returns them), for :func:`~unitscale.optim.effective_rates`."""
    return {
        id(param): name
        for group in groups
        for name, param in group["params"]
        if not name.startswith("#")
    }


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
        >>> from unitscale.optim import lr_scale_func_adam
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
