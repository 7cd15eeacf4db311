"""Scale statistics of a tensor: the records that scale tracking stores on graph nodes.

Design constraints (this is the hot path of tracking):

- statistics are computed on the tensor's own device, under ``no_grad``, into one small
  float64 vector per tensor (:func:`tensor_stats`); nothing is copied to the host until the
  whole graph is read, so tracking costs no host-device synchronisation per op;
- the input is never cloned or modified, so tracking cannot change the numerics;
- empty tensors, NaN and Inf give well-defined values, never an exception: statistics follow
  IEEE arithmetic over all elements (a NaN makes ``std`` NaN, an Inf makes ``abs_max`` Inf),
  an empty tensor gives zeros, and ``nan_count``/``inf_count`` say what happened.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch
from torch import Tensor

__all__ = ["FORMAT_KEYS", "FORMAT_RANGES", "Metrics", "stats_to_data", "tensor_stats"]

#: ``key -> (smallest positive subnormal, largest finite value)`` of the formats whose
#: under/overflow tracking reports.
FORMAT_RANGES: dict[str, tuple[float, float]] = {
    "e4m3": (2.0**-9, 448.0),
    "e5m2": (2.0**-16, 57344.0),
    "fp16": (2.0**-24, 65504.0),
    "bf16": (2.0**-133, float(torch.finfo(torch.bfloat16).max)),
}
FORMAT_KEYS: tuple[str, ...] = tuple(FORMAT_RANGES)

# Interval boundaries for one bucketize pass. A non-zero value underflows in a format when
# it rounds to zero under round-to-nearest-even, i.e. |x| <= min_subnormal / 2; it
# overflows when |x| > max. The boundaries are sorted so that a single bucketize + bincount
# gives every count exactly.
_UNDER = sorted((rng[0] / 2, key) for key, rng in FORMAT_RANGES.items())
_OVER = sorted((rng[1], key) for key, rng in FORMAT_RANGES.items())
_BOUNDARIES = [0.0] + [b for b, _ in _UNDER] + [b for b, _ in _OVER]
_N_BUCKETS = len(_BOUNDARIES) + 1
# Layout of the vector produced by tensor_stats.
_FIELDS = ("numel", "sum_abs", "mean", "var", "abs_max", "abs_min", "nan_count", "inf_count")
_N_STATS = len(_FIELDS) + _N_BUCKETS

_boundary_cache: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _boundaries(device: torch.device, dtype: torch.dtype) -> Tensor:
    key = (device, dtype)
    b = _boundary_cache.get(key)
    if b is None:
        b = torch.tensor(_BOUNDARIES, dtype=torch.float64).to(device=device)
        _boundary_cache[key] = b
    return b


@torch.no_grad()
def tensor_stats(x: Tensor) -> Tensor:
    """Compute the raw statistics of ``x`` as one float64 vector on ``x``'s device.

    No host synchronisation happens here; convert the result with :func:`stats_to_data`
    (ideally for many tensors at once, after ``torch.stack``).

    Example:
        >>> v = tensor_stats(torch.tensor([1.0, -3.0]))
        >>> stats_to_data(v.tolist()).mean_abs
        2.0
    """
    x = x.detach()
    device = x.device
    numel = x.numel()
    if numel == 0:
        out = torch.zeros(_N_STATS, dtype=torch.float64, device=device)
        return out
    a = x.abs()
    if not a.is_contiguous():  # bucketize needs contiguous input (it would copy and warn)
        a = a.contiguous()
    var, mean = torch.var_mean(x, correction=0)
    amin, amax = torch.aminmax(a)
    head = torch.stack(
        [
            a.sum(dtype=torch.float32).double(),
            mean.double(),
            var.double(),
            amax.double(),
            amin.double(),
            torch.isnan(x).sum().double(),
            torch.isinf(x).sum().double(),
        ]
    )
    # right=True: a value equal to a boundary goes to the bucket above it, so bucket i holds
    # boundaries[i-1] <= a < boundaries[i]... we want "<= under" in the lower bucket, so
    # use right=False: bucket i holds boundaries[i-1] < a <= boundaries[i].
    buckets = torch.bucketize(a, _boundaries(device, torch.float64), right=False)
    counts = torch.bincount(buckets.flatten(), minlength=_N_BUCKETS)[:_N_BUCKETS].double()
    return torch.cat(
        [torch.full((1,), float(numel), dtype=torch.float64, device=device), head, counts]
    )


@dataclass(frozen=True)
class _Data:
    """Scale statistics of one tensor (forward value or gradient)."""

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


def stats_to_data(values: list[float]) -> _Data:
    """Turn one vector from :func:`tensor_stats` (as a list of floats) into a record."""
    raw = dict(zip(_FIELDS, values[: len(_FIELDS)], strict=True))
    counts = values[len(_FIELDS) :]
    numel = int(raw["numel"])
    if numel == 0:
        zeros = dict.fromkeys(FORMAT_KEYS, 0.0)
        return _Data(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, dict(zeros), dict(zeros))
    mean, var = raw["mean"], raw["var"]
    # Bucket i (by bucketize, right=False) holds boundaries[i-1] < |x| <= boundaries[i].
    # Bucket 0 is |x| == 0 (or -0); NaN lands in the last bucket and is excluded below.
    nonzero_cum = 0.0
    underflow: dict[str, float] = {}
    overflow: dict[str, float] = {}
    n_under = len(_UNDER)
    for i, (_, key) in enumerate(_UNDER):
        nonzero_cum += counts[1 + i]
        underflow[key] = nonzero_cum / numel
    above = 0.0
    nan = raw["nan_count"]
    # Buckets after the last "over" boundary hold |x| > that max (and NaN); walk down.
    for j in range(len(_OVER) - 1, -1, -1):
        above += counts[1 + n_under + j + 1]
        key = _OVER[j][1]
        overflow[key] = max(above - nan, 0.0) / numel
    return _Data(
        mean_abs=raw["sum_abs"] / numel,
        abs_mean=abs(mean),
        std=math.sqrt(var) if var == var and var >= 0 else float("nan"),
        abs_max=raw["abs_max"],
        abs_min=raw["abs_min"],
        rms=math.sqrt(var + mean * mean) if var == var else float("nan"),
        numel=numel,
        underflow={k: underflow[k] for k in FORMAT_KEYS},
        overflow={k: overflow[k] for k in FORMAT_KEYS},
        nan_count=int(nan),
        inf_count=int(raw["inf_count"]),
    )


@dataclass
class Metrics:
    """Scale statistics of one graph node: ``fwd`` of its value, ``bwd`` of its gradient.

    ``bwd`` is None until a backward pass reaches the node (and stays None where no
    gradient flows). Stored under ``node.meta["metrics"]`` by :func:`track_scales`.
    """

    Data: ClassVar[type[_Data]] = _Data

    fwd: _Data | None = None
    bwd: _Data | None = None

    def __repr__(self) -> str:
        def short(d: _Data | None) -> str:
            return "None" if d is None else f"(mean_abs={d.mean_abs:.3g}, numel={d.numel})"

        return f"Metrics(fwd={short(self.fwd)}, bwd={short(self.bwd)})"
