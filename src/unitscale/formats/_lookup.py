"""Formats by name: :func:`get_format` (per-tensor presets, dtypes and block-scaled presets)."""

from __future__ import annotations

import dataclasses
from typing import overload

import torch

from ._blocks import BLOCK_PRESETS, BlockFormat
from ._format import PRESETS, FormatError, FPFormat, Rounding

__all__ = ["get_format"]

_PRESET_BY_DTYPE = {fmt.torch_dtype: fmt for fmt in PRESETS.values()}


@overload
def get_format(spec: FPFormat | torch.dtype, rounding: Rounding | None = None) -> FPFormat: ...


@overload
def get_format(spec: BlockFormat, rounding: Rounding | None = None) -> BlockFormat: ...


@overload
def get_format(
    spec: str | torch.dtype | FPFormat | BlockFormat, rounding: Rounding | None = None
) -> FPFormat | BlockFormat: ...


def get_format(
    spec: str | torch.dtype | FPFormat | BlockFormat, rounding: Rounding | None = None
) -> FPFormat | BlockFormat:
    """Look up a format by preset key (``"e4m3"``, ``"e5m2"``, ``"fp16"``, ``"bf16"``), dtype,
    or block-scaled preset name (``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp6_e3m2"``,
    ``"mxfp6_e2m3"``, ``"mxfp4_e2m1"``, ``"nvfp4"``: a :class:`BlockFormat`).

    Args:
        spec: a preset key (case-insensitive), a torch dtype with a matching preset
            (``torch.float8_e4m3fn``, ``torch.float8_e5m2``, ``torch.float16``,
            ``torch.bfloat16``), a key of :data:`BLOCK_PRESETS`, or an :class:`FPFormat` or
            :class:`BlockFormat` (returned as is).
        rounding: if given, the returned format rounds this way (a block format: its
            elements).

    Returns:
        The format.

    Raises:
        FormatError: for an unknown key or dtype.

    Example:
        >>> get_format("E4M3", rounding="nearest")
        FPFormat(4, 3, rounding='nearest', special_values='nan_only')
        >>> get_format(torch.bfloat16).max_absolute_value == torch.finfo(torch.bfloat16).max
        True
        >>> get_format("nvfp4").block_size, get_format("mxfp8_e4m3", "stochastic").rounding
        (16, 'stochastic')
    """
    if isinstance(spec, BlockFormat) or (isinstance(spec, str) and spec.lower() in BLOCK_PRESETS):
        block = spec if isinstance(spec, BlockFormat) else BLOCK_PRESETS[spec.lower()]
        if rounding is not None and rounding != block.rounding:
            block = block.with_rounding(rounding)
        return block
    if isinstance(spec, FPFormat):
        fmt = spec
    elif isinstance(spec, str) and spec.lower() in PRESETS:
        fmt = PRESETS[spec.lower()]
    elif isinstance(spec, torch.dtype) and spec in _PRESET_BY_DTYPE:
        fmt = _PRESET_BY_DTYPE[spec]
    else:
        raise FormatError(
            f"unitscale.formats.get_format: unknown format {spec!r}; use one of "
            f"{tuple(PRESETS)}, a block-scaled format among {tuple(BLOCK_PRESETS)}, a dtype "
            f"among {tuple(_PRESET_BY_DTYPE)}, or build an FPFormat(exponent_bits, "
            "mantissa_bits)"
        )
    if rounding is not None and rounding != fmt.rounding:
        fmt = dataclasses.replace(fmt, rounding=rounding)
    return fmt
