"""FP32-only learning-rate sweep of ``unitscale train``'s two model families, and the
positions ablation behind the default u-μP decoder's rotary embeddings.

Each point is one ``unitscale train`` FP32 run (its defaults: 1000 steps, batches of 16 x 64
bytes, width 128, depth 2, 4 heads, warm-up then cosine decay) at ``--seed`` (default 1, not
the committed run's seed 0, so that the rate is not chosen on the run it is reported on):

- ``plain``: the plain GPT (learned position embedding) with torch's Adam;
- ``u-muP``: the default u-μP decoder (``unitscale.TransformerDecoder``, RoPE) with
  ``unitscale.optim.AdamW``, the base rate scaled per parameter;
- ``--no-positions``: the same without positional information of its own: the plain GPT
  without its position embedding (``GPTConfig(position_embedding=False)``), the decoder with
  ``rope=False`` (a "NoPE" decoder, the default before RoPE).

No FP8 run is involved: the rates of ``unitscale train`` are fixed from FP32 evidence alone.
Each point's final held-out and training losses (8 fixed batches each) and seconds are
appended to ``benchmarks/results/train_lr_sweep.json``. Runs use one thread each, so two
can share a 2-core machine (``--jobs 2``); losses do not depend on the load.

Run: ``python benchmarks/train_lr_sweep.py --family u-muP --lrs 0.125,0.25,0.5,1,2
[--no-positions] [--seed 1] [--steps N] [--jobs 2]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from _history import append_run, machine_state

RESULTS = Path(__file__).parent / "results" / "train_lr_sweep.json"
FAMILIES = {"plain": "plain-fp32", "u-muP": "unit-scaled-fp32"}


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_point(family: str, lr: float, seed: int, steps: int, positions: bool) -> dict[str, Any]:
    """One FP32 run of ``family`` at peak rate ``lr``; its final losses and seconds."""
    torch.set_num_threads(1)
    from unitscale import TransformerDecoder
    from unitscale.experiments import training

    run = FAMILIES[family]
    config = training.TrainConfig(
        steps=steps, seed=seed, runs=(run,), lr_plain=lr, lr_unit_scaled=lr
    )
    if not positions:  # the ablation: the same models without positional information
        if family == "plain":
            model_config = dataclasses.replace(config.model_config, position_embedding=False)
            build = lambda c: training.plain_gpt(model_config, seed=c.seed)  # noqa: E731
        else:

            def build(c: training.TrainConfig) -> torch.nn.Module:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(c.seed)
                    # the committed ablation's decoder: the GPT-style block, as before the
                    # Llama-style block became the default
                    return TransformerDecoder(
                        c.hidden_size, c.depth, c.heads, 256, rope=False, block="gpt"
                    )

        training.build_run_model = lambda _run, c: build(c)  # type: ignore[assignment]
    start = time.perf_counter()
    result = training.train_runs(config, progress=False)[run]
    return {
        "family": family,
        "positions": positions,
        "lr": lr,
        "seed": seed,
        "steps": steps,
        "final_heldout_loss": result.final_heldout_loss,
        "final_train_loss": result.final_train_loss,
        "stopped_at": result.stopped_at,
        "seconds": round(time.perf_counter() - start, 1),
    }


def _point(args: tuple[str, float, int, int, bool]) -> dict[str, Any]:
    return run_point(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--lrs", required=True, help="comma-separated peak learning rates")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--no-positions", action="store_true")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    lrs = [float(v) for v in args.lrs.split(",")]
    state = machine_state()
    points = [(args.family, lr, args.seed, args.steps, not args.no_positions) for lr in lrs]
    # spawn: every point in a fresh process (the ablation patches the model builder)
    with multiprocessing.get_context("spawn").Pool(args.jobs, maxtasksperchild=1) as pool:
        results = pool.map(_point, points, chunksize=1)
    for r in results:
        print(json.dumps(r))
    best = min(results, key=lambda r: r["final_heldout_loss"])
    append_run(
        RESULTS,
        {
            **state,
            "code_commit": _commit(),
            "threads_per_run": 1,
            "jobs": args.jobs,
            "family": args.family,
            "positions": not args.no_positions,
            "seed": args.seed,
            "steps": args.steps,
            "points": results,
            "best_lr": best["lr"],
        },
    )


if __name__ == "__main__":
    main()
