"""How ``unit_scale`` initialises the weights of its copy: the modules whose op it replaces
get unit-scale weights (N(0, 1), norms' weights 1, biases 0), and an output head that shares
the input embedding's weight gets a weight of its own (u-muP trains the two differently).

Design constraint: only the transformed copy is touched, never the user's module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Module types unit_scale re-initialises, and the op whose replacement triggers it.
_UNIT_INIT: tuple[tuple[type[nn.Module], Callable[..., Any]], ...] = (
    (nn.Linear, F.linear),
    (nn.Conv1d, F.conv1d),
    (nn.Embedding, F.embedding),
    (nn.LayerNorm, F.layer_norm),
    (nn.RMSNorm, F.rms_norm),
)


def _is_hf_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's linear layers: ``addmm(bias, x, weight)``)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _init_unit_scale(module: nn.Module, mapping: Mapping[Any, Any]) -> list[str]:
    """Re-initialise, in place, the parameters of modules whose op is unit-scaled.

    Returns the qualified names of the parameters it re-initialised.
    """
    replaced = {op for op, fn in mapping.items() if fn is not op}
    touched: list[str] = []
    with torch.no_grad():
        for prefix, sub in module.named_modules():
            # HF Conv1D is initialised like a Linear when addmm is replaced.
            rules = [(cls, op) for cls, op in _UNIT_INIT if isinstance(sub, cls)]
            if _is_hf_conv1d(sub):
                rules.append((type(sub), torch.addmm))
            for _, op in rules:
                if op not in replaced:
                    continue
                weight = getattr(sub, "weight", None)
                bias = getattr(sub, "bias", None)
                if isinstance(sub, (nn.LayerNorm, nn.RMSNorm)):
                    if isinstance(weight, torch.Tensor):
                        weight.fill_(1.0)
                elif isinstance(weight, torch.Tensor):
                    weight.normal_(0.0, 1.0)
                    padding = getattr(sub, "padding_idx", None)
                    if isinstance(sub, nn.Embedding) and padding is not None:
                        weight[padding].zero_()
                if isinstance(bias, torch.Tensor):
                    bias.zero_()
                touched.extend(
                    f"{prefix}.{name}" if prefix else name
                    for name in ("weight", "bias")
                    if isinstance(getattr(sub, name, None), torch.Tensor)
                )
    return touched


def _owns_initialised(module: nn.Module) -> bool:
    return isinstance(
        module, (nn.MultiheadAttention, *(cls for cls, _ in _UNIT_INIT))
    ) or _is_hf_conv1d(module)


def _readout_name(module: nn.Module) -> str | None:
    """Qualified name of the output head's weight: ``get_output_embeddings()``'s (transformers
    models), or None."""
    get_output = getattr(module, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    if not isinstance(getattr(head, "weight", None), nn.Parameter):
        return None
    for name, sub in module.named_modules():
        if sub is head:
            return f"{name}.weight" if name else "weight"
    return None


def _untie_readout(module: nn.Module, readout: str) -> None:
    """Give the output head a weight of its own where it shares the input embedding's.

    u-μP trains the two with different rules (embedding ``lr / sqrt(width)``, readout
    ``lr``) and applies them differently (the readout's ``1/fan_in`` multiplier), which one
    shared tensor cannot have. The copy starts equal to the shared weight; the model's
    config (transformers) is told, so that ``tie_weights()`` does not tie them again.
    """
    head = module.get_submodule(readout.rpartition(".")[0])
    weight = module.get_parameter(readout)
    shared = any(
        p is weight for name, p in module.named_parameters(remove_duplicate=False)
        if name != readout
    )  # fmt: skip
    if not shared:
        return
    head.weight = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "tie_word_embeddings"):
        config.tie_word_embeddings = False


def _unowned_versions(module: nn.Module) -> dict[str, int]:
    """The version counter of each parameter of ``module`` that no module re-initialised by
    :func:`_init_unit_scale` owns, by qualified name."""
    owned = {
        id(p)
        for sub in module.modules()
        if _owns_initialised(sub)
        for p in sub.parameters(recurse=False)
    }
    return {name: p._version for name, p in module.named_parameters() if id(p) not in owned}


def _mark_conv1d_fan_in(module: nn.Module) -> None:
    """Tell ``unitscale.optim`` that transformers' ``Conv1D`` weights are stored ``(in, out)``
    (its ``addmm``), so their fan-in is dimension 0."""
    for sub in module.modules():
        weight = getattr(sub, "weight", None)
        if _is_hf_conv1d(sub) and isinstance(weight, nn.Parameter):
            weight.fan_in_dim = 0  # type: ignore[attr-defined]
