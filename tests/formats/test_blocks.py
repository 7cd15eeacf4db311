"""Block-scaled formats (MX, NVFP4): bit for bit against torchao's emulation where torchao is
installed, and the properties that need no reference (block amax -> scale, values on the
element grid, idempotence, special values, errors) everywhere."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
from torch import Tensor

from unitscale.formats import (
    BLOCK_PRESETS,
    BlockFormat,
    FormatError,
    FPFormat,
    get_format,
)

MX = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1")
MODES = ("floor", "ceil", "even", "rceil")
SHAPES = ((4, 32), (3, 5, 64), (64, 96))
FMAX = torch.finfo(torch.float32).max

# One block of 32 per case; the cases torchao's emulation rounds differently from OCP (blocks
# whose E8M0 scale is 2**-127) are in TINY, tested on their own below.
EDGES: dict[str, list[float]] = {
    "zeros": [0.0] * 32,
    "negative zeros": [-0.0] * 32,
    "nan": [math.nan] + [1.0] * 31,
    "inf": [math.inf] + [1.0] * 30 + [-2.0],
    "-inf": [-math.inf] + [1e-3] * 31,
    "float32 max": [FMAX] + [1.0] * 31,
    "near float32 max": [FMAX, -FMAX] + [3e38] * 30,
    "ties": [1.0 + 2.0**-4 * k for k in range(32)],
    "saturation fp8": [511.0, 448.0, 480.0] + [1.0] * 29,
    "saturation fp4/fp6": [7.99, 6.0, 5.0, 4.5, 3.5, 2.5, 0.25, 0.75] * 4,
    "wide range": [1e6, 1e-6] * 16,
    "subnormal elements": [1.0] + [2.0**-12] * 31,
}
TINY: dict[str, list[float]] = {
    "float32 subnormals": [1e-45] + [1e-40] * 31,
    "amax 2**-119": [2.0**-119] + [2.0**-121] * 31,
}
E2M1 = FPFormat(2, 1, special_values="none")


def _torchao() -> Any:
    reason = "torchao (the test extra) is the reference implementation of MX and NVFP4"
    try:
        return pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason=reason)
    except pytest.skip.Exception:
        raise
    except Exception as error:  # e.g. an older torch than this torchao supports
        pytest.skip(f"{reason}, and it does not import with torch {torch.__version__}: {error}")


def _mx_reference(x: Tensor, name: str, mode: str) -> Tensor:
    """torchao's round trip: ``MXTensor.to_mx`` then ``dequantize`` (blocks along dim -1)."""
    mx = _torchao()
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2

    elements = {
        "mxfp8_e4m3": torch.float8_e4m3fn,
        "mxfp8_e5m2": torch.float8_e5m2,
        "mxfp6_e3m2": DTYPE_FP6_E3M2,
        "mxfp6_e2m3": DTYPE_FP6_E2M3,
        "mxfp4_e2m1": torch.float4_e2m1fn_x2,
    }
    mode_enum = getattr(ScaleCalculationMode, mode.upper())
    tensor = mx.MXTensor.to_mx(x.contiguous(), elements[name], 32, scaling_mode=mode_enum)
    return tensor.dequantize(x.dtype)


def _nvfp4_reference(x: Tensor) -> Tensor:
    """torchao's two-level NVFP4 round trip (per-tensor scale from the tensor's amax)."""
    _torchao()
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    scale = per_tensor_amax_to_scale(x.abs().amax().float())
    return NVFP4Tensor.to_nvfp4(x.contiguous(), per_tensor_scale=scale).dequantize(x.dtype)


def _assert_bits_equal(ours: Tensor, reference: Tensor) -> None:
    """Equal values, signs of zero included; NaN equals NaN."""
    assert ours.dtype == reference.dtype and ours.shape == reference.shape
    both_nan = ours.isnan() & reference.isnan()
    same = (ours == reference) & (ours.signbit() == reference.signbit())
    bad = ~(same | both_nan)
    assert not bad.any(), (ours[bad][:5].tolist(), reference[bad][:5].tolist())


def _mode(name: str, mode: str) -> BlockFormat:
    return dataclasses.replace(get_format(name), scale_mode=mode)


# -- against torchao ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MX)
def test_mx_equals_torchao_on_random_tensors(name: str, mode: str) -> None:
    fmt = _mode(name, mode)
    generator = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        for magnitude in (1e-30, 1e-3, 1.0, 1e4):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(shape, generator=generator) * magnitude).to(dtype)
                _assert_bits_equal(fmt.quantise(x), _mx_reference(x, name, mode))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", MX)
def test_mx_equals_torchao_on_edge_cases(name: str, mode: str) -> None:
    x = torch.tensor(list(EDGES.values()))
    for dtype in (torch.float32, torch.bfloat16):
        _assert_bits_equal(
            _mode(name, mode).quantise(x.to(dtype)), _mx_reference(x.to(dtype), name, mode)
        )


@pytest.mark.parametrize("name", MX)
def test_mx_blocks_along_any_dim_equal_torchao_on_the_moved_tensor(name: str) -> None:
    fmt = get_format(name)
    x = torch.randn(64, 3, 32, generator=torch.Generator().manual_seed(1))
    for dim in (0, 2, -3):
        moved = x.movedim(dim, -1).contiguous()
        expected = _mx_reference(moved, name, "floor").movedim(-1, dim)
        _assert_bits_equal(fmt.quantise(x, dim=dim), expected)
    # a non-contiguous input (a transposed weight) blocks by its logical layout
    _assert_bits_equal(
        fmt.quantise(x[:, 0].t(), dim=0), fmt.quantise(x[:, 0].t().contiguous(), dim=0)
    )


def test_mx_blocks_with_scale_2_to_the_minus_127_follow_ocp_not_torchao() -> None:
    """torchao casts such a block with another scale than it dequantises with (2**-126 with
    "floor", 1 with "rceil"); here the block's E8M0 scale is used both ways."""
    fmt = get_format("mxfp8_e4m3")
    x = torch.tensor([TINY["amax 2**-119"]])
    # amax 2**-119: scale 2**(-119 - 8) = 2**-127; every element is a power of two in range.
    assert torch.equal(fmt.quantise(x), x)
    reference = _mx_reference(x, "mxfp8_e4m3", "floor")
    assert torch.equal(reference, x / 2)  # torchao halves the block
    assert torch.equal(_mx_reference(x, "mxfp8_e4m3", "rceil"), torch.zeros_like(x))


@pytest.mark.parametrize("shape", [(2, 32), (8, 64), (3, 4, 48)])
def test_nvfp4_equals_torchao(shape: tuple[int, ...]) -> None:
    fmt = get_format("nvfp4")
    generator = torch.Generator().manual_seed(2)
    for magnitude in (1e-20, 1.0, 1e5):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(shape, generator=generator) * magnitude).to(dtype)
            _assert_bits_equal(fmt.quantise(x), _nvfp4_reference(x))
    for name, row in EDGES.items():
        if "zeros" in name:
            continue  # see test_nvfp4_zero_tensor_is_zero
        x = torch.tensor([row, [1.0] * 32])
        _assert_bits_equal(fmt.quantise(x), _nvfp4_reference(x))


def test_nvfp4_zero_tensor_is_zero_where_torchao_gives_nan() -> None:
    x = torch.zeros(2, 32)
    assert torch.equal(get_format("nvfp4").quantise(x), x)
    assert _nvfp4_reference(x).isnan().all()


# -- properties (no reference needed) -------------------------------------------------------


def test_presets_and_names() -> None:
    assert set(BLOCK_PRESETS) == {*MX, "nvfp4"}
    for name in (*MX, "nvfp4"):
        fmt = get_format(name.upper())
        assert isinstance(fmt, BlockFormat) and repr(fmt) == f"BlockFormat({name!r})"
        assert get_format(fmt) is fmt
    assert get_format("mxfp8_e4m3").bits == 8.25 and get_format("nvfp4").bits == 4.5
    stochastic = get_format("mxfp4_e2m1", rounding="stochastic")
    assert stochastic.element.rounding == "stochastic"
    assert repr(stochastic) == "BlockFormat('mxfp4_e2m1', rounding='stochastic')"
    with pytest.raises(FormatError, match="mxfp8_e4m3"):
        get_format("mxfp9")


@pytest.mark.parametrize("name", MX)
def test_mx_scale_is_the_floor_rule_and_values_are_on_the_grid(name: str) -> None:
    fmt = get_format(name)
    element = fmt.element
    emax = math.frexp(element.max_absolute_value)[1] - 1
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) * 2.0 ** torch.randint(
        -20, 20, (16, 2), generator=torch.Generator().manual_seed(4)
    ).repeat_interleave(32, dim=1)
    y = fmt.quantise(x)
    blocks, rounded = x.reshape(16, 2, 32), y.reshape(16, 2, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = 2.0 ** (torch.floor(torch.log2(amax)) - emax)
    elements = rounded / scale
    assert torch.equal(element.quantise(elements), elements)  # on the element grid
    assert torch.equal(elements, element.quantise(blocks / scale))  # nearest at that scale
    assert torch.equal(fmt.quantise(y), y)  # idempotent: the block scale does not change


def test_nvfp4_scales_and_grid() -> None:
    fmt = dataclasses.replace(get_format("nvfp4"), tensor_scale=False)
    x = torch.tensor([[6.0 * 0.75, 3.0, 1.0, -0.5] * 4])  # amax 4.5: block scale 0.75
    assert fmt.quantise(x).tolist() == [[4.5, 3.0, 1.125, -0.375] * 4]  # 1/0.75 -> 1.5
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5))
    y = fmt.quantise(x).reshape(4, 4, 16)
    scale = (x.reshape(4, 4, 16).abs().amax(-1, keepdim=True) / 6).to(torch.float8_e4m3fn).float()
    assert torch.equal(E2M1.quantise(y / scale), y / scale)


@pytest.mark.parametrize("name", [*MX, "nvfp4"])
def test_special_values_and_zero_blocks(name: str) -> None:
    fmt = get_format(name)
    x = torch.ones(3, 32)
    x[0, 3] = math.nan
    x[1, 5] = -math.inf
    x[2] = 0.0
    y = fmt.quantise(x)
    if name == "nvfp4":  # the tensor scale is not finite: all NaN
        assert y.isnan().all()
        return
    assert y[0].isnan().all()  # a NaN block: E8M0's NaN scale
    assert y[1, 5].item() == -math.inf and (y[1].abs() < 1e-30).sum() == 31
    assert torch.equal(y[2], x[2])


def test_dtypes_shape_and_input_untouched() -> None:
    fmt = get_format("mxfp6_e2m3")
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = torch.randn(2, 64).to(dtype)
        before = x.clone()
        y = fmt.quantise(x)
        assert y.dtype == dtype and y.shape == x.shape and torch.equal(x, before)
        assert torch.equal(y, fmt.quantise(x.float()).to(dtype))


def test_errors_name_shape_and_block_size() -> None:
    fmt = get_format("mxfp8_e4m3")
    with pytest.raises(FormatError, match=r"shape \(4, 48\).*block size 32.*no padding"):
        fmt.quantise(torch.ones(4, 48))
    with pytest.raises(FormatError, match="dim=2 is out of range"):
        fmt.quantise(torch.ones(4, 32), dim=2)
    with pytest.raises(FormatError, match=r"dtype torch\.int64"):
        fmt.quantise(torch.ones(4, 32, dtype=torch.int64))
    with pytest.raises(FormatError, match=r"torch\.Tensor"):
        fmt.quantise([1.0] * 32)  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="scale_mode"):
        BlockFormat(E2M1, 16, "e4m3", scale_mode="ceil")
    with pytest.raises(FormatError, match="tensor_scale"):
        BlockFormat(E2M1, 32, "e8m0", tensor_scale=True)
    with pytest.raises(FormatError, match="block_size"):
        BlockFormat(E2M1, 0)


def test_stochastic_elements_are_unbiased_and_on_the_grid() -> None:
    fmt = get_format("mxfp4_e2m1", rounding="stochastic")
    x = torch.tensor([[4.0] + [1.25] * 31]).repeat(4000, 1)  # scale 1: 1.25 between 1 and 1.5
    y = fmt.quantise(x, generator=torch.Generator().manual_seed(0))
    assert set(y[:, 1:].unique().tolist()) == {1.0, 1.5}
    assert abs(y[:, 1:].mean().item() - 1.25) < 0.01


def test_block_stats() -> None:
    fmt = get_format("mxfp4_e2m1")
    x = torch.tensor([[1000.0] + [1e-3] * 31, [1.0] * 32])
    stats = fmt.block_stats(x)
    assert stats.flushed == 31 / 64 and stats.scale_clipped == 0.0
    assert stats.error == pytest.approx(float((fmt.quantise(x) - x).norm() / x.norm()))
    exact = fmt.block_stats(torch.ones(2, 32))
    assert exact.flushed == 0.0 and exact.error == 0.0
    tiny = get_format("mxfp8_e4m3").block_stats(torch.full((1, 32), 2.0**-130))
    assert tiny.scale_clipped == 1.0  # wants 2**-138: below E8M0's 2**-127
    nv = get_format("nvfp4").block_stats(torch.tensor([[1e4] * 16 + [1e-3] * 16]))
    assert nv.scale_clipped == 0.5  # the small block's scale is below E4M3's range


# -- what a tensor's overall scale changes (the numbers of docs/guide/formats.rst) ----------

_X = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name", [*MX, "nvfp4"])
def test_power_of_two_tensor_scale_is_absorbed_exactly(name: str) -> None:
    """Scaling a tensor by 2**k scales its rounding by 2**k, bit for bit, for k in -100..100:
    the per-block scales absorb it (what unit scaling's tensor-wide scale cannot change)."""
    fmt = get_format(name)
    reference = fmt.quantise(_X)
    for k in range(-100, 101, 10):
        assert torch.equal(fmt.quantise(_X * 2.0**k), reference * 2.0**k), k
    assert fmt.block_stats(_X * 2.0**100) == fmt.block_stats(_X)


def test_e8m0_range_is_where_a_tensor_scale_still_matters() -> None:
    """At 2**-130 (far below any trained tensor) E8M0 runs out: every block's scale is
    clipped and MXFP4 flushes 95% of the values; MXFP8's E4M3 elements keep them."""
    mx8, mx4 = get_format("mxfp8_e4m3"), get_format("mxfp4_e2m1")
    at_one, tiny = mx4.block_stats(_X), mx4.block_stats(_X * 2.0**-130)
    assert at_one.scale_clipped == 0.0 and round(at_one.error, 4) == 0.1168
    assert tiny.scale_clipped == 1.0 and round(tiny.flushed, 4) == 0.9546
    assert mx8.block_stats(_X * 2.0**-120).scale_clipped == pytest.approx(0.2578125)
    assert round(mx8.block_stats(_X * 2.0**-130).error, 4) == 0.0267


def test_nvfp4_without_tensor_scale_depends_on_the_tensor_scale() -> None:
    """E4M3 block scales span 2**-6..448: without NVFP4's FP32 tensor scale, a tensor at
    2**-8 has every block scale clipped and 69% of its values flushed; at 2**12, every
    block saturates. With the tensor scale (the preset) both are as at scale 1."""
    single = dataclasses.replace(get_format("nvfp4"), tensor_scale=False)
    at_one = single.block_stats(_X)
    assert round(at_one.flushed, 4) == 0.0769 and at_one.scale_clipped == 0.0
    small = single.block_stats(_X * 2.0**-8)
    assert small.scale_clipped == 1.0 and round(small.flushed, 4) == 0.6865
    assert single.block_stats(_X * 2.0**12).scale_clipped == 1.0
    two_level = get_format("nvfp4")
    assert two_level.block_stats(_X * 2.0**-8) == two_level.block_stats(_X)


def test_nvfp4_tiny_tensor_uses_block_scales_alone() -> None:
    x = _X * 2.0**-130  # tensor scale amax / 2688 below float32's smallest normal
    single = dataclasses.replace(get_format("nvfp4"), tensor_scale=False)
    assert torch.equal(get_format("nvfp4").quantise(x), single.quantise(x))
    assert not get_format("nvfp4").quantise(x).isnan().any()
