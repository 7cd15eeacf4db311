"""Training steps and their timing, shared by the benchmarks that time ``unitscale train``'s
steps (``bench_fp8_scaling.py``, ``bench_train_step.py``, ``bench_train_kinds.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from unitscale.data import Batch

__all__ = ["timed", "training_step"]


def training_step(
    model: nn.Module,
    optimiser: torch.optim.Optimizer,
    stream: Iterator[Batch],
    device: torch.device | None = None,
) -> Callable[[], float]:
    """One training step of ``model`` per call, as ``unitscale train`` takes it: the next
    batch of ``stream``, forward with labels, backward, ``optimiser.step()``,
    ``zero_grad``, and the loss read back (which waits for the device)."""

    def step() -> float:
        batch = next(stream)
        ids, labels = batch.input_ids, batch.targets  # as the runner: aligned targets
        if device is not None:
            ids, labels = ids.to(device), labels.to(device)
        loss = model(ids, labels=labels)
        loss.backward()
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def timed(work: Callable[[], Any], k: int) -> tuple[float, float]:
    """Mean wall and process CPU seconds of ``k`` calls of ``work``."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(k):
        work()
    return (time.perf_counter() - wall) / k, (time.process_time() - cpu) / k
