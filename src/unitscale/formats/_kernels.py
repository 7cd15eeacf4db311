"""Rounding kernels behind :meth:`FPFormat.quantise`: native casts where PyTorch has the
format, bit manipulation otherwise, and a hashed random-bits generator for stochastic rounding.

Design constraints: the kernels read only plain numbers (:class:`KernelFormat`, which
:class:`~unitscale.formats.FPFormat` builds; this module never imports it); they never
allocate more than a few buffers the size of the input, and they compile (no data-dependent
Python control flow).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._C import _functorch

from . import _ops
from ._native import rounding


class KernelFormat(NamedTuple):
    """What the kernels need to know of a format, as plain numbers (built by ``FPFormat``)."""

    exponent_bits: int
    mantissa_bits: int
    rounding: str  # "nearest" or "stochastic"
    special_values: str  # "ieee", "nan_only" or "none"
    max_absolute_value: float
    min_normal_exponent: int
    torch_dtype: torch.dtype | None
    bounds: dict[torch.dtype, float]  # per input dtype: the largest value it holds
    overflow: str = "saturate"  # "saturate" or "inf"


class _Work(NamedTuple):
    """The float dtype a quantisation is computed in, and its layout."""

    float_dtype: torch.dtype
    int_dtype: torch.dtype
    mantissa_bits: int
    min_normal_exponent: int


_WORK32 = _Work(torch.float32, torch.int32, 23, -126)
_WORK64 = _Work(torch.float64, torch.int64, 52, -1022)


# Both Functions work under torch.func's reverse mode (grad, vmap(grad), jacrev):
# ``setup_context``, and a vmap rule (rounding is elementwise: the batched tensor is rounded
# as one, its batch dimension where it was, so stochastic rounding draws independent bits for
# every batch element, as it does for every element). No ``jvp``: TorchDynamo cannot trace a
# Function that has one, and compiled rounding matters more than forward mode.


class _QuantiseForward(torch.autograd.Function):
    """``y = fmt.quantise(x)``; ``grad_x = grad_y``."""

    @staticmethod
    def forward(x: Tensor, fmt: KernelFormat) -> Tensor:
        return _quantise(fmt, x, None)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, fmt: KernelFormat) -> Any:
        return _QuantiseForward.apply(x, fmt), in_dims[0]


class _QuantiseBackward(torch.autograd.Function):
    """``y = x``; ``grad_x = fmt.quantise(grad_y)``."""

    @staticmethod
    def forward(x: Tensor, fmt: KernelFormat) -> Tensor:
        # A copy, not a view: the caller may modify the result in place (``y += x``), which
        # autograd forbids on a view returned by a custom Function.
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        ctx.fmt = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        if not torch.compiler.is_compiling() and _functorch.is_functorch_wrapped_tensor(grad):
            # Under torch.func (vmap: jacrev, per-sample gradients): round the batch as one
            # through quantise_fwd's vmap rule rather than op by op on the batched tensor.
            return _QuantiseForward.apply(grad, ctx.fmt), None
        return _quantise(ctx.fmt, grad, None), None

    @staticmethod
    def vmap(info: Any, in_dims: tuple[Any, ...], x: Tensor, fmt: KernelFormat) -> Any:
        return _QuantiseBackward.apply(x, fmt), in_dims[0]


def _quantise(
    fmt: KernelFormat,
    x: Tensor,
    generator: torch.Generator | None,
    allow_native: bool = True,
    allow_c: bool = True,
) -> Tensor:
    """``fmt``'s rounding of ``x``. ``allow_native``: torch's own casts where it has the
    format; ``allow_c``: the C kernel for contiguous float32 CPU tensors (both bit for bit
    the same as the bit-manipulation path, which is what runs without them).

    With ``fmt.overflow == "inf"`` every path rounds without a bound (the format's grid goes
    on above its largest value with the same mantissa width, so a value rounds to the largest
    value or beyond it exactly as an IEEE cast decides), then :func:`_overflow_to_inf` turns
    what landed beyond it into ``±inf``: one cheap pass on the result, and the saturating
    paths stay as they were."""
    bound = fmt.bounds[x.dtype]
    if fmt.overflow == "inf":
        rounded = _round(fmt, x, generator, math.inf, allow_native, allow_c)
        if rounded.dtype == torch.float32 and rounded is not x:
            return _float32_overflow_to_inf(rounded, fmt.max_absolute_value)
        return _overflow_to_inf(rounded, bound)
    return _round(fmt, x, generator, bound, allow_native, allow_c)


def _overflow_to_inf(y: Tensor, bound: float) -> Tensor:
    """``y`` with every value beyond ``±bound`` (the largest value of the format that ``y``'s
    dtype holds, so the comparison is exact) replaced by ``±inf``; NaN stays NaN.

    A fresh tensor (``y`` may be the caller's input, e.g. a float16 tensor rounded to FP16).
    """
    return torch.where(y.abs() > bound, y * math.inf, y)


def _float32_overflow_to_inf(y: Tensor, max_value: float) -> Tensor:
    """:func:`_overflow_to_inf` of a fresh float32 tensor of values of an IEEE format (whose
    largest value ``max_value`` is ``(2 - 2**-m) * 2**emax``, the next value of its grid
    ``2**(emax + 1)``), in place, in two multiplications instead of a comparison and a select
    (several times cheaper in eager mode).

    Scaling by ``2**(127 - emax)`` maps ``max_value`` to float32's largest value or below and
    ``2**(emax + 1)`` and beyond to ``inf``; scaling back is exact for everything else (both
    are powers of two and no value leaves float32's range on the way back). NaN stays NaN.
    """
    _, exponent = math.frexp(max_value)  # max_value = f * 2**exponent, f in [0.5, 1)
    factor = 2.0 ** (128 - exponent)  # 2**(127 - emax), at most 2**126
    return y.mul_(factor).div_(factor)


def _round(
    fmt: KernelFormat,
    x: Tensor,
    generator: torch.Generator | None,
    bound: float,
    allow_native: bool,
    allow_c: bool,
) -> Tensor:
    """``fmt``'s rounding of ``x``, saturating at ``±bound`` (``math.inf``: not at all)."""
    if allow_c and torch.compiler.is_compiling():
        compiled = _native_op(fmt, x, bound, generator)
        if compiled is not None:
            return compiled
    if fmt.rounding == "nearest":
        if allow_c and _c_nearest_applies(fmt, x) and rounding.available():
            # No exception is caught here: whether the kernel applies is decided above, so
            # an error from it is a bug to surface, not a reason to fall back.
            return rounding.nearest(x, 23 - fmt.mantissa_bits, bound, fmt.min_normal_exponent)
        native = fmt.torch_dtype
        if (
            allow_native
            and native is not None
            and x.dtype != torch.float64  # torch's float64 casts round twice, via float32
            and x.device.type in ("cpu", "cuda")
            and not torch.compiler.is_compiling()
        ):
            return _nearest_native(x, fmt, native, bound)
        work = _WORK64 if x.dtype == torch.float64 else _WORK32
        return _nearest_bits(x, fmt, work, bound).to(x.dtype)
    # Stochastic rounding draws (work mantissa - format mantissa) random bits: float32 has
    # none to spare for a 23-bit mantissa with subnormals of its own, so use float64.
    wide = x.dtype == torch.float64 or (fmt.mantissa_bits == 23 and fmt.exponent_bits < 8)
    drop = 23 - fmt.mantissa_bits
    if allow_c and not wide and drop > 0 and _c_kernel_takes(x) and rounding.available():
        # Any layout and 16-bit inputs too: the rounding depends on the values and their
        # logical order only, so a copy in float32 rounds the same.
        x32 = x.to(torch.float32).contiguous()
        seeds = _draw_seeds(x.device, generator)
        return rounding.stochastic(x32, drop, bound, fmt.min_normal_exponent, seeds).to(x.dtype)
    return _stochastic_bits(x, fmt, _WORK64 if wide else _WORK32, bound, generator)


def _native_op(
    fmt: KernelFormat, x: Tensor, bound: float, generator: torch.Generator | None
) -> Tensor | None:
    """While compiling: the C kernel's rounding of ``x`` as a custom op (see :mod:`._ops`),
    or None where it does not take ``x`` (then Inductor fuses the PyTorch path)."""
    if x.device.type != "cpu" or not _ops.native_available():
        return None
    drop = 23 - fmt.mantissa_bits
    if fmt.rounding == "nearest":
        if x.dtype != torch.float32:
            return None
        return _ops.round_nearest(x, drop, bound, fmt.min_normal_exponent)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16) or drop == 0:
        return None
    seeds = _draw_seeds(x.device, generator)
    return _ops.round_stochastic(x, drop, bound, fmt.min_normal_exponent, seeds)


def _c_nearest_applies(fmt: KernelFormat, x: Tensor) -> bool:
    """Whether the C kernel computes ``fmt``'s nearest rounding of ``x``: a plain contiguous
    float32 CPU tensor, outside compilation (every format fits in float32's layout)."""
    return _c_kernel_takes(x) and x.dtype == torch.float32 and x.is_contiguous()


def _c_kernel_takes(x: Tensor) -> bool:
    """Whether the C kernels can round ``x`` (in float32; the stochastic one in any layout):
    a plain float32, float16 or bfloat16 CPU tensor with memory of its own, outside
    compilation.

    Decided before any call, so that the kernel path never needs to catch an error: the
    wrappers of ``torch.func`` (``vmap``, ``grad``: no storage, ``data_ptr()`` raises) and of
    ``functionalize`` (its pointer is not the values' memory: the kernel would read and write
    the wrong memory) take the PyTorch ops, which those transforms see through.
    """
    return (
        type(x) is Tensor
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and x.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and not torch._C._functorch.is_functorch_wrapped_tensor(x)
        and not torch._is_functional_tensor(x)
    )


# (device type, dtype) -> whether torch's cast to dtype saturates out-of-range values to
# ±max and keeps NaN. When it does, the clamp before the cast can be skipped.
_CAST_SATURATES: dict[tuple[str, torch.dtype], bool] = {}


def _cast_saturates(device: torch.device, dtype: torch.dtype, max_value: float) -> bool:
    key = (device.type, dtype)
    known = _CAST_SATURATES.get(key)
    if known is None:
        big = [max_value * 1.0001, max_value * 1.07, max_value * 1.2, 1e30, math.inf]
        # Outside any torch.func transform the caller runs under (functionalize's tensors
        # have no values to read back).
        with torch._C._DisableFuncTorch():
            probe = torch.tensor(big + [-v for v in big] + [math.nan], device=device)
            cast = probe.to(dtype).float().tolist()
        n = len(big)
        known = (
            cast[:n] == [max_value] * n
            and cast[n : 2 * n] == [-max_value] * n
            and math.isnan(cast[-1])
        )
        _CAST_SATURATES[key] = known
    return known


def _nearest_native(x: Tensor, fmt: KernelFormat, native: torch.dtype, bound: float) -> Tensor:
    """Round to nearest with torch's own cast to ``native``, saturating at ``±bound``.

    Each variant makes as few passes over memory as it can: the saturation is done on the
    narrow result where possible rather than on ``x``.
    """
    if math.isinf(bound):  # overflow="inf": unbounded (the caller maps overflow to inf)
        if native.itemsize >= 2 or not _cast_saturates(x.device, native, fmt.max_absolute_value):
            return x.to(native).to(x.dtype)  # IEEE casts: beyond the largest value is ±inf
        return _nearest_bits(x, fmt, _WORK32, bound).to(x.dtype)
    if native.itemsize >= 2:
        # The cast overflows to ±inf at worst; clamp the (narrower) result in place.
        y = x.to(native)
        y = y.clamp(-bound, bound) if y is x else y.clamp_(-bound, bound)
        return y.to(x.dtype)
    # Float8 tensors support no arithmetic.
    if bound == fmt.max_absolute_value and _cast_saturates(x.device, native, bound):
        return x.to(native).to(x.dtype)
    if bound == fmt.max_absolute_value and fmt.special_values == "ieee":
        # An overflow becomes the infinity code: step it down to the largest finite code
        # (the mantissa bits are zero there, so the code below is the max), on one byte.
        y = x.to(native)
        code = y.view(torch.uint8)
        infinity = ((2**fmt.exponent_bits - 1) << fmt.mantissa_bits) & 0x7F
        # .to, not .view: Inductor before torch 2.8 cannot lower a view of a bool tensor.
        code.sub_(((code & 0x7F) == infinity).to(torch.uint8))
        return y.to(x.dtype)
    return x.clamp(-bound, bound).to(native).to(x.dtype)


def _nearest_bits(x: Tensor, fmt: KernelFormat, work: _Work, bound: float) -> Tensor:
    """Round ``x`` to nearest, ties to even, saturating at ``±bound``, in ``work``'s dtype.

    Written for few passes over memory in eager mode: two fresh buffers and a mask, the rest
    in place. (Under ``torch.compile`` it all fuses into one kernel anyway.)
    """
    if x.dtype == work.float_dtype:
        xf = x.clamp(-bound, bound)  # NaN stays NaN
    else:
        xf = x.to(work.float_dtype).clamp_(-bound, bound)
    drop = work.mantissa_bits - fmt.mantissa_bits
    # Normal range: round the bit pattern at `drop` bits, ties to even. A carry out of the
    # mantissa moves into the exponent, which is exactly the next binade's first value.
    bits = xf.view(work.int_dtype)
    if drop > 0:
        rounded = bits >> drop
        rounded &= 1
        rounded += bits
        rounded += (1 << (drop - 1)) - 1
        rounded &= -(1 << drop)
        normal = rounded.view(work.float_dtype)
    else:
        normal = xf.clone()
    # Subnormal range: one float addition rounds to nearest-even at the step of a number
    # whose ulp is the format's subnormal step. NaN takes this branch and stays NaN. (The
    # rounded bits above kept x's sign, so xf itself can become the magnitude.)
    emin = fmt.min_normal_exponent
    magnitude = xf.abs_()
    is_normal = magnitude >= 2.0**emin
    magic = 2.0 ** (emin + drop)
    magnitude += magic
    magnitude -= magic
    subnormal = magnitude.copysign_(normal)
    return torch.where(is_normal, normal, subnormal, out=subnormal)


def _stochastic_bits(
    x: Tensor,
    fmt: KernelFormat,
    work: _Work,
    bound: float,
    generator: torch.Generator | None,
    seeds: Tensor | None = None,
) -> Tensor:
    """Round ``x`` stochastically, saturating at ``±bound``, computing in ``work``'s dtype.

    The random bits are hashed (:func:`_hashed_random_bits`) under ``torch.compile`` or
    where ``seeds`` are given (float32 work only), else drawn with ``torch.randint``. The
    magnitude is worked on in place in one buffer, to make few passes over memory.
    """
    if x.dtype == work.float_dtype:
        magnitude = x.abs()
    else:
        magnitude = x.to(work.float_dtype).abs_()
    magnitude.clamp_(max=bound)  # NaN stays NaN
    drop = work.mantissa_bits - fmt.mantissa_bits
    if drop == 0:  # every value of the working dtype in range is representable
        return magnitude.copysign_(x).to(x.dtype)
    # Below the format's smallest normal, shift the value into the binade [2**emin,
    # 2**(emin + 1)), whose step in the format is the subnormal step, and shift it back after
    # (both exact, but for the first addition's rounding to the working precision).
    emin = fmt.min_normal_exponent
    if emin > work.min_normal_exponent:
        small = _is_below(magnitude, emin, work)
        magnitude.add_(small, alpha=2.0**emin)
    else:  # formats with the working dtype's exponent range: its subnormals are linear
        small = None
    bits = magnitude.view(work.int_dtype)
    # Adding uniform random bits below the kept mantissa, then truncating, rounds up with
    # probability equal to the dropped fraction; a carry moves into the exponent correctly.
    if (seeds is not None or torch.compiler.is_compiling()) and work.mantissa_bits == 23:
        if seeds is None:
            seeds = _draw_seeds(x.device, generator)
        noise = _hashed_random_bits(magnitude, drop, seeds)
    else:
        noise = torch.randint(
            0, 1 << drop, x.shape, dtype=work.int_dtype, device=x.device, generator=generator
        )
    bits += noise
    bits &= -(1 << drop)
    # The noise can carry a NaN's payload out of the NaN range (or wrap it): restore NaN.
    # `small` is NaN exactly where x is, so subtracting it does that for free.
    if small is not None:
        return magnitude.sub_(small, alpha=2.0**emin).copysign_(x).to(x.dtype)
    # (x != x, not isnan: inductor vectorises the comparison, not isnan, on CPU.)
    return magnitude.copysign_(x).masked_fill_(x != x, math.nan).to(x.dtype)


def _is_below(magnitude: Tensor, exponent: int, work: _Work) -> Tensor:
    """1.0 where ``magnitude < 2**exponent``, 0.0 where not, NaN where it is NaN.

    ``(2**exponent - magnitude) * 2**(p - exponent)`` (p: the working precision) is exact,
    at least 1 for every float below ``2**exponent`` and at most 0 from there on; the clamp
    makes it a step. Needs ``2**(p - exponent)`` to be finite (the caller's formats have
    exponents far above the working dtype's smallest).
    """
    precision = work.mantissa_bits + 1
    scale = 2.0 ** (precision - exponent)
    step = torch.mul(magnitude, -scale)
    step += 2.0**precision
    return step.clamp_(0.0, 1.0)


def _draw_seeds(device: torch.device, generator: torch.Generator | None) -> Tensor:
    """The two int32 seeds of :func:`_hashed_random_bits`, from ``generator`` (default:
    torch's global one)."""
    seeds = torch.randint(0, 1 << 32, (2,), dtype=torch.int64, device=device, generator=generator)
    return seeds.to(torch.int32)  # the same 32 bits: int64 to int32 keeps the low word


def _hashed_random_bits(x: Tensor, bits: int, seeds: Tensor) -> Tensor:
    """``bits`` (< 32) uniform random bits per element of ``x``, as int32, from two int32
    ``seeds`` (:func:`_draw_seeds`).

    Used under ``torch.compile``, where it fuses into the rounding kernel: inductor's own
    random numbers (Philox per element) cost several times a copy of the tensor on CPU.
    The bits are the top bits of a 32-bit integer hash (a multiply, then two xorshift-multiply
    rounds) of the element's index (in ``x``'s logical order) plus one seed, with a second
    seed xored in between; both seeds are drawn from torch's generator, so results stay
    reproducible under ``torch.manual_seed``. On a CPU the hash is most of the kernel's
    arithmetic, hence one hash, not two chained. The eager C kernel
    (:mod:`unitscale.formats._native`) computes the same hash.

    The arithmetic is on int32 bit patterns, not on int64 holding [0, 2**32): x86 without
    AVX-512 has no packed 64-bit multiply, so inductor's int64 loop multiplied element by
    element (twice a copy of the tensor). The products wrap modulo 2**32, which is what the
    hash wants, and the masks make the arithmetic right shifts logical.
    """
    position = torch.arange(x.numel(), dtype=torch.int64, device=x.device).reshape(x.shape)
    # A Weyl step first (times 2**32 / golden ratio): consecutive indices alone left the
    # hash's outputs more evenly spread than random ones (a histogram's chi-square ~0.9).
    h = (position.to(torch.int32) + seeds[0]) * -0x61C88647
    key = seeds[1]
    if x.numel() > 1 << 32:  # positions 2**32 apart differ in the high word only
        key = key ^ (position >> 32).to(torch.int32) * 0x2C1B3C6D
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * 0x7FEB352D
    h = h ^ ((h >> 15) & 0x1FFFF) ^ key
    h = h * 0x2C1B3C6D
    if bits > 16:  # the last xorshift changes the low 16 bits only: skipped where unused
        h = h ^ ((h >> 16) & 0xFFFF)
    return (h >> (32 - bits)) & ((1 << bits) - 1)
