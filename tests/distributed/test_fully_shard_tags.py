"""unitscale.data_parallel.fully_shard keeps u-muP tags, fan_in_dim included (in-process,
one gloo rank)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from torch import nn

import unitscale as us
from unitscale.data_parallel import fully_shard


@pytest.fixture
def one_rank() -> Iterator[None]:
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group yet")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fully_shard_keeps_fan_in_dim(one_rank: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model = nn.Sequential(us.Linear(8, 4), us.Linear(4, 4))
    model[0].weight.fan_in_dim = 0  # stored (in, out), as unit_scale marks HF Conv1D
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    first, second = model[0].weight, model[1].weight
    assert first.mup_type == "weight" and first.fan_in_dim == 0  # type: ignore[attr-defined]
    assert not hasattr(second, "fan_in_dim")
    lr_of = {
        id(p): g["lr"] * g["lr_scale"]
        for g in us.optim.AdamW(model.parameters(), lr=1.0).param_groups
        for p in g["params"]
    }
    # weight (4, 8): fan-in read from dimension 0 (4), not the last (8)
    assert lr_of[id(first)] == pytest.approx(1 / 4**0.5)
    assert lr_of[id(second)] == pytest.approx(1 / 4**0.5)
