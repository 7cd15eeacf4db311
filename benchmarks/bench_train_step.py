"""Step time of ``unitscale train``'s FP8 runs against its FP32 runs, both compiled.

For each model family (the plain GPT and the u-μP decoder at ``unitscale train``'s default
size and batch), the FP32 model and its FP8 sibling (``simulate_fp8``, the ``hardware``
recipe) are both compiled with :func:`unitscale.transforms.compile` and trained with the
run's optimiser (:func:`~unitscale.experiments.training.build_optimiser`) on the same
batches. A step is forward, backward, optimiser step and ``zero_grad``, ending with the loss
read back (as ``unitscale train`` does). FP32 and FP8 steps alternate in rounds in one
process, so load on the machine biases both alike; the ratio is the median of the per-round
ratios. Target: FP8 within 1.15x of FP32. The first step (TorchDynamo capture and Inductor
compile) is recorded separately.

Each run is appended to ``benchmarks/results/train_step.json`` with the date and load.

Run: ``python benchmarks/bench_train_step.py [--rounds N] [--steps-per-round K]``
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from _history import append_run, machine_state
from _steps import timed, training_step
from torch import nn

from unitscale.experiments.data import batches
from unitscale.experiments.training import TrainConfig, build_optimiser, build_run_model
from unitscale.transforms import compile as compile_module

RESULTS = Path(__file__).parent / "results" / "train_step.json"
TARGET = 1.15


def stepper(model: nn.Module, run: str, seed: int, config: TrainConfig) -> Callable[[], float]:
    """One training step of ``model`` per call (``run``'s optimiser, as ``unitscale train``
    builds it), on its own copy of the batch stream."""
    optimiser = build_optimiser(run, model, config)
    stream = batches(config.batch_size, config.seq_len, seed=seed, split="train")
    return training_step(model, optimiser, stream)


def family(name: str, config: TrainConfig, rounds: int, k: int) -> dict[str, Any]:
    """FP32 vs FP8 step time of one family (``plain`` or ``unit-scaled``), both compiled."""
    fp32_run, fp8_run = f"{name}-fp32", f"{name}-fp8"
    torch.manual_seed(config.seed)
    fp32 = compile_module(build_run_model(fp32_run, config))
    torch.manual_seed(config.seed)
    fp8 = build_run_model(fp8_run, replace(config, compile_fp8=True))
    steps = {
        "fp32": stepper(fp32, fp32_run, config.seed, config),
        "fp8": stepper(fp8, fp8_run, config.seed, config),
    }
    first = {}
    for key, step in steps.items():
        start = time.perf_counter()
        step()
        first[key] = time.perf_counter() - start
        step()  # the backward graph's and the optimiser's first runs
    times: dict[str, list[float]] = {"fp32": [], "fp8": []}
    for _ in range(rounds):
        for key, step in steps.items():
            times[key].append(timed(step, k)[0])
    ratios = [b / a for a, b in zip(times["fp32"], times["fp8"], strict=True)]
    ratio = statistics.median(ratios)
    result = {
        "fp32_step_ms": round(statistics.median(times["fp32"]) * 1e3, 2),
        "fp8_step_ms": round(statistics.median(times["fp8"]) * 1e3, 2),
        "ratio_fp8_vs_fp32": round(ratio, 3),
        "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "first_step_s": {key: round(value, 2) for key, value in first.items()},
        "target": TARGET,
        "meets_target": ratio <= TARGET,
    }
    print(name, result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps-per-round", type=int, default=5)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    state = machine_state()
    config = TrainConfig()
    results = {
        name: family(name, config, args.rounds, args.steps_per_round)
        for name in ("plain", "unit-scaled")
    }
    append_run(
        args.output,
        {
            **state,
            "model": {
                "hidden_size": config.hidden_size,
                "depth": config.depth,
                "heads": config.heads,
                "batch_size": config.batch_size,
                "seq_len": config.seq_len,
                "fp8_recipe": config.fp8_recipe,
            },
            "rounds": args.rounds,
            "steps_per_round": args.steps_per_round,
            "families": results,
        },
    )


if __name__ == "__main__":
    main()
