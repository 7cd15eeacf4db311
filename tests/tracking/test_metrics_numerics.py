"""Statistics that once went silently wrong: huge finite values, huge counts, and errors
that switched the compiled statistics kernel off for the whole process."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from unitscale.tracking import metrics
from unitscale.tracking.metrics import Metrics, _stats_kernel, stats_to_data, tensor_stats


@pytest.fixture(autouse=True, params=["auto", "eager"])
def stats_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on both CPU paths: the native kernel (the default) and PyTorch
    ops (``UNITSCALE_STATS=eager``, also what runs without the native extension)."""
    monkeypatch.setenv("UNITSCALE_STATS", request.param)
    return str(request.param)


def data_of(x: torch.Tensor) -> Metrics.Data:
    return stats_to_data(tensor_stats(x).tolist(), x.numel())


@pytest.mark.parametrize("magnitude", [1e20, 1e37])
def test_std_of_huge_finite_values_is_finite_and_right(magnitude: float) -> None:
    """float32 squares of 1e20 overflow to Inf; the old kernel reported std = NaN."""
    torch.manual_seed(0)
    x = (torch.randn(4096) * magnitude).clamp(-3e38, 3e38)
    ref = x.double()
    d = data_of(x)
    assert d.finite
    assert d.std == pytest.approx(ref.std(correction=0).item(), rel=1e-5)
    assert d.rms == pytest.approx(ref.square().mean().sqrt().item(), rel=1e-5)
    assert d.mean_abs == pytest.approx(ref.abs().mean().item(), rel=1e-5)
    assert d.abs_mean == pytest.approx(ref.mean().abs().item(), rel=1e-3, abs=1e-6 * magnitude)


def test_sums_near_float32_max_are_finite() -> None:
    x = torch.full((1000,), 3e38)
    d = data_of(x)
    assert d.mean_abs == pytest.approx(3e38, rel=1e-6) and d.std == pytest.approx(0.0, abs=1e33)
    assert math.isfinite(d.rms)


def test_inf_and_nan_still_follow_ieee() -> None:
    d = data_of(torch.tensor([1e20, float("inf")]))
    assert d.abs_max == math.inf and math.isnan(d.std)
    d = data_of(torch.zeros(5))
    assert (d.std, d.mean_abs, d.rms) == (0.0, 0.0, 0.0)


def test_counts_are_exact_beyond_float32_integers() -> None:
    """2**24 + 1 NaNs: counts held in float32 (as the old kernel did) round to 2**24."""
    n = 2**24 + 1
    x = torch.full((n,), math.nan)
    d = data_of(x)
    assert d.nan_count == n
    assert d.numel == n


class _CountCapacity(TorchFunctionMode):
    """Fails any integer ``sum`` whose dtype cannot hold the number of elements summed."""

    def __init__(self) -> None:
        super().__init__()
        self.checked = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.sum, torch.Tensor.sum) and kwargs.get("dtype") is not None:
            dtype = kwargs["dtype"]
            if not dtype.is_floating_point:
                assert torch.iinfo(dtype).max >= args[0].numel(), f"{dtype} count wraps"
                self.checked += 1
        return func(*args, **kwargs)


def test_counts_do_not_wrap_above_2_to_the_31_elements() -> None:
    """A 2**31 + 1 element tensor on the meta device (no memory): every count's integer
    type must hold its element count (the old kernel summed in int32, which wraps)."""
    x = torch.empty(2**31 + 1, device="meta")
    with _CountCapacity() as mode:
        _stats_kernel(x)
    assert mode.checked == 2 + 2 * len(metrics.FORMAT_KEYS)


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> metrics._Kernel:
    monkeypatch.setenv("UNITSCALE_STATS", "compiled")
    return metrics._Kernel()


def test_an_unexpected_error_propagates_and_does_not_switch_to_eager(
    kernel: metrics._Kernel,
) -> None:
    def broken(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("a bug in the kernel")

    kernel.compiled = broken
    with pytest.raises(ValueError, match="a bug in the kernel"):
        kernel(torch.ones(3))
    assert not kernel.failed


def test_out_of_memory_propagates(kernel: metrics._Kernel) -> None:
    def out_of_memory(x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory")

    kernel.compiled = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        kernel(torch.ones(3))
    assert not kernel.failed


def test_a_compile_failure_falls_back_for_that_kind_of_tensor_only(
    kernel: metrics._Kernel,
) -> None:
    calls: list[int] = []

    def fails_on_2d(x: torch.Tensor) -> torch.Tensor:
        calls.append(x.dim())
        if x.dim() == 2:
            raise torch._dynamo.exc.TorchDynamoException("cannot compile this")
        return _stats_kernel(x)

    kernel.compiled = fails_on_2d
    with pytest.warns(RuntimeWarning, match="cannot compile this"):
        eager = kernel(torch.ones(2, 3))
    assert torch.equal(eager, _stats_kernel(torch.ones(2, 3)))
    kernel(torch.ones(2, 3))  # same kind: eager, no new attempt
    kernel(torch.ones(3))  # another kind: still compiled
    assert calls == [2, 1]
    assert kernel.failed


def test_compiled_kernel_handles_huge_values_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNITSCALE_STATS", "compiled")
    torch.manual_seed(0)
    x = torch.randn(1000) * 1e20
    d = data_of(x)
    assert d.std == pytest.approx(x.double().std(correction=0).item(), rel=1e-5)
    assert metrics._kernel.compiled is not None and not metrics._kernel.failed


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_device_kernel_variance_where_the_mean_dominates(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mean 1000, std 1e-3: the variance of x / max|x| was 0.4% off in float32."""
    torch.manual_seed(0)
    x = torch.randn(100_000) * 1e-3 + 1000.0
    if compiled:
        monkeypatch.setenv("UNITSCALE_STATS", "compiled")
        values = metrics.tensor_stats(x)
    else:
        values = _stats_kernel(x)
    want = x.double().var(correction=0).item()
    assert values[2].item() == pytest.approx(want, rel=1e-4)
