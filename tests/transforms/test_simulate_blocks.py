"""simulate_format with block-scaled formats: each GEMM's operands blocked along its reduction
dimension (forward, input gradient, weight gradient), against torchao's MXFP8 training
emulation where torchao is installed and against BlockFormat.quantise everywhere; the
shared op classification and summary; the refusal of real block-scaled GEMMs."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unitscale.formats import FormatError, get_format
from unitscale.transforms import fp8_summary, simulate_format, simulate_fp8, to_fp8, unit_scale
from unitscale.transforms.lowp._blocks import NO_BLOCK_COUNTERPART


def _step(model: nn.Module, x: Tensor, grad: Tensor) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    assert x.grad is not None
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


def _torchao_mx_mm(mode: str) -> Any:
    reason = "torchao (the test extra) is the reference of MX training's GEMMs"
    try:
        linear = pytest.importorskip("torchao.prototype.moe_training.mxfp8_linear", reason=reason)
        config = pytest.importorskip("torchao.prototype.mx_formats.config", reason=reason)
        kp = pytest.importorskip(
            "torchao.quantization.quantize_.common.kernel_preference", reason=reason
        )
    except pytest.skip.Exception:
        raise
    except Exception as error:
        pytest.skip(f"{reason}, and it does not import with torch {torch.__version__}: {error}")
    e4m3 = torch.float8_e4m3fn

    def mm(x: Tensor, w: Tensor) -> Tensor:
        out: Tensor = linear.mx_mm.apply(
            x,
            w,
            e4m3,
            e4m3,
            e4m3,
            32,
            kp.KernelPreference.EMULATED,
            config.MXFP8Dim0CastKernelChoice.TORCH,
            config.MXFP8Dim1CastKernelChoice.TORCH,
            getattr(config.ScaleCalculationMode, mode.upper()),
            False,
        )
        return out

    return mm


@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_linear_equals_torchao_mxfp8_training_bit_for_bit(mode: str) -> None:
    mm = _torchao_mx_mm(mode)
    torch.manual_seed(0)
    x, w, g = torch.randn(4, 16, 64), torch.randn(96, 64), torch.randn(4, 16, 96)
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_ref = mm(x_ref, w_ref)
    y_ref.backward(g)
    linear = nn.Linear(64, 96, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    mx = get_format("mxfp8_e4m3")
    fmt = mx if mode == "floor" else type(mx)(mx.element, scale_mode="rceil")
    out, grad_x, grads = _step(simulate_format(linear, fmt, fmt, ops="linear"), x, g)
    assert torch.equal(out, y_ref.detach())
    assert torch.equal(grad_x, x_ref.grad)
    assert torch.equal(grads["weight"], w_ref.grad)


@pytest.mark.parametrize(
    ("fwd", "bwd"),
    [("mxfp8_e4m3", "mxfp8_e5m2"), ("mxfp4_e2m1", "mxfp4_e2m1"), ("nvfp4", "nvfp4")],
)
def test_each_gemm_blocks_its_reduction_dimension(fwd: str, bwd: str) -> None:
    f, b = get_format(fwd), get_format(bwd)
    torch.manual_seed(1)
    model = nn.Linear(64, 32)
    x, g = torch.randn(2, 16, 64), torch.randn(2, 16, 32)
    out, grad_x, grads = _step(simulate_format(model, fwd, bwd), x, g)
    rows, g_rows, w = x.reshape(32, 64), g.reshape(32, 32), model.weight.detach()
    expected = f.quantise(rows, dim=-1) @ f.quantise(w, dim=-1).t() + model.bias.detach()
    assert torch.equal(out, expected.reshape(2, 16, 32))
    expected_grad_x = b.quantise(g_rows, dim=-1) @ f.quantise(w, dim=0)  # along N
    assert torch.equal(grad_x, expected_grad_x.reshape(2, 16, 64))
    expected_grad_w = b.quantise(g_rows, dim=0).t() @ f.quantise(rows, dim=0)  # along M
    assert torch.equal(grads["weight"], expected_grad_w)
    assert torch.equal(grads["bias"], g_rows.sum(0))  # the unrounded output gradient
    assert not torch.equal(out, model(x))  # something was rounded


def test_unit_scaled_linear_keeps_its_factors() -> None:
    torch.manual_seed(2)
    plain = nn.Linear(64, 32, bias=False)
    unit = unit_scale(plain)
    mx = get_format("mxfp6_e2m3")
    x = torch.randn(32, 64)
    simulated = simulate_format(unit, mx, mx)
    out = simulated(x)
    assert len(fp8_summary(simulated).converted) == 1
    rounded = copy.deepcopy(unit)  # the unit-scaled model with its weight pre-rounded
    (weight,) = rounded.parameters()
    with torch.no_grad():
        weight.copy_(mx.quantise(weight, dim=-1))
    expected = rounded(mx.quantise(x, dim=-1))
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: Tensor) -> Tensor:
        q = self.proj(x)
        scores = q @ x.transpose(-1, -2)  # a two-operand matmul: converted with "matmuls"
        mixed = torch.bmm(scores, x)
        return F.scaled_dot_product_attention(mixed, x, x)  # no block-scaled counterpart


def test_op_classification_and_summary_are_the_fp8_ones() -> None:
    x = torch.randn(2, 32, 32)
    model = simulate_format(_Attention(), "mxfp8_e4m3", "mxfp8_e4m3", ops="matmuls")
    model(x)
    summary = fp8_summary(model)
    fp8 = simulate_fp8(_Attention())
    fp8(x)
    reference = fp8_summary(fp8)
    assert summary.transform == "simulate_format"
    assert set(summary.converted) | {op for op, _ in summary.not_converted} == set(
        reference.converted
    )
    assert summary.not_converted == (("scaled_dot_product_attention", NO_BLOCK_COUNTERPART),)
    linear_only = simulate_format(_Attention(), "mxfp8_e4m3", "mxfp8_e4m3", ops="linear")
    linear_only(x)
    assert fp8_summary(linear_only).converted == ("proj: linear (q)",)


def test_matmul_gradients_block_along_n_and_m() -> None:
    class Product(nn.Module):
        def forward(self, a: Tensor, b: Tensor) -> Tensor:
            return a @ b

    f, b_fmt = get_format("mxfp4_e2m1"), get_format("mxfp8_e5m2")
    torch.manual_seed(3)
    a, b = torch.randn(2, 32, 64, requires_grad=True), torch.randn(64, 32, requires_grad=True)
    g = torch.randn(2, 32, 32)
    out = simulate_format(Product(), f, b_fmt)(a, b)
    out.backward(g)
    assert torch.equal(out, f.quantise(a.detach(), -1) @ f.quantise(b.detach(), -2))
    grad_a = b_fmt.quantise(g, -1) @ f.quantise(b.detach(), -1).mT
    grad_b = (f.quantise(a.detach(), -2).mT @ b_fmt.quantise(g, -2)).sum(0)
    assert torch.equal(a.grad, grad_a) and torch.equal(b.grad, grad_b)


def test_dimensions_not_multiple_of_block_are_left_out_with_the_reason() -> None:
    model = simulate_format(nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 10)), "nvfp4", "nvfp4")
    model(torch.randn(32, 64))
    summary = fp8_summary(model)
    assert summary.converted == ("0: linear (input_1)",)
    ((op, reason),) = summary.not_converted
    assert op == "1: linear (input_2)" and "M=32, K=96, N=10" in reason and "16" in reason


def test_stochastic_gradients_forward_deterministic() -> None:
    torch.manual_seed(4)
    model = nn.Linear(64, 64, bias=False)
    stochastic = get_format("nvfp4", rounding="stochastic")
    sim = simulate_format(model, "nvfp4", stochastic)
    x, g = torch.randn(32, 64), torch.randn(32, 64)
    first = _step(sim, x, g)
    sim.zero_grad()
    second = _step(sim, x, g)
    assert torch.equal(first[0], second[0])
    assert not torch.equal(first[1], second[1])  # different draws
    nearest = simulate_format(model, "nvfp4", "nvfp4")
    assert not torch.equal(first[1], _step(nearest, x, g)[1])


def test_argument_errors() -> None:
    with pytest.raises(FormatError, match="mix a block-scaled format with a per-tensor one"):
        simulate_format(nn.Linear(32, 32), "mxfp8_e4m3", "e5m2")
    with pytest.raises(FormatError, match="scaling='tensorwise' with block-scaled"):
        simulate_format(nn.Linear(32, 32), "mxfp8_e4m3", "mxfp8_e4m3", scaling="tensorwise")
    with pytest.raises(FormatError, match="block-scaled format, not an FP8 recipe"):
        simulate_fp8(nn.Linear(32, 32), recipe="mxfp8_e4m3")
    with pytest.raises(FormatError, match="argument 'ops'"):
        simulate_format(nn.Linear(32, 32), "nvfp4", "nvfp4", ops="all")  # type: ignore[arg-type]


@pytest.mark.parametrize("recipe", ["mxfp8_e4m3", "NVFP4", get_format("mxfp4_e2m1")])
def test_real_block_scaled_gemm_is_refused(recipe: Any) -> None:
    with pytest.raises(FormatError, match=r"Blackwell-class.*10\.x.*simulate_format"):
        to_fp8(nn.Linear(32, 32), recipe=recipe)


def test_to_fp8_refuses_a_block_simulated_model() -> None:
    from unitscale.errors import CaptureError

    with pytest.raises((CaptureError, FormatError)):
        to_fp8(simulate_format(nn.Linear(32, 32), "nvfp4", "nvfp4"))


@pytest.mark.parametrize("readout", [False, True])
def test_unit_scaled_gradients_keep_their_factors(readout: bool) -> None:
    """Operands and gradients of small integers are exact in MXFP8 at any blocking, so the
    block-scaled unit-scaled op must equal the unrounded one, output and both gradients:
    the unit-scaled factors sit where the op applies them."""
    import unitscale.functional as U

    fmt = get_format("mxfp8_e4m3")
    generator = torch.Generator().manual_seed(5)
    x = torch.randint(-4, 5, (32, 64), generator=generator).float()
    w = torch.randint(-4, 5, (32, 64), generator=generator).float()
    g = torch.randint(-4, 5, (32, 32), generator=generator).float()
    op = U.linear_readout if readout else U.linear

    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(w.clone())

        def forward(self, inp: Tensor) -> Tensor:
            return op(inp, self.weight, None)

    simulated = simulate_format(One(), fmt, fmt, ops="linear")
    out, grad_x, grads = _step(simulated, x, g)
    assert len(fp8_summary(simulated).converted) == 1
    ref_out, ref_grad_x, ref_grads = _step(One(), x, g)
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad_x, ref_grad_x, rtol=1e-6, atol=0)
    torch.testing.assert_close(grads["weight"], ref_grads["weight"], rtol=1e-6, atol=0)


def test_keyword_arguments_of_addmm_and_mm() -> None:
    class Ops(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.zeros(32))

        def forward(self, a: Tensor, b: Tensor) -> Tensor:
            return torch.addmm(self.bias, a, b, beta=1, alpha=1) + torch.mm(a, mat2=b)

    fmt = get_format("mxfp8_e4m3")
    a, b = torch.randn(32, 64), torch.randn(64, 32)
    simulated = simulate_format(Ops(), fmt, fmt)
    out = simulated(a, b)
    assert len(fp8_summary(simulated).converted) == 2
    product = fmt.quantise(a, -1) @ fmt.quantise(b, -2)
    torch.testing.assert_close(out, 2 * product, rtol=1e-6, atol=1e-5)


def test_skip_keeps_a_layer_out_of_the_block_format() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Linear(64, 64, bias=False))
    x = torch.randn(32, 64)
    blocked = simulate_format(model, "mxfp4_e2m1", "mxfp4_e2m1", ops="linear", skip=["0"])
    out = blocked(x)
    hidden = model[0](x)  # the skipped layer runs in FP32, bit for bit
    rounded = simulate_format(model[1], "mxfp4_e2m1", "mxfp4_e2m1", ops="linear")(hidden)
    assert torch.equal(out, rounded) and not torch.equal(out, model(x))
    ((op, reason),) = fp8_summary(blocked).not_converted
    assert op.startswith("0") and reason == "skipped by skip="
