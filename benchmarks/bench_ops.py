"""Cost of unit scaling: a stack of Linear + GELU blocks, unit-scaled vs plain ``torch.nn``.

One forward + backward step (``y.backward(grad)``, gradients reset to None between steps) of
``depth`` blocks ``Linear(width, width) -> GELU`` on a ``(tokens, width)`` input, for
``torch.nn.Linear``/``GELU`` and for ``unitscale.Linear``/``GELU`` (default constraints),
each eager and under ``torch.compile`` (Inductor). All four run in the same process and
are timed round-robin (one step of each per round, so that load on a shared machine hits
them alike); reported: median step time over the rounds, and the ratios unit/plain.
Targets: 1.05x eager, 1.00x compiled. Each run is appended to
``benchmarks/results/ops.json`` with the date and load.

Run: ``python benchmarks/bench_ops.py [--rounds N] [--shapes TOKENSxWIDTH ...]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _history import append_run, machine_state
from torch import Tensor, nn

import unitscale as us

RESULTS = Path(__file__).parent / "results" / "ops.json"
TARGETS = {"eager": 1.05, "compiled": 1.00}


def stack(kind: str, width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        if kind == "plain":
            layers += [nn.Linear(width, width), nn.GELU()]
        else:
            layers += [us.Linear(width, width), us.GELU()]
    return nn.Sequential(*layers)


def step_fn(model: nn.Module, x: Tensor, grad: Tensor) -> Callable[[], None]:
    def step() -> None:
        for p in model.parameters():
            p.grad = None
        x.grad = None
        model(x).backward(grad)

    return step


def run_shape(tokens: int, width: int, depth: int, rounds: int, warmup: int) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(tokens, width, requires_grad=True)
    grad = torch.randn(tokens, width)
    steps: dict[str, Callable[[], None]] = {}
    compile_s: dict[str, float] = {}
    for kind in ("plain", "unit"):
        model = stack(kind, width, depth)
        steps[f"{kind}/eager"] = step_fn(model, x, grad)
        compiled = torch.compile(model)
        steps[f"{kind}/compiled"] = step_fn(compiled, x, grad)
        start = time.perf_counter()
        steps[f"{kind}/compiled"]()  # compile outside the timed rounds
        compile_s[kind] = time.perf_counter() - start
    for _ in range(warmup):
        for step in steps.values():
            step()
    # Wall time, and the process's CPU time (user + system), which on a shared machine
    # leaves out the time this process waited for a core (meaningful with one thread).
    clocks = {"wall": time.perf_counter, "cpu": time.process_time}
    times = {clock: {name: [] for name in steps} for clock in clocks}
    names = list(steps)
    for round_index in range(rounds):
        # alternate the order so that no configuration always runs first
        for name in names if round_index % 2 == 0 else names[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            steps[name]()
            times["wall"][name].append(time.perf_counter() - wall)
            times["cpu"][name].append(time.process_time() - cpu)
    result: dict[str, Any] = {"tokens": tokens, "width": width, "depth": depth}
    for clock in clocks:
        result[clock] = {}
        for mode in ("eager", "compiled"):
            plain, unit = times[clock][f"plain/{mode}"], times[clock][f"unit/{mode}"]
            paired = [u / p for u, p in zip(unit, plain, strict=True)]
            ratio = statistics.median(unit) / statistics.median(plain)
            result[clock][mode] = {
                "plain_ms": round(statistics.median(plain) * 1e3, 3),
                "unit_ms": round(statistics.median(unit) * 1e3, 3),
                "ratio": round(ratio, 4),
                "target": TARGETS[mode],
                "met": ratio <= TARGETS[mode],
                "paired_ratio_median": round(statistics.median(paired), 4),
                "paired_ratio_iqr": _iqr(paired),
                "ratio_of_minima": round(min(unit) / min(plain), 4),
            }
    result["compile_s"] = {k: round(v, 2) for k, v in compile_s.items()}
    return result


def _iqr(values: list[float]) -> list[float]:
    q = statistics.quantiles(values, n=4)
    return [round(q[0], 4), round(q[2], 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["2048x1024", "4096x256"])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's default)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    state = machine_state()
    results = []
    for shape in args.shapes:
        tokens, width = (int(v) for v in shape.split("x"))
        result = run_shape(tokens, width, args.depth, args.rounds, args.warmup)
        results.append(result)
        for clock in ("wall", "cpu"):
            eager, compiled = result[clock]["eager"], result[clock]["compiled"]
            print(
                f"tokens={tokens} width={width} depth={args.depth} [{clock}]: "
                f"eager {eager['unit_ms']:.1f}/{eager['plain_ms']:.1f} ms = "
                f"{eager['ratio']:.3f}x, compiled {compiled['unit_ms']:.1f}/"
                f"{compiled['plain_ms']:.1f} ms = {compiled['ratio']:.3f}x"
            )
    append_run(
        args.out,
        {
            **state,
            "benchmark": "Linear+GELU stack, forward+backward step, unit-scaled / plain torch.nn",
            "rounds": args.rounds,
            "statistic": (
                "median step time over rounds, wall clock and process CPU time; "
                "ratio = unit / plain"
            ),
            "targets": TARGETS,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
