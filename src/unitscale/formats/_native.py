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

The C source is ``src/unitscale/_native/rounding.c``, compiled by ``pip install`` as the
optional extension ``unitscale._native._rounding`` without reassociation or any other
relaxation of IEEE arithmetic: the subnormal rounding relies on ``(m + c) - c``. Where it was
not built, the PyTorch path runs (the same nearest results, slower; one warning).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .. import _native

__all__ = ["NativeRounding", "rounding"]


class NativeRounding:
    """The rounding extension, looked for at first use (:meth:`available`)."""

    def __init__(self) -> None:
        self._module: Any = None
        self._looked = False

    def available(self) -> bool:
        """Whether the extension was built (False for good where it was not: the PyTorch
        path gives the same results; the first call warns once)."""
        if not self._looked:
            self._module = _native.extension("_rounding")
            self._looked = True
        return self._module is not None

    def nearest(self, x: Tensor, drop: int, bound: float, min_normal_exponent: int) -> Tensor:
        """``x`` (contiguous, float32, CPU, with storage) rounded to nearest at ``drop``
        (0..23) fewer mantissa bits, saturating at ``±bound``, with subnormals below
        ``2**min_normal_exponent`` (at least -126, as for every format). Call
        :meth:`available` first."""
        return _run(
            self._module.nearest,
            x,
            drop,
            bound,
            min_normal_exponent,
            2.0 ** (min_normal_exponent + drop),
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
        shift_small = min_normal_exponent > -126
        return _run(
            self._module.stochastic,
            x,
            drop,
            bound,
            min_normal_exponent,
            shift_small,
            seed0,
            seed1,
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
