"""Per-step cost of each run kind of ``unitscale train``, interleaved in one process.

Every kind of the default run set (``TrainConfig().runs``) is built as ``unitscale train``
builds it (:func:`~unitscale.experiments.training.build_run_model` and
:func:`~unitscale.experiments.training.build_optimiser`, eager, no monitor) and trained on
its own copy of the training stream. A step is forward, backward, optimiser step and
``zero_grad``, ending with the loss read back, as in :func:`unitscale.experiments.runner.
train_loop`; an evaluation batch is :func:`unitscale.experiments.runner.evaluate` of one
held-out batch. The kinds take turns in rounds of a few steps each, so load from other work
on the machine falls on every kind alike.

Both the wall time and the process's CPU time (``time.process_time``: all its threads) are
recorded. From them, the default ``unitscale train`` (``steps`` steps and its evaluations per
kind) is *estimated*, not measured:

- ``estimate_at_measured_load_s``: from the wall times (a check against the measured run);
- ``idle_estimate_s``: the range an idle machine would give, from the CPU seconds the
  work took: at best every thread busy (CPU seconds / threads), at worst no parallel
  speed-up (CPU seconds). Under load, torch's worker threads also burn CPU while waiting,
  so the upper end is generous.

Each run is appended to ``benchmarks/results/train_kinds_step.json`` with the date and load.

Run: ``python benchmarks/bench_train_kinds.py [--rounds N] [--steps-per-round K]``
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _history import append_run, machine_state
from _steps import timed, training_step

from unitscale.experiments.runner import evaluate, evaluation_batches, training_batches
from unitscale.experiments.training import TrainConfig, build_optimiser, build_run_model

RESULTS = Path(__file__).parent / "results" / "train_kinds_step.json"


def stepper(run: str, config: TrainConfig) -> Callable[[], float]:
    """One training step of ``run`` per call, on its own copy of the training stream."""
    torch.manual_seed(config.seed)
    model = build_run_model(run, config)
    model.train()
    optimiser = build_optimiser(run, model, config)
    stream = iter(training_batches(config.batch_size, config.seq_len, config.seed))
    heldout = evaluation_batches(config.batch_size, config.seq_len, config.seed, "heldout", 1)

    step = training_step(model, optimiser, stream)
    step.evaluate = lambda: evaluate(model, heldout)  # type: ignore[attr-defined]
    return step


def evaluations_per_run(config: TrainConfig) -> int:
    """Forward passes of one evaluation batch each that a run does (runner.train_loop):
    held-out every ``eval_every`` steps and at the end, then the final training loss."""
    heldout_points = len(range(config.eval_every, config.steps, config.eval_every)) + 1
    return (heldout_points + 1) * config.eval_batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    state = machine_state()
    config = TrainConfig()
    steps = {run: stepper(run, config) for run in config.runs}
    for step in steps.values():  # first steps: allocations, the optimiser's state
        step()
    times: dict[str, dict[str, list[float]]] = {
        run: {"step_wall": [], "step_cpu": [], "eval_wall": [], "eval_cpu": []} for run in steps
    }
    for _ in range(args.rounds):
        for run, step in steps.items():
            wall, cpu = timed(step, args.steps_per_round)
            times[run]["step_wall"].append(wall)
            times[run]["step_cpu"].append(cpu)
            wall, cpu = timed(step.evaluate, 1)  # type: ignore[attr-defined]
            times[run]["eval_wall"].append(wall)
            times[run]["eval_cpu"].append(cpu)
    evals = evaluations_per_run(config)
    kinds: dict[str, Any] = {}
    total_wall = total_cpu = 0.0
    for run, t in times.items():
        median = {key: statistics.median(values) for key, values in t.items()}
        run_wall = config.steps * median["step_wall"] + evals * median["eval_wall"]
        run_cpu = config.steps * median["step_cpu"] + evals * median["eval_cpu"]
        total_wall += run_wall
        total_cpu += run_cpu
        kinds[run] = {
            "step_wall_ms": round(median["step_wall"] * 1e3, 1),
            "step_cpu_ms": round(median["step_cpu"] * 1e3, 1),
            "eval_batch_wall_ms": round(median["eval_wall"] * 1e3, 1),
            "eval_batch_cpu_ms": round(median["eval_cpu"] * 1e3, 1),
            "run_estimate_at_measured_load_s": round(run_wall, 1),
            "run_cpu_s": round(run_cpu, 1),
        }
        print(run, kinds[run], flush=True)
    threads = torch.get_num_threads()
    summary = {
        "estimate_at_measured_load_s": round(total_wall, 1),
        "cpu_s": round(total_cpu, 1),
        "idle_estimate_s": [round(total_cpu / threads, 1), round(total_cpu, 1)],
        "note": "estimates of the default `unitscale train` (steps and evaluations per kind, "
        "building and compiling excluded), not a measured run",
    }
    print(summary, flush=True)
    append_run(
        args.output,
        {
            **state,
            "runs_timed": list(steps),
            "steps": config.steps,
            "evaluation_batches_per_run": evals,
            "rounds": args.rounds,
            "steps_per_round": args.steps_per_round,
            "kinds": kinds,
            "default_train": summary,
        },
    )


if __name__ == "__main__":
    main()
