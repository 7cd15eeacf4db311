"""Scale tracking on a CUDA device: the statistics the device kernel gathers equal the CPU
paths' and float64 arithmetic, and a tracked step never synchronises with the host.

Skipped without a GPU (CI has none): ``benchmarks/device_check.sh`` runs these where a GPU is
lent (the ``-k cuda`` selection picks them by this file's name).
"""

from __future__ import annotations

import pytest
import torch

from unitscale.tracking import metrics
from unitscale.tracking.metrics import stats_to_data, tensor_stats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_cuda_statistics_equal_the_cpu_paths() -> None:
    """Same tensor, read on the GPU (the compiled device kernel) and on the CPU (the native
    kernel, then PyTorch ops): counts exactly, sums and extremes to float32 accuracy."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.randn(100_000, generator=g) * 3,
            torch.zeros(100),
            torch.tensor([2.0**-10, 2.0**-17, 448.0, 500.0, 6e4, 7e4, 2.0**-140]),
        ]
    )
    on_gpu = stats_to_data(tensor_stats(x.cuda()).cpu().tolist(), x.numel())
    for mode in ("auto", "eager"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("UNITSCALE_STATS", mode)
            on_cpu = stats_to_data(tensor_stats(x).tolist(), x.numel())
        assert on_gpu.underflow == on_cpu.underflow and on_gpu.overflow == on_cpu.overflow
        assert (on_gpu.abs_max, on_gpu.abs_min) == (on_cpu.abs_max, on_cpu.abs_min)
        for field in ("mean_abs", "abs_mean", "std", "rms"):
            assert getattr(on_gpu, field) == pytest.approx(getattr(on_cpu, field), rel=1e-5)
    assert metrics._kernel.compiled is not None and not metrics._kernel.failed


def test_tracked_step_on_cuda_is_exact_and_never_syncs() -> None:
    from unitscale.transforms import track_scales

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)
    ).cuda()
    tracked = track_scales(model)
    x = torch.randn(32, 64, device="cuda")

    def step() -> torch.Tensor:
        out = tracked(x)
        out.square().mean().backward()
        return out

    step()  # capture and compile first: the check is on a step as training runs them
    tracked.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any host-device synchronisation raises
    try:
        out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, model(x))
    graph = tracked.scales_graph()
    gelu = next(n for n in graph.nodes if n.target is torch.nn.functional.gelu)
    hidden = torch.nn.functional.gelu(model[0](x)).detach().double().cpu()
    fwd = gelu.meta["metrics"].fwd
    assert fwd.mean_abs == pytest.approx(hidden.abs().mean().item(), rel=1e-5)
    assert fwd.std == pytest.approx(hidden.std(correction=0).item(), rel=1e-5)
    assert fwd.abs_max == pytest.approx(hidden.abs().max().item(), rel=1e-6)
    assert gelu.meta["metrics"].bwd is not None
