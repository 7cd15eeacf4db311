"""The block-scaled formats table and its claims, from the multi-seed ``unitscale train`` run
committed under ``benchmarks/results/train/block-formats-seeds``: the
plain and the unit-scaled model in MXFP8, MXFP4 and NVFP4, each against its own FP32 run of
the same seed, on both losses."""

from __future__ import annotations

from typing import Any

import _tables_common as paths
from _tables_fp8 import _spread, seed_gaps, timing_line

#: ``python benchmarks/train_wall_time.py --results
#: benchmarks/results/train/block-formats-seeds -- --seeds 0,1,2 --lr-plain 0.0015 --runs
#: plain-fp32,plain-mxfp8,...,unit-scaled-nvfp4 --threads 1``.
BLOCK_FOLDER = "block-formats-seeds"

#: The block-scaled formats in the table's order.
FORMATS = ("mxfp8", "mxfp4", "nvfp4")


def _document() -> dict[str, Any] | None:
    return paths.train_results(BLOCK_FOLDER)


def _recipes() -> dict[str, str]:
    """Each block-scaled precision's transform, as ``unitscale train`` applies it."""
    from unitscale.experiments._train_config import BLOCK_RUNS

    return {name: repr(transform) for name, transform in BLOCK_RUNS.items()}


def block_table() -> str:
    """One row per run of the committed block-format result (FP32 runs first, then each
    format's plain and unit-scaled run): each cell mean ± sample std over the seeds, the gaps
    with [min, max], each seed's against its own family's FP32 run of that seed."""
    document = _document()
    if document is None:
        return (
            "No block-format result is committed yet: run `python benchmarks/"
            f"train_wall_time.py --results benchmarks/results/train/{BLOCK_FOLDER} -- --seeds "
            "0,1,2 --lr-plain 0.0015 --runs plain-fp32,plain-mxfp8,plain-mxfp4,plain-nvfp4,"
            "unit-scaled-fp32,unit-scaled-mxfp8,unit-scaled-mxfp4,unit-scaled-nvfp4 "
            "--threads 1`."
        )
    recipes = _recipes()
    runs = document["runs"]
    seeds = ", ".join(str(seed) for seed in document["seeds"])
    lines = [
        "| format | run | seeds | peak lr | final train loss | final held-out loss "
        "| held-out vs FP32 | train vs FP32 | transform |",
        "|---|---|---|--:|--:|--:|--:|--:|---|",
    ]
    order = sorted(
        runs,
        key=lambda run: (
            runs[run]["precision"] != "fp32",
            FORMATS.index(runs[run]["precision"]) if runs[run]["precision"] in FORMATS else -1,
            runs[run]["family"] != "plain",
        ),
    )
    for run in order:
        entry = runs[run]
        stats = entry["stats"]
        precision = entry["precision"]
        gaps = [_spread(stats[k], percent=True) if k in stats else ""
                for k in ("heldout_vs_fp32", "train_vs_fp32")]  # fmt: skip
        transform = f"`{recipes[precision]}`" if precision in recipes else ""
        lines.append(
            f"| {precision.upper() if precision != 'fp32' else '(FP32)'} | {run} | {seeds} "
            f"| {entry['lr']:g} | {_spread(stats['final_train_loss'], ranged=False)} "
            f"| {_spread(stats['final_heldout_loss'], ranged=False)} | {gaps[0]} | {gaps[1]} "
            f"| {transform} |"
        )
    return "\n".join(lines)


def block_claims() -> str:
    """Per format, the plain and the unit-scaled model's gap to its own FP32 run: held-out
    (per seed and what holds on every seed) and training, then the run's time and load."""
    document = _document()
    if document is None:
        return ""
    runs = document["runs"]
    folder = paths.TRAIN / BLOCK_FOLDER
    lines = []
    for precision in FORMATS:
        pair = [f"{family}-{precision}" for family in ("unit-scaled", "plain")]
        if not all(run in runs for run in pair):
            continue
        lines.append(
            f"- **{precision.upper()}**: the u-μP model against its own FP32 run: "
            f"{seed_gaps(runs[pair[0]])}; the plain model against its own: "
            f"{seed_gaps(runs[pair[1]])}."
        )
    seeds = ", ".join(map(str, document["seeds"]))
    lines.append(
        f"- (mean ± sample standard deviation [min, max] over seeds {seeds}; the linear ops "
        "of both models, forward operands and gradients blocked along each GEMM's reduction "
        "dimension; no per-tensor scale beyond the format's own; one model size, "
        f"{document['settings']['steps']} steps: evidence, not a guarantee.) What this shows "
        "is each model's gap to its own FP32 run, not which model reaches the lower loss."
    )
    timing = timing_line(folder)
    if timing:
        lines.append(timing)
    return "\n".join(lines)
