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

Nothing here is required: where the extension was not built, the PyTorch kernel
(:func:`unitscale.tracking.metrics._stats_kernel`, run eagerly) reads CPU tensors instead
(same statistics, one warning), and ``UNITSCALE_STATS=eager`` selects it explicitly. It also
reads what the native kernel declines: float64 tensors, and tensors holding NaN or Inf.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch
from torch import Tensor

from .. import _native

__all__ = ["PIECE", "NativeStats", "float_of_bits", "native", "native_stats"]

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


#: Elements per piece of a strided (or float16) tensor that :func:`native_stats` copies into
#: a contiguous float32/bfloat16 buffer for the kernel: 4 MiB of float32, so that no copy of
#: the whole tensor is made.
PIECE = 1 << 20


# The native kernel sums around an element of the tensor in float64: only where the variance
# is below 1e-4 of the second moment about that element do its float64 digits run short.
_NATIVE_CANCELLATION = 1e-4


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.int64 if dtype == torch.float64 else torch.int32


_BITS: dict[tuple[float, torch.dtype], int] = {}


def _bits_of(value: float, dtype: torch.dtype) -> int:
    """The bit pattern of the non-negative ``value`` in ``dtype`` (float32 or float64)."""
    key = (value, dtype)
    if key not in _BITS:
        _BITS[key] = int(torch.tensor(value, dtype=dtype).view(_bits_dtype(dtype)).item())
    return _BITS[key]


def _fills_its_span(x: Tensor) -> bool:
    """True when the elements of ``x`` occupy exactly ``x.numel()`` consecutive memory slots
    from ``x.data_ptr()`` (no gaps, no overlaps), in whatever order: its strides, ordered,
    are those of a contiguous tensor of the permuted shape."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride(), strict=True), key=lambda p: p[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def _pieces(x: Tensor) -> list[Tensor]:
    """Views of ``x`` that cover each element once, each at most :data:`PIECE` elements
    where the layout allows it without a copy."""
    if x.numel() <= PIECE:
        return [x]
    if x.is_contiguous():
        return list(x.view(-1).split(PIECE))
    # Strided: split along the outermost dimension longer than 1, then split each slice.
    dim = next(d for d in range(x.dim()) if x.shape[d] > 1)
    per_slice = x.numel() // x.shape[dim]
    step = max(1, PIECE // per_slice)
    return [p for block in x.split(step, dim=dim) for p in _pieces(block)]


_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _readable(piece: Tensor) -> Tensor:
    """``piece`` as the kernel reads it: contiguous float32 or bfloat16."""
    if piece.dtype == torch.float16:
        return piece.float()  # contiguous, whatever the piece's strides
    return piece if piece.is_contiguous() else piece.contiguous()


_THRESHOLD_BITS: dict[tuple[tuple[float, ...], tuple[float, ...]], Any] = {}
# The thresholds of the last call (the same tuple objects at every call from tracking), their
# kernel form and the kernel that took them: a contiguous float32/bfloat16 tensor with those
# thresholds, for that kernel, skips every other check.
_last_thresholds: tuple[Any, Any, Any, Any] = (None, None, None, None)
_ONE_CALL_DTYPES = (torch.float32, torch.bfloat16)


def native_stats(
    x: Tensor, under: tuple[float, ...], over: tuple[float, ...]
) -> list[float] | None:
    """The statistics of the non-empty CPU tensor ``x`` by the native kernel (see
    :mod:`._native`), or None where it does not apply (no kernel, float64, too many
    thresholds) or ``x`` holds NaN or Inf (whose IEEE semantics the PyTorch path keeps)."""
    global _last_thresholds
    last = _last_thresholds
    if (
        under is last[0]
        and over is last[1]
        and native is last[3]
        and x.dtype in _ONE_CALL_DTYPES
        and x.is_contiguous()
    ):
        # The common case, shortest: it runs for every tracked tensor at every call.
        return native.summary(x, last[2], _NATIVE_CANCELLATION)
    if x.dtype not in _NATIVE_DTYPES or not native.available():
        return None
    entry = _THRESHOLD_BITS.get((under, over))
    if entry is None:
        if len(under) > THRESHOLDS or len(over) > THRESHOLDS:
            return None
        under_bits = tuple(_bits_of(bound, torch.float32) for bound in under)
        over_bits = tuple(_bits_of(bound, torch.float32) for bound in over)
        entry = _THRESHOLD_BITS[(under, over)] = (
            (under_bits, over_bits),
            native.thresholds(under_bits, over_bits),
        )
    _last_thresholds = (under, over, entry[1], native)
    if x.dtype != torch.float16 and (x.is_contiguous() or _fills_its_span(x)):
        # One call does it all (the common case: the fixed cost is what small tensors pay).
        # A tensor whose elements fill its memory span in another order (a transpose or
        # permute of a contiguous tensor: attention's heads) is read in memory order, as
        # if contiguous: the statistics do not depend on the order, and no copy is made.
        return native.summary(x, entry[1], _NATIVE_CANCELLATION)
    if x.numel() <= PIECE:
        # One piece (a slice, float16): its contiguous float32/bfloat16 copy in one call.
        return native.summary(_readable(x), entry[1], _NATIVE_CANCELLATION)
    bits = entry[0]
    n = x.numel()
    # Strided tensors (and float16, which the kernel does not read) are copied piece by
    # piece, so that no copy of the whole tensor is made.
    x = x.detach()
    shift = float(x[(0,) * x.dim()].item())
    pieces = _pieces(x)
    parts = [native.stats(_readable(piece), shift, *bits) for piece in pieces]
    if any(part is None for part in parts):
        return None
    found = [part for part in parts if part is not None]
    values = [sum(part[k] for part in found) for k in range(len(found[0]))]
    values[3] = max(part[3] for part in found)
    values[4] = min(part[4] for part in found)
    sum_abs, shifted, squares = values[0], values[1], values[2]
    mean = shift + shifted / n
    var = squares / n - (shifted / n) ** 2
    if var <= _NATIVE_CANCELLATION * squares / n and squares > 0:
        # The shift lies far from the mean against the spread: sum around the mean.
        centred = squares = 0.0
        for piece in pieces:
            part, part_sq = native.centred(_readable(piece), mean)
            centred += part
            squares += part_sq
        var = squares / n - (centred / n) ** 2
    return [sum_abs, mean, var, values[3], values[4], 0.0, 0.0, *values[5:]]
