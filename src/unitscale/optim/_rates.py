"""Each parameter's effective learning rate and decay, for an optimiser unitscale builds."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._rules import rule_text

__all__ = ["effective_rates"]

_COLUMNS = [
    "name",
    "tag",
    "shape",
    "mup_scaling_depth",
    "algorithm",
    "base_lr",
    "lr_scale",
    "lr",
    "weight_decay",
    "decay_per_step",
    "rule",
]


def _algorithm(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> str:
    if "algorithm" in group:
        return "Muon" if group["algorithm"] == "muon" else "Adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "SGD"
    muon = getattr(torch.optim, "Muon", None)
    if muon is not None and isinstance(optimizer, muon):
        return "Muon"
    return "Adam"


def _names(optimizer: torch.optim.Optimizer, model: nn.Module | None) -> dict[int, str]:
    names: dict[int, str] = {}
    if model is not None:
        names.update((id(p), n) for n, p in model.named_parameters(remove_duplicate=False))
    names.update(getattr(optimizer, "_unitscale_names", {}))
    return names


def _decay(group: dict[str, Any]) -> float:
    """The coefficient torch's step applies: ``weight_decay / decay_lr`` with independent
    decay (see :class:`~unitscale.optim.AdamW`), else the group's own."""
    decay = float(group.get("weight_decay", 0.0))
    if group.get("independent_weight_decay", False) and decay:
        decay_lr = group.get("decay_lr", 0.0)
        return decay / decay_lr if decay_lr else 0.0
    return decay


def effective_rates(optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> Any:
    """One row per parameter: its tag, effective learning rate and decay, and the rule.

    For an optimiser unitscale builds (:class:`Adam`, :class:`AdamW`, :class:`SGD`,
    :class:`Muon`) or any torch optimiser over :func:`scaled_parameters` groups. The table
    a "my u-μP model does not learn" question starts from: a parameter at rate 0, a rule
    that is not the one expected, an untagged parameter, a decay larger than its rate.

    Columns: ``name`` (from ``(name, parameter)`` pairs given to the optimiser, else from
    ``model``, else ``group<i>.<j>``), ``tag`` (``mup_type``, None if untagged), ``shape``,
    ``mup_scaling_depth``, ``algorithm`` (``"Adam"``, ``"SGD"`` or ``"Muon"``),
    ``base_lr`` (the group's ``"lr"``, what schedulers set; for bare
    :func:`scaled_parameters` groups, whose ``"lr"`` is already scaled, NaN), ``lr_scale``
    (u-μP's factor; for a Muon matrix the factor after torch's own shape adjustment is put
    back), ``lr`` (the rate the step uses now, ``base_lr * lr_scale``), ``weight_decay``
    (the coefficient torch's step applies: with independent decay ``weight_decay / (lr_0 *
    lr_scale)``), ``decay_per_step`` (the fraction of the parameter a decoupled step takes
    off, ``lr * weight_decay``) and ``rule`` (e.g.
    ``"weight: lr * 1/sqrt(fan_in=64) * 1/sqrt(depth=2) (Adam)"``).

    Args:
        optimizer: the optimiser.
        model: the model, for names when the optimiser was given bare parameters.

    Returns:
        A ``pandas.DataFrame``, in the optimiser's order.

    Example:
        >>> import unitscale as us
        >>> model = us.TransformerDecoder(64, depth=2, heads=4, vocab_size=32)
        >>> opt = us.optim.AdamW(model.named_parameters(), lr=0.5, weight_decay=0.1)
        >>> table = effective_rates(opt)
        >>> print(table.loc[[0, 1, 9], ["name", "tag", "lr", "decay_per_step"]].to_string())
                               name     tag        lr  decay_per_step
        0          embedding.weight  weight  0.062500             0.1
        1  layers.0.attn.qkv.weight  weight  0.044194             0.1
        9            readout.weight  output  0.500000             0.1
        >>> print(table.loc[1, "rule"])
        weight: lr * 1/sqrt(fan_in=64) * 1/sqrt(depth=2) (Adam)
    """
    import pandas as pd

    from ._muon import torch_muon_adjustment

    names = _names(optimizer, model)
    rows = []
    for g, group in enumerate(optimizer.param_groups):
        algorithm = _algorithm(optimizer, group)
        scaled = "lr_scale" in group
        for j, param in enumerate(group["params"]):
            scale = float(group["lr_scale"]) if scaled else float("nan")
            if scaled and algorithm == "Muon" and group.get("algorithm") == "muon":
                scale *= torch_muon_adjustment(param.shape)
            base = float(group["lr"])
            lr = base * scale if scaled else base
            decay = _decay(group)
            rows.append(
                {
                    "name": names.get(id(param), f"group{g}.{j}"),
                    "tag": getattr(param, "mup_type", None),
                    "shape": tuple(param.shape),
                    "mup_scaling_depth": getattr(param, "mup_scaling_depth", None),
                    "algorithm": algorithm,
                    "base_lr": base if scaled else float("nan"),
                    "lr_scale": scale,
                    "lr": lr,
                    "weight_decay": decay,
                    "decay_per_step": lr * decay,
                    "rule": rule_text(param, algorithm),
                }
            )
    frame = pd.DataFrame(rows, columns=_COLUMNS)
    frame["mup_scaling_depth"] = frame["mup_scaling_depth"].astype("Int64")  # None: <NA>
    return frame
