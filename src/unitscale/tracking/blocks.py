"""Block-format metrics of tracked tensors (``track_scales(model, block_formats=...)``).

Per tensor and per block-scaled format (:class:`~unitscale.formats.BlockFormat`), with
blocks along the tensor's last dimension (the reduction dimension of a linear op's input
and weight in its forward GEMM, and of its output gradient in the input-gradient GEMM):

- ``block_flushed_<format>``: fraction of the nonzero elements that round to zero inside
  their block (small next to their block's largest element);
- ``block_scale_clipped_<format>``: fraction of the blocks whose scale hits the scale
  format's range (E8M0: the exponent the rule asks for is beyond ``2**-127..2**127``;
  NVFP4's E4M3: below its smallest normal or above 448);
- ``block_error_<format>``: ``||rounded - x|| / ||x||`` over the finite elements.

NaN where the tensor cannot be blocked (a last dimension that is not a multiple of the
block size, or a scalar). Computed eagerly, from the tensor, at record time: several passes
over each tensor per format, so only when asked for (the default records none: tracking's
per-op cost is unchanged).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.fx import Graph

from ..errors import UnitScaleError
from ..formats import BLOCK_PRESETS, BlockFormat, get_format
from .metrics import Metrics

__all__ = [
    "BLOCK_METRIC_KINDS",
    "attach_block_metrics",
    "block_metric_description",
    "block_metrics",
    "check_block_formats",
]

#: The block metrics, each recorded as ``<kind>_<format name>``.
BLOCK_METRIC_KINDS: tuple[str, ...] = ("block_flushed", "block_scale_clipped", "block_error")

_DESCRIPTIONS = {
    "block_flushed": "fraction of nonzero values flushed to zero inside their {} block",
    "block_scale_clipped": "fraction of {} blocks whose scale is clipped by the scale range",
    "block_error": "relative error ||q(x) - x|| / ||x|| of x rounded to {}",
}


def check_block_formats(formats: object, where: str) -> tuple[tuple[str, BlockFormat], ...]:
    """``(name, format)`` for each block-scaled preset name (or format) in ``formats``."""
    if formats is None:
        return ()
    if isinstance(formats, (str, BlockFormat)):
        formats = (formats,)
    if not isinstance(formats, Sequence):
        raise UnitScaleError(
            f"{where}: block_formats={formats!r} must be a sequence of block-scaled format "
            f"names ({', '.join(BLOCK_PRESETS)})"
        )
    out = []
    for spec in formats:
        fmt = get_format(spec) if isinstance(spec, str) and spec.lower() in BLOCK_PRESETS else spec
        if not isinstance(fmt, BlockFormat):
            raise UnitScaleError(
                f"{where}: block_formats holds {spec!r}, which is not a block-scaled format; "
                f"use names among {', '.join(BLOCK_PRESETS)}"
            )
        out.append((_name_of(fmt), fmt))
    return tuple(out)


def _name_of(fmt: BlockFormat) -> str:
    for name, preset in BLOCK_PRESETS.items():
        if preset == fmt:
            return name
    text = repr(fmt)
    return "".join(c if c.isalnum() else "_" for c in text).strip("_").lower()


def block_metrics(x: Tensor, formats: tuple[tuple[str, BlockFormat], ...]) -> dict[str, float]:
    """The block metrics of ``x`` (blocks along its last dimension) for every format.

    Example:
        >>> fmts = check_block_formats(["mxfp4_e2m1"], "example")
        >>> m = block_metrics(torch.tensor([[1000.0] + [1e-3] * 31]), fmts)
        >>> m["block_flushed_mxfp4_e2m1"], m["block_scale_clipped_mxfp4_e2m1"]
        (0.96875, 0.0)
    """
    out: dict[str, float] = {}
    for name, fmt in formats:
        if (
            x.dim() == 0
            or x.numel() == 0
            or x.shape[-1] % fmt.block_size
            or not (x.is_floating_point())
        ):
            values = (math.nan, math.nan, math.nan)
        else:
            with torch.no_grad():
                stats = fmt.block_stats(x.detach(), dim=-1)
            values = (stats.flushed, stats.scale_clipped, stats.error)
        for kind, value in zip(BLOCK_METRIC_KINDS, values, strict=True):
            out[f"{kind}_{name}"] = value
    return out


def block_metric_description(key: str) -> str | None:
    """What a block metric column is (None for another column)."""
    for kind, text in _DESCRIPTIONS.items():
        if key.startswith(kind + "_"):
            return text.format(key[len(kind) + 1 :].upper())
    return None


def attach_block_metrics(graph: Graph, track: Any, module: Any) -> None:
    """Put the block metrics recorded in the last call of ``module`` on the metrics of
    ``graph``'s nodes (``Metrics.blocks``), as its plan maps nodes to recorded slots.

    A slot that shares another's tensor (the same object seen again) takes its metrics; a
    view (another shape, so other blocks) has none. Under data parallelism the graph is
    built afresh without a plan: no block metrics there."""
    joined = track._joined
    capture = module.capture
    if joined is None or joined.graph is not graph or capture is None:
        return
    trace = capture.last_trace
    for kind, node, _, k, slot, input_id in joined.plan:
        metrics = node.meta.get("metrics")
        if not isinstance(metrics, Metrics):
            continue
        invocation = trace[k]
        fwd = _lookup(invocation, "fwd", slot)
        if kind == "param":
            bwd = track._param_blocks.get(input_id)
        else:
            bwd = _lookup(invocation, "bwd", slot)
            if bwd is None and kind == "input":
                bwd = track._param_blocks.get(input_id)
        metrics.blocks = {"fwd": fwd or {}, "bwd": bwd or {}}


def _lookup(invocation: Any, direction: str, slot: Any) -> dict[str, float] | None:
    found: dict[str, float] | None = invocation.data.get("blocks", {}).get((direction, slot))
    if found is None:
        same = invocation.data.get("same", {}).get(slot)
        if same is not None:
            other, source = same
            found = other.data.get("blocks", {}).get((direction, source))
    return found
