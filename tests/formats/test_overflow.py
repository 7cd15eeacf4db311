"""Tests of ``FPFormat(..., overflow="inf")``: IEEE overflow to infinity, on every path.

The reference is PyTorch's own IEEE casts (``x.to(torch.float16)``, ``torch.float8_e5m2``),
which round to nearest and overflow to ``±inf`` from the largest value plus half a step.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
from unittest import mock

import pytest
import torch
from torch import nn

from unitscale.formats import E4M3, E5M2, FP16, FormatError, FPFormat, _kernels, _native, _ops
from unitscale.transforms import simulate_format
from unitscale.transforms.lowp._quantise import _format_of, format_spec

FP16_INF = dataclasses.replace(FP16, rounding="nearest", overflow="inf")
E5M2_INF = dataclasses.replace(E5M2, rounding="nearest", overflow="inf")
CASTS = {FP16_INF: torch.float16, E5M2_INF: torch.float8_e5m2}


def _after(value: float, direction: float) -> float:
    return float(torch.nextafter(torch.tensor(value), torch.tensor(direction)))


def overflow_inputs(fmt: FPFormat) -> torch.Tensor:
    """float32 values: normals, subnormals, underflow to zero, the overflow boundary (the
    largest value, the last float32 below the tie, the tie itself, the float32 after it),
    beyond it up to float32's max, ±inf, NaN, and a large random sample of bit patterns."""
    top, step = (
        fmt.max_absolute_value,
        2.0 ** (math.floor(math.log2(fmt.max_absolute_value)) - fmt.mantissa_bits),
    )
    tie = top + step / 2  # 65520 for FP16, 61440 for E5M2
    tiny = fmt.min_absolute_subnormal
    special = [
        1.0, 0.1, 3.14159, 1000.0, 0.0, -0.0,  # normals and zeros
        fmt.min_absolute_normal, tiny, 3 * tiny, 1.5 * tiny,  # subnormals
        tiny / 2, _after(tiny / 2, 1.0), tiny / 4, 1e-30,  # underflow (tie to zero) and not
        top, _after(top, math.inf), _after(tie, 0.0), tie, _after(tie, math.inf),
        top + step, 2 * top, 1e30, float(torch.finfo(torch.float32).max),
        math.inf, math.nan,
    ]  # fmt: skip
    values = torch.tensor(special, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31 - 1, (200_000,), dtype=torch.int32, generator=gen)
    # Random patterns (every exponent, NaN payloads included), and values near the format's
    # range, where overflow and rounding are decided.
    near = torch.empty(100_000).uniform_(-2 * top, 2 * top, generator=gen)
    return torch.cat([values, -values, bits.view(torch.float32), near])


IMPLS = ["public", "torch", "saturating-cast", "bits", "compiled-c-op", "compiled-inductor"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt", list(CASTS), ids=repr)
def test_nearest_overflow_inf_is_the_ieee_cast_bit_for_bit(
    fmt: FPFormat, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    dtype = CASTS[fmt]
    boundary = torch.tensor([fmt.max_absolute_value * 1.0715, math.inf])
    if not torch.isinf(boundary.to(dtype).float()).all():
        pytest.skip(f"torch's cast to {dtype} saturates here: it is no IEEE reference")
    x = overflow_inputs(fmt)
    expected = x.to(dtype).float()
    if impl == "public":
        actual = fmt.quantise(x)
    elif impl == "torch":
        actual = _kernels._quantise(fmt._kernel, x, None, allow_c=False)
    elif impl == "saturating-cast":
        # The branch taken on a device whose float8 cast saturates (that cast cannot show an
        # overflow): the bit-manipulation path, which must not saturate either.
        with mock.patch.dict(_kernels._CAST_SATURATES, {("cpu", torch.float8_e5m2): True}):
            actual = _kernels._quantise(fmt._kernel, x, None, allow_c=False)
    elif impl == "bits":
        actual = _kernels._quantise(fmt._kernel, x, None, allow_native=False, allow_c=False)
    else:
        native_op = impl == "compiled-c-op"
        if native_op and not _native.rounding.available():
            pytest.skip("the native extension was not built at install")
        monkeypatch.setattr(_ops, "native_available", lambda: native_op)
        torch._dynamo.reset()
        actual = torch.compile(fmt.quantise, fullgraph=True)(x)
    # The boundary as the brief states it for FP16: 65519.996 -> 65504, 65520 -> inf.
    assert torch.isinf(expected).any() and (expected.abs() == fmt.max_absolute_value).any()
    assert torch.equal(torch.isnan(actual), torch.isnan(expected))
    keep = ~torch.isnan(expected)
    mismatches = (actual[keep].view(torch.int32) != expected[keep].view(torch.int32)).sum()
    assert int(mismatches) == 0


def test_fp16_overflow_boundary_values() -> None:
    x = torch.tensor([65504.0, 65519.996, 65520.0, -65520.0, 1e-8, math.inf, -math.inf])
    assert FP16_INF.quantise(x).tolist() == [65504.0, 65504.0, math.inf, -math.inf, 0.0,
                                             math.inf, -math.inf]  # fmt: skip
    # The saturating default is unchanged.
    assert dataclasses.replace(FP16_INF, overflow="saturate").quantise(x).tolist() == [
        65504.0, 65504.0, 65504.0, -65504.0, 0.0, 65504.0, -65504.0
    ]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_inputs_overflow_as_the_cast_makes_them(dtype: torch.dtype) -> None:
    # Every bit pattern of the input dtype; the result stays in that dtype. (bfloat16 values
    # in FP16's normal range are FP16 values, so the round trip through float16 is exact
    # there, and stochastic rounding leaves them as they are too.)
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    expected = x.to(torch.float16).to(dtype)
    stochastic = dataclasses.replace(FP16_INF, rounding="stochastic").quantise(x)
    for actual, exact in ((FP16_INF.quantise(x), x == x), (stochastic, x.abs() >= 2.0**-14)):
        assert actual.dtype == dtype
        assert torch.equal(torch.isnan(actual), torch.isnan(expected))
        keep = ~torch.isnan(expected) & exact
        assert torch.equal(actual[keep].view(torch.int16), expected[keep].view(torch.int16))
        assert int(torch.isinf(actual[keep]).sum()) >= 2  # beyond 65504 (and ±inf itself)


@pytest.mark.parametrize("fmt", list(CASTS), ids=repr)
def test_float64_inputs_overflow_as_the_cast_makes_them(fmt: FPFormat) -> None:
    # float32 values, so that torch's cast from float64 (through float32) rounds once.
    x = overflow_inputs(fmt)
    expected = x.to(CASTS[fmt]).double()
    actual = fmt.quantise(x.double())
    assert actual.dtype == torch.float64
    assert torch.equal(torch.isnan(actual), torch.isnan(expected))
    keep = ~torch.isnan(expected)
    assert torch.equal(actual[keep].view(torch.int64), expected[keep].view(torch.int64))


@pytest.mark.parametrize("impl", ["c", "hashed", "randint"])
def test_stochastic_overflows_as_the_rounded_value_says(impl: str) -> None:
    fmt = dataclasses.replace(FP16, overflow="inf", rounding="stochastic")
    step = 32.0  # FP16's step just below 2**16; 65504 + 32 = 65536 is beyond the largest value
    points = torch.tensor([65504.0 + step * f for f in (0.0, 0.25, 0.5, 0.875)] + [65536.0, 1e9])
    draws = 20_000
    x = points[:, None].expand(-1, draws).contiguous()
    torch.manual_seed(0)
    if impl == "c":
        if not _native.rounding.available():
            pytest.skip("the native extension was not built at install")
        q = fmt.quantise(x)
    elif impl == "hashed":
        seeds = _kernels._draw_seeds(x.device, None)
        q = _kernels._overflow_to_inf(
            _kernels._stochastic_bits(x, fmt._kernel, _kernels._WORK32, math.inf, None, seeds),
            fmt.max_absolute_value,
        )
    else:
        q = _kernels._quantise(fmt._kernel, x, None, allow_c=False)
    # Each value rounds to one of its neighbours: the largest value or infinity.
    assert bool(((q == 65504.0) | (q == math.inf)).all())
    share = (q == math.inf).double().mean(dim=1)
    expected = ((points - 65504.0) / step).clamp(max=1.0).double()
    stderr = (expected * (1 - expected) / draws).sqrt()
    assert bool(((share - expected).abs() <= 5 * stderr + 1e-12).all()), share
    assert share[0] == 0.0 and share[-2:].tolist() == [1.0, 1.0]
    nan_and_inf = torch.tensor([math.nan, math.inf, -math.inf])
    out = fmt.quantise(nan_and_inf)
    assert math.isnan(out[0]) and out[1:].tolist() == [math.inf, -math.inf]


def test_overflow_inf_under_vmap_and_through_quantise_fwd_and_bwd() -> None:
    x = torch.tensor([[1.0, 7e4], [-7e4, 65519.0]])
    expected = x.to(torch.float16).float()
    assert torch.equal(torch.func.vmap(FP16_INF.quantise)(x), expected)
    leaf = x.clone().requires_grad_()
    y = FP16_INF.quantise_bwd(leaf)
    y.backward(x)
    assert torch.equal(leaf.grad, expected)
    leaf.grad = None
    FP16_INF.quantise_fwd(leaf).backward(x)
    assert torch.equal(leaf.grad, x)  # straight through
    assert torch.equal(FP16_INF.quantise_fwd(x), expected)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"special_values": "nan_only", "overflow": "inf"}, "overflow='inf' needs infinities"),
        ({"special_values": "none", "overflow": "inf"}, "special_values='none' has not"),
        ({"overflow": "wrap"}, "argument 'overflow'='wrap' is not supported"),
    ],
)
def test_invalid_overflow(kwargs: dict[str, str], match: str) -> None:
    with pytest.raises(FormatError, match=match):
        FPFormat(4, 3, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="overflow"):
        dataclasses.replace(E4M3, overflow="inf")


def test_overflow_is_part_of_the_format() -> None:
    assert repr(FP16_INF) == "FPFormat(5, 10, rounding='nearest', overflow='inf')"
    assert repr(FP16) == "FPFormat(5, 10, rounding='nearest')"
    saturating = dataclasses.replace(FP16_INF, overflow="saturate")
    assert FP16_INF != saturating and len({FP16_INF, saturating, copy.deepcopy(FP16_INF)}) == 2
    assert pickle.loads(pickle.dumps(FP16_INF)) == FP16_INF
    assert FP16.overflow == "saturate" and E5M2.overflow == "saturate"
    # A graph node's plain-data spec keeps it (and a default format's spec is unchanged).
    assert format_spec(saturating) == (5, 10, "nearest", "ieee")
    assert _format_of(format_spec(FP16_INF)) == FP16_INF
    assert _format_of(format_spec(saturating)) == saturating


def test_simulate_format_overflows_gradients_to_inf() -> None:
    model = simulate_format(nn.Linear(2, 1, bias=False), FP16_INF, FP16_INF)
    x = torch.ones(1, 2, requires_grad=True)
    out = model(x)
    out.backward(torch.tensor([[1e6]]))  # the weight's gradient (1e6 * x) overflows FP16
    assert torch.isinf(model.weight.grad).all()
    saturating = dataclasses.replace(FP16_INF, overflow="saturate")
    model = simulate_format(nn.Linear(2, 1, bias=False), saturating, saturating)
    x = torch.ones(1, 2, requires_grad=True)
    model(x).backward(torch.tensor([[1e6]]))
    assert torch.isfinite(x.grad).all()
