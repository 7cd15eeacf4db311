"""What per-tensor FP8 scales cost: step time of each ``scaling`` against ``scaling="none"``.

The built-in plain GPT (``unitscale train``'s default size and batch) in simulated FP8 (the
``hardware`` recipe) is trained with Adam on the same batches three times over, with
``scaling="none"``, ``"tensorwise"`` (torchao's default recipe) and ``"delayed"``. A step is
forward, backward, optimiser step and ``zero_grad``, ending with the loss read back. The
three alternate in rounds in one process, so load on the machine biases them alike; each
ratio is the median of the per-round ratios to ``"none"``. The number of amax reductions and
scale computations per step comes from :func:`unitscale.transforms.scaling_cost` (counted
from the rewritten graphs, not estimated). ``--compile`` runs each model through
:func:`unitscale.transforms.compile` (the first, compiling step is recorded separately).

Each run is appended to ``benchmarks/results/fp8_scaling.json`` with the date and load.

Run: ``python benchmarks/bench_fp8_scaling.py [--rounds N] [--steps-per-round K]
[--device cuda] [--compile]``
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
from _steps import timed, training_step
from torch import nn

from unitscale.experiments.data import batches
from unitscale.experiments.training import FP8_OPS, TrainConfig
from unitscale.models import plain_gpt
from unitscale.transforms import compile as compile_module
from unitscale.transforms import scaling_cost, simulate_fp8

RESULTS = Path(__file__).parent / "results" / "fp8_scaling.json"
SCALINGS = ("none", "tensorwise", "delayed")


def stepper(model: nn.Module, config: TrainConfig, device: torch.device) -> Callable[[], float]:
    """One training step of ``model`` per call, on its own copy of the batch stream."""
    optimiser = torch.optim.Adam(model.parameters(), lr=config.lr_for("plain-fp8"))
    stream = batches(config.batch_size, config.seq_len, seed=config.seed, split="train")
    return training_step(model, optimiser, stream, device)


def measure(
    config: TrainConfig, device: torch.device, compiled: bool, rounds: int, k: int
) -> dict[str, Any]:
    models = {}
    for scaling in SCALINGS:
        # The scope of unitscale train's FP8 runs and of torchao's recipe: the linear ops.
        model = simulate_fp8(
            plain_gpt(config.model_config, seed=config.seed),
            scaling=scaling,  # type: ignore[arg-type]
            ops=FP8_OPS,  # type: ignore[arg-type]
        )
        model = model.to(device)
        models[scaling] = compile_module(model) if compiled else model
    steps = {scaling: stepper(model, config, device) for scaling, model in models.items()}
    first = {}
    for scaling, step in steps.items():
        start = time.perf_counter()
        step()
        first[scaling] = round(time.perf_counter() - start, 2)
        step()  # the backward graph's and the optimiser's first runs
    costs = {}
    for scaling, model in models.items():
        cost = scaling_cost(model)
        costs[scaling] = {
            "amax_reductions": cost.amax_reductions,
            "scale_computations": cost.scale_computations,
            "forward": cost.forward,
            "backward": cost.backward,
        }
    times: dict[str, list[float]] = {scaling: [] for scaling in SCALINGS}
    for _ in range(rounds):
        for scaling, step in steps.items():
            times[scaling].append(timed(step, k)[0])
    result: dict[str, Any] = {"first_step_s": first, "per_step_counts": costs}
    for scaling in SCALINGS:
        ratios = [b / a for a, b in zip(times["none"], times[scaling], strict=True)]
        result[scaling] = {
            "step_ms": round(statistics.median(times[scaling]) * 1e3, 2),
            "ratio_vs_none": round(statistics.median(ratios), 3),
            "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            # The share of a step the scales take, from the step times (not a profile).
            "scale_share_of_step": round(1 - 1 / statistics.median(ratios), 3),
        }
    print(result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps-per-round", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    state = machine_state()
    config = TrainConfig()
    result = measure(config, device, args.compile, args.rounds, args.steps_per_round)
    append_run(
        args.output,
        {
            **state,
            "device": args.device,
            "compiled": args.compile,
            "model": {
                "family": "plain",
                "hidden_size": config.hidden_size,
                "depth": config.depth,
                "heads": config.heads,
                "batch_size": config.batch_size,
                "seq_len": config.seq_len,
                "fp8_recipe": "hardware",
                "ops": FP8_OPS,
            },
            "rounds": args.rounds,
            "steps_per_round": args.steps_per_round,
            "results": result,
        },
    )


if __name__ == "__main__":
    main()
