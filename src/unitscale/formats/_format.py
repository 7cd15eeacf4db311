"""Number formats and quantisation: simulate FP8/FP16/BF16 (or any small float) in PyTorch.

An :class:`FPFormat` describes a binary floating-point format by its exponent and mantissa
widths, how its top exponent is used (:data:`SpecialValues`) and how values are rounded into
it. ``quantise(x)`` returns the nearest values of the format (or a random neighbour, for
stochastic rounding), still in ``x``'s dtype, so that low-precision arithmetic can be
simulated with ordinary tensors.

Presets: :data:`E4M3` (OCP FP8 E4M3, ``torch.float8_e4m3fn``), :data:`E5M2` (OCP FP8 E5M2,
``torch.float8_e5m2``), :data:`FP16` and :data:`BF16`. They round to nearest by default,
like every :class:`FPFormat` and a format named by its key (``"e4m3"``), as hardware casts
do: one default everywhere. Stochastic rounding (which keeps small updates unbiased) only
when asked for: ``dataclasses.replace(E4M3, rounding="stochastic")``.

Semantics, for every format and both roundings:

- ``rounding="nearest"`` is round-to-nearest, ties-to-even, bit-identical to PyTorch's casts
  (``x.to(torch.float8_e4m3fn).to(x.dtype)`` etc.) for every finite input within range,
  subnormals and signed zeros included;
- ``rounding="stochastic"`` returns one of the two representable neighbours of ``x``, the
  upper one with probability equal to ``x``'s distance from the lower one in units of their
  gap, so that ``E[quantise(x)] = x``. For float32 inputs that is exact in the format's
  normal range; in its subnormal range the decision is made on ``x`` rounded to float32 at
  the scale of the format's smallest normal, a bias below ``2**-(24 - mantissa_bits)`` of
  one step. Random bits come from torch's generator on ``x``'s device (or ``generator=``),
  so ``torch.manual_seed`` makes results reproducible. Under ``torch.compile`` they come
  from a counter-based hash of the element index keyed by seeds drawn from that generator
  (fused into the kernel, several times cheaper than inductor's own random numbers), so
  compiled and eager results differ draw by draw, not in distribution;
- with ``overflow="saturate"`` (the default), values beyond the largest finite value
  saturate to it, and so do ``±inf`` (a format used to simulate training should not turn an
  overflow into an infinity that poisons the whole step; ``tracking`` reports overflow
  separately); NaN stays NaN;
- with ``overflow="inf"`` (formats with ``special_values="ieee"`` only), a value whose
  rounding lands beyond the largest finite value becomes ``±inf``, as an IEEE cast does
  (for rounding to nearest: from the largest value plus half a step up, ties included,
  FP16's 65520; for stochastic rounding: where the random draw rounds up past the largest
  value), and ``±inf`` stays ``±inf``: bit-identical to ``x.to(torch.float16).float()``
  for FP16 and to ``torch.float8_e5m2``'s cast for E5M2, which is what dynamic loss scaling
  (``torch.amp.GradScaler``) needs to see an overflow;
- the result has ``x``'s dtype (float16, bfloat16, float32 or float64). Where the format's
  largest value is not representable in that dtype (FP16's 65504 in bfloat16), values
  saturate to the largest value representable in both (with ``overflow="inf"``: a rounded
  value beyond that one is ``±inf``, as casting it back to the dtype would make it);
- float64 inputs are rounded once, correctly. (PyTorch's casts from float64 round through
  float32, so they can differ from ours in rare double-rounding cases.)

Design constraints: everything is vectorised tensor arithmetic (integer bit manipulation on
the float32/float64 view, plus one float addition for the subnormal range) with no Python
loop over elements and no CPU-only op, so it runs on any device and under ``torch.compile``.
That addition assumes float32 subnormals are not flushed to zero (PyTorch's default; see
``torch.set_flush_denormal``).
For ``rounding="nearest"`` with a preset that has a native torch dtype, the eager path uses
that dtype's cast (exact, and fewer passes over memory) with saturation done on the narrow
result. Compiled code on a CPU calls the one-pass C kernels as custom ops
(:mod:`._ops`), whatever TorchDynamo makes of the format's numbers; elsewhere it takes the
bit-manipulation path, which inductor fuses into a single pass. See
``benchmarks/bench_formats.py`` for the costs relative to ``x.clone()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import torch
from torch import Tensor

from ..errors import UnitScaleError
from ._kernels import KernelFormat, _quantise, _QuantiseBackward, _QuantiseForward

__all__ = [
    # formats
    "BF16",
    "E4M3",
    "E5M2",
    "FP16",
    "PRESETS",
    "FPFormat",
    "FormatError",
    "Overflow",
    "Rounding",
    "SpecialValues",
]

Rounding = Literal["stochastic", "nearest"]
"""How :meth:`FPFormat.quantise` rounds: ``"stochastic"`` or ``"nearest"`` (ties to even)."""

Overflow = Literal["saturate", "inf"]
"""What :meth:`FPFormat.quantise` makes of a value beyond the format's largest finite value:
``"saturate"`` (that largest value, the default) or ``"inf"`` (``±inf``, as IEEE casts do;
formats with ``special_values="ieee"`` only)."""

SpecialValues = Literal["ieee", "nan_only", "none"]
"""How a format uses its top exponent.

- ``"ieee"``: reserved for ±inf and NaN, as in IEEE-754 (FP16, BF16, OCP FP8 E5M2);
- ``"nan_only"``: no infinities; the top exponent holds finite values except the all-ones
  mantissa, which is NaN (OCP FP8 E4M3, ``torch.float8_e4m3fn``);
- ``"none"``: no infinities and no NaN; every code is a finite value (OCP MX FP6/FP4).
"""

_ROUNDINGS: tuple[str, ...] = ("stochastic", "nearest")
_SPECIAL_VALUES: tuple[str, ...] = ("ieee", "nan_only", "none")
_OVERFLOWS: tuple[str, ...] = ("saturate", "inf")
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class FormatError(UnitScaleError, ValueError):
    """A number format was given impossible parameters, or quantise a tensor it cannot take."""


# (exponent_bits, mantissa_bits, min normal exponent) of the dtypes quantise accepts, used
# to find the largest value representable both in a format and in the input's dtype.
_DTYPE_LAYOUT: dict[torch.dtype, tuple[int, int]] = {
    torch.float16: (10, -14),
    torch.bfloat16: (7, -126),
    torch.float32: (23, -126),
    torch.float64: (52, -1022),
}


# The torch dtype holding exactly a format's values: (exponent, mantissa bits, special values).
_NATIVE_DTYPES: dict[tuple[int, int, str], torch.dtype] = {
    (4, 3, "nan_only"): torch.float8_e4m3fn,
    (5, 2, "ieee"): torch.float8_e5m2,
    (5, 10, "ieee"): torch.float16,
    (8, 7, "ieee"): torch.bfloat16,
}


def _floor_to_grid(value: float, mantissa_bits: int, min_normal_exponent: int) -> float:
    """Largest float with ``mantissa_bits`` and the given exponent floor that is <= value > 0."""
    _, exponent = math.frexp(value)  # value = m * 2**exponent, m in [0.5, 1)
    quantum = 2.0 ** (max(exponent - 1, min_normal_exponent) - mantissa_bits)
    return math.floor(value / quantum) * quantum


def _check_int(name: str, value: object, low: int, high: int, why: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise FormatError(
            f"unitscale.formats.FPFormat: argument {name!r}={value!r} must be an int "
            f"in {low}..{high} ({why})"
        )
    if not low <= value <= high:
        raise FormatError(
            f"unitscale.formats.FPFormat: argument {name!r}={value!r} is out of range; "
            f"use {low}..{high} ({why})"
        )
    return value


@dataclass(frozen=True, repr=False)
class FPFormat:
    """A binary floating-point format: 1 sign bit, ``exponent_bits``, ``mantissa_bits``.

    The exponent bias is ``2**(exponent_bits - 1) - 1`` and the smallest exponent field
    encodes subnormals, as in IEEE-754; ``special_values`` says how the top exponent is used
    (see :data:`SpecialValues`). Every value of a format is a float32 value, so quantisation
    is simulated exactly in float32 (or float64) arithmetic.

    Args:
        exponent_bits: width of the exponent field, 1..8.
        mantissa_bits: width of the mantissa (fraction) field, 0..23.
        rounding: ``"nearest"`` (the default: ties to even, as hardware casts) or
            ``"stochastic"``.
        special_values: ``"ieee"`` (default), ``"nan_only"`` or ``"none"``.
        overflow: ``"saturate"`` (default: beyond the largest finite value is that value)
            or ``"inf"`` (beyond it is ``±inf``, as an IEEE cast makes it: what dynamic loss
            scaling needs to detect an overflow); ``"inf"`` needs
            ``special_values="ieee"``, the only formats with infinities.

    Raises:
        FormatError: for bits out of range, an unknown ``rounding``, ``special_values`` or
            ``overflow``, ``overflow="inf"`` without infinities, or a format with no normal
            numbers or beyond float32's range.

    Example:
        >>> fmt = FPFormat(4, 3, rounding="nearest", special_values="nan_only")
        >>> fmt.bits, fmt.max_absolute_value, fmt.min_absolute_subnormal
        (8, 448.0, 0.001953125)
        >>> fmt.quantise(torch.tensor([0.3, 1000.0, -1e-5])).tolist()
        [0.3125, 448.0, -0.0]
        >>> half = FPFormat(5, 10, rounding="nearest", overflow="inf")  # a float16 cast
        >>> half.quantise(torch.tensor([65519.0, 65520.0, -1e6])).tolist()
        [65504.0, inf, -inf]
    """

    exponent_bits: int
    mantissa_bits: int
    rounding: Rounding = "nearest"
    special_values: SpecialValues = "ieee"
    overflow: Overflow = "saturate"
    # Derived in __post_init__ and kept out of the dataclass's fields (read through the
    # _max/_bounds properties): torch < 2.8's Dynamo rebuilds a dataclass argument of an
    # autograd Function by passing every field to __init__.

    def __post_init__(self) -> None:
        e = _check_int("exponent_bits", self.exponent_bits, 1, 8, "values must fit float32")
        m = _check_int("mantissa_bits", self.mantissa_bits, 0, 23, "values must fit float32")
        if self.rounding not in _ROUNDINGS:
            raise FormatError(
                f"unitscale.formats.FPFormat: argument 'rounding'={self.rounding!r} is not "
                f"supported; use one of {_ROUNDINGS}"
            )
        if self.special_values not in _SPECIAL_VALUES:
            raise FormatError(
                f"unitscale.formats.FPFormat: argument 'special_values'="
                f"{self.special_values!r} is not supported; use one of {_SPECIAL_VALUES}"
            )
        if self.overflow not in _OVERFLOWS:
            raise FormatError(
                f"unitscale.formats.FPFormat: argument 'overflow'={self.overflow!r} is not "
                f"supported; use one of {_OVERFLOWS}"
            )
        if self.overflow == "inf" and self.special_values != "ieee":
            raise FormatError(
                f"unitscale.formats.FPFormat: overflow='inf' needs infinities, which "
                f"special_values={self.special_values!r} has not; use special_values='ieee' "
                "or overflow='saturate'"
            )
        # The largest finite code: (exponent field, mantissa field).
        if self.special_values == "ieee":
            top_field, top_mantissa = 2**e - 2, 2**m - 1
        elif self.special_values == "nan_only":
            top_field, top_mantissa = 2**e - 1, 2**m - 2
            if top_mantissa < 0:  # no mantissa bits: the whole top exponent is NaN
                top_field, top_mantissa = 2**e - 2, 0
        else:
            top_field, top_mantissa = 2**e - 1, 2**m - 1
        if top_field < 1:
            raise FormatError(
                f"unitscale.formats.FPFormat: exponent_bits={e} with "
                f"special_values={self.special_values!r} leaves no normal numbers; use "
                "exponent_bits >= 2, or special_values='none'"
            )
        max_value = 2.0 ** (top_field - self._bias) * (1 + top_mantissa / 2**m)
        if max_value > _FLOAT32_MAX:
            raise FormatError(
                f"unitscale.formats.FPFormat: exponent_bits={e} with "
                f"special_values={self.special_values!r} has values beyond float32's range, "
                "which quantisation cannot simulate; use special_values='ieee' or fewer "
                "exponent bits"
            )
        bounds = {}
        for dtype, (dtype_mantissa, dtype_min_exponent) in _DTYPE_LAYOUT.items():
            bound = min(max_value, float(torch.finfo(dtype).max))
            bound = _floor_to_grid(bound, m, self._min_normal_exponent)
            bounds[dtype] = _floor_to_grid(bound, dtype_mantissa, dtype_min_exponent)
        object.__setattr__(self, "_derived", (max_value, bounds))
        kernel_format = KernelFormat(
            e,
            m,
            self.rounding,
            self.special_values,
            max_value,
            self._min_normal_exponent,
            self.torch_dtype,
            bounds,
            self.overflow,
        )
        object.__setattr__(self, "_kernel_format", kernel_format)

    @property
    def _max(self) -> float:
        """The largest finite value."""
        return self._derived[0]  # type: ignore[attr-defined]

    @property
    def _bounds(self) -> dict[torch.dtype, float]:
        """Saturation bound per dtype: the largest value of this format that dtype holds."""
        return self._derived[1]  # type: ignore[attr-defined]

    @property
    def _kernel(self) -> KernelFormat:
        """This format as the plain numbers the rounding kernels read."""
        return self._kernel_format  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        extra = "" if self.special_values == "ieee" else f", special_values={self.special_values!r}"
        if self.overflow != "saturate":
            extra += f", overflow={self.overflow!r}"
        return (
            f"FPFormat({self.exponent_bits}, {self.mantissa_bits}, "
            f"rounding={self.rounding!r}{extra})"
        )

    # -- properties -------------------------------------------------------------------------

    @property
    def _bias(self) -> int:
        return int(2 ** (self.exponent_bits - 1) - 1)

    @property
    def _min_normal_exponent(self) -> int:
        return 1 - self._bias

    @property
    def bits(self) -> int:
        """Total width in bits (sign, exponent and mantissa)."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def max_absolute_value(self) -> float:
        """Largest finite value (the saturation point with ``overflow="saturate"``)."""
        return self._max

    @property
    def min_absolute_normal(self) -> float:
        """Smallest positive normal value, ``2**(1 - bias)``."""
        return 2.0**self._min_normal_exponent

    @property
    def min_absolute_subnormal(self) -> float:
        """Smallest positive (subnormal) value, ``2**(1 - bias - mantissa_bits)``."""
        return 2.0 ** (self._min_normal_exponent - self.mantissa_bits)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype holding exactly this format's values, or None if there is none."""
        return _NATIVE_DTYPES.get((self.exponent_bits, self.mantissa_bits, self.special_values))

    # -- quantisation -----------------------------------------------------------------------

    def quantise(self, x: Tensor, *, generator: torch.Generator | None = None) -> Tensor:
        """Round ``x`` to this format, keeping its dtype (see the module docstring).

        No gradient flows through ``quantise`` (rounding is flat almost everywhere); use
        :meth:`quantise_fwd` or :meth:`quantise_bwd` for straight-through gradients.

        Args:
            x: a float16, bfloat16, float32 or float64 tensor, on any device.
            generator: random source for stochastic rounding (default: torch's global one
                on ``x``'s device). Ignored for ``rounding="nearest"``.

        Returns:
            A new tensor of ``x``'s dtype, shape and device holding values of this format.

        Raises:
            FormatError: if ``x`` is not a tensor of one of those dtypes.

        Example:
            >>> fmt = FPFormat(2, 1, rounding="nearest")
            >>> fmt.max_absolute_value
            3.0
            >>> fmt.quantise(torch.tensor([1.25, 1.75, 0.25, 9.0, float("nan")])).tolist()
            [1.0, 2.0, 0.0, 3.0, nan]
        """
        x = self._check_input(x, "quantise")
        with torch.no_grad():
            return _quantise(self._kernel, x.detach(), generator)

    def quantise_fwd(self, x: Tensor) -> Tensor:
        """Quantise ``x`` in the forward pass; pass its gradient through unchanged.

        Args:
            x: a floating-point tensor (see :meth:`quantise`).

        Returns:
            ``quantise(x)``, whose backward is the identity (straight-through estimator).

        Example:
            >>> x = torch.tensor([1.25, 2.5], requires_grad=True)
            >>> y = FPFormat(2, 1, rounding="nearest").quantise_fwd(x)  # values 1, 1.5, 2, 3
            >>> y.backward(torch.tensor([1.25, 2.5]))
            >>> y.tolist(), x.grad.tolist()  # ties go to even codes
            ([1.0, 2.0], [1.25, 2.5])
        """
        x = self._check_input(x, "quantise_fwd")
        return _QuantiseForward.apply(x, self._kernel)

    def quantise_bwd(self, x: Tensor) -> Tensor:
        """Leave ``x`` unchanged in the forward pass; quantise its gradient in the backward.

        Args:
            x: a floating-point tensor (see :meth:`quantise`).

        Returns:
            a copy of ``x`` (not a view, so it may be modified in place), whose backward
            rounds the incoming gradient to this format.

        Example:
            >>> x = torch.tensor([1.25, 2.5], requires_grad=True)
            >>> y = FPFormat(2, 1, rounding="nearest").quantise_bwd(x)
            >>> y.backward(torch.tensor([1.25, 2.5]))
            >>> y.tolist(), x.grad.tolist()
            ([1.25, 2.5], [1.0, 2.0])
        """
        x = self._check_input(x, "quantise_bwd")
        return _QuantiseBackward.apply(x, self._kernel)

    def _check_input(self, x: object, method: str) -> Tensor:
        if not isinstance(x, Tensor):
            raise FormatError(
                f"unitscale.formats.{self!r}.{method}: x must be a torch.Tensor, "
                f"got {type(x).__name__}"
            )
        if x.dtype not in _DTYPE_LAYOUT:
            raise FormatError(
                f"unitscale.formats.{self!r}.{method}: x has dtype {x.dtype}; quantise "
                "takes float16, bfloat16, float32 or float64 tensors (convert first)"
            )
        return x


# -- presets ---------------------------------------------------------------------------------

E4M3 = FPFormat(4, 3, special_values="nan_only")
"""OCP FP8 E4M3 (``torch.float8_e4m3fn``): max 448, min normal 2**-6, min subnormal 2**-9,
no infinities. Rounds to nearest (ties to even), as ``x.to(torch.float8_e4m3fn)`` does."""

E5M2 = FPFormat(5, 2)
"""OCP FP8 E5M2 (``torch.float8_e5m2``), IEEE-like: max 57344, min normal 2**-14, min
subnormal 2**-16. Rounds to nearest (ties to even)."""

FP16 = FPFormat(5, 10)
"""IEEE-754 half precision (``torch.float16``): max 65504. Rounds to nearest (ties to even)."""

BF16 = FPFormat(8, 7)
"""bfloat16 (``torch.bfloat16``): float32's range, 8 bits of precision. Rounds to nearest
(ties to even)."""

PRESETS: MappingProxyType[str, FPFormat] = MappingProxyType(
    {"e4m3": E4M3, "e5m2": E5M2, "fp16": FP16, "bf16": BF16}
)
"""The presets by key; the keys match ``unitscale.tracking.metrics.FORMAT_KEYS``."""
