"""The long run's table and statements (static scales over 10,000 steps),
from ``benchmarks/results/train/long-run-10k/results.json`` as ``benchmarks/long_run.py``
writes it; the statements are ``summary.txt``'s, computed by ``_long_run_report``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _tables_common as paths
from _long_run_report import statements

LONG_RUN_FOLDER = "long-run-10k"


def _document() -> dict[str, Any] | None:
    return paths.train_results(LONG_RUN_FOLDER)


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2%}"


def _loss(value: float | None) -> str:
    return "diverged" if value is None else f"{value:.4f}"


def _lowest_heldout(path: Path) -> str:
    """The lowest held-out loss of a job's ``losses.csv`` and its step (where the run
    started to overfit the bundled text, if before the end)."""
    import csv

    with path.open(newline="") as file:
        rows = [row for row in csv.DictReader(file) if row["heldout_loss"]]
    if not rows:
        return "n/a"
    best = min(rows, key=lambda row: float(row["heldout_loss"]))
    return f"{float(best['heldout_loss']):.4f} ({best['step']})"


def long_run_table() -> str:
    """Per run, per seed: the final training and held-out loss, the lowest held-out loss and
    its step, and each low-precision run's gaps to its own FP32 run; then whether the static
    unit scales stayed in range and what drifted (``statements``). Says so where the
    experiment is not committed or not complete."""
    document = _document()
    folder = (paths.TRAIN / LONG_RUN_FOLDER).relative_to(paths.ROOT)
    if document is None or not document.get("complete"):
        missing = "" if document is None else f" ({len(document['missing_jobs'])} jobs missing)"
        return (
            f"Not committed yet{missing}: `python benchmarks/long_run.py --jobs 2` writes "
            f"`{folder}/`."
        )
    settings = document["settings"]
    seeds = [f"seed{seed}" for seed in settings["seeds"]]
    header = " | ".join(
        f"{seed}: final train / held-out | lowest held-out (step) | vs FP32: held-out / train"
        for seed in seeds
    )
    lines = [
        f"| run | {header} | vs FP32, mean: held-out / train |",
        "|---|" + "--:|--:|--:|" * len(seeds) + "--:|",
    ]
    for kind in settings["kinds"]:
        cells, gaps = [], {"heldout": [], "train": []}
        for seed in seeds:
            job = document["jobs"][seed][kind]
            lowest = _lowest_heldout(paths.TRAIN / LONG_RUN_FOLDER / seed / kind / "losses.csv")
            entry = document["gaps_to_fp32"].get(seed, {}).get(kind)
            gap = ""
            if entry is not None:
                gap = f"{_percent(entry['heldout'])} / {_percent(entry['train'])}"
                for which in gaps:
                    gaps[which] += [] if entry[which] is None else [entry[which]]
            cells.append(
                f"{_loss(job['final_train_loss'])} / {_loss(job['final_heldout_loss'])} "
                f"| {lowest} | {gap}"
            )
        mean = ""
        if all(len(values) == len(seeds) for values in gaps.values()):
            mean = " / ".join(_percent(sum(v) / len(v)) for v in gaps.values())
        lines.append(f"| {kind} | {' | '.join(cells)} | {mean} |")
    lines += [
        "",
        f"{settings['steps']} steps, width {settings['width']}, depth {settings['depth']}, "
        f"heads {settings['heads']}, batch {settings['batch_size']} x {settings['seq_len']}, "
        f"plain lr {settings['lr_plain']}, u-μP lr `unitscale train`'s default, hardware "
        "recipe on the linear ops; "
        f"`{folder}/results.json`, `overflow_underflow.png`, `loss_curves.png`. The "
        f"`{document['scale_ranges']['run']}` run's linear ops, monitored every "
        f"{settings['monitor_every']} steps (computed from those numbers by "
        "`benchmarks/_long_run_report.py`):",
        "",
    ]
    lines += [f"- {line}" for line in statements(document["scale_ranges"])]
    return "\n".join(lines)
