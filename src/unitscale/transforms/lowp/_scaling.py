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

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor, nn

__all__ = [
    "AMAX_EPS",
    "DEFAULT_HISTORY_LEN",
    "HISTORY_PREFIX",
    "ROWWISE_SCALINGS",
    "SCALINGS",
    "Scaling",
    "amax_scale",
    "axis_amax",
    "cast_scale",
    "delayed_scale",
    "history_buffer",
    "keep_histories",
    "power_of_2_floor",
    "saturate_to",
    "scaled_cast",
    "tensor_amax",
]

Scaling = Literal["none", "tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp"]
"""How :func:`~unitscale.transforms.simulate_fp8` scales each tensor it rounds."""

SCALINGS: tuple[str, ...] = ("none", "tensorwise", "delayed", "rowwise", "rowwise_with_gw_hp")

ROWWISE_SCALINGS: tuple[str, ...] = ("rowwise", "rowwise_with_gw_hp")
"""torchao's rowwise recipes (``Float8LinearConfig.from_recipe_name``): linear ops only, each
GEMM operand scaled per row or column along that GEMM's reduction dimension, power-of-two
scales, E4M3 for every tensor, the GEMM's output in bfloat16 (see :mod:`~._simulated_rowwise`)."""

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


def power_of_2_floor(scale: Tensor) -> Tensor:
    """``scale`` rounded down to a power of two (torchao's
    ``_round_scale_down_to_power_of_2``: ``exp2(floor(log2(scale)))``), so that scaling and
    unscaling are exact.

    Example:
        >>> power_of_2_floor(torch.tensor([224.0, 0.3])).tolist()
        [128.0, 0.25]
    """
    return torch.exp2(torch.floor(torch.log2(scale)))


def axis_amax(x: Tensor, dim: int) -> Tensor:
    """``max(abs(x))`` along ``dim`` (kept, size 1), as float32: the amax of each row
    (``dim=-1``) or column (``dim=0``) of a matrix, read in one ``aminmax`` pass.

    Example:
        >>> axis_amax(torch.tensor([[1.0, -4.0], [2.0, 0.5]]), dim=-1).tolist()
        [[4.0], [2.0]]
    """
    low, high = torch.aminmax(x.detach(), dim=dim, keepdim=True)
    return torch.maximum(high, -low).to(torch.float32)


def cast_scale(
    x: Tensor,
    format_max: float,
    scaling: str,
    history: Tensor | None = None,
    record: bool = False,
    dim: int | None = None,
) -> Tensor:
    """The scale ``format_max / amax`` that a scaled cast of ``x`` multiplies it by.

    ``"tensorwise"``: the amax of ``x``; ``"delayed"``: from ``history`` (updated with
    ``record``, see :func:`delayed_scale`); the rowwise recipes: the amax along ``dim`` (one
    scale per row for ``dim=-1``, per column for ``dim=0``; the whole tensor for None), the
    scale rounded down to a power of two (torchao's rowwise recipes set
    ``round_scales_to_power_of_2``).
    """
    if scaling in ROWWISE_SCALINGS:
        amax = tensor_amax(x) if dim is None else axis_amax(x, dim)
        return power_of_2_floor(amax_scale(amax, format_max))
    if scaling == "delayed" and history is not None:
        return delayed_scale(x, history, format_max, record=record)
    return amax_scale(tensor_amax(x), format_max)


def scaled_cast(
    x: Tensor,
    cast: Callable[[Tensor], Tensor],
    format_max: float,
    scaling: str,
    *,
    scale: Tensor | None = None,
    history: Tensor | None = None,
    record: bool = False,
    dim: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``cast(float32(x) * scale)`` and ``1 / scale``: the one scaled cast of FP8.

    ``simulate_fp8`` passes the rounding to a format as ``cast`` (and multiplies the result
    by the inverse scale: the value the FP8 GEMM sees); ``to_fp8`` a saturating conversion to
    a float8 dtype (and hands the inverse scale to ``_scaled_mm``). torchao scales in float32
    and its float8 GEMM multiplies by the reciprocal scale, as here. ``scale`` is computed by
    :func:`cast_scale` from ``scaling`` (and ``history``, ``record``, ``dim``) unless given;
    with ``scaling="none"`` and no ``scale``, the result is ``cast(x)`` and None.

    Example:
        >>> from unitscale.formats import E4M3
        >>> x = torch.tensor([[1000.0, 0.3], [0.5, 0.25]])
        >>> rounded, inverse = scaled_cast(x, E4M3.quantise, 448.0, "rowwise", dim=-1)
        >>> inverse.tolist()  # per row: 448/1000 -> 0.25 (a power of two), 448/0.5 -> 512
        [[4.0], [0.001953125]]
        >>> (rounded * inverse).tolist()
        [[1024.0, 0.3125], [0.5, 0.25]]
    """
    if scale is None:
        if scaling == "none":
            return cast(x), None
        scale = cast_scale(x, format_max, scaling, history, record, dim)
    return cast(x.to(torch.float32) * scale), scale.reciprocal()


def saturate_to(x: Tensor, dtype: torch.dtype, fmax: float) -> Tensor:
    """``x`` clamped to ``[-fmax, fmax]`` and converted to the float8 ``dtype``: the cast
    ``to_fp8`` hands :func:`scaled_cast` (torch's conversion does not saturate by itself)."""
    return x.clamp(-fmax, fmax).to(dtype)


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
