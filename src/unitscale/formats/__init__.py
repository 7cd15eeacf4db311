"""Number formats: :class:`FPFormat` and its presets (the rounding kernels are in ``_kernels``)."""

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
    get_format,
)

__all__ = [  # noqa: RUF022 (grouped by kind)
    # the format
    "FPFormat",
    "FormatError",
    "Overflow",
    "Rounding",
    "SpecialValues",
    # presets
    "BF16",
    "E4M3",
    "E5M2",
    "FP16",
    "PRESETS",
    "get_format",
]
