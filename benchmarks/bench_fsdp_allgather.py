"""Bytes FSDP2 all-gathers per training step, with and without ``to_fp8``'s float8 all-gather.

Two local gloo ranks (``torch.multiprocessing``) train unitscale's u-muP
``TransformerDecoder`` under ``to_fp8`` and ``unitscale.data_parallel.fully_shard`` (each
layer sharded, then the root, as torchtitan shards a model; ``reshard_after_forward`` left
at its default, so each layer's weights are gathered again for the backward). Every
collective the step issues goes through a wrapper of ``torch.distributed``'s functions
(``all_gather_single``, ``reduce_scatter_single``, ``all_reduce``, ...) that counts it and
the bytes of its input, separately for the forward and the backward. Cases: weights in FP32,
and in bf16 (FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16)``), each with
``fsdp_float8_all_gather`` on and off; ``scaling="none"`` and ``"tensorwise"``. The counts
are those of a step after the first (the first captures the graphs and, with
``"tensorwise"``, registers the weights of the amax all-reduce). Bytes do not depend on the
machine's load: one short run is the measurement.

Reported (rank 0): per case the bytes each rank sends into all-gathers in the forward and
in the backward, the collectives by kind, and per phase the ratio of the bytes with float8
all-gather to those without. The layers' groups hold only linear weights (their u-muP norms
have no weight), so the backward's ratio is that of the linear weights alone; the forward
also gathers the root's group (embedding, readout, final norm), whose embedding stays in its
precision. Beside torchao (:func:`_against_torchao`, a plain 3-layer MLP): the collectives
per step of its float8 all-gather with and without its per-step amax precomputation, and
of ours. Appended to ``benchmarks/results/fsdp_allgather.json``.

Run: ``python benchmarks/bench_fsdp_allgather.py``

On one device (``--device cuda``, for the GPU check: :func:`one_device_check`): a single
rank (world size 1 still runs every hook: the cast, the gather, the GEMM taking the gathered
float8 weight) trains an MLP whose dimensions are multiples of 16 (what CUDA's float8 GEMMs
take) for 3 AdamW steps with and without float8 all-gather, both scalings; the run records
whether losses and gradients are equal bit for bit and how many weights arrived in float8
(one rank sends no bytes), and is appended to the same history with ``"device": "cuda"``.
Speed across GPUs is not measured (one lent GPU cannot).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _history import append_run, machine_state
from torch import nn

import unitscale as us
from unitscale.data_parallel import fully_shard
from unitscale.transforms import fp8_summary, to_fp8

RESULTS = Path(__file__).parent / "results" / "fsdp_allgather.json"
WORLD = 2
HIDDEN, DEPTH, VOCAB, SEQ, BATCH = 64, 2, 64, 32, 4
#: The collectives of ``torch.distributed`` counted (FSDP2 and the amax all-reduce use them).
COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_reduce",
    "broadcast",
)


class _Counter:
    """Wraps ``torch.distributed``'s collectives: counts calls and input bytes per phase."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        for name in COLLECTIVES:
            setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            # the input: the second tensor of the output-first calls, else the first
            first_is_output = name.startswith(("all_gather", "reduce_scatter"))
            source = tensors[1] if first_is_output and len(tensors) > 1 else tensors[0]
            self.calls[f"{self.phase}:{name}"] += 1
            self.bytes[f"{self.phase}:{name}"] += source.numel() * source.element_size()
            return original(*args, **kwargs)

        return counted

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


def _model(scaling: str, gather: bool, dtype: Any, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    torch.manual_seed(0)
    decoder = us.TransformerDecoder(
        hidden_size=HIDDEN, depth=DEPTH, heads=4, vocab_size=VOCAB, mup=True
    )
    model = to_fp8(decoder, scaling=scaling, fsdp_float8_all_gather=gather)  # type: ignore[arg-type]
    policy = MixedPrecisionPolicy(param_dtype=dtype)
    for layer in model.module.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def _case(counter: _Counter, scaling: str, gather: bool, dtype: Any, mesh: Any) -> dict[str, Any]:
    model = _model(scaling, gather, dtype, mesh)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator)
        counter.reset()
        counter.phase = "forward"
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        counter.phase = "backward"
        loss.backward()
        counter.phase = "optimiser"
        optimiser.step()
        optimiser.zero_grad()
    summary = fp8_summary(model)
    linear = sum(
        p.numel() for n, p in model.named_parameters() if n in set(summary.float8_all_gather)
    )
    others = sum(p.numel() for p in model.parameters()) - linear
    return {
        "scaling": scaling,
        "float8_all_gather": gather,
        "param_dtype": str(dtype).removeprefix("torch.") if dtype else "float32",
        "weights_gathered_in_float8": len(summary.float8_all_gather),
        "linear_weight_elements": linear,
        "other_elements": others,
        "calls": dict(counter.calls),
        "bytes": dict(counter.bytes),
    }


def _gathered(case: dict[str, Any], phase: str) -> int:
    return sum(b for k, b in case["bytes"].items() if k.startswith(phase) and "all_gather" in k)


def _summarise(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ratio of the linear weights' all-gathered bytes with float8 all-gather to without:
    the other parameters' bytes (gathered as before in both) are taken off both totals."""
    rows = []
    for case in cases:
        if not case["float8_all_gather"]:
            continue
        base = next(
            c
            for c in cases
            if not c["float8_all_gather"]
            and c["scaling"] == case["scaling"]
            and c["param_dtype"] == case["param_dtype"]
        )
        row = {k: case[k] for k in ("scaling", "param_dtype")}
        for phase in ("forward", "backward"):
            with8, without = _gathered(case, phase), _gathered(base, phase)
            row[f"{phase}_bytes"] = with8
            row[f"{phase}_bytes_without"] = without
            row[f"{phase}_ratio"] = round(with8 / without, 4) if without else None
        gathers = base["calls"].get("forward:all_gather_single", 0) + base["calls"].get(
            "backward:all_gather_single", 0
        )
        row["all_reduces_per_step"] = sum(
            n for k, n in case["calls"].items() if k.endswith(":all_reduce")
        )
        row["all_reduces_per_step_without"] = sum(
            n for k, n in base["calls"].items() if k.endswith(":all_reduce")
        )
        row["all_gathers_per_step"] = gathers
        rows.append(row)
    return rows


def _stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(64, 64), nn.ReLU())])


def _against_torchao(counter: _Counter, mesh: Any) -> dict[str, Any]:
    """Collectives (torch's ``CommDebugMode``: c10d and functional collectives alike) and
    all-gathered bytes of the third step of a 3-layer MLP (64 x 64 linear layers; each
    layer sharded, then the root) under to_fp8's float8 all-gather ("none", "tensorwise")
    and torchao's (``Float8Linear``, ``enable_fsdp_float8_all_gather``), with and without
    ``precompute_float8_dynamic_scale_for_fsdp`` after each step."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torchao import float8

    def sharded(model: nn.Module, layers: nn.Module, shard: Any) -> nn.Module:
        for index in range(0, len(layers), 2):
            shard(layers[index], mesh=mesh)
        shard(model, mesh=mesh)
        return model

    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    cases: dict[str, tuple[nn.Module, bool]] = {}
    for scaling in ("none", "tensorwise"):
        ours = to_fp8(_stack(), scaling=scaling)  # type: ignore[arg-type]
        cases[f"to_fp8 {scaling}"] = (sharded(ours, ours.module, fully_shard), False)
    for precompute in (True, False):
        theirs = float8.convert_to_float8_training(_stack(), config=config)
        name = "torchao" + (" + precompute" if precompute else "")
        cases[name] = (sharded(theirs, theirs, torch_fully_shard), precompute)
    found: dict[str, Any] = {}
    for name, (model, precompute) in cases.items():
        optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            counter.reset()
            counter.phase = "step"
            with CommDebugMode() as comm:
                model(torch.randn(8, 64)).square().sum().backward()
                optimiser.step()
                optimiser.zero_grad()
                if precompute:
                    float8.precompute_float8_dynamic_scale_for_fsdp(model)
        counts = {str(op): n for op, n in comm.get_comm_counts().items()}
        found[name] = {
            "collectives": counts,
            "all_reduces": sum(
                n for op, n in counts.items() if "all_reduce" in op or "allreduce" in op
            ),
            "all_gather_bytes": sum(b for k, b in counter.bytes.items() if "all_gather" in k),
        }
    return found


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    counter = _Counter()
    cases = [
        _case(counter, scaling, gather, dtype, mesh)
        for scaling in ("none", "tensorwise")
        for dtype in (None, torch.bfloat16)
        for gather in (False, True)
    ]
    try:
        torchao: dict[str, Any] | None = _against_torchao(counter, mesh)
    except ImportError:
        torchao = None
    if rank == 0:
        Path(out).write_text(json.dumps({"cases": cases, "torchao": torchao}))
    dist.barrier()
    dist.destroy_process_group()


def _mlp_step(scaling: str, gather: bool, device: str) -> dict[str, Any]:
    """3 AdamW steps of a to_fp8 MLP under fully_shard on one rank: losses, gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)).to(device)
    model = to_fp8(mlp, scaling=scaling, fsdp_float8_all_gather=gather)  # type: ignore[arg-type]
    fully_shard(model, mesh=init_device_mesh(device, (1,)))
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], []
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(32, 64, generator=generator).to(device)
        loss = model(x).square().mean()
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.full_tensor().clone() for p in model.parameters()])
        optimiser.step()
        optimiser.zero_grad()
    summary = fp8_summary(model)
    return {
        "losses": losses,
        "grads": grads,
        "float8": len(summary.float8_all_gather),
    }


def one_device_check(device: str = "cuda") -> dict[str, Any]:
    """FSDP2 float8 all-gather on one rank of ``device`` (``nccl`` on CUDA, else gloo): for
    each scaling, whether training with it equals training without it bit for bit, the
    weights gathered in float8 (FSDP2 on one rank issues no all-gather: no bytes to count).
    """
    backend = "nccl" if device.startswith("cuda") else "gloo"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    results: dict[str, Any] = {"device": device, "world": 1}
    try:
        for scaling in ("none", "tensorwise"):
            on = _mlp_step(scaling, True, device)
            off = _mlp_step(scaling, False, device)
            results[scaling] = {
                "equal": all(
                    torch.equal(a, b) for a, b in zip(on["losses"], off["losses"], strict=True)
                )
                and all(
                    torch.equal(a, b)
                    for step_on, step_off in zip(on["grads"], off["grads"], strict=True)
                    for a, b in zip(step_on, step_off, strict=True)
                ),
                "weights_in_float8": on["float8"],
            }
    finally:
        dist.destroy_process_group()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default=None, help="one-rank check on this device")
    parser.add_argument(
        "--output", type=Path, default=RESULTS, help=f"results history (default {RESULTS})"
    )
    args = parser.parse_args()
    if args.device is not None:
        run = {**machine_state(), **one_device_check(args.device)}
        append_run(args.output, run)
        print(json.dumps(run))
        if not all(run[s]["equal"] and run[s]["weights_in_float8"] for s in ("none", "tensorwise")):
            raise SystemExit(1)
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_fsdp_allgather_{os.getpid()}.json"
    mp.spawn(_rank, args=(port, str(out)), nprocs=WORLD, join=True)
    measured = json.loads(out.read_text())
    out.unlink()
    cases = measured["cases"]
    summary = _summarise(cases)
    run = {
        **machine_state(),
        "world": WORLD,
        "model": f"TransformerDecoder(hidden={HIDDEN}, depth={DEPTH}, vocab={VOCAB})",
        "batch_per_rank": [BATCH, SEQ],
        "sharding": "each layer, then the root; reshard_after_forward default",
        "summary": summary,
        "cases": cases,
        "against_torchao": measured["torchao"],
    }
    append_run(args.output, run)
    for row in summary:
        print(json.dumps(row))
    print(json.dumps(measured["torchao"]))


if __name__ == "__main__":
    main()
