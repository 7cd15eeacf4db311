"""Cost of a u-μP optimiser step: ``unitscale.optim.AdamW`` vs ``torch.optim.AdamW``.

The u-μP optimisers are torch's own with one parameter group per distinct learning rate, so a
step should cost the same. Both optimise the parameters of one model each (two identical
u-μP ``TransformerDecoder`` copies, gradients filled once with N(0, 1)), in one process,
timed round-robin (one ``step()`` of each per round, in alternating order, so that load on a
shared machine hits them alike); reported: median step time of each over the rounds and the
ratio u-μP / torch, per ``foreach`` setting. Results are appended to
``benchmarks/results/optim.json`` with the date, ``os.getloadavg()`` before and after, the
torch version and the thread count (the machine may be shared: read the load first).

Run: ``python benchmarks/bench_optim.py [--rounds N] [--width W] [--depth D]``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from _history import append_run, machine_state

import unitscale as us

RESULTS = Path(__file__).parent / "results" / "optim.json"


def _with_grads(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = us.TransformerDecoder(width, depth, max(width // 64, 1), 1024, mup=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def run(width: int, depth: int, rounds: int, foreach: bool) -> dict[str, Any]:
    model = _with_grads(width, depth)
    twin = copy.deepcopy(model)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        q.grad = p.grad.clone()  # type: ignore[union-attr]
    optimisers = {
        "torch": torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=foreach),
        "umup": us.optim.AdamW(twin.parameters(), lr=1e-3, weight_decay=0.1, foreach=foreach),
    }
    times: dict[str, list[float]] = {name: [] for name in optimisers}
    for _ in range(3):  # warm-up: state allocation
        for opt in optimisers.values():
            opt.step()
    order = list(optimisers)
    for round_index in range(rounds):
        for name in order if round_index % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            optimisers[name].step()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "width": width,
        "depth": depth,
        "foreach": foreach,
        "parameters": sum(p.numel() for p in model.parameters()),
        "param_groups": {name: len(opt.param_groups) for name, opt in optimisers.items()},
        "median_step_ms": {name: round(1e3 * t, 4) for name, t in medians.items()},
        "ratio_umup_over_torch": round(medians["umup"] / medians["torch"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    state = machine_state()
    results = [run(args.width, args.depth, args.rounds, foreach) for foreach in (True, False)]
    append_run(args.out, {**state, "rounds": args.rounds, "results": results})
    for r in results:
        print(
            f"foreach={r['foreach']}: torch {r['median_step_ms']['torch']} ms, "
            f"u-muP {r['median_step_ms']['umup']} ms, ratio {r['ratio_umup_over_torch']} "
            f"(groups {r['param_groups']}); load {state['load_average_before']}"
        )


if __name__ == "__main__":
    main()
