"""Scale statistics of CPU tensors: the native kernel's wrapper, and the PyTorch path.

On the CPU, tracking reads statistics by one of two paths, with the same semantics as the
device kernel (:func:`unitscale.tracking.metrics._stats_kernel`), which the tests check
value for value:

- :func:`native_stats`, the default: one pass of a small C kernel (:mod:`._native`) over
  each contiguous float32/bfloat16 tensor (float16 and strided tensors are copied piece by
  piece), a few microseconds of fixed cost;
- the PyTorch path, where the install built no native extension (or
  ``UNITSCALE_STATS=eager``): small
  tensors are copied and read many at a time (:class:`SmallBatch`, one set of row-wise
  reductions per size), others by :func:`cpu_stats`, which uses the host's cheap reads of
  partial results to skip most of the work a device-side kernel does for every tensor:

  - the tensor is read in pieces of at most :data:`PIECE` elements (views, never copies,
    for contiguous tensors), so every temporary stays in cache and no temporary of the
    tensor's size is allocated; temporaries of large pieces go to per-thread buffers that
    are reused (:class:`_Scratch`) rather than allocated for each;
  - per piece: ``|x|``, its minimum and maximum (one ``aminmax``), and three sums (``|x|``,
    ``x``, ``x**2``) accumulated in float32 by torch's cascade summation and combined on
    the host in float64; pieces whose magnitudes would overflow or underflow float32
    squares are summed in float64 instead (exact conversion);
  - the variance is ``E[x**2] - E[x]**2`` unless the mean dominates (cancellation), when a
    second pass sums ``(x - mean)**2`` in float64;
  - under/overflow counts are computed only for the thresholds that the piece's minimum and
    maximum straddle (a piece whose largest value is 3 cannot overflow E4M3), exactly, on
    the integer bit patterns of ``|x|`` (monotonic in the value for non-negative floats),
    without a boolean temporary: ``bits <= T`` is written as int32 0/1 and summed;
  - NaN and Inf are counted only when a piece's sums say they are present.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
from torch import Tensor

from ._native import THRESHOLDS, native

__all__ = ["PIECE", "SMALL", "Pending", "SmallBatch", "cpu_stats", "native_stats"]

#: Elements per piece: 4 MiB of float32, so that a piece's few temporaries stay in a
#: server's last-level cache while each op's fixed cost (thread dispatch: several
#: microseconds) is paid once per million elements. (Pieces of 64Ki elements, which fit in
#: L2, paid it 16 times as often: measured with fresh temporaries, before the buffers
#: below, 5x one read of a 16 MiB tensor against 3.4x, and 17x against 8x on 2 MiB;
#: benchmarks/bench_tracking.py, 2 threads.)
PIECE = 1 << 20

# float32 squares stay normal and finite for magnitudes in (2**-60, 2**60); outside it the
# piece is summed in float64. (A float32 sum of squares that overflows all the same goes to
# the float64 path as a non-finite piece.)
_F32_SAFE = (2.0**-60, 2.0**60)
# Where the variance is below half the second moment (the mean is not small against the
# spread), E[x**2] - E[x]**2 loses digits to cancellation: the variance is summed around the
# mean instead, so its relative error stays that of a float32 sum (about 1e-7).
_CANCELLATION = 0.5
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


class _Scratch(threading.local):
    """Per-thread float32 buffers that the PyTorch path writes its temporaries into.

    Fresh temporaries of a megabyte or more cost far more than the ops that fill them: three
    of them alive at once make the allocator hand memory back to the system and fault it in
    again, several times the ops' own cost per piece. Each thread keeps at most
    :data:`SCRATCH_SLOTS` buffers of up to :data:`PIECE` elements (4 MiB each), made when it
    first reads a tensor that large; other temporaries are allocated.
    """

    def __init__(self) -> None:
        self.buffers: list[Tensor | None] = [None] * SCRATCH_SLOTS
        # Views of the buffers by (slot, shape, dtype): making one costs about as much as
        # the op that writes into it (a few microseconds), and pieces repeat their shapes.
        self.views: dict[tuple[int, tuple[int, ...], torch.dtype], Tensor] = {}


#: Buffers per thread: ``|x|``; squares, then counts; the small-tensor batch's rows.
SCRATCH_SLOTS = 3
#: Smaller temporaries are allocated: the allocator reuses those of a few pieces cheaply.
SCRATCH_FROM = 1 << 15
_scratch_buffers = _Scratch()


def _scratch(
    slot: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> Tensor | None:
    """A contiguous float32 (or, viewed, int32) tensor of ``shape`` in this thread's buffer
    ``slot``, or None where it would hold fewer than :data:`SCRATCH_FROM` or more than
    :data:`PIECE` elements (the caller then allocates)."""
    scratch = _scratch_buffers
    key = (slot, shape, dtype)
    view = scratch.views.get(key)
    if view is not None:
        return view
    n = math.prod(shape)
    if not SCRATCH_FROM <= n <= PIECE:
        return None
    if len(scratch.views) >= 64:
        scratch.views = {}
    # Buffers and views are made outside inference mode: tracking runs in it too, and what
    # is made there cannot be written outside it.
    with torch.inference_mode(False):
        buffer = scratch.buffers[slot]
        if buffer is None or buffer.numel() < n:
            # Grown to a power of two (at most PIECE), so that a few sizes settle it.
            buffer = torch.empty(min(PIECE, 1 << max(n - 1, 1).bit_length()))
            scratch.buffers[slot] = buffer
            scratch.views = {k: v for k, v in scratch.views.items() if k[0] != slot}
        view = scratch.views[key] = buffer[:n].view(dtype).view(shape)
    return view


def _count_le(
    bits: Tensor, threshold: int, out: Tensor | None = None, dim: int | None = None
) -> Tensor:
    """How many of the non-negative bit patterns ``bits`` are ``<= threshold`` (int32, of
    all of them or along ``dim``; ``bits`` has at most :data:`PIECE` elements, so int32
    cannot wrap). ``out``: an int32 temporary of ``bits``' shape to work in (None: one is
    allocated)."""
    # The comparison written as int32 0/1 (into an int32 tensor: a boolean result is written
    # by a slower kernel), then summed: two passes.
    work = torch.le(bits, threshold, out=torch.empty_like(bits) if out is None else out)
    return work.sum(dtype=torch.int32) if dim is None else work.sum(dim, dtype=torch.int32)


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
    shape = tuple(c.shape) if c.dtype == torch.float32 else None  # None: no buffers
    a = torch.abs(c, out=None if shape is None else _scratch(0, shape))
    # (torch.linalg.vector_norm would save the square's temporary, but it does not sum by
    # cascade: its relative error reaches 1e-4 where these sums stay near 1e-7.)
    squares = torch.mul(c, c, out=None if shape is None else _scratch(1, shape))
    lo, hi, sum_abs, total, sum_sq = torch.stack(
        (*torch.aminmax(a), a.sum(), c.sum(), squares.sum())
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
    # The squares are summed: their buffer is free.
    work = None if shape is None else _scratch(1, shape, torch.int32)
    counts = [_count_le(bits, _bits_of(under[k], c.dtype), work) for k in wanted_under]
    counts += [_count_le(bits, _bits_of(over[k], c.dtype), work) for k in wanted_over]
    if wanted_under and lo == 0:
        counts.append(_count_le(bits, 0, work))
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


@torch.no_grad()
def cpu_stats(x: Tensor, under: tuple[float, ...], over: tuple[float, ...]) -> list[float]:
    """Statistics of the non-empty CPU tensor ``x`` by PyTorch ops, in the layout of the
    device kernel: ``sum_abs, mean, var, abs_max, abs_min, nan_count, inf_count`` then the
    counts of ``0 < |x| <= under[k]`` and of ``|x| > over[k]``."""
    n = x.numel()
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


#: CPU float32/float16/bfloat16 tensors of at most this many elements are batched when
#: tracking records them (see :class:`SmallBatch`): for them a torch op's fixed cost
#: (microseconds) outweighs its work. Measured, 2 threads, against one read of each: 8Ki to
#: 32Ki elements 2.9-4.3x batched, 7.6-9.7x read one by one; 64Ki 5.1x against 5.9x.
SMALL = 1 << 15
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
            if len(items) > 1:
                copies = [copy for copy, _ in items]
                rows = torch.stack(copies, out=_scratch(2, (len(copies), n)))
            else:
                rows = items[0][0].view(1, n)
            for (_, pending), values in zip(items, self._rows(rows), strict=True):
                pending._values = values

    def _rows(self, rows: Tensor) -> list[list[float]]:
        r, n = rows.shape
        under, over = self.under, self.over
        shape = (r, n)
        a = torch.abs(rows, out=_scratch(0, shape))
        squares = torch.mul(rows, rows, out=_scratch(1, shape))
        # (amin and amax, not aminmax(dim=1): on the CPU the row-wise aminmax runs about
        # 15 times slower than the two of them.)
        head = torch.stack((a.amin(1), a.amax(1), a.sum(1), rows.sum(1), squares.sum(1)))
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
            work = _scratch(1, shape, torch.int32)  # the squares are summed
            found = torch.stack([_count_le(bits, t, work, dim=1) for t in thresholds]).tolist()
        zeros = found[-1] if wanted_under and lowest == 0 else [0] * r
        n_under = len(wanted_under)
        out: list[list[float]] = []
        centred: list[int] = []
        for i in range(r):
            if not (
                math.isfinite(sum_abs[i]) and math.isfinite(sum_sq[i]) and math.isfinite(total[i])
            ) or (hi[i] > 0 and not (_F32_SAFE[0] < hi[i] < _F32_SAFE[1])):
                out.append(cpu_stats(rows[i], under, over))
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
