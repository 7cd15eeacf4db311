"""Properties of the statistics recorded for each tensor."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from unitscale.tracking.metrics import (
    FORMAT_RANGES,
    Metrics,
    _stats_kernel,
    stats_to_data,
    tensor_stats,
)

CASTS = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


@pytest.fixture(autouse=True, params=["auto", "eager"])
def stats_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on both CPU paths: the native kernel (the default) and PyTorch
    ops (``UNITSCALE_STATS=eager``, also what runs without the native extension)."""
    monkeypatch.setenv("UNITSCALE_STATS", request.param)
    return str(request.param)


def data_of(x: torch.Tensor) -> Metrics.Data:
    return stats_to_data(tensor_stats(x).tolist(), x.numel())


@pytest.mark.parametrize("shape", [(1,), (7, 3), (64, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_statistics_match_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3 + 0.5).to(dtype)
    d = data_of(x)
    ref = x.double()
    tol = {"rel": 1e-3} if dtype == torch.float32 else {"rel": 1e-2}
    assert d.numel == x.numel()
    assert d.mean_abs == pytest.approx(ref.abs().mean().item(), **tol)
    assert d.abs_mean == pytest.approx(ref.mean().abs().item(), **tol)
    assert d.std == pytest.approx(ref.std(correction=0).item(), **tol, abs=1e-6)
    assert d.abs_max == pytest.approx(ref.abs().max().item(), **tol)
    assert d.abs_min == pytest.approx(ref.abs().min().item(), **tol)
    assert d.rms == pytest.approx(ref.square().mean().sqrt().item(), **tol)
    assert d.finite


def test_one_element_has_zero_std() -> None:
    d = data_of(torch.tensor([-2.5]))
    assert d.std == 0.0
    assert d.mean_abs == d.abs_max == d.abs_min == d.rms == 2.5


@pytest.mark.parametrize("key", list(CASTS))
def test_underflow_and_overflow_agree_with_casts(key: str) -> None:
    """Underflow: non-zero values that the format's own cast rounds to zero (ties included)."""
    torch.manual_seed(1)
    min_sub, max_val = FORMAT_RANGES[key]
    # log-uniform magnitudes spanning the format's whole range and beyond, plus exact ties.
    exps = torch.empty(20000).uniform_(math.log2(min_sub) - 4, math.log2(max_val) + 2)
    x = torch.exp2(exps) * torch.randn(20000).sign()
    ties = torch.tensor([min_sub / 2, -min_sub / 2, min_sub, max_val, -max_val * 1.01])
    x = torch.cat([x, ties, torch.zeros(10)])
    d = data_of(x)
    nonzero = x != 0
    if key == "bf16":
        x = x.double()
    cast = x.to(CASTS[key]).to(torch.float64)
    expected_under = ((cast == 0) & nonzero).double().mean().item()
    expected_over = (x.abs() > max_val).double().mean().item()
    assert d.underflow[key] == pytest.approx(expected_under, abs=1e-12)
    assert d.overflow[key] == pytest.approx(expected_over, abs=1e-12)
    assert 0 < d.underflow[key] and 0 < d.overflow[key]


def test_empty_tensor_is_defined() -> None:
    d = data_of(torch.empty(0, 4))
    assert d.numel == 0
    assert (d.mean_abs, d.std, d.abs_max, d.rms) == (0.0, 0.0, 0.0, 0.0)
    assert all(v == 0.0 for v in d.underflow.values())


def test_nan_and_inf_are_counted_not_raised() -> None:
    x = torch.tensor([1.0, float("nan"), float("inf"), -2.0])
    d = data_of(x)
    assert (d.nan_count, d.inf_count, d.finite) == (1, 1, False)
    assert math.isnan(d.mean_abs)
    # inf overflows every format; NaN is not counted as overflow.
    assert d.overflow["e4m3"] == pytest.approx(0.25)
    d = data_of(torch.tensor([1.0, float("-inf")]))
    assert d.abs_max == math.inf and d.nan_count == 0


@pytest.fixture
def compiled_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNITSCALE_STATS", "compiled")


def test_compiled_and_eager_statistics_agree(compiled_statistics: None) -> None:
    from unitscale.tracking.metrics import _kernel, _stats_kernel

    torch.manual_seed(2)
    for x in [torch.randn(1000) * 1e3, torch.randn(37, 5).t(), torch.randn(300).half()]:
        compiled = stats_to_data(tensor_stats(x).tolist(), x.numel())
        eager = stats_to_data(_stats_kernel(x).tolist(), x.numel())
        assert compiled.underflow == eager.underflow and compiled.overflow == eager.overflow
        for field in Metrics.Data.SCALAR_FIELDS:
            assert getattr(compiled, field) == pytest.approx(getattr(eager, field), rel=1e-5)
    assert _kernel.compiled is not None and not _kernel.failed  # the compiled path ran


def test_tracked_model_with_compiled_statistics(compiled_statistics: None) -> None:
    from unitscale.transforms import track_scales

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    tracked = track_scales(model)
    x = torch.randn(8, 16)
    out = tracked(x)
    assert torch.equal(out, model(x))
    out.square().mean().backward()
    graph = tracked.scales_graph()
    gelu = next(n for n in graph.nodes if n.target is torch.nn.functional.gelu)
    expected = torch.nn.functional.gelu(model[0](x)).detach()
    assert gelu.meta["metrics"].fwd.mean_abs == pytest.approx(expected.abs().mean().item())
    assert gelu.meta["metrics"].bwd is not None


class _NoHostReads(TorchFunctionMode):
    """Raises on every way of reading a tensor's values on the host (a device sync on a GPU;
    ``torch.cuda.set_sync_debug_mode`` is CUDA-only, so this works on any device)."""

    READS = (
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__bool__,
        torch.Tensor.__float__,
        torch.Tensor.__int__,
        torch.Tensor.cpu,
        torch.Tensor.numpy,
    )

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in self.READS or (
            func is torch.Tensor.to
            and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device")))
        ):
            raise AssertionError(f"host read during statistics: {func.__name__}")
        return func(*args, **kwargs)


def test_no_host_reads_is_able_to_fail() -> None:
    with _NoHostReads(), pytest.raises(AssertionError, match="host read"):
        bool(torch.ones(1) > 0)
    with _NoHostReads(), pytest.raises(AssertionError, match="host read"):
        torch.ones(1).to("cpu")


@pytest.mark.parametrize(
    "x",
    [
        torch.randn(100, requires_grad=True),
        torch.tensor([1.0, float("nan"), float("inf")]),
        torch.empty(0),
        torch.randn(8, 8).half().t(),
    ],
)
def test_statistics_do_not_modify_and_the_device_kernel_does_not_sync(x: torch.Tensor) -> None:
    """On an accelerator, statistics are computed on the device and read once per graph: the
    device kernel must not read the host. (The CPU paths read partial results on purpose:
    there a read costs nothing.)"""
    before = x.detach().clone()
    v = tensor_stats(x)
    assert not v.requires_grad and v.dtype == torch.float64
    if x.numel():
        with _NoHostReads():
            _stats_kernel(x.detach())
    torch.testing.assert_close(x.detach(), before, rtol=0, atol=0, equal_nan=True)


def test_each_record_owns_its_fraction_dicts() -> None:
    """Records built from the same counts share no dict: changing one leaves the others."""
    from unitscale.tracking.metrics import FORMAT_KEYS, stats_to_data, tensor_stats

    quiet = tensor_stats(torch.ones(4)).tolist()
    loud = tensor_stats(torch.tensor([1e-30, 1e6, 1.0, 2.0])).tolist()
    records = [stats_to_data(values, 4) for values in (quiet, quiet, loud, loud)]
    for record in records:
        record.underflow["e4m3"] = record.overflow["e4m3"] = 99.0
    fresh = [stats_to_data(values, 4) for values in (quiet, loud)]
    assert fresh[0].underflow == fresh[0].overflow == dict.fromkeys(FORMAT_KEYS, 0.0)
    assert fresh[1].underflow["e4m3"] == 0.25 and fresh[1].overflow["e4m3"] == 0.25
    assert fresh[1].overflow["fp16"] == 0.25 and fresh[1].overflow["bf16"] == 0.0


@pytest.mark.parametrize("numel", [3, 7, 2**40 + 1])
def test_fraction_dicts_are_counts_over_numel_in_key_order(numel: int) -> None:
    """The records' fractions are ``count / numel`` for each format in ``FORMAT_KEYS``'
    order, the same from the written-out four-format path as from the general one (which a
    different number of presets would take)."""
    from unitscale.tracking import metrics

    assert len(metrics.FORMAT_KEYS) == 4  # the presets: stats_to_data takes the fast path
    under, over = [0.0, 1.0, 2.0, 3.0], [3.0, 0.0, 1.0, 0.0]
    values = [4.0, 1.0, 1.0, 2.0, 0.5, 0.0, 0.0, *under, *over]
    record = stats_to_data(values, numel)
    for counts, fractions in ((under, record.underflow), (over, record.overflow)):
        expected = {
            key: count / numel for key, count in zip(metrics.FORMAT_KEYS, counts, strict=True)
        }
        assert list(fractions.items()) == list(expected.items())
        assert metrics._fractions_any(counts, numel) == fractions
    with pytest.raises(ValueError):  # the general path checks the number of counts too
        metrics._fractions_any(under[:3], numel)
