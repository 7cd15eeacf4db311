"""Number formats: :class:`FPFormat` and its presets, and the block-scaled
:class:`BlockFormat` (MX, NVFP4) (the rounding kernels are in ``_kernels``)."""

from ._blocks import BLOCK_PRESETS, BlockFormat, BlockStats, ScaleMode
from ._format import (
    BF16,
    E4M3,
    E5M2,
    FP16,
    PRESETS,
    FormatError,
    FPFormat,
    Overflow,
    Rounding,
    SpecialValues,
)
from ._lookup import get_format

__all__ = [  # noqa: RUF022 (grouped by kind)
    # the format
    "FPFormat",
    "FormatError",
    "Overflow",
    "Rounding",
    "SpecialValues",
    # block-scaled formats
    "BlockFormat",
    "BlockStats",
    "ScaleMode",
    "BLOCK_PRESETS",
    # presets
    "BF16",
    "E4M3",
    "E5M2",
    "FP16",
    "PRESETS",
    "get_format",
]
