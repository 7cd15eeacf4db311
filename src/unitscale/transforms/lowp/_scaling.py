"""Per-tensor scaling for FP8 simulation: torchao's tensorwise recipe and delayed scaling.

A scaled cast multiplies a tensor by ``scale = format_max / amax`` before rounding it to the
format and divides by the same scale afterwards, so that the tensor's largest magnitude lands
on the format's largest value whatever the tensor's own scale. Two ways to choose ``amax``:

- ``"tensorwise"``: the amax of the tensor being rounded, computed when it is rounded
  (dynamic scaling). This is ``torchao.float8.convert_to_float8_training`` with its default
  ``Float8LinearConfig`` (read from torchao 0.18's ``float8_utils.py``): ``amax =
  max(abs(x))`` in the tensor's dtype, ``scale = float32(fmax / clamp(float64(amax),
  min=1e-12))`` (so a zero tensor gets the finite scale ``fmax * 1e12`` and stays zero), the
  scale *not* rounded to a power of two (``round_scales_to_power_of_2=False``), the scaled
  tensor computed in float32 and cast with saturation, and no reduction of amax over ranks
  (``reduce_amax=False``: under data parallelism each rank scales by its local amax).
- ``"delayed"``: the amax is the maximum of an *amax history* of earlier steps, as in
  Transformer Engine's ``DelayedScaling`` and torchao's former delayed scaling; the history
  is rolled and the current amax written at its front after it is used. Its length defaults
  to 16, torchao's former ``DelayedScalingConfig.history_len`` default. First step: while the
  history holds no non-zero amax (a fresh model), the current amax is used, i.e. the first
  step scales as ``"tensorwise"`` does (torchao's former delayed scaling likewise initialised
  its history from the first step's tensors). The history is only updated while autograd
  records (a training step): a forward under ``torch.no_grad()`` (evaluation) reads it.

Design constraints: scales stay on the device (no host synchronisation), computed with
tensor ops only, so they run under ``torch.compile``; the history tensors are buffers of the
transformed model's root module (``fp8_amax_history_<module>_<role>``, one per scaled
rounding: ``fp8_amax_history_blocks_0_fc_input``, ``..._weight``, ``..._grad_output``), so
they are saved in ``state_dict()``, move with ``.to()`` and are restored by
``load_state_dict()``; they are buffers, not a child module, so that containers that iterate
their children (``nn.Sequential``) are not changed. A history is named after its op's place
in the model (see ``_Sites`` in :mod:`unitscale.transforms.lowp._pass`), not after the node
of one captured graph: a graph recaptured for new input shapes keeps its histories, and two
ops never share one, on either side of a graph break or in layers whose graph Dynamo
captures once and reuses.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

__all__ = [
    "AMAX_EPS",
    "DEFAULT_HISTORY_LEN",
    "HISTORY_PREFIX",
    "SCALINGS",
    "Scaling",
    "amax_scale",
    "delayed_scale",
    "history_buffer",
    "keep_histories",
    "scaled_round",
    "tensor_amax",
]

Scaling = Literal["none", "tensorwise", "delayed"]
"""How :func:`~unitscale.transforms.simulate_fp8` scales each tensor it rounds."""

SCALINGS: tuple[str, ...] = ("none", "tensorwise", "delayed")

AMAX_EPS = 1e-12
"""The smallest amax a scale is computed from (torchao's ``float8_utils.EPS``)."""

DEFAULT_HISTORY_LEN = 16
"""Default amax-history length of ``scaling="delayed"``: torchao's former
``DelayedScalingConfig.history_len`` (Transformer Engine's ``DelayedScaling`` defaults to
1024 since v1.0; 16 reacts faster to a growing tensor)."""


def amax_scale(amax: Tensor, format_max: float) -> Tensor:
    """``format_max / amax`` as torchao computes it: in float64, amax clamped to 1e-12, then
    float32 (torchao's ``amax_to_scale`` without power-of-two rounding).

    Example:
        >>> amax_scale(torch.tensor(2.0), 448.0).item(), amax_scale(torch.tensor(0.0), 448.0)
        (224.0, tensor(4.4800e+14))
    """
    return (format_max / amax.to(torch.float64).clamp(min=AMAX_EPS)).to(torch.float32)


def tensor_amax(x: Tensor) -> Tensor:
    """``max(abs(x))`` as a float32 scalar (0 for an empty tensor; NaN if ``x`` holds one).

    Computed as ``max(max(x), -min(x))`` by one ``aminmax`` pass, which reads ``x`` once and
    allocates nothing of its size (``x.abs().amax()`` writes ``abs(x)`` first); the value is
    the same, exactly.

    Example:
        >>> tensor_amax(torch.tensor([0.5, -3.0, 2.0]))
        tensor(3.)
    """
    x = x.detach()
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    low, high = torch.aminmax(x)
    return torch.maximum(high, -low).to(torch.float32)


def delayed_scale(x: Tensor, history: Tensor, format_max: float, record: bool) -> Tensor:
    """The delayed scale of ``x`` from ``history``; with ``record``, roll ``x``'s amax into it.

    Args:
        x: the tensor about to be rounded.
        history: float32 amax history (most recent first), updated in place.
        format_max: the format's largest value.
        record: whether to write ``x``'s amax into the history after reading it.

    Returns:
        ``format_max / max(history)``, or ``format_max / amax(x)`` while the history holds no
        non-zero value (the first step).

    Example:
        >>> history = torch.zeros(3)
        >>> delayed_scale(torch.tensor([4.0]), history, 448.0, record=True).item()  # first step
        112.0
        >>> delayed_scale(torch.tensor([1.0]), history, 448.0, record=True).item(), history
        (112.0, tensor([1., 4., 0.]))
    """
    current = tensor_amax(x)
    earlier = history.amax()
    scale = amax_scale(torch.where(earlier > 0, earlier, current), format_max)
    if record:
        with torch.no_grad():
            history.copy_(torch.cat([current.view(1).to(history.dtype), history[:-1]]))
    return scale


def scaled_round(x: Tensor, scale: Tensor, round_fn: Any) -> Tensor:
    """``round_fn(float32(x) * scale) * (1 / scale)``, in ``x``'s dtype: torchao scales in
    float32, and its float8 GEMM (``_scaled_mm``) multiplies by the reciprocal scale."""
    return round_fn(x.to(torch.float32) * scale).mul_(scale.reciprocal()).to(x.dtype)


HISTORY_PREFIX = "fp8_amax_history_"
"""Name prefix of the amax-history buffers on the transformed model's root module."""


def history_buffer(root: nn.Module, site: str, history_len: int, device: torch.device) -> str:
    """The name of ``site``'s history buffer on ``root``, created (zeros: "no earlier step")
    if it does not exist yet, e.g. ``fp8_amax_history_input_scale``."""
    name = HISTORY_PREFIX + site
    if name not in root._buffers:
        root.register_buffer(name, torch.zeros(history_len, device=device))
    return name


def _create_loaded_histories(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    for key, value in state_dict.items():
        name = key[len(prefix) :]
        if key.startswith(prefix + HISTORY_PREFIX) and "." not in name:
            if name not in module._buffers:
                module.register_buffer(name, torch.zeros_like(value, dtype=torch.float32))


def keep_histories(root: nn.Module) -> None:
    """Let ``root.load_state_dict()`` restore histories that ``root`` has not built yet (a
    freshly transformed model loading a trained one's checkpoint)."""
    hooks = root._load_state_dict_pre_hooks.values()
    if not any(getattr(h, "hook", h) is _create_loaded_histories for h in hooks):
        root._register_load_state_dict_pre_hook(_create_loaded_histories, with_module=True)
