"""A transformed model inside ``DistributedDataParallel`` with several gradient buckets.

Under DDP, TorchDynamo's DDPOptimizer splits a captured graph at the buckets' boundaries. The
passes must see whole graphs: split, ``unit_scale`` no longer saw the residual adds whose
stream entered the second piece as an input, left them as they were and built a different
model than in one process (loss 6.011 against 6.024 on the built-in GPT, gradients off by up
to 38). One process with a gloo group of one rank is enough to make DDP split the graph.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from unitscale.data import batches
from unitscale.models import plain_gpt
from unitscale.transforms import unit_scale, unit_scale_summary


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    if dist.is_initialized():  # pragma: no cover - the suite runs ranks in subprocesses
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_unit_scale_inside_ddp_with_several_buckets_equals_one_process(
    one_rank_group: None,
) -> None:
    batch = next(batches(4, 32, seed=0, split="train"))
    torch.manual_seed(0)
    alone = unit_scale(plain_gpt(seed=0))
    torch.manual_seed(0)
    wrapped = unit_scale(plain_gpt(seed=0))
    # 1.5 MB buckets: the default GPT's 3.6 MB of parameters fill three.
    ddp = DistributedDataParallel(wrapped, bucket_cap_mb=1.5)
    expected = alone(batch.input_ids, labels=batch.labels)
    expected.backward()
    loss = ddp(batch.input_ids, labels=batch.labels)
    loss.backward()
    assert "none left as is" in str(unit_scale_summary(wrapped))
    assert loss.item() == expected.item()
    reference = dict(alone.named_parameters())
    for name, parameter in wrapped.named_parameters():
        if parameter.grad is not None or reference[name].grad is not None:
            torch.testing.assert_close(parameter.grad, reference[name].grad, rtol=0, atol=0)
