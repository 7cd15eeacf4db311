"""Tests of unitscale.formats: exactness against torch casts and an independent reference.

The reference (``representable`` + ``reference_nearest``) enumerates every finite value of a
format from its bit layout and rounds by searching that sorted list, so it shares no code or
trick with the implementation.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
from unittest import mock

import numpy as np
import pytest
import torch

from unitscale import _native as native_build
from unitscale.errors import UnitScaleError
from unitscale.formats import (
    BF16,
    E4M3,
    E5M2,
    FP16,
    PRESETS,
    FormatError,
    FPFormat,
    _kernels,
    _native,
    _ops,
    get_format,
)
from unitscale.tracking.metrics import FORMAT_RANGES

NATIVE = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}
NEAREST = {key: dataclasses.replace(fmt, rounding="nearest") for key, fmt in PRESETS.items()}
# The presets round to nearest; the stochastic-rounding tests use their stochastic twins.
SR = {key: dataclasses.replace(fmt, rounding="stochastic") for key, fmt in PRESETS.items()}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]

# Generic formats checked against the reference (none has a torch dtype).
GENERIC = [
    FPFormat(3, 2, rounding="nearest"),
    FPFormat(2, 1, rounding="nearest", special_values="none"),  # OCP MX FP4 E2M1, max 6
    FPFormat(3, 2, rounding="nearest", special_values="none"),  # OCP MX FP6 E3M2, max 28
    FPFormat(2, 3, rounding="nearest", special_values="none"),  # OCP MX FP6 E2M3, max 7.5
    FPFormat(4, 3, rounding="nearest"),  # IEEE-style E4M3, max 240
    FPFormat(5, 0, rounding="nearest"),
    FPFormat(1, 2, rounding="nearest", special_values="none"),
    FPFormat(3, 0, rounding="nearest", special_values="nan_only"),
    FPFormat(8, 3, rounding="nearest"),
    FPFormat(6, 9, rounding="nearest"),
]


# -- independent reference ---------------------------------------------------------------------


def representable(fmt: FPFormat) -> np.ndarray:
    """Every finite non-negative value of ``fmt``, in code order (hence increasing)."""
    e, m = fmt.exponent_bits, fmt.mantissa_bits
    bias = 2 ** (e - 1) - 1
    field, mantissa = np.meshgrid(np.arange(2**e), np.arange(2**m), indexing="ij")
    field, mantissa = field.ravel(), mantissa.ravel()
    fraction = mantissa / 2.0**m
    values = np.where(
        field == 0,
        fraction * 2.0 ** (1 - bias),
        (1 + fraction) * np.exp2(field.astype(np.float64) - bias),
    )
    keep = np.ones_like(values, dtype=bool)
    top = field == 2**e - 1
    if fmt.special_values == "ieee":
        keep &= ~top
    elif fmt.special_values == "nan_only":
        keep &= ~(top & (mantissa == 2**m - 1))
    values = values[keep]
    assert np.all(np.diff(values) > 0)
    return values


def neighbours(values: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For |x| <= max: (index of hi, lo, hi) with lo <= |x| <= hi consecutive in ``values``."""
    a = np.abs(x)
    hi_index = np.searchsorted(values, a, side="left")  # values[i - 1] < a <= values[i]
    hi = values[hi_index]
    lo = np.where(hi == a, a, values[np.maximum(hi_index - 1, 0)])
    return hi_index, lo, hi


def reference_nearest(fmt: FPFormat, x: np.ndarray) -> np.ndarray:
    """Round float64 ``x`` to ``fmt``: nearest, ties to the even code, saturating; NaN kept."""
    values = representable(fmt)
    a = np.minimum(np.abs(np.nan_to_num(x, nan=0.0)), values[-1])
    hi_index, lo, hi = neighbours(values, a)
    up = (hi - a < a - lo) | ((hi - a == a - lo) & (hi_index % 2 == 0))
    out = np.copysign(np.where(up, hi, lo), x)
    return np.where(np.isnan(x), np.nan, out)


# -- helpers -------------------------------------------------------------------------------------


def all_16bit(dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Every bit pattern of a 16-bit float dtype."""
    return (
        torch.arange(-(2**15), 2**15, dtype=torch.int32, device=device).to(torch.int16).view(dtype)
    )


def quantise(fmt: FPFormat, x: torch.Tensor, impl: str) -> torch.Tensor:
    """Quantise through one implementation path.

    ``public``: as users call it (the C kernel for float32 CPU tensors, else native casts
    for presets); ``torch``: native casts where torch has the format; ``unprobed``: the
    same, as if torch's float8 casts did not saturate (clamp or code fix-up); ``bits``: the
    generic bit-manipulation path (also used under torch.compile).
    """
    if impl == "public":
        return fmt.quantise(x)
    if impl == "torch":
        return _kernels._quantise(fmt._kernel, x, None, allow_c=False)
    if impl == "unprobed":
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        with mock.patch.dict(_kernels._CAST_SATURATES, {(x.device.type, d): False for d in fp8}):
            return _kernels._quantise(fmt._kernel, x, None, allow_c=False)
    return _kernels._quantise(fmt._kernel, x, None, allow_native=False, allow_c=False)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit patterns (so signed zeros count), NaN matching NaN."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    a, e = actual[~nan].view(int_dtype), expected[~nan].view(int_dtype)
    bad = (a != e).nonzero().flatten()
    if len(bad):
        i = bad[0]
        x_bad, e_bad = actual[~nan][i].item(), expected[~nan][i].item()
        raise AssertionError(f"{len(bad)} mismatches, first: got {x_bad!r}, expected {e_bad!r}")


def torch_cast(key: str, x: torch.Tensor) -> torch.Tensor:
    return x.to(NATIVE[key]).to(x.dtype)


def boundary_grid(fmt: FPFormat, device: str) -> torch.Tensor:
    """float32 values around every exponent boundary, every tie and the subnormal range."""
    values = torch.tensor(representable(fmt), dtype=torch.float64)
    mids = (values[1:] + values[:-1]) / 2  # exact in float32 for these formats
    base = torch.cat([values, mids]).float()
    bits = base.view(torch.int32)
    near = bits[:, None] + torch.arange(-2, 3, dtype=torch.int32)  # ties and their neighbours
    # Powers of two from below the smallest subnormal to above the largest value, each with
    # the 64 float32 values on either side: every exponent boundary of every preset.
    lo = math.floor(math.log2(fmt.min_absolute_subnormal)) - 2
    hi = math.ceil(math.log2(fmt.max_absolute_value)) + 1
    powers = torch.tensor([2.0**k for k in range(lo, hi + 1)], dtype=torch.float32)
    around = powers.view(torch.int32)[:, None] + torch.arange(-64, 65, dtype=torch.int32)
    # float32 subnormals (BF16 has subnormals of its own there) and random patterns.
    f32_subnormal = torch.arange(0, 2**23, 997, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    rand = torch.randint(0, 2**31 - 1, (2**16,), dtype=torch.int32, generator=gen)
    all_bits = torch.cat([near.flatten(), around.flatten(), f32_subnormal, rand])
    x = all_bits.view(torch.float32)
    x = x[x.abs() <= fmt.max_absolute_value]
    return torch.cat([x, -x]).to(device)


# -- properties and presets ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fmt", "bits", "max_value", "min_normal", "min_subnormal"),
    [
        (E4M3, 8, 448.0, 2.0**-6, 2.0**-9),
        (E5M2, 8, 57344.0, 2.0**-14, 2.0**-16),
        (FP16, 16, 65504.0, 2.0**-14, 2.0**-24),
        (BF16, 16, float(torch.finfo(torch.bfloat16).max), 2.0**-126, 2.0**-133),
        (FPFormat(2, 1, special_values="none"), 4, 6.0, 1.0, 0.5),
        (FPFormat(3, 2, special_values="none"), 6, 28.0, 0.25, 0.0625),
        (FPFormat(2, 3, special_values="none"), 6, 7.5, 1.0, 0.125),
        (FPFormat(4, 3), 8, 240.0, 2.0**-6, 2.0**-9),
    ],
)
def test_properties(
    fmt: FPFormat, bits: int, max_value: float, min_normal: float, min_subnormal: float
) -> None:
    assert fmt.bits == bits
    assert fmt.max_absolute_value == max_value
    assert fmt.min_absolute_normal == min_normal
    assert fmt.min_absolute_subnormal == min_subnormal
    values = representable(fmt)
    assert values[-1] == max_value and values[1] == min_subnormal
    assert values[2**fmt.mantissa_bits] == min_normal


@pytest.mark.parametrize("key", list(PRESETS))
def test_presets_match_torch_dtypes_and_tracking(key: str) -> None:
    fmt = PRESETS[key]
    finfo = torch.finfo(NATIVE[key])
    assert fmt.torch_dtype is NATIVE[key]
    assert fmt.max_absolute_value == finfo.max
    assert fmt.min_absolute_normal == finfo.smallest_normal
    assert fmt.bits == finfo.bits
    assert FORMAT_RANGES[key] == (fmt.min_absolute_subnormal, fmt.max_absolute_value)
    assert fmt.rounding == "nearest"  # the documented default, as hardware casts round
    assert get_format(key) is fmt and get_format(key.upper()) is fmt
    assert get_format(NATIVE[key]) is fmt
    assert get_format(key, rounding="nearest") == NEAREST[key]


def test_repr_and_replace() -> None:
    assert repr(E4M3) == "FPFormat(4, 3, rounding='nearest', special_values='nan_only')"
    assert E4M3 == NEAREST["e4m3"] and FPFormat(3, 2) == GENERIC[0]  # nearest by default
    assert repr(NEAREST["fp16"]) == "FPFormat(5, 10, rounding='nearest')"
    for fmt in [*PRESETS.values(), *GENERIC]:
        assert eval(repr(fmt), {"FPFormat": FPFormat}) == fmt
    nearest = dataclasses.replace(E4M3, rounding="nearest")
    assert nearest.rounding == "nearest" and nearest.max_absolute_value == 448.0
    assert hash(nearest) == hash(NEAREST["e4m3"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        E4M3.rounding = "nearest"  # type: ignore[misc]
    for fmt in (E4M3, FPFormat(3, 2, rounding="nearest", special_values="none")):
        for clone in (pickle.loads(pickle.dumps(fmt)), copy.deepcopy(fmt)):
            assert clone == fmt and clone.max_absolute_value == fmt.max_absolute_value


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"exponent_bits": 0, "mantissa_bits": 3},
            r"'exponent_bits'=0 is out of range; use 1\.\.8",
        ),
        ({"exponent_bits": 9, "mantissa_bits": 3}, r"'exponent_bits'=9 .* use 1\.\.8"),
        ({"exponent_bits": 4, "mantissa_bits": -1}, r"'mantissa_bits'=-1 .* use 0\.\.23"),
        ({"exponent_bits": 4, "mantissa_bits": 24}, r"'mantissa_bits'=24 .* fit float32"),
        ({"exponent_bits": 4.0, "mantissa_bits": 3}, r"'exponent_bits'=4\.0 must be an int"),
        ({"exponent_bits": True, "mantissa_bits": 3}, r"'exponent_bits'=True must be an int"),
        ({"exponent_bits": 4, "mantissa_bits": 3, "rounding": "up"}, r"'rounding'='up'.*nearest"),
        (
            {"exponent_bits": 4, "mantissa_bits": 3, "special_values": "fn"},
            r"'special_values'='fn' is not supported",
        ),
        ({"exponent_bits": 1, "mantissa_bits": 3}, r"exponent_bits=1 .* no normal numbers"),
        (
            {"exponent_bits": 8, "mantissa_bits": 3, "special_values": "nan_only"},
            r"beyond float32's range",
        ),
    ],
)
def test_invalid_formats(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(FormatError, match=match) as info:
        FPFormat(**kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, UnitScaleError) and isinstance(info.value, ValueError)
    with pytest.raises(FormatError, match="rounding"):
        dataclasses.replace(E4M3, rounding="down")  # type: ignore[arg-type]


def test_invalid_inputs() -> None:
    with pytest.raises(FormatError, match=r"quantise: x has dtype torch.int64; .*float32"):
        E4M3.quantise(torch.arange(3))
    with pytest.raises(FormatError, match=r"quantise_fwd: x must be a torch.Tensor, got list"):
        E4M3.quantise_fwd([1.0])  # type: ignore[arg-type]
    with pytest.raises(FormatError, match=r"quantise_bwd: x has dtype torch.float8_e4m3fn"):
        E4M3.quantise_bwd(torch.zeros(2, dtype=torch.float8_e4m3fn))
    with pytest.raises(FormatError, match=r"unknown format 'e3m4'; use one of \('e4m3'"):
        get_format("e3m4")
    with pytest.raises(FormatError, match=r"unknown format torch.float32"):
        get_format(torch.float32)


# -- round to nearest: bit-exact against torch casts ---------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["public", "unprobed", "bits"])
@pytest.mark.parametrize("source", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("key", list(PRESETS))
def test_nearest_all_16bit_patterns(key: str, source: torch.dtype, impl: str, device: str) -> None:
    fmt = NEAREST[key]
    x = all_16bit(source, device)
    expected = torch_cast(key, x)
    actual = quantise(fmt, x, impl)
    in_range = (x.float().abs() <= fmt.max_absolute_value) & torch.isfinite(expected)
    assert_same_bits(actual[in_range | torch.isnan(x)], expected[in_range | torch.isnan(x)])
    # Everything else (beyond max, ±inf) saturates to the largest value of both formats.
    bound = fmt._bounds[source]
    rest = ~in_range & ~torch.isnan(x)
    assert rest.any() or key == "bf16"
    torch.testing.assert_close(actual[rest].float().abs(), torch.full_like(x[rest].float(), bound))
    assert torch.equal(torch.signbit(actual[rest]), torch.signbit(x[rest]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", ["public", "torch", "unprobed", "bits"])
@pytest.mark.parametrize("key", list(PRESETS))
def test_nearest_float32_boundaries_ties_subnormals(key: str, impl: str, device: str) -> None:
    fmt = NEAREST[key]
    x = boundary_grid(fmt, device)
    assert_same_bits(quantise(fmt, x, impl), torch_cast(key, x))


@pytest.mark.parametrize("fmt", [*GENERIC, NEAREST["e4m3"], NEAREST["e5m2"]], ids=repr)
def test_nearest_generic_formats_match_reference(fmt: FPFormat) -> None:
    x = torch.cat([all_16bit(torch.float16).float(), boundary_grid(fmt, "cpu")])
    x = torch.cat([x, torch.tensor([math.inf, -math.inf, 1e38, -1e38])])
    expected = torch.from_numpy(reference_nearest(fmt, x.double().numpy())).float()
    assert_same_bits(fmt.quantise(x), expected)
    # float64 inputs: random values carrying bits far below float32's precision.
    gen = torch.Generator().manual_seed(1)
    x64 = torch.randn(2**14, dtype=torch.float64, generator=gen)
    x64 = x64 * torch.exp2(torch.randint(-20, 20, (2**14,), generator=gen).double())
    expected64 = torch.from_numpy(reference_nearest(fmt, x64.numpy()))
    assert_same_bits(fmt.quantise(x64), expected64)


needs_c = pytest.mark.skipif(
    not _native.rounding.available(), reason="the native extension was not built at install"
)


@needs_c
def test_the_c_kernel_is_used_where_it_was_built() -> None:
    # Otherwise every test of the public path would quietly test the PyTorch fallback only
    # (tests/test_native.py checks that CI's install builds it).
    x = torch.randn(100)
    with mock.patch.object(_native.rounding, "nearest", side_effect=AssertionError("used")):
        with pytest.raises(AssertionError, match="used"):
            NEAREST["e4m3"].quantise(x)
        # Not for what it does not handle: other dtypes, strided layouts, under compile.
        NEAREST["e4m3"].quantise(x.half())
        NEAREST["e4m3"].quantise(x.reshape(10, 10).t())
        NEAREST["e4m3"].quantise(x.double())
    with mock.patch.object(_native.rounding, "stochastic", side_effect=AssertionError("used")):
        # Stochastic: float32 and 16-bit inputs of any layout (in float32, contiguous).
        for y in (x, x.half(), x.bfloat16(), x.reshape(10, 10).t()):
            with pytest.raises(AssertionError, match="used"):
                SR["e4m3"].quantise(y)
        # Not for float64, nor where float32 has no random bits to spare (23-bit mantissas).
        SR["e4m3"].quantise(x.double())
        FPFormat(5, 23, rounding="stochastic").quantise(x)


@needs_c
@pytest.mark.parametrize("fmt", [*NEAREST.values(), *GENERIC], ids=repr)
def test_c_kernel_matches_the_pytorch_path_bit_for_bit(fmt: FPFormat) -> None:
    # float32 inputs only (what the kernel takes): every float16 and bfloat16 value, the
    # format's boundaries and ties, beyond its range, and random bit patterns of every kind
    # (NaN payloads, infinities, float32 subnormals); enough of them for OpenMP's split.
    gen = torch.Generator().manual_seed(3)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (2**18,), dtype=torch.int32, generator=gen)
    x = torch.cat(
        [
            all_16bit(torch.float16).float(),
            all_16bit(torch.bfloat16).float(),
            boundary_grid(fmt, "cpu"),
            torch.tensor([math.inf, -math.inf, 1e38, -1e38, fmt.max_absolute_value * 1.01]),
            random_bits.view(torch.float32),
        ]
    )
    pytorch = _kernels._quantise(fmt._kernel, x, None, allow_native=False, allow_c=False)
    assert_same_bits(fmt.quantise(x), pytorch)
    for n in (0, 1, 7, 31, 65537):  # vector remainders, the parallel threshold
        assert_same_bits(fmt.quantise(x[-n:] if n else x[:0]), pytorch[-n:] if n else x[:0])


@needs_c
@pytest.mark.parametrize("fmt", [*PRESETS.values(), *GENERIC, FPFormat(8, 1)], ids=repr)
def test_c_stochastic_kernel_matches_the_hashed_pytorch_path_and_compiled(fmt: FPFormat) -> None:
    # The eager C kernel, the PyTorch ops with hashed bits and the compiled kernel compute
    # the same function of the input and the two seeds: bit for bit, on every kind of float32
    # bit pattern (NaN payloads, infinities, subnormals), below and above the format's range.
    fmt = dataclasses.replace(fmt, rounding="stochastic")
    gen = torch.Generator().manual_seed(4)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (2**18,), dtype=torch.int32, generator=gen)
    x = torch.cat(
        [
            boundary_grid(fmt, "cpu"),
            torch.randn(4096, generator=gen) * fmt.max_absolute_value,
            torch.tensor([math.inf, -math.inf, 1e38, -1e38, 0.0, -0.0, 1e-45, -1e-40]),
            random_bits.view(torch.float32),
        ]
    )
    bound, drop = fmt._bounds[torch.float32], 23 - fmt.mantissa_bits
    seeds = torch.tensor([0x1234567, -0x2345678], dtype=torch.int32)
    c = _native.rounding.stochastic(x, drop, bound, fmt._min_normal_exponent, seeds)

    def pytorch(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return _kernels._stochastic_bits(t, fmt._kernel, _kernels._WORK32, bound, None, s)

    assert_same_bits(c, pytorch(x, seeds))
    torch._dynamo.reset()  # one graph per format: no recompile limit
    assert_same_bits(c, torch.compile(pytorch, fullgraph=True)(x, seeds))
    for n in (1, 7, 31, 65537):  # vector remainders, the parallel threshold
        assert_same_bits(
            _native.rounding.stochastic(x[:n], drop, bound, fmt._min_normal_exponent, seeds),
            c[:n],
        )
    # The public path: the C kernel, with two seeds drawn from the generator.
    drawn = _kernels._draw_seeds(x.device, torch.Generator().manual_seed(9))
    expected = _native.rounding.stochastic(x, drop, bound, fmt._min_normal_exponent, drawn)
    assert_same_bits(fmt.quantise(x, generator=torch.Generator().manual_seed(9)), expected)


@needs_c
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_an_error_inside_the_c_kernel_surfaces(rounding: str) -> None:
    # Only unavailability (decided before the call) falls back; an error inside the kernel
    # path is a bug, not a reason to quietly take the slower path.
    fmt = dataclasses.replace(E4M3, rounding=rounding)
    bug = RuntimeError("a bug inside the kernel path")
    with mock.patch.object(_native.rounding, rounding, side_effect=bug):
        with pytest.raises(RuntimeError, match="a bug inside the kernel path"):
            fmt.quantise(torch.randn(64))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_kernel_that_was_not_built_falls_back_to_the_same_results(rounding: str) -> None:
    fmt = dataclasses.replace(E4M3, rounding=rounding)
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 100
    expected = _kernels._quantise(fmt._kernel, x, torch.Generator().manual_seed(5), allow_c=False)
    unbuilt = _native.NativeRounding()
    with (
        mock.patch.object(native_build, "_loaded", {"_rounding": None}),
        mock.patch.object(_kernels, "rounding", unbuilt),
    ):
        out = fmt.quantise(x, generator=torch.Generator().manual_seed(5))
        assert not unbuilt.available()
    assert_same_bits(out, expected)


# vmap's own note that in-place clamp_ has no batching rule (the PyTorch path uses it).
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_the_c_kernel_is_never_given_tensors_without_memory_of_their_own() -> None:
    # torch.func's wrappers (vmap, grad) have no storage and functionalize's pointer is not
    # the values' memory: decided before the call, they take the PyTorch ops.
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(6)) * 10
    nearest = NEAREST["e4m3"]
    called = AssertionError("the C kernel was called")
    with (
        mock.patch.object(_native.rounding, "nearest", side_effect=called),
        mock.patch.object(_native.rounding, "stochastic", side_effect=called),
    ):
        expected = _kernels._quantise(nearest._kernel, x, None, allow_c=False)
        assert_same_bits(torch.vmap(nearest.quantise)(x), expected)
        assert_same_bits(torch.func.functionalize(nearest.quantise)(x), expected)
        gradient = torch.func.grad(lambda t: (nearest.quantise(t) * t).sum())(x[0])
        assert_same_bits(gradient, expected[0])  # the rounding is a constant to grad
        if torch.__version__ < "2.13":
            return  # torch 2.8's vmap has no batching rule for view(dtype), which the ops use
        rounded = torch.vmap(E4M3.quantise, randomness="different")(x)
        # Stochastic rounding: a value of the format (rounding it again keeps it) next to x.
        assert_same_bits(_kernels._quantise(nearest._kernel, rounded, None, allow_c=False), rounded)
        assert ((rounded - x).abs() <= x.abs() / 8 + 2**-9).all()


def test_float64_is_rounded_once() -> None:
    # Just above the tie between 1.0 and 1.125, by less than float32 can hold: the correct
    # rounding is up. torch's float64 cast rounds through float32 and lands on the tie.
    x = torch.tensor([1.0625 + 2.0**-40, -(1.0625 + 2.0**-40)], dtype=torch.float64)
    out = NEAREST["e4m3"].quantise(x)
    assert out.dtype == torch.float64 and out.tolist() == [1.125, -1.125]
    assert x.to(torch.float8_e4m3fn).double().tolist() == [1.0, -1.0]
    y = torch.tensor([1 + 2.0**-11 + 2.0**-40], dtype=torch.float64)
    assert NEAREST["fp16"].quantise(y).item() == 1 + 2.0**-10


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("key", list(PRESETS))
def test_saturation_nan_and_dtype(key: str, dtype: torch.dtype, rounding: str) -> None:
    fmt = dataclasses.replace(PRESETS[key], rounding=rounding)
    big = min(fmt.max_absolute_value * 4, float(torch.finfo(dtype).max))
    x = torch.tensor([big, -big, math.inf, -math.inf, math.nan, 1.0, -0.0], dtype=dtype)
    before = x.clone()
    out = fmt.quantise(x)
    assert out.dtype == dtype and out.shape == x.shape and out.data_ptr() != x.data_ptr()
    assert torch.equal(x[:4], before[:4]) and torch.isnan(x[4])  # input untouched
    bound = fmt._bounds[dtype]
    expected = torch.tensor([bound, -bound, bound, -bound, math.nan, 1.0, -0.0], dtype=dtype)
    assert_same_bits(out, expected)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2, BF16, FPFormat(5, 0), FPFormat(3, 2)], ids=repr)
def test_nan_payloads_stay_nan(fmt: FPFormat, rounding: str) -> None:
    fmt = dataclasses.replace(fmt, rounding=rounding)
    nan32 = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7FC00000, -0x00400000], dtype=torch.int32)
    nan64 = torch.tensor([0x7FFFFFFFFFFFFFFF, -1, 0x7FF0000000000001], dtype=torch.int64)
    for nans in (nan32.view(torch.float32), nan64.view(torch.float64)):
        assert torch.isnan(nans).all()
        assert torch.isnan(fmt.quantise(nans.repeat(100))).all()


def test_saturation_bound_representable_in_both() -> None:
    # FP16's max (65504) is no bfloat16 value: bfloat16 inputs saturate to 65280, the largest
    # value of both, and float16 inputs quantised to BF16 likewise.
    for rounding in ("nearest", "stochastic"):
        fp16 = dataclasses.replace(FP16, rounding=rounding)
        bf16 = dataclasses.replace(BF16, rounding=rounding)
        out = fp16.quantise(torch.tensor([1e6, 65504.0], dtype=torch.bfloat16))
        assert out.tolist() == [65280.0, 65280.0]
        assert bf16.quantise(torch.tensor([65504.0, -math.inf], dtype=torch.float16)).tolist() == [
            65280.0,
            -65280.0,
        ]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_shapes_and_layouts(rounding: str) -> None:
    fmt = dataclasses.replace(E4M3, rounding=rounding)
    assert fmt.quantise(torch.empty(0, 3)).shape == (0, 3)
    x = torch.randn(64, 32).t()
    torch.manual_seed(0)
    a = fmt.quantise(x)
    torch.manual_seed(0)
    b = fmt.quantise(x.contiguous())
    assert torch.equal(a, b) and a.shape == (32, 64)


# -- stochastic rounding -------------------------------------------------------------------------

STOCHASTIC = [
    *SR.values(),
    FPFormat(3, 2, rounding="stochastic"),
    FPFormat(2, 1, rounding="stochastic", special_values="none"),
]


def probe_points(fmt: FPFormat) -> np.ndarray:
    """Points at fractions 0.1, 1/3, 0.5, 0.9 of gaps across the range, and below it."""
    values = representable(fmt)
    n = len(values)
    gaps = [0, 1, 2, 2**fmt.mantissa_bits - 1, 2**fmt.mantissa_bits, n // 2, n - 2]
    points = [
        values[i] + f * (values[i + 1] - values[i]) for i in gaps for f in (0.1, 1 / 3, 0.5, 0.9)
    ]
    points = np.array(points, dtype=np.float32).astype(np.float64)  # representable inputs
    return np.concatenate([points, -points])


@pytest.mark.parametrize(
    ("dtype", "impl"),
    [(torch.float32, "public"), (torch.float32, "bits"), (torch.float64, "public")],
    ids=["float32", "float32-no-c-kernel", "float64"],
)
@pytest.mark.parametrize("fmt", STOCHASTIC, ids=repr)
def test_stochastic_is_unbiased_neighbour(fmt: FPFormat, dtype: torch.dtype, impl: str) -> None:
    # "public" takes the C kernel (hashed bits) for float32 where it is built; "bits" the
    # PyTorch ops with torch.randint's bits, what runs without the native extension.
    torch.manual_seed(0)
    points = probe_points(fmt)
    draws = 20_000
    x = torch.from_numpy(points).to(dtype)[:, None].expand(-1, draws)
    q = quantise(fmt, x, impl).double().numpy()
    _, lo, hi = neighbours(representable(fmt), points)
    lo, hi = np.copysign(lo, points)[:, None], np.copysign(hi, points)[:, None]
    assert np.all((q == lo) | (q == hi)), "a result is not a neighbour of its input"
    # Unbiased: the mean of `draws` Bernoulli choices between lo and hi is within 5 standard
    # errors of x (a false failure has probability < 1e-6 per point; the seed is fixed).
    p = (points[:, None] - lo) / (hi - lo)
    stderr = np.abs(hi - lo) * np.sqrt(p * (1 - p) / draws)
    assert np.all(np.abs(q.mean(axis=1, keepdims=True) - points[:, None]) <= 5 * stderr)
    # Inputs that are values of the format come back exactly.
    exact = torch.from_numpy(np.concatenate([representable(fmt), -representable(fmt)])).float()
    assert torch.equal(quantise(fmt, exact, impl), exact)


@pytest.mark.parametrize("fmt", STOCHASTIC, ids=repr)
def test_stochastic_neighbours_at_every_boundary(fmt: FPFormat) -> None:
    x = boundary_grid(fmt, "cpu")  # each value of the format ±2 ulps, ties, binade edges...
    q = fmt.quantise(x).double().numpy()
    _, lo, hi = neighbours(representable(fmt), x.double().numpy())
    sign = np.sign(x.double().numpy())
    assert np.all((q == sign * lo) | (q == sign * hi))


def test_stochastic_below_smallest_subnormal_and_float16_inputs() -> None:
    # 0.3 of E4M3's smallest subnormal rounds up 30% of the time, from float16 too.
    torch.manual_seed(0)
    x = torch.full((100_000,), 0.3 * 2.0**-9, dtype=torch.float16)
    q = SR["e4m3"].quantise(x)
    assert q.dtype == torch.float16 and set(q.unique().tolist()) == {0.0, 2.0**-9}
    p_up = (q != 0).double().mean().item()
    assert abs(p_up - x[0].item() / 2.0**-9) < 5 * math.sqrt(0.3 * 0.7 / 100_000)


def test_stochastic_23_bit_mantissa_has_random_bits() -> None:
    # E5M23 subnormals are finer than float32 can round stochastically: float64 is used.
    fmt = FPFormat(5, 23, rounding="stochastic")
    x = torch.full((40_000,), 2.0**-20 + 2.0**-40)
    lo, hi = 2.0**-20, 2.0**-20 + 2.0**-37
    q = fmt.quantise(x).double()
    assert set(q.unique().tolist()) == {lo, hi}
    assert abs((q == hi).double().mean().item() - 1 / 8) < 5 * math.sqrt(7 / 64 / 40_000)


def test_stochastic_reproducible() -> None:
    x = torch.randn(4096) * 3
    torch.manual_seed(123)
    a = SR["e4m3"].quantise(x)
    torch.manual_seed(123)
    b = SR["e4m3"].quantise(x)
    c = SR["e4m3"].quantise(x)
    assert torch.equal(a, b) and not torch.equal(b, c)
    # An explicit generator gives its own stream and leaves the global one alone.
    torch.manual_seed(5)
    g1 = SR["e4m3"].quantise(x, generator=torch.Generator().manual_seed(7))
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(3), after)
    g2 = SR["e4m3"].quantise(x, generator=torch.Generator().manual_seed(7))
    g3 = SR["e4m3"].quantise(x, generator=torch.Generator().manual_seed(8))
    assert torch.equal(g1, g2) and not torch.equal(g1, g3)


# -- straight-through gradients ------------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True])
def test_quantise_fwd_and_bwd_gradients(compiled: bool) -> None:
    fmt = NEAREST["e4m3"]
    grad_fmt = NEAREST["e5m2"]

    def fwd(x: torch.Tensor) -> torch.Tensor:
        return fmt.quantise_fwd(x) * 3.0

    def bwd(x: torch.Tensor) -> torch.Tensor:
        return grad_fmt.quantise_bwd(x) * 3.0

    if compiled:  # Dynamo capture and autograd tracing, without the C++ build
        fwd = torch.compile(fwd, backend="aot_eager", fullgraph=True)
        bwd = torch.compile(bwd, backend="aot_eager", fullgraph=True)
    x0 = torch.randn(1000, dtype=torch.float64) * 10
    grad = torch.randn(1000, dtype=torch.float64) * 10

    x = x0.clone().requires_grad_()
    y = fwd(x)
    y.backward(grad)
    assert torch.equal(y, fmt.quantise(x0) * 3.0)
    assert torch.equal(x.grad, grad * 3.0)  # straight through

    x = x0.clone().requires_grad_()
    y = bwd(x)
    y.backward(grad)
    assert torch.equal(y, x0 * 3.0)
    assert torch.equal(x.grad, grad_fmt.quantise(grad * 3.0))
    assert not torch.equal(x.grad, grad * 3.0)

    x = x0.clone().requires_grad_()
    assert not fmt.quantise(x).requires_grad  # plain quantise carries no gradient


# -- torch.compile (inductor): the generic path and the hashed random bits -----------------------


@pytest.mark.parametrize("native_op", [True, False], ids=["c-op", "inductor"])
def test_compiled_matches_eager(native_op: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # On a CPU compiled code calls the C kernels as custom ops where they are built; without
    # them (and on other devices) Inductor fuses the PyTorch path: both are checked.
    if native_op and not _native.rounding.available():
        pytest.skip("the native extension was not built at install")
    monkeypatch.setattr(_ops, "native_available", lambda: native_op)
    torch._dynamo.reset()
    nearest = [NEAREST[key] for key in PRESETS] + [GENERIC[0]]
    stochastic = SR["e4m3"]

    @torch.compile(fullgraph=True)
    def run(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*(fmt.quantise(x) for fmt in nearest), stochastic.quantise(x))

    # One input (one compilation): every float16 pattern, E4M3's grid, then draws of points
    # for the stochastic check.
    x = torch.cat([all_16bit(torch.float16).float(), boundary_grid(E4M3, "cpu")])
    points = probe_points(E4M3)
    draws = 20_000
    xs = torch.from_numpy(points).float()[:, None].expand(-1, draws)
    torch.manual_seed(0)
    *compiled_nearest, compiled_sr = run(torch.cat([x, xs.flatten()]))
    for fmt, out in zip(nearest, compiled_nearest, strict=True):
        assert_same_bits(out[: len(x)], fmt.quantise(x))

    # Stochastic: neighbours, unbiased (5 standard errors), reproducible under manual_seed.
    q = compiled_sr[len(x) :].reshape(xs.shape).double().numpy()
    _, lo, hi = neighbours(representable(E4M3), points)
    lo, hi = np.copysign(lo, points)[:, None], np.copysign(hi, points)[:, None]
    assert np.all((q == lo) | (q == hi))
    p = (points[:, None] - lo) / (hi - lo)
    stderr = np.abs(hi - lo) * np.sqrt(p * (1 - p) / draws)
    assert np.all(np.abs(q.mean(axis=1, keepdims=True) - points[:, None]) <= 5 * stderr)
    torch.manual_seed(0)
    assert_same_bits(run(torch.cat([x, xs.flatten()]))[-1], compiled_sr)


def test_compiled_random_bits_are_uniform_and_uncorrelated() -> None:
    # The hash under torch.compile stands in for a random generator: its top bits over
    # consecutive indices must histogram like independent uniform draws (chi-square per
    # degree of freedom 1, standard error sqrt(2 / dof) per seed), neither lumpier nor more
    # even (a hash of bare consecutive indices was ~0.93), with no correlation between
    # neighbours or between two calls.
    bits, n, bins, seeds = 20, 2**22, 4096, 4
    draw = torch.compile(
        lambda t: _kernels._hashed_random_bits(t, bits, _kernels._draw_seeds(t.device, None)),
        fullgraph=True,
    )
    x = torch.zeros(n)
    chi, previous = [], None
    for seed in range(seeds):
        torch.manual_seed(seed)
        u = (draw(x).double() + 0.5) / 2**bits
        assert u.min() > 0 and u.max() < 1
        counts = torch.histc(u, bins, 0, 1)
        expected = n / bins
        chi.append(float(((counts - expected) ** 2 / expected).sum()) / (bins - 1))
        for other in (u[1:], u[8:], previous):
            if other is not None:
                corr = float(torch.corrcoef(torch.stack([u[: len(other)], other]))[0, 1])
                assert abs(corr) < 5 / math.sqrt(n)
        previous = u
    stderr = math.sqrt(2 / (bins - 1) / seeds)
    assert abs(sum(chi) / seeds - 1) < 4 * stderr, chi


# -- compiled as users write it: torch.compile(fmt.quantise), several formats, one process -------


@pytest.mark.skipif(
    not _native.rounding.available(), reason="the native extension was not built at install"
)
def test_compiled_quantise_of_several_formats_runs_the_c_kernels_bit_for_bit() -> None:
    # torch.compile(fmt.quantise) with default options for formats that share one code object
    # (the second recompiles it, and Dynamo then makes the format's numbers symbolic): every
    # graph calls the one-pass C kernel as a custom op, with the eager results bit for bit
    # (stochastic too: the seeds come from the same generator draws).
    from torch._dynamo.testing import EagerAndRecordGraphs

    torch._dynamo.reset()
    formats = [NEAREST["e4m3"], NEAREST["e5m2"], SR["e4m3"], NEAREST["e4m3"]]
    x = torch.cat([all_16bit(torch.float16).float(), boundary_grid(E4M3, "cpu")])
    backend = EagerAndRecordGraphs()
    for fmt in formats:
        compiled = torch.compile(fmt.quantise, backend=backend)
        torch.manual_seed(3)
        out = compiled(x)
        torch.manual_seed(3)
        assert_same_bits(out, fmt.quantise(x))
        inductor = torch.compile(fmt.quantise)
        torch.manual_seed(3)
        assert_same_bits(inductor(x), out)
    ops = [
        {str(n.target) for n in g.graph.nodes if "unitscale" in str(n.target)}
        for g in backend.graphs
    ]
    assert ops == [
        {"unitscale.round_nearest.default"},
        {"unitscale.round_nearest.default"},
        {"unitscale.round_stochastic.default"},
    ]  # the fourth call reused the first graph
    torch._dynamo.reset()


@pytest.mark.skipif(
    not _native.rounding.available(), reason="the native extension was not built at install"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rounding_custom_ops_pass_opcheck(dtype: torch.dtype) -> None:
    # Schema, fake (meta) implementation, autograd registration and tracing of both ops.
    x = (torch.randn(5, 7) * 100).to(dtype).t()  # strided: the ops make it contiguous
    fmt = E4M3._kernel
    seeds = torch.tensor([5, -7], dtype=torch.int32)
    stochastic = (x, 20, fmt.bounds[dtype], fmt.min_normal_exponent, seeds)
    torch.library.opcheck(torch.ops.unitscale.round_stochastic.default, stochastic)
    x32 = x.float().requires_grad_()
    nearest = (x32, 20, fmt.bounds[torch.float32], fmt.min_normal_exponent)
    torch.library.opcheck(torch.ops.unitscale.round_nearest.default, nearest)
    assert_same_bits(torch.ops.unitscale.round_nearest(*nearest), NEAREST["e4m3"].quantise(x32))


def test_kernels_take_plain_numbers_and_never_import_the_format() -> None:
    # No import circle (docs/design.rst, "Layers"): _kernels reads a KernelFormat, never FPFormat.
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(_kernels))
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module is not None
    }
    assert "_format" not in imported and "unitscale.formats._format" not in imported
    assert "FPFormat" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert E4M3._kernel == _kernels.KernelFormat(
        4, 3, "nearest", "nan_only", 448.0, -6, torch.float8_e4m3fn, E4M3._bounds
    )


# -- torch.func -----------------------------------------------------------------------------


def test_quantise_fwd_and_bwd_under_torch_func_grad_match_autograd() -> None:
    fmt = FPFormat(4, 3, rounding="nearest")
    x = torch.randn(64) * 10
    weights = torch.randn(64) * 10
    for method in ("quantise_fwd", "quantise_bwd"):

        def loss(t: torch.Tensor, method: str = method) -> torch.Tensor:
            return (getattr(fmt, method)(t) * weights).sum()

        leaf = x.clone().requires_grad_()
        loss(leaf).backward()
        assert torch.equal(torch.func.grad(loss)(x), leaf.grad), method
    # quantise_bwd rounds the gradient, quantise_fwd passes it through.
    assert torch.equal(
        torch.func.grad(lambda t: (fmt.quantise_bwd(t) * weights).sum())(x), fmt.quantise(weights)
    )


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantise_under_vmap_rounds_each_row_as_alone(rounding: str) -> None:
    """vmap needs no randomness flag: stochastic rounding draws bits for every element, of
    every batch row alike; nearest rounding gives each row's own result bit for bit."""
    fmt = FPFormat(4, 3, rounding=rounding)
    x = torch.randn(8, 100) * 10
    out = torch.vmap(fmt.quantise_fwd)(x)
    assert out.shape == x.shape
    grid = FPFormat(4, 3, rounding="nearest")
    assert torch.equal(grid.quantise(out), out)  # every value on the format's grid
    if rounding == "nearest":
        assert torch.equal(out, torch.stack([fmt.quantise_fwd(row) for row in x]))
    # Per-sample gradients through quantise_bwd: each row's gradient rounded.
    weights = torch.randn(100) * 10
    per_sample = torch.vmap(torch.func.grad(lambda r: (fmt.quantise_bwd(r) * weights).sum()))(x)
    assert torch.equal(grid.quantise(per_sample), per_sample)
    if rounding == "nearest":
        assert torch.equal(per_sample, fmt.quantise(weights).expand(8, -1))


def test_quantise_bwd_under_jacrev_rounds_the_cotangent() -> None:
    fmt = FPFormat(4, 3, rounding="nearest")
    x = torch.randn(16) * 10
    # Reverse mode rounds the cotangent: 1.3 reaches quantise_bwd, 1.25 leaves it.
    jacobian = torch.func.jacrev(lambda t: fmt.quantise_bwd(t) * 1.3)(x[:4])
    assert torch.equal(jacobian, torch.eye(4) * 1.25)
