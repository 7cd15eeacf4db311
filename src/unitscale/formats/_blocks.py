"""Block-scaled formats: OCP Microscaling (MXFP8, MXFP6, MXFP4) and NVIDIA's NVFP4.

A :class:`BlockFormat` stores a tensor as small floats (an :class:`FPFormat`, the
*element* format) in blocks of consecutive elements along one dimension, each block with a
scale of its own:

- **MX** (OCP Microscaling Formats v1.0): blocks of 32, one E8M0 scale per block (a power of
  two, ``2**-127`` to ``2**127``; the code ``0xFF`` is NaN). The scale comes from the block's
  largest magnitude ``amax``: with ``scale_mode="floor"`` (OCP v1.0 section 6.3 and torchao's
  default) it is ``2**(floor(log2(amax)) - emax)``, ``emax`` the exponent of the element
  format's largest power of two (E4M3: 8, E5M2: 15, E3M2: 4, E2M3: 2, E2M1: 2); elements
  beyond the element format's largest value saturate to it. torchao's other modes are
  options: ``"ceil"`` (``ceil`` instead of ``floor``: no saturation, more flushed to zero),
  ``"even"`` (``amax`` rounded to the element format's precision first) and ``"rceil"``
  (``2**ceil(log2(amax / max))``, cuBLAS's rule for MXFP8).
- **NVFP4**: blocks of 16 E2M1 elements, an E4M3 scale per block (``amax / 6`` rounded to
  E4M3) and, with ``tensor_scale=True`` (the default, as Transformer Engine's
  ``NVFP4BlockScaling`` and torchao's two-level scaling), one FP32 scale per tensor,
  ``amax(tensor) / (448 * 6)``, by which the block scales are divided before they are
  rounded, so that they use E4M3's range.

``quantise(x, dim=-1)`` returns the values such a tensor holds (each element rounded at its
block's scale, times the scale), in ``x``'s dtype, so that a block-scaled GEMM's operands can
be simulated with ordinary tensors. The arithmetic is torchao 0.18's
(``torchao.prototype.mx_formats``: ``MXTensor.to_mx`` then ``dequantize``, and
``NVFP4Tensor.to_nvfp4`` with ``per_tensor_scale=per_tensor_amax_to_scale(amax)`` then
``dequantize``), bit for bit, tested on edge cases and random tensors. Special values:

- a block holding NaN is NaN throughout (its E8M0 scale is the NaN code); ``±inf`` gives its
  MX block the largest scale the element format's range needs, so ``±inf`` stays ``±inf``
  (the element saturates, times the scale, overflows float32) and that block's finite
  elements are flushed to zero or near it;
- an all-zero block stays zero (E8M0 has no zero: its scale is the smallest, ``2**-127``);
- NVFP4 with a tensor scale is NaN throughout where the tensor holds a NaN or an infinity
  (the tensor scale is not finite), as torchao's. Where the tensor scale
  ``amax / 2688`` is below float32's smallest normal (amax below ``2688 * 2**-126``, about
  ``2**-114.6``, an all-zero tensor included) the block scales alone are used (a tensor
  scale of 1: such a tensor flushes to zero, as its E4M3 block scales cannot go below
  ``2**-6``); there torchao's reciprocal of a subnormal or zero tensor scale overflows and
  its round trip returns NaN or values unrelated to the input.

One deliberate difference from torchao: in an MX block whose scale is the smallest E8M0
value, ``2**-127`` (blocks whose amax is below about ``2**-119`` for MXFP8), torchao casts
with another scale than it dequantises with (``2**-126`` with ``"floor"``, ``1`` with
``"rceil"``), so its round trip halves (or flushes) such values; here the block's scale is
used both ways, as OCP defines. The tests state the difference.

The blocked dimension must be a multiple of the block size: there is no padding (a
:class:`FormatError` names the shape and the block size). Inputs of dtype float16,
bfloat16, float32 or float64 are computed in float32 (float64 rounded to float32 first) and
returned in their own dtype.

Design constraints: vectorised tensor arithmetic on the blocked view (no Python loop over
blocks, no CPU-only op); the element rounding is :meth:`FPFormat.quantise`, so stochastic
rounding of the elements (``rounding="stochastic"``, for gradients) is the element format's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import torch
from torch import Tensor

from ._format import FormatError, FPFormat, Rounding

__all__ = [
    "BLOCK_PRESETS",
    "BlockFormat",
    "BlockStats",
    "ScaleMode",
]

ScaleMode = Literal["floor", "ceil", "even", "rceil"]
"""How an MX block's E8M0 scale is chosen from its amax (see :class:`BlockFormat`)."""

_SCALE_MODES: tuple[str, ...] = ("floor", "ceil", "even", "rceil")
_SCALE_FORMATS: tuple[str, ...] = ("e8m0", "e4m3")
_E8M0_MIN, _E8M0_MAX = -127, 127  # exponents of E8M0's finite values
_E4M3 = FPFormat(4, 3, special_values="nan_only")
_E4M3_TINY = 2.0**-6  # torch.finfo(torch.float8_e4m3fn).tiny: NVFP4's smallest block scale
_FLOAT32_TINY = 2.0**-126  # float32's smallest normal
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class BlockStats:
    """What a block-scaled rounding of one tensor lost (:meth:`BlockFormat.block_stats`).

    Attributes:
        flushed: fraction of the nonzero elements that round to zero inside their block.
        scale_clipped: fraction of the blocks whose scale is clipped by the scale format's
            range (E8M0: the exponent the rule asks for is beyond ``-127..127``; E4M3: the
            block scale is below E4M3's smallest normal or above 448).
        error: ``||rounded - x|| / ||x||`` over the finite elements (0 for a zero tensor).
    """

    flushed: float
    scale_clipped: float
    error: float


class _Where:
    """``unitscale.formats.<format>.<method>``, for errors: formatted only when one is raised."""

    def __init__(self, fmt: BlockFormat, method: str) -> None:
        self.fmt, self.method = fmt, method

    def __str__(self) -> str:
        return f"unitscale.formats.{self.fmt!r}.{self.method}"


@dataclass(frozen=True)
class BlockFormat:
    """A block-scaled number format: ``element`` values in blocks of ``block_size`` along one
    dimension, each block with a scale in ``scale_format`` (see the module docstring).

    Presets by name in :data:`BLOCK_PRESETS` (and :func:`~unitscale.formats.get_format`):
    ``"mxfp8_e4m3"``, ``"mxfp8_e5m2"``, ``"mxfp6_e3m2"``, ``"mxfp6_e2m3"``,
    ``"mxfp4_e2m1"`` and ``"nvfp4"``.

    Args:
        element: the element format (its ``rounding`` is the elements' rounding).
        block_size: elements per block (MX: 32, NVFP4: 16).
        scale_format: ``"e8m0"`` (MX: a power of two per block) or ``"e4m3"`` (NVFP4).
        scale_mode: for ``"e8m0"``: ``"floor"`` (default, OCP v1.0), ``"ceil"``, ``"even"``
            or ``"rceil"``, as torchao's ``ScaleCalculationMode``.
        tensor_scale: for ``"e4m3"``: divide the block scales by one FP32 scale per tensor,
            ``amax / (448 * element max)`` (NVFP4's two-level scaling; default True).

    Raises:
        FormatError: an element that is not an ``FPFormat``, a block size below 1, an unknown
            scale format or mode, or a mode or tensor scale the scale format does not take.

    Example:
        >>> from unitscale.formats import get_format
        >>> mx = get_format("mxfp4_e2m1")
        >>> x = torch.tensor([[0.3, 5.0, -1.1, 0.0] * 8])  # one block: amax 5 -> scale 1
        >>> mx.quantise(x)[0, :4].tolist()  # E2M1 values 0, 0.5, 1, 1.5, 2, 3, 4, 6
        [0.5, 4.0, -1.0, 0.0]
    """

    element: FPFormat
    block_size: int = 32
    scale_format: Literal["e8m0", "e4m3"] = "e8m0"
    scale_mode: ScaleMode = "floor"
    tensor_scale: bool = False

    def __post_init__(self) -> None:
        where = "unitscale.formats.BlockFormat"
        if not isinstance(self.element, FPFormat):
            raise FormatError(f"{where}: element={self.element!r} is not an FPFormat")
        size = self.block_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise FormatError(f"{where}: block_size={size!r} must be a positive int")
        if self.scale_format not in _SCALE_FORMATS:
            raise FormatError(
                f"{where}: scale_format={self.scale_format!r} is not supported; use one of "
                f"{_SCALE_FORMATS}"
            )
        if self.scale_mode not in _SCALE_MODES:
            raise FormatError(
                f"{where}: scale_mode={self.scale_mode!r} is not supported; use one of "
                f"{_SCALE_MODES}"
            )
        if self.scale_format == "e4m3" and self.scale_mode != "floor":
            raise FormatError(
                f"{where}: scale_mode={self.scale_mode!r} applies to E8M0 scales only; an "
                "E4M3 block scale is amax / element max rounded to nearest"
            )
        if self.scale_format == "e8m0" and self.tensor_scale:
            raise FormatError(
                f"{where}: tensor_scale=True applies to E4M3 block scales (NVFP4); MX formats "
                "have none"
            )

    def __repr__(self) -> str:
        for name, preset in BLOCK_PRESETS.items():
            if preset == self:
                return f"BlockFormat({name!r})"
            if preset.with_rounding(self.rounding) == self:
                return f"BlockFormat({name!r}, rounding={self.rounding!r})"
        return (
            f"BlockFormat(element={self.element!r}, block_size={self.block_size}, "
            f"scale_format={self.scale_format!r}, scale_mode={self.scale_mode!r}, "
            f"tensor_scale={self.tensor_scale})"
        )

    @property
    def rounding(self) -> Rounding:
        """The elements' rounding (``"nearest"`` or ``"stochastic"``)."""
        return self.element.rounding

    @property
    def bits(self) -> float:
        """Bits per element with the block scale's share, e.g. 8.25 for MXFP8, 4.5 for NVFP4."""
        return self.element.bits + 8 / self.block_size

    @property
    def max_absolute_value(self) -> float:
        """The largest finite value a block can hold (its element's max at the largest
        block scale that stays finite in float32, for E8M0)."""
        if self.scale_format == "e4m3":
            return self.element.max_absolute_value * _E4M3.max_absolute_value
        return min(self.element.max_absolute_value * 2.0**_E8M0_MAX, float(torch.finfo().max))

    def with_rounding(self, rounding: Rounding) -> BlockFormat:
        """This format with its elements rounded ``rounding`` (e.g. ``"stochastic"``)."""
        element = dataclasses.replace(self.element, rounding=rounding)
        return dataclasses.replace(self, element=element)

    # -- quantisation -----------------------------------------------------------------------

    def quantise(
        self, x: Tensor, dim: int = -1, *, generator: torch.Generator | None = None
    ) -> Tensor:
        """Round ``x`` to this format with blocks along ``dim``, keeping its dtype and shape.

        Args:
            x: a float16, bfloat16, float32 or float64 tensor whose size along ``dim`` is a
                multiple of :attr:`block_size`.
            dim: the blocked dimension (a GEMM operand's reduction dimension).
            generator: random source for stochastically rounded elements.

        Returns:
            A new tensor: each element rounded at its block's scale, times that scale.

        Raises:
            FormatError: ``x`` is not such a tensor, or ``dim`` is out of range or not a
                multiple of the block size (there is no padding).
        """
        with torch.no_grad():
            blocks, restore = self._blocks(x, dim, "quantise")
            rounded, _ = self._round_blocks(blocks, generator)
            return restore(rounded)

    def block_stats(self, x: Tensor, dim: int = -1) -> BlockStats:
        """What rounding ``x`` (blocks along ``dim``) loses: see :class:`BlockStats`.

        Example:
            >>> from unitscale.formats import get_format
            >>> x = torch.tensor([[1000.0] + [1e-3] * 31])  # E2M1 flushes the small ones
            >>> get_format("mxfp4_e2m1").block_stats(x).flushed
            0.96875
        """
        with torch.no_grad():
            blocks, _ = self._blocks(x, dim, "block_stats")
            rounded, clipped = self._round_blocks(blocks, None)
            finite = blocks.isfinite()
            flushed = ((rounded == 0) & (blocks != 0) & finite).sum()
            nonzero = ((blocks != 0) & finite).sum().clamp(min=1)
            # in float64: float32 squares of values near its range ends would under/overflow
            wide, rounded_wide = blocks.double(), rounded.double()
            x0 = torch.where(finite, wide, 0.0)
            diff = torch.where(finite, rounded_wide - wide, 0.0)
            norm = x0.norm()
            error = torch.where(norm > 0, diff.norm() / norm.clamp(min=1e-300), 0.0)
            n_blocks = max(blocks.numel() // self.block_size, 1)
            return BlockStats(
                flushed=float(flushed / nonzero),
                scale_clipped=float(clipped.sum()) / n_blocks,
                error=float(error),
            )

    def _blocks(
        self, x: object, dim: int, method: str
    ) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        """``x`` in float32 as ``(..., blocks, block_size)`` with ``dim`` blocked last, and
        the function that puts a result of that shape back into ``x``'s shape and dtype."""
        # Only where it raises: TorchDynamo 2.8 cannot trace repr() of a frozen dataclass.
        where = _Where(self, method)
        if not isinstance(x, Tensor):
            raise FormatError(f"{where}: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _FLOAT_DTYPES:
            raise FormatError(
                f"{where}: x has dtype {x.dtype}; quantise takes float16, bfloat16, float32 "
                "or float64 tensors (convert first)"
            )
        if x.dim() == 0 or not -x.dim() <= dim < x.dim():
            raise FormatError(
                f"{where}: dim={dim} is out of range for a tensor of shape {tuple(x.shape)}"
            )
        size = x.shape[dim]
        if size % self.block_size:
            raise FormatError(
                f"{where}: x has shape {tuple(x.shape)}, whose dimension {dim} ({size}) is "
                f"not a multiple of the block size {self.block_size}; block-scaled formats "
                "block a GEMM's reduction dimension whole (no padding): pad it, or leave "
                "this op out"
            )
        moved = x.detach().movedim(dim, -1).to(torch.float32)
        shape = moved.shape
        blocks = moved.reshape(*shape[:-1], size // self.block_size, self.block_size)
        dtype = x.dtype

        def restore(y: Tensor) -> Tensor:
            return y.reshape(shape).movedim(-1, dim).to(dtype).contiguous()

        return blocks, restore

    def _round_blocks(
        self, blocks: Tensor, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        """The rounding of float32 ``blocks`` and, per block, whether its scale was clipped."""
        amax = blocks.abs().amax(dim=-1, keepdim=True)  # NaN where the block holds one
        if self.scale_format == "e4m3":
            return self._round_nvfp4(blocks, amax, generator)
        return self._round_mx(blocks, amax, generator)

    def _round_mx(
        self, blocks: Tensor, amax: Tensor, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        exponent, clipped = _e8m0_exponent(amax, self.element, self.scale_mode)
        scale = _power_of_two(exponent)
        elements = self.element.quantise(blocks / scale, generator=generator)
        out = elements * scale
        return torch.where(amax.isnan(), math.nan, out), clipped.squeeze(-1)

    def _round_nvfp4(
        self, blocks: Tensor, amax: Tensor, generator: torch.Generator | None
    ) -> tuple[Tensor, Tensor]:
        # The operations and their order are torchao's nvfp4_quantize (and the MSLK kernel it
        # matches): multiplications by reciprocals, not divisions, so the roundings agree.
        element_max = self.element.max_absolute_value
        block_scale = amax / element_max
        if self.tensor_scale:
            tensor_amax = blocks.abs().amax()
            tensor_scale = tensor_amax / (_E4M3.max_absolute_value * element_max)
            # A subnormal (or zero) tensor scale: its reciprocal overflows float32 or is
            # inexact; the block scales alone then (see the module docstring).
            tensor_scale = torch.where(tensor_scale < _FLOAT32_TINY, 1.0, tensor_scale)
            wanted = block_scale / tensor_scale
        else:
            tensor_scale = None
            wanted = block_scale
        scale8 = _E4M3.quantise(wanted.clamp(_E4M3_TINY, _E4M3.max_absolute_value))
        clipped = (wanted < _E4M3_TINY) & (amax > 0) | (wanted > _E4M3.max_absolute_value)
        if tensor_scale is None:
            scaled = blocks * (1.0 / scale8)
            dequant = scale8
        else:
            scaled = blocks * ((1.0 / tensor_scale) / scale8)
            dequant = tensor_scale * scale8
        elements = self.element.quantise(
            scaled.clamp(-element_max, element_max), generator=generator
        )
        return elements * dequant, clipped.squeeze(-1)


def _e8m0_exponent(amax: Tensor, element: FPFormat, mode: str) -> tuple[Tensor, Tensor]:
    """Per block: the unbiased exponent of the E8M0 scale (int32, 128 for a NaN block) that
    ``mode`` gives for ``amax`` (float32), as torchao's ``to_mx``; and whether the rule asked
    for an exponent beyond E8M0's range (clipped)."""
    _, top = math.frexp(element.max_absolute_value)
    emax = top - 1  # exponent of the element format's largest power of two
    if mode == "rceil":
        descale = amax / element.max_absolute_value
        mantissa, exp2 = torch.frexp(descale)  # descale = m * 2**e, m in [0.5, 1)
        wanted = torch.where(mantissa == 0.5, exp2 - 1, exp2).to(torch.int32)
        wanted = torch.where(descale == 0, _E8M0_MIN - 1, wanted)
        wanted = torch.where(descale.isinf(), _E8M0_MAX, wanted)
    else:
        bits = amax.view(torch.int32)
        if mode == "even":
            drop = 23 - element.mantissa_bits
            bits = (bits + (1 << (drop - 1))) & ~((1 << 23) - 1)
        field = (bits >> 23) & 0xFF
        unbiased = field - 127
        if mode == "ceil":
            unbiased = unbiased + ((bits & 0x7FFFFF) > 0).to(torch.int32)
        wanted = unbiased - emax
    exponent = wanted.clamp(_E8M0_MIN, _E8M0_MAX + 1)
    clipped = ((wanted < _E8M0_MIN) & (amax > 0)) | ((wanted > _E8M0_MAX) & amax.isfinite())
    return torch.where(amax.isnan(), _E8M0_MAX + 1, exponent), clipped


def _power_of_two(exponent: Tensor) -> Tensor:
    """``2.0**exponent`` in float32 for int32 exponents in -127..128 (128: NaN, E8M0's NaN
    code), built from the bits (``2**-127`` is a float32 subnormal)."""
    normal = ((exponent + 127).clamp(min=0) << 23).view(torch.float32)
    scale = torch.where(exponent == _E8M0_MIN, 2.0**_E8M0_MIN, normal)
    return torch.where(exponent > _E8M0_MAX, math.nan, scale)


def _mx(element: FPFormat) -> BlockFormat:
    return BlockFormat(element, 32, "e8m0")


BLOCK_PRESETS: MappingProxyType[str, BlockFormat] = MappingProxyType(
    {
        "mxfp8_e4m3": _mx(FPFormat(4, 3, special_values="nan_only")),
        "mxfp8_e5m2": _mx(FPFormat(5, 2)),
        "mxfp6_e3m2": _mx(FPFormat(3, 2, special_values="none")),
        "mxfp6_e2m3": _mx(FPFormat(2, 3, special_values="none")),
        "mxfp4_e2m1": _mx(FPFormat(2, 1, special_values="none")),
        "nvfp4": BlockFormat(FPFormat(2, 1, special_values="none"), 16, "e4m3", tensor_scale=True),
    }
)
"""The block-scaled presets by name, each rounding its elements to nearest. OCP MX
(blocks of 32, E8M0 scales, ``scale_mode="floor"``) with E4M3, E5M2, E3M2, E2M3 and E2M1
elements, and NVFP4 (blocks of 16 E2M1, E4M3 block scales, an FP32 tensor scale)."""
