"""Cost of reducing scale statistics over 2 data-parallel ranks, against the step time.

Two local gloo ranks (``torch.multiprocessing``), one thread each, train the built-in GPT
(``unit_scale(plain_gpt())``, default size) under ``DistributedDataParallel`` on halves of a
16 x 64 batch. Per round, interleaved: one untracked DDP training step (forward, backward,
Adam), one recorded ``ScaleMonitor`` step, then two reads of that step's ``scales_graph()``:
reduced over the ranks (five collectives) and local (``set_data_parallel(size=1)``: no
collective). Reported (rank 0, medians over the rounds): the step time, the two read
times, and the reduction's cost (reduced - local read) as a fraction of the step time.
Appended to ``benchmarks/results/distributed.json`` with the load average before and after
(the machine may be shared: read the load first).

Run: ``python benchmarks/bench_distributed.py [--rounds N]``
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _history import append_run, machine_state
from torch.nn.parallel import DistributedDataParallel

import unitscale as us
from unitscale.data_parallel import set_data_parallel
from unitscale.experiments.data import batches
from unitscale.models import plain_gpt
from unitscale.transforms import unit_scale

RESULTS = Path(__file__).parent / "results" / "distributed.json"
WORLD = 2


def _timed(fn: Any, *args: Any) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def _train_step(model: Any, optimiser: Any, ids: torch.Tensor, labels: torch.Tensor) -> None:
    model(ids, labels=labels).backward()
    optimiser.step()
    optimiser.zero_grad()


def _rank(rank: int, port: int, rounds: int, out: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    base = unit_scale(plain_gpt(seed=0))
    plain = DistributedDataParallel(copy.deepcopy(base))
    monitor = us.ScaleMonitor(base, every=1, check_finite=False)
    tracked = DistributedDataParallel(monitor.module)
    optimisers = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (plain, tracked)]
    stream = batches(16, 64, seed=0, split="train")
    times: dict[str, list[float]] = {"step": [], "read_reduced": [], "read_local": []}
    records = 0
    for round_index in range(rounds + 2):  # two warm-up rounds (capture, allocation)
        batch = next(stream)
        rows = slice(rank * 8, (rank + 1) * 8)
        ids, labels = batch.input_ids[rows], batch.labels[rows]
        step_time = _timed(_train_step, plain, optimisers[0], ids, labels)
        tracked(ids, labels=labels).backward()
        dist.barrier()
        reduced = _timed(monitor.module.scales_graph)
        set_data_parallel(size=1)
        local = _timed(monitor.module.scales_graph)
        set_data_parallel()
        monitor.step()
        optimisers[1].step()
        optimisers[1].zero_grad()
        records = sum(1 for n in monitor.module.scales_graph().nodes if n.meta.get("metrics"))
        if round_index >= 2:
            times["step"].append(step_time)
            times["read_reduced"].append(reduced)
            times["read_local"].append(local)
    if rank == 0:
        medians = {name: statistics.median(values) for name, values in times.items()}
        out.update(
            step_s=medians["step"],
            read_reduced_s=medians["read_reduced"],
            read_local_s=medians["read_local"],
            reduction_vs_step=(medians["read_reduced"] - medians["read_local"]) / medians["step"],
            tensors=records,
        )
        Path(os.environ["BENCH_OUT"]).write_text(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    state = machine_state()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    scratch = Path(__file__).parent / "results" / ".distributed.tmp"
    os.environ["BENCH_OUT"] = str(scratch)
    mp.spawn(_rank, args=(port, args.rounds, {}), nprocs=WORLD, join=True)
    result = json.loads(scratch.read_text())  # written by rank 0 of this run just now
    scratch.unlink()
    run = {
        **state,
        "threads": 1,
        "processes": WORLD,
        "backend": "gloo",
        "model": "unit_scale(plain_gpt()), width 128, depth 2; batch 16 x 64 (8 per rank)",
        "rounds": args.rounds,
        **result,
    }
    print(
        f"step {result['step_s'] * 1e3:.1f} ms; scales_graph() read reduced "
        f"{result['read_reduced_s'] * 1e3:.1f} ms, local {result['read_local_s'] * 1e3:.1f} ms; "
        f"reduction {100 * result['reduction_vs_step']:.1f}% of a step "
        f"({result['tensors']} tensors)"
    )
    append_run(RESULTS, run)


if __name__ == "__main__":
    main()
