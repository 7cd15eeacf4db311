"""ScaleMonitor's per-step NaN/Inf check must read flags that the device has finished writing.

On CUDA a ``non_blocking=True`` copy to the host returns at once and the host buffer is
filled later, so reading it without a synchronisation can see stale values. The CPU has no
such race, so the test models one: a non-blocking copy to the host returns stale
"all finite" flags, and only a blocking copy (or one followed by a synchronisation) gives the
real ones.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from unitscale.tracking import NonFiniteWarning, ScaleMonitor


class _StaleNonBlockingCopies(TorchFunctionMode):
    """``t.to("cpu", non_blocking=True)`` of a bool tensor returns a copy not yet written:
    here, the stale ``True`` ("finite") of an earlier step."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is torch.Tensor.to and kwargs.get("non_blocking") and result.dtype == torch.bool:
            return torch.ones_like(result)
        return result


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum()


def test_non_finite_loss_is_seen_even_when_non_blocking_copies_are_stale() -> None:
    model = Scaled()
    monitor = ScaleMonitor(model, every=None)
    loss = monitor.module(torch.tensor([1.0, float("inf"), 2.0, 3.0]))
    loss.backward()
    with _StaleNonBlockingCopies(), warnings.catch_warnings():
        warnings.simplefilter("ignore", NonFiniteWarning)
        report = monitor.step()
    assert report is not None and "loss" in report.trigger
