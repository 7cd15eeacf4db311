"""Scale statistics of a tensor: the records that scale tracking stores on graph nodes.

Design constraints (this is the hot path of tracking):

- statistics come as one small float64 vector per tensor (:func:`tensor_stats`), computed
  under ``no_grad`` by one of two implementations, chosen by device (:func:`deferred_stats`):

  - on the CPU, where a host read costs nothing, by the native one-pass kernel
    (:mod:`._native`, built by ``pip install``), a few microseconds of fixed cost;
  - elsewhere, and on the CPU where the install built no native extension (or for what it
    declines: float64, NaN or Inf), by :func:`_stats_kernel` in PyTorch ops: on an
    accelerator compiled with ``torch.compile`` on the tensor's own device, one kernel that
    reads the tensor twice (its largest magnitude first, which scales the sums so that they
    stay finite), allocates nothing of its size, counts in int64, and is copied to the host
    only when the whole graph is read, so tracking costs no host-device synchronisation
    per op; on the CPU run eagerly, so nothing waits for a compiler.

  Tests check the two value for value on the same tensors.
- the input is never modified, so tracking cannot change the numerics (on the CPU the
  statistics are computed before the recording call returns, so a later in-place change
  cannot alter its record);
- empty tensors, NaN and Inf give well-defined values, never an exception: statistics follow
  IEEE arithmetic over all elements (a NaN makes ``std`` NaN, an Inf makes ``abs_max`` Inf),
  an empty tensor gives zeros, and ``nan_count``/``inf_count`` say what happened.

``UNITSCALE_STATS`` selects the paths: ``auto`` (the default, as above), ``eager`` (nothing
compiled, no native kernel: :func:`_stats_kernel` run eagerly on every device) or
``compiled`` (:func:`_stats_kernel` compiled on every device, the CPU included, which needs a
C++ compiler there; only on request).

Why the PyTorch implementation kept is the device kernel rather than the CPU-tuned PyTorch
path it replaced (pieces, per-thread buffers, a batch for small tensors): that path read
partial results on the host after every piece, a device synchronisation per tensor on an
accelerator, so the device kernel was needed anyway; both gave float64 arithmetic's values
on every edge case the tests hold (within 1e-6; extremes and counts exactly). The cost of
the choice falls only where the install built no native kernel (and on the tensors it
declines): measured with one thread against one read of the tensor (``x.abs().sum()``), two
runs on a loaded 2-core machine, the eager kernel takes 58-84x for 2**11-2**15 float32
elements (the replaced path 7-14x, 2.5-8.6x batched), 84-90x for 2**17, 89-149x for 2**20
(6-9x) and 113-274x for 2**22-2**24 (2-4x): 12-21 ms per million elements. Such an install
warns once that the PyTorch paths run instead.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Union

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .._compat import dynamo_recompile_limit
from ..formats import PRESETS
from ._native import native_stats

__all__ = [
    "FORMAT_KEYS",
    "FORMAT_RANGES",
    "STRUCTURAL_ZERO_RTOL",
    "Metrics",
    "stats_to_data",
    "structural_zero_fraction",
    "tensor_stats",
]

#: ``key -> (smallest positive subnormal, largest finite value)`` of the formats whose
#: under/overflow tracking reports: the presets of :mod:`unitscale.formats`.
FORMAT_RANGES: dict[str, tuple[float, float]] = {
    key: (fmt.min_absolute_subnormal, fmt.max_absolute_value) for key, fmt in PRESETS.items()
}
FORMAT_KEYS: tuple[str, ...] = tuple(FORMAT_RANGES)

_UNDERFLOW_BELOW = tuple(rng[0] / 2 for rng in FORMAT_RANGES.values())
_OVERFLOW_ABOVE = tuple(rng[1] for rng in FORMAT_RANGES.values())
# Layout of the vector produced by tensor_stats (after the format counts).
_FIELDS = ("sum_abs", "mean", "var", "abs_max", "abs_min", "nan_count", "inf_count")
_N_STATS = len(_FIELDS) + 2 * len(FORMAT_KEYS)


#: A non-zero element is a *structural zero* when ``|x| <= STRUCTURAL_ZERO_RTOL * rms(x)``:
#: a value about 8 float32 roundings (2**-23 each) below the tensor's own scale is what
#: rounding leaves of a quantity that is mathematically zero (the gradient of an attention
#: key's bias, which softmax cancels: 1e-6 against 2.8 for the query's), not a signal a
#: low-precision format could lose.
STRUCTURAL_ZERO_RTOL = 2.0**-20


def structural_zero_fraction(x: Tensor) -> float:
    """The fraction of the elements of ``x`` that are structural zeros: non-zero, and at
    most :data:`STRUCTURAL_ZERO_RTOL` times the root mean square of ``x``.

    Exact zeros are not counted (they are not underflow either). Where the threshold lies
    below a format's underflow bound, every structural zero underflows, so the fraction of
    values at risk of underflow is ``max(0, underflow - structural)``; where it lies above,
    every underflowing value is a structural zero and that difference is 0 as well.

    Example:
        >>> g = torch.tensor([3.0, -2.0, 1e-7, 0.0])  # rms 1.8: 1e-7 is rounding noise
        >>> structural_zero_fraction(g)
        0.25
    """
    if x.numel() == 0:
        return 0.0
    with torch.no_grad():
        magnitude = x.detach().abs().double()
        rms = magnitude.square().mean().sqrt()
        noise = (magnitude > 0) & (magnitude <= STRUCTURAL_ZERO_RTOL * rms)
        return float(noise.sum()) / x.numel()


def _count(mask: Tensor) -> Tensor:
    """How many elements of ``mask`` are True, exactly: int64 (int32 wraps above 2**31
    elements, one logits tensor on a large GPU), converted to float64 (exact to 2**53)."""
    return mask.sum(dtype=torch.int64).double()


def _stats_kernel(x: Tensor) -> Tensor:
    """All statistics in one pass over ``x``: fused into one loop when compiled.

    A non-zero value underflows in a format when round-to-nearest-even takes it to zero,
    i.e. ``|x| <= min_subnormal / 2``; it overflows when ``|x| > max``.

    Sums accumulate in float64. The variance is taken of ``d = x/2 - x[0]/2`` (the halves
    are exact, and their difference cannot overflow), scaled by ``max|d|`` into [-1, 1] and
    rescaled in float64: so it is finite for any finite tensor (squaring values near 1e20 in
    float32 would overflow to Inf), and subtracting an element first keeps it accurate where
    the mean dominates the spread (the variance of ``x / max|x|`` loses it to float32
    rounding: 0.4% off for mean 1000 and std 1e-3).
    """
    # No reshape: for a non-contiguous tensor it would materialise a copy.
    if x.dtype != torch.float64:
        x = x.float()
    a = x.abs()
    abs_max = a.amax()
    half = x * 0.5
    d = half - half[(0,) * x.dim()]
    d_max = d.abs().amax()
    # Inf or NaN present (or all equal): no rescaling, IEEE arithmetic says what happened.
    scale = torch.where(torch.isfinite(d_max) & (d_max > 0), d_max, torch.ones_like(d_max))
    var = torch.var(d / scale, correction=0).double()
    parts = [
        a.sum(dtype=torch.float64),  # float64 accumulation: finite, and exact for small sums
        x.sum(dtype=torch.float64) / x.numel(),
        var * (2 * scale.double()) ** 2,
        abs_max.double(),
        a.amin().double(),
        _count(torch.isnan(x)),
        _count(torch.isinf(x)),
    ]
    for bound in _UNDERFLOW_BELOW:
        parts.append(_count((a <= bound) & (a > 0)))
    for bound in _OVERFLOW_ABOVE:
        parts.append(_count(a > bound))
    return torch.stack(parts)


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What ``torch.compile`` raises when it cannot compile the kernel (no C++ compiler, an
    unsupported tensor type or op): only these fall back to the eager kernel."""
    import torch._dynamo.exc
    import torch._inductor.exc

    names = ("CppCompileError", "InvalidCxxCompiler", "OperatorIssue", "InductorError")
    inductor = tuple(getattr(torch._inductor.exc, name, None) for name in names)
    found = (torch._dynamo.exc.TorchDynamoException, *inductor)
    return tuple(error for error in found if isinstance(error, type))


def _is_out_of_memory(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, torch.OutOfMemoryError):
            return True
        error = error.__cause__ or error.__context__
    return False


def _mode() -> str:
    """``UNITSCALE_STATS``: "auto" (the default), "compiled" or "eager" (see the module)."""
    return os.environ.get("UNITSCALE_STATS", "auto")


class _Kernel:
    """Runs :func:`_stats_kernel` compiled (one fused pass), or eagerly where that fails.

    For accelerator tensors (CPU tensors only with ``UNITSCALE_STATS=compiled``: see
    :func:`deferred_stats`). ``UNITSCALE_STATS=eager`` in the environment selects the eager
    path (same statistics, more memory traffic; useful where compile time matters more than
    run time).
    Only a compilation failure (see :func:`_compile_errors`) falls back, and only for that
    call and later tensors of the same kind (device type, dtype, number of dimensions): other
    kinds still use the compiled kernel. Any other error, an out-of-memory error included,
    propagates.
    """

    def __init__(self) -> None:
        self.compiled: Any = None
        self.failed_kinds: set[tuple[str, torch.dtype, int]] = set()

    @property
    def failed(self) -> bool:
        """Whether compilation failed for some kind of tensor (which then runs eagerly)."""
        return bool(self.failed_kinds)

    def __call__(self, x: Tensor) -> Tensor:
        kind = (x.device.type, x.dtype, x.dim())
        if kind in self.failed_kinds or _mode() == "eager":
            return _stats_kernel(x)
        try:
            if self.compiled is None:
                self.compiled = torch.compile(_stats_kernel, dynamic=True, fullgraph=True)
            with dynamo_recompile_limit(64):
                return self.compiled(x)
        except _compile_errors() as error:
            if _is_out_of_memory(error):
                raise
            self.failed_kinds.add(kind)
            first_line = str(error).splitlines()[0] if str(error) else ""
            warnings.warn(
                f"unitscale: compiled scale statistics are unavailable for {x.device.type} "
                f"{x.dtype} tensors of {x.dim()} dimensions ({type(error).__name__}: "
                f"{first_line}); using eager statistics for them, which are slower but "
                "identical",
                RuntimeWarning,
                stacklevel=2,
            )
        return _stats_kernel(x)


_kernel = _Kernel()


def tensor_stats(x: Tensor) -> Tensor:
    """Compute the raw statistics of ``x`` as one float64 vector on ``x``'s device.

    On an accelerator no host synchronisation happens here; convert the result with
    :func:`stats_to_data` (ideally for many tensors at once, after ``torch.stack``).

    Example:
        >>> x = torch.tensor([1.0, -3.0])
        >>> stats_to_data(tensor_stats(x).tolist(), x.numel()).mean_abs
        2.0
    """
    stats = deferred_stats(x)
    if isinstance(stats, list):
        return torch.tensor(stats, dtype=torch.float64)
    return stats


#: Where tracking records statistics: a Tensor on the tensor's device, or a list of floats
#: (computed on the host by the native kernel).
Stats = Union[Tensor, list[float]]  # noqa: UP007 (a runtime alias)

# Tensor types read by the native kernel. Other subclasses of Parameter (unitscale.Parameter,
# u-muP's tagged weights) have ordinary storage too; wrapper subclasses (DTensor, and
# parameters holding one) take the PyTorch kernel.
_PLAIN = (Tensor, torch.nn.Parameter)


def _has_plain_storage(x: Tensor) -> bool:
    return type(x) in _PLAIN or (
        isinstance(x, torch.nn.Parameter) and not is_traceable_wrapper_subclass(x)
    )


def deferred_stats(x: Tensor, mode: str | None = None) -> Stats:
    """The statistics of ``x`` in the form cheapest to produce now (see :data:`Stats`).

    On the CPU: by the native kernel where it is available and reads ``x`` (not with
    ``UNITSCALE_STATS=eager``), else by :func:`_stats_kernel` run eagerly (compiled only with
    ``UNITSCALE_STATS=compiled``). On other devices the compiled kernel runs
    asynchronously. Same values whichever path runs. ``mode`` is ``UNITSCALE_STATS`` as the
    caller read it (tracking reads it once per call: reading the environment costs a third
    of a small tensor's statistics); None reads it here.
    """
    if x.numel() == 0:
        return torch.zeros(_N_STATS, dtype=torch.float64, device=x.device)
    if mode is None:
        mode = _mode()
    # No autograd anywhere below: every path reads a detached tensor (or its memory).
    if x.is_cpu and mode != "compiled":
        if mode == "auto" and _has_plain_storage(x):
            values = native_stats(x, _UNDERFLOW_BELOW, _OVERFLOW_ABOVE)
            if values is not None:
                return values
        with torch.no_grad():
            return _stats_kernel(x.detach())
    with torch.no_grad():
        return _kernel(x.detach())


def host_stats(stats: Stats) -> list[float] | None:
    """The values of ``stats`` if they are on the host (None for a tensor)."""
    if isinstance(stats, list):
        return stats
    return None


@dataclass(frozen=True)
class _Data:
    """Scale statistics of one tensor ``x`` (forward value or gradient).

    ``mean_abs`` is the mean of ``|x|`` (the scale); ``abs_mean`` is ``|mean of x|`` (the
    size of the mean, 0 for a centred tensor): two different statistics.
    """

    mean_abs: float
    abs_mean: float
    std: float
    abs_max: float
    abs_min: float
    rms: float
    numel: int
    underflow: dict[str, float] = field(default_factory=dict)
    overflow: dict[str, float] = field(default_factory=dict)
    nan_count: int = 0
    inf_count: int = 0

    SCALAR_FIELDS: ClassVar[tuple[str, ...]] = (
        "mean_abs",
        "abs_mean",
        "std",
        "abs_max",
        "abs_min",
        "rms",
        "numel",
    )

    @property
    def finite(self) -> bool:
        """True when the tensor held no NaN and no Inf."""
        return self.nan_count == 0 and self.inf_count == 0

    def as_dict(self) -> dict[str, float]:
        """Flat ``{metric: value}``, with ``underflow_<fmt>``/``overflow_<fmt>`` keys."""
        out: dict[str, float] = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("underflow", "overflow")
        }
        for key in FORMAT_KEYS:
            out[f"underflow_{key}"] = self.underflow.get(key, 0.0)
            out[f"overflow_{key}"] = self.overflow.get(key, 0.0)
        return out


_N_FIELDS = len(_FIELDS)
_N_KEYS = len(FORMAT_KEYS)


_UNDERFLOW_END = _N_FIELDS + _N_KEYS


def _fractions_any(counts: list[float], numel: int) -> dict[str, float]:
    """``{format: count / numel}`` for every key of :data:`FORMAT_KEYS` (any number)."""
    return {key: count / numel for key, count in zip(FORMAT_KEYS, counts, strict=True)}


def _fractions_of_four(counts: list[float], numel: int) -> dict[str, float]:
    """:func:`_fractions_any` written out for four formats (the presets): a dict display
    costs a third of a comprehension, and it runs twice for every record at every read."""
    first, second, third, fourth = counts
    key_1, key_2, key_3, key_4 = _KEYS_OF_FOUR
    return {
        key_1: first / numel,
        key_2: second / numel,
        key_3: third / numel,
        key_4: fourth / numel,
    }


_KEYS_OF_FOUR = FORMAT_KEYS if _N_KEYS == 4 else ("",) * 4
_fractions = _fractions_of_four if _N_KEYS == 4 else _fractions_any


def stats_to_data(values: list[float], numel: int) -> _Data:
    """Turn one vector from :func:`tensor_stats` (as a list of floats) into a record."""
    if numel == 0:
        zeros = dict.fromkeys(FORMAT_KEYS, 0.0)
        return _Data(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, dict(zeros), dict(zeros))
    if len(values) != _N_STATS:
        raise ValueError(
            f"stats_to_data: expected {_N_STATS} values (see tensor_stats), got {len(values)}"
        )
    sum_abs, mean, var, abs_max, abs_min, nan_count, inf_count = values[:_N_FIELDS]
    if math.isnan(var):
        std = rms = var
    else:
        var = max(var, 0.0)
        std = math.sqrt(var)
        rms = math.sqrt(var + mean * mean)
    # Built without the frozen dataclass's __init__ (one object.__setattr__ per field), its
    # field dict at once: this runs for every tracked tensor at every read. Each record gets
    # fraction dicts of its own.
    data = object.__new__(_Data)
    object.__setattr__(
        data,
        "__dict__",
        {
            "mean_abs": sum_abs / numel,
            "abs_mean": abs(mean),
            "std": std,
            "abs_max": abs_max,
            "abs_min": abs_min,
            "rms": rms,
            "numel": numel,
            "underflow": _fractions(values[_N_FIELDS:_UNDERFLOW_END], numel),
            "overflow": _fractions(values[_UNDERFLOW_END:], numel),
            "nan_count": int(nan_count),
            "inf_count": int(inf_count),
        },
    )
    return data


_fast_module: list[Any] = []  # [the configured extension, or None] once looked for


def fast_stats(load: bool = False) -> Any:
    """The native statistics extension (:meth:`._native.NativeStats.extension`),
    configured for tracking's thresholds and records, or None where it is unavailable. Its
    ``summary(x)`` is ``(x.numel(), deferred_stats(x))`` for a non-empty CPU float32/bfloat16
    tensor without NaN or Inf, strided ones included (None for any other: the caller takes
    :func:`deferred_stats`), its ``to_data`` is :func:`stats_to_data`; the tests check both
    value for value. Only for ``UNITSCALE_STATS=auto`` (the callers check).

    The extension is looked for only once statistics of a CPU tensor were needed (or with
    ``load``): a model tracked on an accelerator alone, where the install built no
    extension, is not warned about it."""
    if _fast_module:
        return _fast_module[0]
    from ._native import _NATIVE_CANCELLATION, THRESHOLDS, _bits_of, native

    if not (load or native.loaded()):
        return None  # looked for again at the next call
    module = None
    if len(_UNDERFLOW_BELOW) <= THRESHOLDS and len(_OVERFLOW_ABOVE) <= THRESHOLDS:
        module = native.extension()
    if module is not None:
        under = tuple(_bits_of(bound, torch.float32) for bound in _UNDERFLOW_BELOW)
        over = tuple(_bits_of(bound, torch.float32) for bound in _OVERFLOW_ABOVE)
        module.configure(
            Tensor,
            torch.nn.Parameter,
            torch.float32,
            torch.bfloat16,
            under,
            over,
            native.thresholds(under, over)[2],  # the lowest overflow threshold
            _NATIVE_CANCELLATION,
            _Data,
            (*_Data.SCALAR_FIELDS, "underflow", "overflow", "nan_count", "inf_count"),
            FORMAT_KEYS,
            stats_to_data,
        )
    _fast_module.append(module)
    return module


@dataclass
class Metrics:
    """Scale statistics of one graph node: ``fwd`` of its value, ``bwd`` of its gradient.

    ``bwd`` is None until a backward pass reaches the node (and stays None where no
    gradient flows). Stored under ``node.meta["metrics"]`` by
    :func:`~unitscale.transforms.track_scales`.

    Which gradient ``bwd`` describes: for an activation, the gradient of the recorded call
    (with gradient accumulation, the last micro-batch's); for a trainable parameter,
    ``param.grad``, the gradient the optimiser sees, the same quantity in one process and
    under data parallelism: accumulated over the calls since the last ``zero_grad()`` and,
    under DDP or FSDP2, averaged over the ranks (taken when the recorded call's gradient has
    been added, or under DDP/FSDP2 when the graph is read). Statistics read inside DDP or
    FSDP2 are those of the global batch (:mod:`unitscale.tracking`).
    """

    Data: ClassVar[type[_Data]] = _Data

    fwd: _Data | None = None
    bwd: _Data | None = None
    #: Block-format metrics by direction (``{"fwd": {...}, "bwd": {...}}``), only where
    #: ``track_scales(..., block_formats=...)`` asked for them (see
    #: :mod:`unitscale.tracking.blocks`); None otherwise.
    blocks: dict[str, dict[str, float]] | None = None

    def __repr__(self) -> str:
        def short(d: _Data | None) -> str:
            return "None" if d is None else f"(mean_abs={d.mean_abs:.3g}, numel={d.numel})"

        return f"Metrics(fwd={short(self.fwd)}, bwd={short(self.bwd)})"
