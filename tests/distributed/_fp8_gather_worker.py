"""One rank of the FSDP2 float8 all-gather checks (started by test_fp8_all_gather.py).

Run as ``python _fp8_gather_worker.py CHECKS OUT_DIR`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set. For each model (``decoder``: unitscale's u-muP
``TransformerDecoder``; ``llama``: a ``unit_scale``'d transformers Llama of a random config)
and scaling, it trains three copies for 3 AdamW steps on the same batches: ``to_fp8`` under
``unitscale.data_parallel.fully_shard`` with float8 all-gather, the same without it, and one
process on the whole batch; it writes the losses, gradients compared and what FSDP2 gathered
to ``OUT_DIR/rank<R>.json``.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import unitscale as us
from unitscale.data_parallel import fully_shard, set_data_parallel
from unitscale.transforms import fp8_summary, to_fp8, unit_scale
from unitscale.transforms.lowp import _fsdp, _gemm

VOCAB, SEQ, GLOBAL_BATCH, STEPS = 64, 16, 4, 3


def _decoder() -> nn.Module:
    torch.manual_seed(0)
    return us.TransformerDecoder(hidden_size=32, depth=2, heads=2, vocab_size=VOCAB, mup=True)


def _llama() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return unit_scale(transformers.LlamaForCausalLM(config))


MODELS: dict[str, Callable[[], nn.Module]] = {"decoder": _decoder, "llama": _llama}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + step)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def _loss(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    out = model(ids, labels=labels)
    return out if isinstance(out, torch.Tensor) else out.loss


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


def _train(model: nn.Module, sharded: bool) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """3 AdamW steps: the mean loss of each step and every parameter's full gradient."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for step in range(STEPS):
        ids, labels = _batch(step)
        if sharded:
            rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
            ids, labels = ids[rows], labels[rows]
        else:
            set_data_parallel(size=1)
        loss = _loss(model, ids, labels)
        loss.backward()
        set_data_parallel()
        mean = loss.detach().clone()
        if sharded:
            dist.all_reduce(mean)
            mean /= world
        losses.append(float(mean))
        grads.append({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        optimiser.step()
        optimiser.zero_grad()
    return losses, grads


def _relative(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    return max(float((got[n] - v).norm() / v.norm().clamp_min(1e-30)) for n, v in ref.items())


def _counting_gemm_weights() -> list[str]:
    """Patch the GEMMs' look-up of a gathered weight to record the type of each weight."""
    seen: list[str] = []
    original = _fsdp.float8_weight

    def spy(weight: torch.Tensor) -> Any:
        seen.append(type(weight).__name__)
        return original(weight)

    _gemm.float8_weight = spy  # type: ignore[assignment]
    return seen


def _hand_cast(model: nn.Module, scaling: str, names: list[str]) -> dict[str, Any]:
    """One more forward: each float8 weight a GEMM received against the whole weight cast
    by hand (``_gemm._cast``, the cast of the GEMM without float8 all-gather). The weights
    are read before: after a forward without backward FSDP2 leaves the root's parameters
    gathered (here: the float8 ones)."""
    params = {n: _full(p) for n, p in model.state_dict().items()}
    received: list[tuple[torch.Tensor, Any]] = []
    original = _fsdp.float8_weight

    def keep(weight: torch.Tensor) -> Any:
        found = original(weight)
        if found is not None:
            received.append((found[0].clone(), found[1]))
        return found

    _gemm.float8_weight = keep  # type: ignore[assignment]
    ids, labels = _batch(0)
    with torch.no_grad():
        _loss(model, ids[:1], labels[:1])
    by_hand = [_gemm._cast(params[n], _gemm.E4M3_DTYPE, scaling, None, False) for n in names]
    matched = sum(
        any(
            torch.equal(data.view(torch.uint8), hand.view(torch.uint8))
            and (inverse is None) == (hand_inverse is None)
            and (inverse is None or torch.equal(inverse, hand_inverse))
            for hand, hand_inverse in by_hand
        )
        for data, inverse in received
    )
    return {"received": len(received), "matched": matched}


def check_equal(name: str, scaling: str) -> dict[str, Any]:
    """With float8 all-gather against without, and against one process."""
    base = MODELS[name]()
    gathered = to_fp8(copy.deepcopy(base), scaling=scaling)  # type: ignore[arg-type]
    plain = to_fp8(copy.deepcopy(base), scaling=scaling, fsdp_float8_all_gather=False)  # type: ignore[arg-type]
    single = to_fp8(copy.deepcopy(base), scaling=scaling)  # type: ignore[arg-type]
    fully_shard(gathered)
    fully_shard(plain)
    seen = _counting_gemm_weights()
    losses_g, grads_g = _train(gathered, sharded=True)
    arrived = sorted(set(seen))
    seen.clear()
    losses_p, grads_p = _train(plain, sharded=True)
    arrived_plain = sorted(set(seen))
    losses_1, grads_1 = _train(single, sharded=False)
    summary = fp8_summary(gathered)
    weight = next(n for n in summary.float8_all_gather)
    saved = _full(gathered.state_dict()[weight])
    local = type(gathered.state_dict()[weight]._local_tensor).__name__
    param = _full(dict(gathered.named_parameters())[weight])
    hand = _hand_cast(gathered, scaling, list(summary.float8_all_gather))
    return {
        "losses_equal": losses_g == losses_p,
        "grads_equal": all(
            torch.equal(a[n], b[n]) for a, b in zip(grads_g, grads_p, strict=True) for n in a
        ),
        "grad_names": sorted(grads_g[0]) == sorted(grads_1[0]),
        "loss_errors": [abs(g - o) / abs(o) for g, o in zip(losses_g, losses_1, strict=True)],
        "grad_errors": [_relative(o, g) for g, o in zip(grads_g, grads_1, strict=True)],
        "arrived": arrived,
        "hand_cast": hand,
        "arrived_plain": arrived_plain,
        "float8_all_gather": list(summary.float8_all_gather),
        "high_precision_gather": [list(p) for p in summary.high_precision_gather],
        "plain_summary": [list(p) for p in fp8_summary(plain).high_precision_gather],
        "linear_weights": sorted(
            n for n, m in base.named_modules() if isinstance(m, nn.Linear) for _ in [0]
        ),
        "state_dtype": str(saved.dtype),
        "state_type": type(saved).__name__,
        "state_equals_param": torch.equal(saved, param),
        "state_local_type": local,
    }


def check_torchao() -> dict[str, Any]:
    """``to_fp8(scaling="tensorwise")`` under our ``fully_shard`` against torchao's
    ``Float8Linear`` with float8 all-gather under torch's (scales precomputed after each
    step): each rank's outputs and the full gradients of 3 AdamW steps."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torchao import float8

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    ours = fully_shard(to_fp8(mlp(), scaling="tensorwise"))
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    theirs = float8.convert_to_float8_training(mlp(), config=config)
    torch_fully_shard(theirs)
    optimisers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    equal = []
    for _ in range(STEPS):
        x = torch.randn(8, 16, generator=generator)
        outs = [m(x) for m in (ours, theirs)]
        for out in outs:
            out.square().sum().backward()
        grads = [[_full(p.grad) for p in m.parameters()] for m in (ours, theirs)]
        equal.append(
            torch.equal(*outs) and all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
        )
        for optimiser in optimisers:
            optimiser.step()
            optimiser.zero_grad()
        float8.precompute_float8_dynamic_scale_for_fsdp(theirs)
    return {"equal": equal, "float8_all_gather": list(fp8_summary(ours).float8_all_gather)}


def main() -> None:
    checks, out = sys.argv[1].split(","), Path(sys.argv[2])
    dist.init_process_group("gloo")
    results: dict[str, Any] = {}
    for check in checks:
        if check == "fsdp-averages":  # whether this torch's FSDP2 averages over gloo at all
            from _worker import check_fsdp_averages

            results[check] = check_fsdp_averages()
            continue
        name, scaling = check.split(":")
        try:
            results[check] = check_torchao() if name == "torchao" else check_equal(name, scaling)
        except Exception as error:  # reported to the test, which fails on it
            import traceback

            results[check] = {"error": f"{error!r}\n{traceback.format_exc()}"}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
