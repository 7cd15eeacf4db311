"""One rank of the data-parallel checks, started by the tests in this folder (not a test).

Run as ``python _worker.py CHECKS OUT_DIR`` with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT`` set. Every rank builds the same models from the same seed, computes the
reference (one process on the concatenated batch, data-parallel size 1) itself, then runs the
wrapped model (DDP or FSDP2) on its shard of the batch, and writes what it measured to
``OUT_DIR/rank<R>.json`` for the test to assert on.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("UNITSCALE_STATS", "eager")

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import unitscale as us
from unitscale.data_parallel import fully_shard, set_data_parallel
from unitscale.models import GPTConfig, plain_gpt, unit_scaled_gpt
from unitscale.parameter import has_mup_tags
from unitscale.transforms import simulate_fp8, track_scales, unit_scale

CONFIG = GPTConfig(vocab_size=64, hidden_size=32, depth=1, heads=2, seq_len=16)
GLOBAL_BATCH = 8


def _decoder() -> nn.Module:
    torch.manual_seed(0)
    return us.TransformerDecoder(hidden_size=32, depth=2, heads=2, vocab_size=64, mup=True)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "modules-decoder": _decoder,
    "modules-gpt": lambda: unit_scaled_gpt(CONFIG, seed=0),
    "unit_scale": lambda: unit_scale(plain_gpt(CONFIG, seed=0)),
    "simulate_fp8": lambda: simulate_fp8(unit_scale(plain_gpt(CONFIG, seed=0))),
    "track_scales": lambda: track_scales(unit_scale(plain_gpt(CONFIG, seed=0))),
}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(
        0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len + 1), generator=generator
    )
    return ids[:, :-1], ids[:, 1:]


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return full() if full is not None else tensor


def _strip(name: str) -> str:
    return name.removeprefix("module.")


def _relative_errors(
    ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]
) -> dict[str, float]:
    return {
        name: float((got[name] - value).norm() / value.norm().clamp_min(1e-30))
        for name, value in ref.items()
        if name in got
    }


def check_gradients(name: str, wrapper: str) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, labels = batch()
    model = MODELS[name]()
    reference = copy.deepcopy(model)
    set_data_parallel(size=1)
    ref_loss = reference(inputs, labels=labels)
    ref_loss.backward()
    set_data_parallel()
    ref_grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}
    keys_before = list(model.state_dict().keys())
    tags_before = {n: has_mup_tags(p) for n, p in model.named_parameters()}
    if wrapper == "fsdp":
        wrapped: nn.Module = fully_shard(model)
    else:
        wrapped = DistributedDataParallel(model)
        if wrapper == "ddp-uncorrected":  # the scales of one process: shows the check can fail
            set_data_parallel(size=1)
    local = GLOBAL_BATCH // world
    rows = slice(rank * local, (rank + 1) * local)
    loss = wrapped(inputs[rows], labels=labels[rows])
    loss.backward()
    set_data_parallel()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    mean_loss /= world
    grads = {
        _strip(n): _full(p.grad).detach()
        for n, p in wrapped.named_parameters()
        if p.grad is not None
    }
    errors = _relative_errors(ref_grads, grads)
    inner = wrapped.module if isinstance(wrapped, DistributedDataParallel) else wrapped
    return {
        "loss_error": abs(float(mean_loss - ref_loss.detach()) / float(ref_loss.detach())),
        "max_grad_error": max(errors.values()),
        "min_grad_error": min(errors.values()),
        "worst": max(errors, key=errors.__getitem__),
        "grad_names": sorted(grads) == sorted(ref_grads),
        "missing": sorted(set(ref_grads) - set(grads)),
        "state_dict_keys": list(inner.state_dict().keys()) == keys_before,
        "names": [_strip(n) for n, _ in wrapped.named_parameters()] == list(tags_before),
        "tags": {_strip(n): has_mup_tags(p) for n, p in wrapped.named_parameters()} == tags_before,
        "any_tags": any(tags_before.values()),
    }


def check_compile() -> dict[str, Any]:
    """torch.compile(fullgraph=True) of a unit-scaled module with torch.distributed up."""
    torch.manual_seed(0)
    layer = us.Linear(16, 8)
    x = torch.randn(4, 16)
    single = copy.deepcopy(layer)
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True)
    compiled(x).sum().backward()
    layer(x).sum().backward()
    set_data_parallel(size=1)
    single(x).sum().backward()
    set_data_parallel()
    compiled_grad = compiled.weight.grad
    return {
        "compiled_vs_eager": float(
            (compiled_grad - layer.weight.grad).norm() / layer.weight.grad.norm()
        ),
        "ratio_to_one_process": float(layer.weight.grad.norm() / single.weight.grad.norm()),
    }


def main() -> None:
    checks, out = sys.argv[1].split(","), Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results: dict[str, Any] = {}
    try:
        for check in checks:
            if check == "compile":
                results[check] = check_compile()
                continue
            name, wrapper = check.rsplit(":", 1)
            results[check] = check_gradients(name, wrapper)
    finally:
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results, indent=1))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
