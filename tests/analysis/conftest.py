"""Fixtures for the analysis tests: a tracked built-in model and hand-built graphs."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from torch.fx import Graph

from unitscale.data import example_batch
from unitscale.models import GPTConfig, plain_gpt
from unitscale.tracking.metrics import Metrics


@pytest.fixture(scope="session")
def tracked_gpt() -> tuple[Graph, dict[str, int]]:
    """The scales graph of a small plain GPT after one forward and backward pass."""
    from unitscale.transforms import track_scales

    model = plain_gpt(GPTConfig(hidden_size=32, depth=1, seq_len=16), seed=0)
    tracked = track_scales(model)
    tracked(**example_batch(2, 16, seed=0)).backward()
    params = {name: p.numel() for name, p in model.named_parameters()}
    return tracked.scales_graph(), params


def data(mean_abs: float, numel: int = 16, **over: float) -> object:
    """A Metrics.Data whose other statistics follow from ``mean_abs``."""
    fields = dict(
        mean_abs=mean_abs,
        abs_mean=0.0,
        std=mean_abs * 1.25,
        abs_max=mean_abs * 4 if math.isfinite(mean_abs) else mean_abs,
        abs_min=mean_abs / 8 if math.isfinite(mean_abs) else mean_abs,
        rms=mean_abs * 1.25,
        numel=numel,
    )
    fields.update(over)
    return Metrics.Data(**fields)  # type: ignore[arg-type]


@pytest.fixture
def chain_graph() -> Callable[..., Graph]:
    """Build ``x -> op_1 -> ... -> op_n`` with given forward/backward scales, by hand."""
    import operator

    def build(scales: list[tuple[float, float | None]], names: list[str] | None = None) -> Graph:
        g = Graph()
        node = g.placeholder("x")
        previous = None
        for i, (fwd, bwd) in enumerate(scales):
            if i > 0:
                node = g.call_function(operator.mul, (previous, 2.0))
            node.meta.update(
                clean_name=names[i] if names else f"t{i}",
                module_path=f"layer{i // 10}",
                requires_grad=False,
                outputs_float_tensor=True,
                metrics=Metrics(fwd=data(fwd), bwd=None if bwd is None else data(bwd)),  # type: ignore[arg-type]
            )
            previous = node
        g.output(previous)
        return g

    return build
