"""u-μP's norms without trainable parameters, for ``unit_scale``.

The u-μP paper's recommended scheme (Blake et al., ICLR 2025, section 4 and the models of its
experiments) has no trainable norm affine: a norm's scale and bias are not in the residual
stream's width-independent update analysis, and trained at u-μP's learning rates (``lr`` and
``lr / sqrt(depth)``, far above a standard model's) they move too fast. So ``unit_scale``
fixes them: each normalisation module's parameters stop requiring gradients, torch's norms
(``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, batch norms) with scale 1 and bias 0,
other norm classes (transformers' ``LlamaRMSNorm``...) with the values they hold (their own
initialisation is the identity).

Design constraints: works on the copy ``unit_scale`` made, never on the user's module; which
modules are norms is :func:`unitscale.parameter.infer_mup_type`'s rule (torch's norm classes
and any class whose name ends in ``Norm``).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["freeze_norms"]

_TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)


def _is_norm(module: nn.Module) -> bool:
    """A normalisation module with parameters of its own (the modules whose scales
    :func:`unitscale.parameter.infer_mup_type` tags ``"norm"``)."""
    is_norm = isinstance(module, _TORCH_NORMS) or type(module).__name__.endswith("Norm")
    return is_norm and any(True for _ in module.parameters(recurse=False))


def freeze_norms(module: nn.Module) -> list[str]:
    """Make every normalisation module's parameters of ``module`` fixed (in place).

    Returns:
        The qualified names of the parameters frozen.
    """
    frozen: list[str] = []
    with torch.no_grad():
        for prefix, sub in module.named_modules():
            if not _is_norm(sub):
                continue
            for name, param in sub.named_parameters(recurse=False):
                if isinstance(sub, _TORCH_NORMS):
                    param.fill_(0.0 if name == "bias" else 1.0)
                param.requires_grad_(False)
                frozen.append(f"{prefix}.{name}" if prefix else name)
    return frozen
