"""to_fp8 on a CUDA device: what the CPU tests cannot show (cuBLAS's float8 GEMMs, its
alignment rules met by padding, bf16 and autocast, rowwise, delayed scaling).

Skipped without a CUDA device with float8 GEMMs (compute capability 8.9 or later; CI has
none): ``benchmarks/device_check.sh`` runs this file first where a GPU is lent. The
comparisons are against ``simulate_fp8(ops="linear")`` on the same device, within
tolerances, not bit for bit: cuBLAS sums in its own order, applies the scales to the
accumulator and (forward, ``fast_accum=True``) accumulates float8 products in lower
precision; a last-bit difference before a later E4M3/E5M2 rounding can flip it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from unitscale.transforms import fp8_summary, simulate_fp8, to_fp8
from unitscale.transforms.lowp import _scaled_mm as _mm

_REASON = "no CUDA device" if not torch.cuda.is_available() else _mm.float8_device_error("cuda")
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"needs CUDA float8: {_REASON}")


def _stack(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    stack = nn.Sequential(nn.Linear(33, 17), nn.GELU(), nn.Linear(17, 5))
    return stack.to(device="cuda", dtype=dtype)


def _grads(model: nn.Module, x: Tensor, autocast: bool = False) -> list[Tensor]:
    x = x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().square().mean().backward()
    return [out.detach().float(), x.grad.float(), *(p.grad.float() for p in model.parameters())]


def _close(ours: list[Tensor], theirs: list[Tensor], rtol: float) -> None:
    for a, b in zip(ours, theirs, strict=True):
        error = ((a - b).norm() / b.norm().clamp(min=1e-30)).item()
        assert error < rtol, error


@pytest.mark.parametrize("scaling", ["none", "tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_odd_shapes_and_rows_convert_on_cuda(scaling: str) -> None:
    """33 -> 17 -> 5 features, 3 x 7 rows: every GEMM padded to CUDA's multiples of 16."""
    if scaling.startswith("rowwise") and _mm.float8_device_error("cuda", rowwise=True):
        pytest.skip(str(_mm.float8_device_error("cuda", rowwise=True)))
    x = torch.randn(3, 7, 33, device="cuda") * 4
    model = to_fp8(_stack(), scaling=scaling)  # type: ignore[arg-type]
    ours = _grads(model, x)
    assert fp8_summary(model).converted_flop_share == 1.0
    if not scaling.startswith("rowwise"):  # rowwise: torchao's numerics, no simulation
        theirs = _grads(simulate_fp8(_stack(), scaling=scaling, ops="linear"), x)
        _close(ours, theirs, 2e-2)


@pytest.mark.parametrize("mode", ["bf16", "autocast"])
def test_bf16_and_autocast_convert_every_linear_op_on_cuda(mode: str) -> None:
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    x = torch.randn(4, 16, 33, device="cuda", dtype=dtype)
    model = to_fp8(_stack(dtype))
    ours = _grads(model, x, autocast=mode == "autocast")
    summary = fp8_summary(model)
    assert summary.converted_flop_share == 1.0, summary
    theirs = _grads(simulate_fp8(_stack(dtype), ops="linear"), x, autocast=mode == "autocast")
    _close(ours, theirs, 5e-2)


def test_autocast_output_is_bf16_on_cuda() -> None:
    model = to_fp8(_stack())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(torch.randn(8, 33, device="cuda"))
    assert out.dtype == torch.bfloat16


def test_delayed_scaling_runs_and_updates_its_histories_on_cuda() -> None:
    model = to_fp8(_stack(), scaling="delayed")
    x = torch.randn(16, 33, device="cuda")
    _grads(model, x)
    histories = {k: v.clone() for k, v in model.state_dict().items() if "amax_history" in k}
    assert histories and all(v.device.type == "cuda" and v[0] > 0 for v in histories.values())
    _grads(model, x * 10)
    after = model.state_dict()
    assert any(not torch.equal(after[k], v) for k, v in histories.items())


def test_fast_accumulation_stays_close_on_cuda() -> None:
    x = torch.randn(64, 33, device="cuda")
    fast = _grads(to_fp8(_stack(), fast_accum=True), x)
    exact = _grads(to_fp8(copy.deepcopy(_stack()), fast_accum=False), x)
    _close(fast, exact, 1e-2)
