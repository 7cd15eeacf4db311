"""Scale statistics of a CPU tensor, computed with decisions taken on the host.

On a CPU there is no device to synchronise with, so reading a partial result (a tensor's
largest magnitude, say) costs a microsecond, and the rest of the work can depend on it. This
path uses that to do, for typical tensors, a small fraction of the work a device-side kernel
must do for every tensor:

- the tensor is read in pieces of at most :data:`PIECE` elements (views, never copies, for
  contiguous tensors), so every temporary stays in cache and no temporary of the tensor's
  size is allocated;
- per piece: ``|x|``, its minimum and maximum (one ``aminmax``), and three sums (``|x|``,
  ``x``, ``x**2``) accumulated in float32 by torch's cascade summation and combined on the
  host in float64; pieces whose magnitudes would overflow or underflow float32 squares are
  summed in float64 instead (exact conversion);
- the variance is ``E[x**2] - E[x]**2`` unless the mean dominates (cancellation), when a
  second pass sums ``(x - mean)**2`` in float64;
- under/overflow counts are computed only for the thresholds that the piece's minimum and
  maximum straddle (a piece whose largest value is 3 cannot overflow E4M3), exactly, on the
  integer bit patterns of ``|x|`` (monotonic in the value for non-negative floats), without
  a boolean temporary: ``clamp(T + 1 - bits, 0, 1).sum()`` counts ``bits <= T``;
- NaN and Inf are counted only when a piece's sums say they are present.

Semantics are those of the device kernel (:func:`unitscale.tracking.metrics._stats_kernel`),
which the tests check value for value.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor

__all__ = ["LARGE", "PIECE", "compile_errors", "cpu_stats", "is_out_of_memory"]

#: Elements per piece: 256 KiB of float32, so a piece's temporaries stay in L2 cache.
PIECE = 1 << 16
#: From this many elements, a contiguous float32/16 tensor is read by compiled kernels (one
#: fused pass for the sums and extremes, one for the counts it needs) rather than in pieces:
#: there a pass costs more than a compiled call's fixed cost (about 0.1 ms). Below it no
#: kernel is compiled, so small models never wait for a compiler.
LARGE = 1 << 19

# float32 squares stay normal and finite (and sums of PIECE of them finite) for magnitudes in
# (2**-60, 2**60); outside it the piece is summed in float64.
_F32_SAFE = (2.0**-60, 2.0**60)
# Where the variance is below half the second moment (the mean is not small against the
# spread), E[x**2] - E[x]**2 loses digits to cancellation: the variance is summed around the
# mean instead, so its relative error stays that of a float32 sum (about 1e-7).
_CANCELLATION = 0.5


def _bits_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.int64 if dtype == torch.float64 else torch.int32


_BITS: dict[tuple[float, torch.dtype], int] = {}


def _bits_of(value: float, dtype: torch.dtype) -> int:
    """The bit pattern of the non-negative ``value`` in ``dtype`` (float32 or float64)."""
    key = (value, dtype)
    if key not in _BITS:
        _BITS[key] = int(torch.tensor(value, dtype=dtype).view(_bits_dtype(dtype)).item())
    return _BITS[key]


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


class _Accumulator:
    """Statistics of the pieces read so far, in float64 on the host."""

    def __init__(self, n_under: int, n_over: int) -> None:
        self.sum_abs = 0.0
        self.sum = 0.0
        self.sum_sq = 0.0
        self.abs_max = 0.0
        self.abs_min = math.inf
        self.nan = 0
        self.inf = 0
        self.under = [0] * n_under
        self.over = [0] * n_over


def _count_le(bits: Tensor, threshold: int) -> int:
    """How many of the non-negative bit patterns ``bits`` are ``<= threshold``."""
    return int(torch.rsub(bits, threshold + 1).clamp_(0, 1).sum().item())


def _nonfinite_piece(
    c: Tensor, acc: _Accumulator, under: tuple[float, ...], over: tuple[float, ...]
) -> None:
    """A piece holding NaN or Inf (or whose float32 sums overflowed): IEEE sums in float64
    and counts by comparison (NaN counts as neither underflow nor overflow)."""
    c64 = c.double()
    a64 = c64.abs()
    acc.sum_abs += a64.sum().item()
    acc.sum += c64.sum().item()
    acc.sum_sq += c64.square().sum().item()
    acc.nan += int(torch.isnan(c).sum().item())
    acc.inf += int(torch.isinf(c).sum().item())
    for k, bound in enumerate(under):
        acc.under[k] += int(((a64 <= bound) & (a64 > 0)).sum().item())
    for k, bound in enumerate(over):
        acc.over[k] += int((a64 > bound).sum().item())
    # NaN propagates into the extremes as in the device kernel; an Inf is the maximum.
    lo, hi = torch.stack(torch.aminmax(a64)).tolist() if not acc.nan else (math.nan, math.nan)
    _extremes(acc, lo, hi)


def _extremes(acc: _Accumulator, lo: float, hi: float) -> None:
    if math.isnan(lo) or math.isnan(acc.abs_max):
        acc.abs_max = acc.abs_min = math.nan
    else:
        acc.abs_max = max(acc.abs_max, hi)
        acc.abs_min = min(acc.abs_min, lo)


def _read_piece(
    c: Tensor, acc: _Accumulator, under: tuple[float, ...], over: tuple[float, ...]
) -> None:
    if c.dtype != torch.float64:
        c = c.float()  # float16/bfloat16 convert exactly; float32 stays itself
    a = c.abs()
    lo, hi, sum_abs, total, sum_sq = torch.stack(
        (*torch.aminmax(a), a.sum(), c.sum(), c.square().sum())
    ).tolist()
    if not (math.isfinite(sum_abs) and math.isfinite(sum_sq) and math.isfinite(total)):
        _nonfinite_piece(c, acc, under, over)
        return
    if hi > 0 and not (_F32_SAFE[0] < hi < _F32_SAFE[1]):
        # float32 squares would lose precision or overflow: sum in float64 (for a float64
        # piece, around a power of two near its maximum, so that squares stay finite).
        scale = 2.0 ** -math.frexp(hi)[1] if c.dtype == torch.float64 else 1.0
        c64 = c.double() * scale if scale != 1.0 else c.double()
        sum_abs = c64.abs().sum().item() / scale
        total = c64.sum().item() / scale
        sum_sq = c64.square().sum().item() / (scale * scale)
    _extremes(acc, lo, hi)
    acc.sum_abs += sum_abs
    acc.sum += total
    acc.sum_sq += sum_sq
    bits = a.view(_bits_dtype(c.dtype))
    zeros: int | None = None
    for k, bound in enumerate(under):
        if lo <= bound:  # some values may be at or below the bound: count them exactly
            if zeros is None:
                zeros = _count_le(bits, 0) if lo == 0 else 0
            acc.under[k] += _count_le(bits, _bits_of(bound, c.dtype)) - zeros
    for k, bound in enumerate(over):
        if hi > bound:
            acc.over[k] += c.numel() - _count_le(bits, _bits_of(bound, c.dtype))


def _centred_sum_sq(pieces: list[Tensor], mean: float) -> tuple[float, float]:
    """``sum(x - mean)`` and ``sum((x - mean)**2)`` in float64."""
    total = squares = 0.0
    for c in pieces:
        d = c.double() - mean
        total += d.sum().item()
        squares += d.square().sum().item()
    return total, squares


def compile_errors() -> tuple[type[BaseException], ...]:
    """What ``torch.compile`` raises when it cannot compile a kernel (no C++ compiler, an
    unsupported tensor type or op): only these fall back to eager statistics."""
    import torch._dynamo.exc
    import torch._inductor.exc

    names = ("CppCompileError", "InvalidCxxCompiler", "OperatorIssue", "InductorError")
    inductor = tuple(getattr(torch._inductor.exc, name, None) for name in names)
    found = (torch._dynamo.exc.TorchDynamoException, *inductor)
    return tuple(error for error in found if isinstance(error, type))


def is_out_of_memory(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, torch.OutOfMemoryError):
            return True
        error = error.__cause__ or error.__context__
    return False


def _moments_kernel(x: Tensor, shift: Tensor) -> Tensor:
    """``sum|x|, sum(x - shift), sum((x - shift)**2), max|x|, min|x|`` in float64, one pass.
    The shift (an element of ``x``) keeps the variance clear of cancellation."""
    x = x.float()
    a = x.abs()
    d = (x - shift).double()
    return torch.stack(
        (a.sum(dtype=torch.float64), d.sum(), (d * d).sum(), a.amax().double(), a.amin().double())
    )


def _counts_kernel(x: Tensor, t0: Tensor, t1: Tensor, t2: Tensor) -> Tensor:
    """How many ``|x| <= t`` for three thresholds, one pass (int32: ``x`` has < 2**31
    elements)."""
    a = x.float().abs()
    return torch.stack([(a <= t).sum(dtype=torch.int32) for t in (t0, t1, t2)])


class _LargeKernels:
    """The compiled kernels for large tensors, compiled at first use; after a compilation
    failure (see :func:`compile_errors`) large tensors are read in pieces, with a warning."""

    def __init__(self) -> None:
        self.moments: Any = None
        self.counts: Any = None
        self.failed = False

    def __call__(self, x: Tensor, under: tuple[float, ...], over: tuple[float, ...]) -> Any:
        """The statistics of ``x`` (see :func:`cpu_stats`), or None where ``x`` is not
        finite (the caller reads it in pieces) or compilation failed."""
        if self.failed:
            return None
        try:
            return self._run(x, under, over)
        except compile_errors() as error:
            if is_out_of_memory(error):
                raise
            self.failed = True
            first_line = str(error).splitlines()[0] if str(error) else ""
            warnings.warn(
                "unitscale: compiled scale statistics are unavailable on this machine "
                f"({type(error).__name__}: {first_line}); large CPU tensors are read in "
                "pieces instead, which is slower but gives the same statistics",
                RuntimeWarning,
                stacklevel=4,
            )
            return None

    def _run(self, x: Tensor, under: tuple[float, ...], over: tuple[float, ...]) -> Any:
        if self.moments is None:
            self.moments = torch.compile(_moments_kernel, dynamic=True, fullgraph=True)
            self.counts = torch.compile(_counts_kernel, dynamic=True, fullgraph=True)
        flat = x.view(-1)
        n = flat.numel()
        sum_abs, shifted, squares, hi, lo = self.moments(flat, flat[0]).tolist()
        if not (math.isfinite(sum_abs) and math.isfinite(squares) and math.isfinite(shifted)):
            return None  # NaN or Inf: counted exactly, piece by piece
        mean = flat[0].item() + shifted / n
        var = squares / n - (shifted / n) ** 2
        wanted: list[float] = [0.0] if lo == 0 else []
        wanted += [bound for bound in under if lo <= bound]
        wanted += [bound for bound in over if hi > bound]
        found: dict[float, int] = {0.0: 0}
        for start in range(0, len(wanted), 3):
            group = (wanted[start : start + 3] * 3)[:3]
            thresholds = [torch.tensor(t, dtype=torch.float32) for t in group]
            for t, count in zip(group, self.counts(flat, *thresholds).tolist(), strict=True):
                found[t] = count
        zeros = found[0.0]
        under_counts = [found[b] - zeros if lo <= b else 0 for b in under]
        over_counts = [n - found[b] if hi > b else 0 for b in over]
        return [sum_abs, mean, var, hi, lo, 0.0, 0.0, *under_counts, *over_counts]


_large = _LargeKernels()


def _large_applies(x: Tensor) -> bool:
    return (
        LARGE <= x.numel() < 2**31
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and x.is_contiguous()
    )


@torch.no_grad()
def cpu_stats(
    x: Tensor, under: tuple[float, ...], over: tuple[float, ...], compiled: bool = True
) -> list[float]:
    """Statistics of the non-empty CPU tensor ``x`` in the layout of the device kernel:
    ``sum_abs, mean, var, abs_max, abs_min, nan_count, inf_count`` then the counts of
    ``0 < |x| <= under[k]`` and of ``|x| > over[k]``. With ``compiled``, large tensors
    (see :data:`LARGE`) are read by compiled kernels."""
    n = x.numel()
    if compiled and _large_applies(x):
        values = _large(x, under, over)
        if values is not None:
            return [float(v) for v in values]
    acc = _Accumulator(len(under), len(over))
    pieces = _pieces(x)
    for c in pieces:
        _read_piece(c, acc, under, over)
    mean = acc.sum / n
    mean_sq = acc.sum_sq / n
    var = mean_sq - mean * mean
    finite = acc.nan == 0 and acc.inf == 0
    if finite and math.isinf(mean_sq):
        return _result(acc, mean, math.inf)  # float64 values beyond 1e154: squares overflow
    if finite and var <= _CANCELLATION * mean_sq and mean_sq > 0:
        centred, squares = _centred_sum_sq(pieces, mean)
        var = squares / n - (centred / n) ** 2
    return _result(acc, mean, var)


def _result(acc: _Accumulator, mean: float, var: float) -> list[float]:
    return [
        acc.sum_abs,
        mean,
        var,
        acc.abs_max,
        acc.abs_min,
        float(acc.nan),
        float(acc.inf),
        *map(float, acc.under),
        *map(float, acc.over),
    ]
