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
import time
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


def _count_le(bits: Tensor, threshold: int) -> Tensor:
    """How many of the non-negative bit patterns ``bits`` are ``<= threshold`` (a 0-d int
    tensor; ``bits`` has at most :data:`PIECE` elements, so int32 cannot wrap)."""
    return torch.rsub(bits, threshold + 1).clamp_(0, 1).sum(dtype=torch.int32)


def _nonfinite_piece(
    c: Tensor, acc: _Accumulator, under: tuple[float, ...], over: tuple[float, ...]
) -> None:
    """A piece holding NaN or Inf (or whose float32 sums overflowed): IEEE sums in float64
    and counts by comparison (NaN counts as neither underflow nor overflow)."""
    c64 = c.double()
    a64 = c64.abs()
    nan = int(torch.isnan(c).sum().item())
    parts = [a64.sum(), c64.sum(), c64.square().sum(), torch.isinf(c).sum()]
    parts += [((a64 <= bound) & (a64 > 0)).sum() for bound in under]
    parts += [(a64 > bound).sum() for bound in over]
    if not nan:
        parts += torch.aminmax(a64)
    values = torch.stack([p.double() for p in parts]).tolist()
    acc.sum_abs += values[0]
    acc.sum += values[1]
    acc.sum_sq += values[2]
    acc.nan += nan
    acc.inf += int(values[3])
    n_under = len(under)
    for k in range(n_under):
        acc.under[k] += int(values[4 + k])
    for k in range(len(over)):
        acc.over[k] += int(values[4 + n_under + k])
    # NaN propagates into the extremes as in the device kernel; an Inf is the maximum.
    lo, hi = (math.nan, math.nan) if nan else values[-2:]
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
    # (torch.linalg.vector_norm would save the square's temporary, but it does not sum by
    # cascade: its relative error reaches 1e-4 where these sums stay near 1e-7.)
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
        sums = torch.stack((c64.abs().sum(), c64.sum(), c64.square().sum())).tolist()
        sum_abs, total, sum_sq = sums[0] / scale, sums[1] / scale, sums[2] / (scale * scale)
    _extremes(acc, lo, hi)
    acc.sum_abs += sum_abs
    acc.sum += total
    acc.sum_sq += sum_sq
    # Counts only for the thresholds this piece straddles, read in one transfer.
    wanted_under = [k for k, bound in enumerate(under) if lo <= bound]
    wanted_over = [k for k, bound in enumerate(over) if hi > bound]
    if not (wanted_under or wanted_over):
        return
    bits = a.view(_bits_dtype(c.dtype))
    counts = [_count_le(bits, _bits_of(under[k], c.dtype)) for k in wanted_under]
    counts += [_count_le(bits, _bits_of(over[k], c.dtype)) for k in wanted_over]
    if wanted_under and lo == 0:
        counts.append(_count_le(bits, 0))
    found = torch.stack(counts).tolist()
    zeros = found[-1] if wanted_under and lo == 0 else 0
    for k, count in zip(wanted_under, found, strict=False):
        acc.under[k] += count - zeros
    for k, count in zip(wanted_over, found[len(wanted_under) :], strict=False):
        acc.over[k] += c.numel() - count


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


def _fused_kernel(under: tuple[float, ...], over: tuple[float, ...]) -> Any:
    """One pass over a flat float tensor for every statistic, the thresholds constants:
    ``sum|x|, sum(x - shift), sum((x - shift)**2)`` in float64 (the shift, an element of
    ``x``, keeps the variance clear of cancellation), ``max|x|, min|x|``, the number of
    zeros and the counts of ``|x| <= under[k]`` and ``|x| > over[k]`` (int32: ``x`` has
    fewer than 2**31 elements)."""

    def kernel(x: Tensor, shift: Tensor) -> Tensor:
        x = x.float()
        a = x.abs()
        d = (x - shift).double()
        parts = [a.double().sum(), d.sum(), (d * d).sum(), a.amax().double(), a.amin().double()]
        parts.append((a == 0).sum(dtype=torch.int32).double())
        parts += [(a <= bound).sum(dtype=torch.int32).double() for bound in under]
        parts += [(a > bound).sum(dtype=torch.int32).double() for bound in over]
        return torch.stack(parts)

    return kernel


class _LargeKernels:
    """The compiled kernel for large tensors, compiled when it pays: once reading large
    tensors in pieces has cost :attr:`compile_after` seconds in this process (about what a
    compile costs), so that short runs (``unitscale analyse``, a first tracked call) never
    wait for a compiler and long ones (``ScaleMonitor``) soon read large tensors in one
    fused pass. After a compilation failure (see :func:`compile_errors`) large tensors are
    read in pieces, with a warning."""

    def __init__(self, compile_after: float = 1.0) -> None:
        self.compile_after = compile_after
        self.pieces_seconds = 0.0
        self.kernels: dict[tuple[tuple[float, ...], tuple[float, ...]], Any] = {}
        self.failed = False

    def due(self) -> bool:
        """Whether large tensors are read by the compiled kernel now."""
        return not self.failed and self.pieces_seconds >= self.compile_after

    def __call__(self, x: Tensor, under: tuple[float, ...], over: tuple[float, ...]) -> Any:
        """The statistics of ``x`` (see :func:`cpu_stats`), or None where ``x`` is not
        finite (the caller reads it in pieces) or compilation failed."""
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
        kernel = self.kernels.get((under, over))
        if kernel is None:
            kernel = torch.compile(_fused_kernel(under, over), dynamic=True, fullgraph=True)
            self.kernels[(under, over)] = kernel
        flat = x.view(-1)
        n = flat.numel()
        shift = flat[0]
        values = kernel(flat, shift).tolist()
        sum_abs, shifted, squares, hi, lo, zeros = values[:6]
        if not (math.isfinite(sum_abs) and math.isfinite(squares) and math.isfinite(shifted)):
            return None  # NaN or Inf: counted exactly, piece by piece
        mean = float(shift.item()) + shifted / n
        var = squares / n - (shifted / n) ** 2
        n_under = len(under)
        under_counts = [count - zeros for count in values[6 : 6 + n_under]]
        return [sum_abs, mean, var, hi, lo, 0.0, 0.0, *under_counts, *values[6 + n_under :]]


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
    large = compiled and _large_applies(x)
    if large and _large.due():
        values = _large(x, under, over)
        if values is not None:
            return [float(v) for v in values]
        large = False  # not finite: read in pieces, which count NaN and Inf
    start = time.perf_counter() if large else 0.0
    acc = _Accumulator(len(under), len(over))
    pieces = _pieces(x)
    for c in pieces:
        _read_piece(c, acc, under, over)
    if large:
        _large.pieces_seconds += time.perf_counter() - start
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


#: CPU float32/float16/bfloat16 tensors of at most this many elements are batched (see
#: :class:`SmallBatch`): for them a torch op's fixed cost (microseconds) outweighs its work.
SMALL = 1 << 13
#: A batch is read once its snapshots hold this many elements (1 MiB of float32), which
#: bounds the memory it holds.
FLUSH_ELEMENTS = 1 << 18


class Pending:
    """The statistics of one batched tensor: :meth:`values` reads the batch if needed."""

    __slots__ = ("_batch", "_values")

    def __init__(self, batch: SmallBatch) -> None:
        self._batch = batch
        self._values: list[float] | None = None

    def values(self) -> list[float]:
        if self._values is None:
            self._batch.flush()
        if self._values is None:  # pragma: no cover - flush fills every pending entry
            raise RuntimeError("unitscale: batched statistics were lost")
        return self._values


class SmallBatch:
    """Statistics of small tensors, read many at a time.

    :meth:`add` copies the tensor (flat, as float32: float16/bfloat16 convert exactly), so
    that later in-place changes of the tensor cannot change its statistics, and returns a
    :class:`Pending`. :meth:`flush` stacks the copies of each size into a matrix and reads
    all rows with one set of row-wise reductions, so the ops' fixed costs are paid once per
    size rather than once per tensor. Semantics are those of :func:`cpu_stats`: rows that
    hold NaN or Inf, whose magnitudes fall outside float32's safe range for squares, are
    read by it one by one; rows whose mean dominates their spread get their variance from a
    second, centred float64 pass (for all such rows at once).
    """

    def __init__(self, under: tuple[float, ...], over: tuple[float, ...]) -> None:
        self.under = under
        self.over = over
        self.groups: dict[int, list[tuple[Tensor, Pending]]] = {}
        self.elements = 0

    def add(self, x: Tensor) -> Pending:
        """Queue the detached CPU tensor ``x`` (float32/16/bf16, at most :data:`SMALL`
        elements)."""
        if x.dtype == torch.float32 and x.is_contiguous():
            copy = x.view(-1).clone()
        else:
            copy = x.reshape(-1).float()
            if copy.data_ptr() == x.data_ptr():  # pragma: no cover - reshape copied already
                copy = copy.clone()
        pending = Pending(self)
        n = copy.numel()
        group = self.groups.get(n)
        if group is None:
            group = self.groups[n] = []
        group.append((copy, pending))
        self.elements += n
        if self.elements >= FLUSH_ELEMENTS:
            self.flush()
        return pending

    @torch.no_grad()
    def flush(self) -> None:
        """Compute the statistics of every queued tensor and release the copies."""
        groups, self.groups, self.elements = self.groups, {}, 0
        for n, items in groups.items():
            rows = torch.stack([copy for copy, _ in items]) if len(items) > 1 else None
            if rows is None:
                rows = items[0][0].view(1, n)
            for (_, pending), values in zip(items, self._rows(rows), strict=True):
                pending._values = values

    def _rows(self, rows: Tensor) -> list[list[float]]:
        r, n = rows.shape
        under, over = self.under, self.over
        a = rows.abs()
        lo_t, hi_t = torch.aminmax(a, dim=1)
        head = torch.stack((lo_t, hi_t, a.sum(1), rows.sum(1), rows.square().sum(1)))
        lo, hi, sum_abs, total, sum_sq = head.tolist()
        # Counts for the thresholds some row straddles, all rows at once.
        lowest, highest = min(lo), max(hi)
        wanted_under = [k for k, bound in enumerate(under) if lowest <= bound]
        wanted_over = [k for k, bound in enumerate(over) if highest > bound]
        thresholds = [_bits_of(under[k], torch.float32) for k in wanted_under]
        thresholds += [_bits_of(over[k], torch.float32) for k in wanted_over]
        if wanted_under and lowest == 0:
            thresholds.append(0)
        found: list[list[int]] = []
        if thresholds:
            bits = a.view(torch.int32)
            found = torch.stack(
                [torch.rsub(bits, t + 1).clamp_(0, 1).sum(1, dtype=torch.int32) for t in thresholds]
            ).tolist()
        zeros = found[-1] if wanted_under and lowest == 0 else [0] * r
        n_under = len(wanted_under)
        out: list[list[float]] = []
        centred: list[int] = []
        for i in range(r):
            if not (
                math.isfinite(sum_abs[i]) and math.isfinite(sum_sq[i]) and math.isfinite(total[i])
            ) or (hi[i] > 0 and not (_F32_SAFE[0] < hi[i] < _F32_SAFE[1])):
                out.append(cpu_stats(rows[i], under, over, compiled=False))
                continue
            mean = total[i] / n
            mean_sq = sum_sq[i] / n
            var = mean_sq - mean * mean
            if var <= _CANCELLATION * mean_sq and mean_sq > 0:
                centred.append(i)
            under_counts = [0.0] * len(under)
            for j, k in enumerate(wanted_under):
                under_counts[k] = float(found[j][i] - zeros[i])
            over_counts = [0.0] * len(over)
            for j, k in enumerate(wanted_over):
                over_counts[k] = float(n - found[n_under + j][i])
            out.append([sum_abs[i], mean, var, hi[i], lo[i], 0.0, 0.0, *under_counts, *over_counts])
        if centred:
            index = torch.tensor(centred)
            chosen = rows.index_select(0, index).double()
            means = torch.tensor([out[i][1] for i in centred], dtype=torch.float64)
            d = chosen - means.unsqueeze(1)
            sums, squares = torch.stack((d.sum(1), d.square().sum(1))).tolist()
            for j, i in enumerate(centred):
                out[i][2] = squares[j] / n - (sums[j] / n) ** 2
        return out
