"""Parameter-gradient statistics describe ``param.grad``, the gradient the optimiser sees.

In one process they were once this call's gradient (from a hook), under DDP
``param.grad`` (accumulated and reduced). Now both are ``param.grad`` at read time; the
multi-rank check is in ``tests/distributed/test_statistics.py``.
"""

from __future__ import annotations

import pytest
import torch

from unitscale.models import GPTConfig, plain_gpt
from unitscale.tracking.records import graph_records
from unitscale.transforms import track_scales, unit_scale

CONFIG = GPTConfig(vocab_size=64, hidden_size=32, depth=1, heads=2, seq_len=8, aligned_labels=True)


def _param_bwd_rms(model: torch.nn.Module) -> dict[str, float]:
    names = {n for n, _ in model.named_parameters()}
    return {
        r.name: r.metrics["rms"]
        for r in graph_records(model.scales_graph())
        if r.name in names and r.direction == "bwd"
    }


@pytest.fixture
def tracked() -> torch.nn.Module:
    torch.manual_seed(0)
    return track_scales(unit_scale(plain_gpt(CONFIG, seed=0)))


def test_accumulated_calls_report_the_accumulated_gradient(tracked: torch.nn.Module) -> None:
    """Two calls without ``zero_grad``: every parameter's gradient statistics are those of
    ``param.grad`` (the sum of both calls), not of the last call's gradient."""
    ids = torch.randint(0, CONFIG.vocab_size, (4, CONFIG.seq_len + 1))
    for rows in (slice(0, 2), slice(2, 4)):
        tracked(ids[rows, :-1], labels=ids[rows, 1:]).backward()
    reported = _param_bwd_rms(tracked)
    expected = {
        n: float(p.grad.double().pow(2).mean().sqrt())
        for n, p in tracked.named_parameters()
        if p.grad is not None
    }
    assert len(reported) > 10 and sorted(reported) == sorted(expected)
    assert reported == pytest.approx(expected, rel=1e-6)


def test_forward_only_call_reports_no_parameter_gradient(tracked: torch.nn.Module) -> None:
    """A stale ``param.grad`` from an earlier call is not reported for a call whose backward
    has not run: gradient statistics stay None where no gradient flowed."""
    ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len + 1))
    tracked(ids[:, :-1], labels=ids[:, 1:]).backward()
    assert _param_bwd_rms(tracked)
    tracked(ids[:, :-1], labels=ids[:, 1:])
    assert _param_bwd_rms(tracked) == {}
