"""Native (C) rounding kernels for contiguous float32 CPU tensors, in one pass: to nearest, and
stochastic.

Eager PyTorch needs several passes over memory for a saturating quantisation: torch's own
cast round trip (``x.to(dtype).to(torch.float32)``) writes and reads an intermediate tensor,
saturation needs a clamp or a fix-up of the overflow codes, and formats with no torch dtype
take about a dozen ops; stochastic rounding adds a tensor of random bits. These kernels read
each value once and write its rounding once, what a clone costs. The nearest kernel computes
exactly what :func:`unitscale.formats._kernels._nearest_bits` does (the same operations on
the same bit patterns), so the results are bit for bit those of the PyTorch path; the tests
compare the two on every float16 and bfloat16 pattern and on every format's boundaries, ties
and subnormals. The stochastic kernel computes what
:func:`unitscale.formats._kernels._stochastic_bits` does with hashed random bits (the path
``torch.compile`` takes), bit for bit for the same seeds; the PyTorch fallback draws its bits
with ``torch.randint`` instead (another random stream, the same distribution).

Built like the statistics kernel (:mod:`unitscale._cbuild`), without reassociation or any
other relaxation of IEEE arithmetic: the subnormal rounding relies on ``(m + c) - c``. Where
no C compiler is found or the build fails, the PyTorch path runs (the same nearest results,
slower).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
from torch import Tensor

from .. import _cbuild

__all__ = ["NativeRounding", "rounding"]

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef US_PARALLEL
#define US_PARALLEL 65536
#endif

static inline uint32_t us_bits(float v) { uint32_t b; memcpy(&b, &v, 4); return b; }
static inline float us_float(uint32_t b) { float v; memcpy(&v, &b, 4); return v; }

/* y = x rounded to nearest (ties to even) at `drop` (0..23) fewer mantissa bits than
   float32's, saturating at +-bound. From `smallest_normal` (the format's) down, the step is
   the format's subnormal step: one addition of `magic` (2**(emin + drop)) rounds there.
   NaN stays NaN (clamping and the subnormal branch both keep it). */
void us_nearest_f32(const float* x, float* y, int64_t n, int32_t drop, float bound,
                    float smallest_normal, float magic) {
    const uint32_t odd = drop > 0 ? 1u : 0u;
    const uint32_t half = drop > 0 ? (1u << (drop - 1)) - 1u : 0u;
    const uint32_t keep = drop > 0 ? ~((1u << drop) - 1u) : ~0u;
#pragma omp parallel for if (n >= US_PARALLEL) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        v = v > bound ? bound : (v < -bound ? -bound : v);
        uint32_t b = us_bits(v);
        float normal = us_float((b + ((b >> drop) & odd) + half) & keep);
        float m = fabsf(v);
        float subnormal = copysignf((m + magic) - magic, normal);
        y[i] = m >= smallest_normal ? normal : subnormal;
    }
}

/* y = x rounded stochastically at `drop` (1..23) fewer mantissa bits, saturating at
   +-bound: uniform random bits added below the kept mantissa, then truncated (a carry moves
   into the exponent). With `shift_small`, magnitudes below the format's smallest normal are
   shifted into its first binade (whose step is the subnormal step) and back. The random
   bits are the hash of _kernels._hashed_random_bits, of the element's index and two seeds:
   the same bits as the compiled path for the same seeds. NaN stays NaN. */
void us_stochastic_f32(const float* x, float* y, int64_t n, int32_t drop, float bound,
                       float smallest_normal, int32_t shift_small, uint32_t seed0,
                       uint32_t seed1) {
    const uint32_t keep = ~((1u << drop) - 1u);
    const int32_t shift = 32 - drop;
#pragma omp parallel for if (n >= US_PARALLEL) schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        float m = fabsf(v);
        m = m > bound ? bound : m;
        int small = shift_small && m < smallest_normal;
        m = small ? m + smallest_normal : m;
        uint32_t key = seed1 ^ ((uint32_t)((uint64_t)i >> 32) * 0x2C1B3C6Du);
        uint32_t h = ((uint32_t)i + seed0) * 0x9E3779B9u;
        h ^= h >> 16;
        h *= 0x7FEB352Du;
        h ^= (h >> 15) ^ key;
        h *= 0x2C1B3C6Du;
        if (drop > 16) h ^= h >> 16; /* changes the low 16 bits only */
        float r = us_float((us_bits(m) + (h >> shift)) & keep);
        r = small ? r - smallest_normal : r;
        y[i] = v != v ? v : copysignf(r, v);
    }
}
"""

_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math")


class NativeRounding:
    """The compiled rounding kernel, built and loaded at first use."""

    def __init__(self) -> None:
        self._nearest: Any = None
        self._stochastic: Any = None
        self._library = _cbuild.LazyLibrary("rounding", _SOURCE, _FLAGS, self._bind)

    def _bind(self, lib: ctypes.CDLL) -> None:
        # x, y, n, drop, bound, smallest normal (see _run), then each kernel's own arguments.
        c = ctypes
        common = [c.c_void_p, c.c_void_p, c.c_int64, c.c_int32, c.c_float, c.c_float]
        extra = [c.c_int32, c.c_uint32, c.c_uint32]
        self._stochastic = _cbuild.declare(lib.us_stochastic_f32, [*common, *extra])
        self._nearest = _cbuild.declare(lib.us_nearest_f32, [*common, c.c_float])

    def available(self) -> bool:
        """Whether the kernel is loaded (building it on the first call; False for good where
        that fails: the PyTorch path gives the same results)."""
        return self._nearest is not None or self._library.get() is not None

    def nearest(self, x: Tensor, drop: int, bound: float, min_normal_exponent: int) -> Tensor:
        """``x`` (contiguous, float32, CPU, with storage) rounded to nearest at ``drop``
        (0..23) fewer mantissa bits, saturating at ``±bound``, with subnormals below
        ``2**min_normal_exponent`` (at least -126, as for every format). Call
        :meth:`available` first."""
        return _run(
            self._nearest, x, drop, bound, min_normal_exponent, 2.0 ** (min_normal_exponent + drop)
        )

    def stochastic(
        self, x: Tensor, drop: int, bound: float, min_normal_exponent: int, seeds: Tensor
    ) -> Tensor:
        """``x`` (contiguous, float32, CPU, with storage) rounded stochastically at ``drop``
        (1..23) fewer mantissa bits, saturating at ``±bound``, with subnormals below
        ``2**min_normal_exponent``; the random bits hash each element's index with the two
        int32 ``seeds`` (see :func:`unitscale.formats._kernels._hashed_random_bits`). Call
        :meth:`available` first."""
        seed0, seed1 = (int(s) & 0xFFFFFFFF for s in seeds.tolist())
        shift_small = int(min_normal_exponent > -126)
        return _run(
            self._stochastic, x, drop, bound, min_normal_exponent, shift_small, seed0, seed1
        )


def _run(
    kernel: Any, x: Tensor, drop: int, bound: float, min_normal_exponent: int, *extra: Any
) -> Tensor:
    """A new contiguous tensor: ``kernel`` applied to ``x`` with the arguments every rounding
    kernel takes (x, y, n, drop, bound, the smallest normal), then its own ``extra``."""
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    kernel(x.data_ptr(), y.data_ptr(), x.numel(), drop, bound, 2.0**min_normal_exponent, *extra)
    return y


rounding = NativeRounding()
