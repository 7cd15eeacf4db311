"""A native (C) kernel for the scale statistics of CPU tensors: one pass, a few microseconds
of fixed cost.

PyTorch's CPU ops cost microseconds each however small the tensor, and the statistics need
about a dozen of them (sums, extremes, threshold counts); a compiled Inductor kernel costs
tens of microseconds per call and seconds to compile. This module compiles (once per
machine, about a second, cached on disk) a small C file with no dependencies, and calls it
through :mod:`ctypes`; large tensors are shared out over OpenMP's threads (the runtime PyTorch
has loaded, so its thread count).

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

Nothing here is required: where no C compiler is found or compilation fails, the PyTorch
path of :mod:`unitscale.tracking._cpu_stats` runs instead (same statistics), and
``UNITSCALE_STATS=eager`` selects that path explicitly.
"""

from __future__ import annotations

import ctypes
import math
import struct
import warnings
from typing import Any

import torch
from torch import Tensor

from .. import _cbuild

__all__ = ["NativeStats", "float_of_bits", "native"]

_SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* us_stats writes out[0..2] = sum|x|, sum(x - s), sum((x - s)^2) (float64), out[3..4] =
   max|x| and min|x|, out[5] = how many zeros, out[6 + k] = how many |x| <= under[k] (zeros
   included), every value a double (counts are exact to 2**53). The bit patterns of
   magnitudes are non-negative int32 ordered as the values (NaN above Inf), so each count
   is one signed comparison. NaN and Inf are not counted:
   they make the sums non-finite, and the caller reads such tensors otherwise. Exactly
   US_NT thresholds (unused ones are -1: they never count), so that the loop over them
   unrolls and the loop over elements vectorises.
   us_over: counts[k] = how many |x| > over[k] (unused: INT32_MAX), read only where the
   largest magnitude exceeds a threshold. */
#define US_BLOCK 1024
#define US_NT 4
/* From this many elements, the loops run on OpenMP's threads (the runtime PyTorch loaded,
   so its thread count): below it a fork and join costs more than it saves. */
#ifndef US_PARALLEL
#define US_PARALLEL 65536
#endif

static inline uint32_t us_bits(const void* p, int64_t i, int bf16) {
    if (bf16) {
        uint16_t h;
        memcpy(&h, (const char*)p + 2 * i, 2);
        return ((uint32_t)h) << 16;
    }
    uint32_t b;
    memcpy(&b, (const char*)p + 4 * i, 4);
    return b;
}

static inline void us_stats(const void* x, int64_t n, double shift, const int32_t* under_in,
                            double* out, int bf16) {
    int32_t under[US_NT];
    for (int k = 0; k < US_NT; ++k) under[k] = under_in[k];
    double s_abs = 0.0, s_d = 0.0, s_d2 = 0.0;
    int32_t hi = 0, lo = INT32_MAX;
    int64_t zeros = 0, cu[US_NT] = {0};
    int64_t blocks = (n + US_BLOCK - 1) / US_BLOCK;
#pragma omp parallel for if (n >= US_PARALLEL) schedule(static) \
    reduction(+ : s_abs, s_d, s_d2, zeros, cu[:US_NT]) reduction(max : hi) reduction(min : lo)
    for (int64_t block = 0; block < blocks; ++block) {
        int64_t start = block * US_BLOCK;
        int64_t stop = start + US_BLOCK < n ? start + US_BLOCK : n;
        double b_abs = 0.0, b_d = 0.0, b_d2 = 0.0;
        int32_t b_hi = 0, b_lo = INT32_MAX, b_zeros = 0, bu[US_NT] = {0};
        for (int64_t i = start; i < stop; ++i) {
            uint32_t bits = us_bits(x, i, bf16);
            int32_t m = (int32_t)(bits & 0x7FFFFFFFu);
            float v;
            memcpy(&v, &bits, 4);
            double dv = (double)v;
            double d = dv - shift;
            b_abs += dv < 0 ? -dv : dv;
            b_d += d;
            b_d2 += d * d;
            b_hi = m > b_hi ? m : b_hi;
            b_lo = m < b_lo ? m : b_lo;
            b_zeros += m == 0;
            for (int k = 0; k < US_NT; ++k) bu[k] += m <= under[k];
        }
        s_abs += b_abs;
        s_d += b_d;
        s_d2 += b_d2;
        hi = b_hi > hi ? b_hi : hi;
        lo = b_lo < lo ? b_lo : lo;
        zeros += b_zeros;
        for (int k = 0; k < US_NT; ++k) cu[k] += bu[k];
    }
    uint32_t hi_bits = (uint32_t)hi, lo_bits = (uint32_t)lo;
    float hi_value, lo_value;
    memcpy(&hi_value, &hi_bits, 4);
    memcpy(&lo_value, &lo_bits, 4);
    out[0] = s_abs;
    out[1] = s_d;
    out[2] = s_d2;
    out[3] = (double)hi_value;
    out[4] = (double)lo_value;
    out[5] = (double)zeros;
    for (int k = 0; k < US_NT; ++k) out[6 + k] = (double)cu[k];
}

static inline void us_over(const void* x, int64_t n, const int32_t* over_in, int64_t* counts,
                           int bf16) {
    int32_t over[US_NT];
    for (int k = 0; k < US_NT; ++k) over[k] = over_in[k];
    int64_t co[US_NT] = {0};
    int64_t blocks = (n + US_BLOCK - 1) / US_BLOCK;
#pragma omp parallel for if (n >= US_PARALLEL) schedule(static) reduction(+ : co[:US_NT])
    for (int64_t block = 0; block < blocks; ++block) {
        int64_t start = block * US_BLOCK;
        int64_t stop = start + US_BLOCK < n ? start + US_BLOCK : n;
        int32_t bo[US_NT] = {0};
        for (int64_t i = start; i < stop; ++i) {
            int32_t m = (int32_t)(us_bits(x, i, bf16) & 0x7FFFFFFFu);
            for (int k = 0; k < US_NT; ++k) bo[k] += m > over[k];
        }
        for (int k = 0; k < US_NT; ++k) co[k] += bo[k];
    }
    for (int k = 0; k < US_NT; ++k) counts[k] = co[k];
}

/* sum(x - mean) and sum((x - mean)^2) in float64: the variance where the shift was far from
   the mean. */
static inline void us_centred(const void* x, int64_t n, double mean, double* out, int bf16) {
    double s = 0.0, s2 = 0.0;
#pragma omp parallel for if (n >= US_PARALLEL) schedule(static) reduction(+ : s, s2)
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits = us_bits(x, i, bf16);
        float v;
        memcpy(&v, &bits, 4);
        double d = (double)v - mean;
        s += d;
        s2 += d * d;
    }
    out[0] = s;
    out[1] = s2;
}

/* The whole summary of a contiguous tensor, in the layout of the device kernel: out[0..6] =
   sum|x|, mean, var, max|x|, min|x|, 0, 0 (NaN and Inf counts); out[7 + k] = how many
   0 < |x| <= under[k]; out[7 + US_NT + k] = how many |x| > over[k] (0 unless max|x| exceeds
   over_min, the lowest used threshold, which saves that pass). The shift is x[0]; a centred
   pass replaces the variance where var <= cancel * E[(x - s)^2]. Returns 1, out undefined,
   where x holds NaN or Inf (max|x| beyond float32's largest finite value), else 0. */
static inline int us_summary(const void* x, int64_t n, const int32_t* under, const int32_t* over,
                             double over_min, double cancel, double* out, int bf16) {
    uint32_t first_bits = us_bits(x, 0, bf16);
    float first;
    memcpy(&first, &first_bits, 4);
    double raw[6 + US_NT];
    us_stats(x, n, (double)first, under, raw, bf16);
    if (!(raw[3] <= 3.4028234663852886e38)) return 1;
    double shifted = raw[1] / (double)n, squares = raw[2] / (double)n;
    double mean = (double)first + shifted;
    double var = squares - shifted * shifted;
    if (var <= cancel * squares && raw[2] > 0) {
        double centred[2];
        us_centred(x, n, mean, centred, bf16);
        double c = centred[0] / (double)n;
        var = centred[1] / (double)n - c * c;
    }
    out[0] = raw[0];
    out[1] = mean;
    out[2] = var;
    out[3] = raw[3];
    out[4] = raw[4];
    out[5] = 0.0;
    out[6] = 0.0;
    for (int k = 0; k < US_NT; ++k) out[7 + k] = raw[6 + k] - raw[5];
    int64_t counts[US_NT] = {0};
    if (raw[3] > over_min) us_over(x, n, over, counts, bf16);
    for (int k = 0; k < US_NT; ++k) out[7 + US_NT + k] = (double)counts[k];
    return 0;
}

int us_summary_f32(const void* x, int64_t n, const int32_t* under, const int32_t* over,
                   double over_min, double cancel, double* out) {
    return us_summary(x, n, under, over, over_min, cancel, out, 0);
}
int us_summary_bf16(const void* x, int64_t n, const int32_t* under, const int32_t* over,
                    double over_min, double cancel, double* out) {
    return us_summary(x, n, under, over, over_min, cancel, out, 1);
}
void us_stats_f32(const void* x, int64_t n, double shift, const int32_t* under, double* out) {
    us_stats(x, n, shift, under, out, 0);
}
void us_stats_bf16(const void* x, int64_t n, double shift, const int32_t* under, double* out) {
    us_stats(x, n, shift, under, out, 1);
}
void us_over_f32(const void* x, int64_t n, const int32_t* over, int64_t* counts) {
    us_over(x, n, over, counts, 0);
}
void us_over_bf16(const void* x, int64_t n, const int32_t* over, int64_t* counts) {
    us_over(x, n, over, counts, 1);
}
void us_centred_f32(const void* x, int64_t n, double mean, double* out) {
    us_centred(x, n, mean, out, 0);
}
void us_centred_bf16(const void* x, int64_t n, double mean, double* out) {
    us_centred(x, n, mean, out, 1);
}
"""

# Reassociating the float64 sums lets the compiler vectorise them (which only changes their
# rounding, not their IEEE semantics: no finite-math or flush-to-zero assumptions).
_FLAGS = (
    "-O3",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
)
#: Thresholds of each kind the kernel takes (the C source's US_NT).
THRESHOLDS = 4
_INT32_MAX = 2**31 - 1
_Out = ctypes.c_double * (6 + THRESHOLDS)
_Summary = ctypes.c_double * (7 + 2 * THRESHOLDS)
_isfinite = math.isfinite


def float_of_bits(bits: int) -> float:
    """The float32 value whose bit pattern is ``bits``."""
    return float(struct.unpack("<f", struct.pack("<I", bits))[0])


def _warn_unavailable(reason: str) -> None:
    warnings.warn(
        f"unitscale: the native statistics kernel is unavailable ({reason}); CPU scale "
        "statistics use PyTorch ops instead, which give the same statistics more slowly",
        RuntimeWarning,
        # The caller of metrics.deferred_stats (through LazyLibrary.get, available,
        # native_stats and deferred_stats).
        stacklevel=6,
    )


class NativeStats:
    """The compiled kernel, built and loaded at first use (:meth:`available`)."""

    def __init__(self) -> None:
        self._lib: Any = None
        self._library = _cbuild.LazyLibrary("stats", _SOURCE, _FLAGS, self._bind, _warn_unavailable)
        self._thresholds: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}
        self._stats_f32: Any = None
        self._stats_bf16: Any = None
        self._summary_f32: Any = None
        self._summary_bf16: Any = None

    def available(self) -> bool:
        """Whether the kernel is loaded (building it on the first call)."""
        return self._lib is not None or self._library.get() is not None

    def _bind(self, lib: Any) -> None:
        ptr, double, int64 = ctypes.c_void_p, ctypes.c_double, ctypes.c_int64
        signatures = {  # stem: (argument types, return type)
            "us_stats": ([ptr, int64, double, ptr, ptr], None),
            "us_over": ([ptr, int64, ptr, ptr], None),
            "us_centred": ([ptr, int64, double, ptr], None),
            "us_summary": ([ptr, int64, ptr, ptr, double, double, ptr], ctypes.c_int),
        }
        for stem, (argtypes, restype) in signatures.items():
            for suffix in ("f32", "bf16"):
                _cbuild.declare(getattr(lib, f"{stem}_{suffix}"), argtypes, restype)
        self._stats_f32, self._stats_bf16 = lib.us_stats_f32, lib.us_stats_bf16
        self._summary_f32, self._summary_bf16 = lib.us_summary_f32, lib.us_summary_bf16
        self._lib = lib

    def stats(
        self, x: Tensor, shift: float, under: tuple[int, ...], over: tuple[int, ...]
    ) -> list[float] | None:
        """Statistics of the contiguous CPU float32/bfloat16 tensor ``x``: ``sum|x|``,
        ``sum(x - shift)``, ``sum((x - shift)**2)``, ``max|x|``, ``min|x|``, then the counts
        of ``0 < |x| <= t`` for the float32 bit patterns ``t`` in ``under`` and of ``|x| > t``
        for those in ``over`` (at most :data:`THRESHOLDS` of each). None where ``x`` holds
        NaN or Inf."""
        arrays = self._thresholds.get((under, over))
        if arrays is None:
            arrays = self._arrays(under, over)
        bf16 = x.dtype == torch.bfloat16
        out = _Out()
        (self._stats_bf16 if bf16 else self._stats_f32)(
            x.data_ptr(), x.numel(), shift, arrays[0], out
        )
        values = out[:]
        if not (_isfinite(values[0]) and _isfinite(values[1]) and _isfinite(values[2])):
            return None
        zeros = values[5]
        result = values[:5] + [c - zeros for c in values[6 : 6 + len(under)]]
        if over and values[3] > arrays[2]:  # some magnitude exceeds a threshold: count them
            counts = (ctypes.c_int64 * THRESHOLDS)()
            (self._lib.us_over_bf16 if bf16 else self._lib.us_over_f32)(
                x.data_ptr(), x.numel(), arrays[1], counts
            )
            result += [float(c) for c in counts[: len(over)]]
        else:
            result += [0.0] * len(over)
        return result

    def summary(self, x: Tensor, thresholds: Any, cancellation: float) -> list[float] | None:
        """Every statistic of the contiguous CPU float32/bfloat16 tensor ``x`` in the layout
        of the device kernel (``sum_abs, mean, var, abs_max, abs_min, nan_count, inf_count``,
        then the under- and overflow counts), from one call into the kernel: the shift is
        ``x``'s first element, and a centred second pass runs where the variance is at most
        ``cancellation`` times the mean square about it. ``thresholds`` is from
        :meth:`thresholds`. None where ``x`` holds NaN or Inf."""
        out = _Summary()
        kernel = self._summary_bf16 if x.dtype == torch.bfloat16 else self._summary_f32
        if kernel(
            x.data_ptr(), x.numel(), thresholds[0], thresholds[1], thresholds[2], cancellation, out
        ):
            return None
        keep = thresholds[3]
        return out[:] if keep is None else [out[i] for i in keep]

    def thresholds(self, under: tuple[int, ...], over: tuple[int, ...]) -> Any:
        """The kernel's form of these thresholds' float32 bit patterns (for :meth:`summary`)."""
        arrays = self._thresholds.get((under, over))
        return arrays if arrays is not None else self._arrays(under, over)

    def _arrays(self, under: tuple[int, ...], over: tuple[int, ...]) -> Any:
        nu, no = len(under), len(over)
        if nu > THRESHOLDS or no > THRESHOLDS:
            raise ValueError(f"at most {THRESHOLDS} thresholds of each kind")
        lowest_over = min((float_of_bits(t) for t in over), default=math.inf)
        arrays = self._thresholds[(under, over)] = (
            (ctypes.c_int32 * THRESHOLDS)(*under, *[-1] * (THRESHOLDS - nu)),
            (ctypes.c_int32 * THRESHOLDS)(*over, *[_INT32_MAX] * (THRESHOLDS - no)),
            lowest_over,
            # The summary's entries to keep (None: all of them, every threshold being used).
            None
            if nu == no == THRESHOLDS
            else [*range(7 + nu), *range(7 + THRESHOLDS, 7 + THRESHOLDS + no)],
        )
        return arrays

    def centred(self, x: Tensor, mean: float) -> tuple[float, float]:
        """``sum(x - mean)`` and ``sum((x - mean)**2)`` of ``x`` (as for :meth:`stats`)."""
        lib = self._lib
        fn = lib.us_centred_bf16 if x.dtype == torch.bfloat16 else lib.us_centred_f32

        out = (ctypes.c_double * 2)()
        fn(x.data_ptr(), x.numel(), mean, out)
        return out[0], out[1]


native = NativeStats()
