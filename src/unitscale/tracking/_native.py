"""The native kernel for the scale statistics of CPU tensors: one pass, a few microseconds of
fixed cost.

PyTorch's CPU ops cost microseconds each however small the tensor, and the statistics need
about a dozen of them (sums, extremes, threshold counts); a compiled Inductor kernel costs
tens of microseconds per call and seconds to compile. The kernel is C
(``src/unitscale/_native/stats.c``), compiled by ``pip install`` as the optional CPython
extension ``unitscale._native._stats``; large tensors are shared out over OpenMP's threads
where the build has OpenMP. Tracking calls its ``summary`` once per tensor
(:func:`unitscale.tracking.metrics.fast_stats`): it reads the tensor's layout itself and builds
the records. :class:`NativeStats` calls the same kernel on raw memory for what that declines
(float16, pieces of large strided tensors).

The C code reads float32 or bfloat16 values and computes, in one pass, everything the
device kernel (:func:`unitscale.tracking.metrics._stats_kernel`) does:

- ``sum |x|``, ``sum (x - s)`` and ``sum (x - s)**2`` in float64, ``s`` an element of the
  tensor (its first), which keeps the variance clear of cancellation; float32 products are
  exact in float64, so the only rounding is that of the float64 sums;
- the largest and smallest magnitudes, on the integer bit patterns of ``|x|`` (ordered as the
  values are, NaN above Inf); NaN and Inf make the sums non-finite, and such tensors are left
  to the PyTorch path, which keeps the device kernel's IEEE semantics;
- the under/overflow counts exactly, as integer comparisons of the bit patterns with the
  thresholds' bit patterns: ``0 < |x| <= t`` and ``t < |x| <= Inf`` (NaN is neither).

Nothing here is required: where the extension was not built, the PyTorch path of
:mod:`unitscale.tracking._cpu_stats` runs instead (same statistics, one warning), and
``UNITSCALE_STATS=eager`` selects that path explicitly.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch
from torch import Tensor

from .. import _native

__all__ = ["NativeStats", "float_of_bits", "native"]

#: Thresholds of each kind the kernel takes (US_NT in stats.c).
THRESHOLDS = 4
_INT32_MAX = 2**31 - 1
_isfinite = math.isfinite


def float_of_bits(bits: int) -> float:
    """The float32 value whose bit pattern is ``bits``."""
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


class NativeStats:
    """The statistics extension, looked for at first use (:meth:`available`)."""

    def __init__(self) -> None:
        self._module: Any = None
        self._looked = False
        self._thresholds: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}

    def available(self) -> bool:
        """Whether the extension was built (looked for, and warned of once where it was
        not, on the first call)."""
        if not self._looked:
            self._module = _native.extension("_stats")
            self._looked = True
        return self._module is not None

    def loaded(self) -> bool:
        """Whether the extension has been looked for and found (without looking for it)."""
        return self._module is not None

    def extension(self) -> Any:
        """The extension module (its ``summary``/``to_data``/``configure`` serve
        :func:`unitscale.tracking.metrics.fast_stats`), or None where it was not built."""
        return self._module if self.available() else None

    @property
    def failure(self) -> str:
        """Why the extension is unavailable ("" where it is built or not looked for yet)."""
        return _native.missing.get("_stats", "") if self._looked else ""

    def stats(
        self, x: Tensor, shift: float, under: tuple[int, ...], over: tuple[int, ...]
    ) -> list[float] | None:
        """Statistics of the contiguous CPU float32/bfloat16 tensor ``x``: ``sum|x|``,
        ``sum(x - shift)``, ``sum((x - shift)**2)``, ``max|x|``, ``min|x|``, then the counts
        of ``0 < |x| <= t`` for the float32 bit patterns ``t`` in ``under`` and of ``|x| > t``
        for those in ``over`` (at most :data:`THRESHOLDS` of each). None where ``x`` holds
        NaN or Inf. Call :meth:`available` first."""
        arrays = self.thresholds(under, over)
        bf16 = x.dtype == torch.bfloat16
        values = self._module.stats_at(x.data_ptr(), x.numel(), bf16, shift, arrays[0])
        if not (_isfinite(values[0]) and _isfinite(values[1]) and _isfinite(values[2])):
            return None
        zeros = values[5]
        result = values[:5] + [c - zeros for c in values[6 : 6 + len(under)]]
        if over and values[3] > arrays[2]:  # some magnitude exceeds a threshold: count them
            counts = self._module.over_at(x.data_ptr(), x.numel(), bf16, arrays[1])
            result += counts[: len(over)]
        else:
            result += [0.0] * len(over)
        return list(result)

    def summary(self, x: Tensor, thresholds: Any, cancellation: float) -> list[float] | None:
        """Every statistic of the non-empty contiguous CPU float32/bfloat16 tensor ``x`` in
        the layout of the device kernel (``sum_abs, mean, var, abs_max, abs_min, nan_count,
        inf_count``, then the under- and overflow counts), from one call into the kernel: the
        shift is ``x``'s first element, and a centred second pass runs where the variance is
        at most ``cancellation`` times the mean square about it. ``thresholds`` is from
        :meth:`thresholds`. None where ``x`` holds NaN or Inf."""
        out = self._module.summary_at(
            x.data_ptr(),
            x.numel(),
            x.dtype == torch.bfloat16,
            thresholds[0],
            thresholds[1],
            thresholds[2],
            cancellation,
        )
        if out is None:
            return None
        keep = thresholds[3]
        return out if keep is None else [out[i] for i in keep]

    def thresholds(self, under: tuple[int, ...], over: tuple[int, ...]) -> Any:
        """The kernel's form of these thresholds' float32 bit patterns (for :meth:`summary`):
        both padded to :data:`THRESHOLDS`, the lowest overflow threshold, and the entries of
        the summary to keep."""
        arrays = self._thresholds.get((under, over))
        if arrays is not None:
            return arrays
        nu, no = len(under), len(over)
        if nu > THRESHOLDS or no > THRESHOLDS:
            raise ValueError(f"at most {THRESHOLDS} thresholds of each kind")
        lowest_over = min((float_of_bits(t) for t in over), default=math.inf)
        arrays = self._thresholds[(under, over)] = (
            (*under, *[-1] * (THRESHOLDS - nu)),
            (*over, *[_INT32_MAX] * (THRESHOLDS - no)),
            lowest_over,
            # The summary's entries to keep (None: all of them, every threshold being used).
            None
            if nu == no == THRESHOLDS
            else [*range(7 + nu), *range(7 + THRESHOLDS, 7 + THRESHOLDS + no)],
        )
        return arrays

    def centred(self, x: Tensor, mean: float) -> tuple[float, float]:
        """``sum(x - mean)`` and ``sum((x - mean)**2)`` of ``x`` (as for :meth:`stats`)."""
        s, s2 = self._module.centred_at(x.data_ptr(), x.numel(), x.dtype == torch.bfloat16, mean)
        return float(s), float(s2)


native = NativeStats()
