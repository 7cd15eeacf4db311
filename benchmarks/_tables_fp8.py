"""The FP8 table and its claims, from the ``unitscale train`` runs committed under
``benchmarks/results/train``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _tables_common as paths
from _history import latest_run
from _tables_common import _when


def summary_rows(path: Path) -> dict[str, dict[str, Any]]:
    """The table of a ``unitscale train`` summary.txt: run -> lr, train and held-out loss,
    scaling: FP8 scales or FP16 loss scaling ("" for FP32 runs; "no scaling" for FP8 runs
    from before the column existed)."""
    rows: dict[str, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        cells = line.split()
        if len(cells) >= 4 and cells[0].startswith(("plain-", "unit-scaled-")):
            try:
                numbers = [float(cell) for cell in cells[1:4]]
            except ValueError:  # a diverged run: not a number to compare
                continue
            fp8 = "-fp8" in cells[0]
            scales = " ".join(cells[6:]) if len(cells) > 6 else ("no scaling" if fp8 else "")
            rows[cells[0]] = {
                "lr": numbers[0],
                "train": numbers[1],
                "heldout": numbers[2],
                "scales": scales,
            }
    return rows


def _baseline(run: str) -> str:
    """The FP32 run an FP8 run is compared with: its family's."""
    return "plain-fp32" if run.startswith("plain-") else "unit-scaled-fp32"


def _train_folders() -> list[Path]:
    """Committed one-seed ``unitscale train`` runs (seed 0), the hardware recipe first; the
    hardware one is left out where a multi-seed run replaces it."""
    folders = sorted(paths.TRAIN.glob("*-seed0"), key=lambda f: not f.name.startswith("hardware"))
    if _seeds_document() is not None:
        folders = [f for f in folders if not f.name.startswith("hardware")]
    return folders


#: ``python benchmarks/train_wall_time.py --results benchmarks/results/train/hardware-recipe-seeds
#: -- --seeds 0,1,2`` (``unitscale train --seeds 0,1,2`` with its time and load recorded).
SEEDS_FOLDER = "hardware-recipe-seeds"

#: The scope of a one-seed folder's FP8 runs: every matmul-like op, attention's included
#: (recorded before ``simulate_fp8`` had ``ops=`` and ``unitscale train`` chose the linear
#: ops).
LEGACY_OPS = "all matmuls"


def _seeds_document() -> dict[str, Any] | None:
    """The committed multi-seed ``results.json`` (None until one is committed)."""
    return paths.train_results(SEEDS_FOLDER)


def _gap(row: dict[str, Any], base: dict[str, Any], key: str) -> float:
    return 100 * (row[key] / base[key] - 1)


def _spread(stats: dict[str, Any], percent: bool = False, ranged: bool = True) -> str:
    """``mean ± std [min, max]`` of :func:`seed_stats`' numbers (percentages with ``percent``)."""
    if stats["mean"] is None:
        return "diverged"

    def show(value: float) -> str:
        return f"{100 * value:+.2f}%" if percent else f"{value:.4f}"

    text = show(stats["mean"])
    if stats["std"] is not None:
        text += f" ± {show(stats['std']).lstrip('+')}"
    if ranged and stats["n"] > 1:
        text += f" [{show(stats['min'])}, {show(stats['max'])}]"
    return text


_FP8_HEADER = [
    "| recipe | run | scaling | ops | seeds | peak lr | final train loss | final held-out loss "
    "| held-out vs FP32 | train vs FP32 | file |",
    "|---|---|---|---|---|--:|--:|--:|--:|--:|---|",
]


def _seeds_rows(document: dict[str, Any]) -> list[str]:
    """One row per run of the multi-seed result: each cell mean ± sample std over the seeds
    ([min, max] for the gaps, each seed's against its own FP32 run of that seed)."""
    path = f"`{(paths.TRAIN / SEEDS_FOLDER).relative_to(paths.ROOT)}/results.json`"
    seeds = ", ".join(str(seed) for seed in document["seeds"])
    rows = []
    for run, entry in document["runs"].items():
        stats = entry["stats"]
        fp8 = entry["precision"] != "fp32"
        gaps = [_spread(stats[k], percent=True) if k in stats else ""
                for k in ("heldout_vs_fp32", "train_vs_fp32")]  # fmt: skip
        ops = {"linear": "linear", "matmuls": "all matmuls"}.get(entry["ops"], entry["ops"])
        rows.append(
            f"| {document['fp8_recipe'] if fp8 else '(FP32)'} | {run} | {entry['scaling']} "
            f"| {ops if fp8 else ''} | {seeds} | {entry['lr']:g} "
            f"| {_spread(stats['final_train_loss'], ranged=False)} "
            f"| {_spread(stats['final_heldout_loss'], ranged=False)} | {gaps[0]} | {gaps[1]} "
            f"| {path} |"
        )
    return rows


def fp8_table() -> str:
    """The committed multi-seed ``unitscale train`` run (where there is one), then every
    committed one-seed run, one row per recipe and run; each FP8 run's gaps are against its
    own family's FP32 run of the same folder (and seed); a folder without that FP32 run shows
    no gap."""
    lines = list(_FP8_HEADER)
    document = _seeds_document()
    if document is not None:
        lines += _seeds_rows(document)
    for folder in _train_folders():
        recipe = folder.name.removesuffix("-recipe-seed0")
        rows = summary_rows(folder / "summary.txt")
        for run, row in rows.items():
            gaps = ["", ""]
            base = rows.get(_baseline(run)) if row["scales"] else None
            if base is not None:
                gaps = [f"{_gap(row, base, key):+.2f}%" for key in ("heldout", "train")]
            lines.append(
                f"| {recipe if row['scales'] else '(FP32)'} | {run} | {row['scales']} "
                f"| {LEGACY_OPS if row['scales'] else ''} | 0 "
                f"| {row['lr']:g} | {row['train']:.4f} | {row['heldout']:.4f} | {gaps[0]} "
                f"| {gaps[1]} | `{folder.relative_to(paths.ROOT)}/summary.txt` |"
            )
    return "\n".join(lines)


def _scaling_cost_line() -> str:
    """What the tensorwise and delayed recipes' scales cost (``fp8_scaling.json``)."""
    scaling_run = latest_run(paths.RESULTS / "fp8_scaling.json")
    cost = scaling_run["results"]["per_step_counts"]["tensorwise"]
    ops = scaling_run.get("model", {}).get("ops", "matmuls")
    scope = "its linear ops" if ops == "linear" else "every matmul-like op (attention's too)"
    share = "; ".join(
        f"{name} {scaling_run['results'][name]['scale_share_of_step']:.0%} "
        f"({scaling_run['results'][name]['ratio_vs_none']:.2f}x the step with no scales)"
        for name in ("tensorwise", "delayed")
        if name in scaling_run["results"]
    )
    compiled = "compiled" if scaling_run.get("compiled") else "eager"
    return (
        f"Per step of the built-in model with {scope} in FP8, tensorwise scaling does "
        f"{cost['amax_reductions']} amax reductions and {cost['scale_computations']} scale "
        "computations (`unitscale.transforms.scaling_cost`, "
        "`benchmarks/results/fp8_scaling.json`), which unit scaling does without. Their share "
        f"of a training step of the plain model in simulated FP8 ({compiled}, "
        f"{scaling_run['threads']} threads, this CPU): {share}; "
        f"{_when(scaling_run, paths.RESULTS / 'fp8_scaling.json')}."
    )


#: The plain model's runs under a per-tensor or per-row scaling recipe, in the claim's order.
_SCALED_RUNS = ("plain-fp8-tensorwise", "plain-fp8-rowwise", "plain-fp8-delayed")

_BASELINE_NOTE = (
    '`plain-fp8` rounds with no per-tensor scales ("no scaling"). `plain-fp8-tensorwise` '
    "is the plain model under torchao's default float8 recipe (`simulate_fp8(model, "
    'scaling="tensorwise", ops="linear")`: the linear ops only, tested to round the same '
    "operands and give the same loss and gradients as `torchao.float8.convert_to_float8_"
    "training` on the built-in GPT); `plain-fp8-rowwise` is torchao's rowwise recipe "
    '(`simulate_fp8(model, scaling="rowwise")`: a power-of-two scale per row of each GEMM '
    "operand, E4M3 gradients, tested bit for bit against torchao's)"
)


def _every_seed(per_seed: dict[str, dict[str, Any]]) -> str:
    """What holds on every seed: the largest held-out gap in magnitude, its seed and the
    spread (as ``unitscale.experiments.training.every_seed_text`` words it)."""
    values = {seed: v["heldout_vs_fp32"] for seed, v in per_seed.items()}
    if any(v is None for v in values.values()):
        return "diverged on a seed: no bound holds on every seed"
    seed, worst = max(values.items(), key=lambda item: abs(item[1]))
    return (
        f"on every seed within {abs(worst):.2%} of FP32, worst seed {seed} {worst:+.2%}, "
        f"spread {min(values.values()):+.2%} to {max(values.values()):+.2%}"
    )


def seed_gaps(entry: dict[str, Any]) -> str:
    """A multi-seed run's gaps to its FP32 run (``results.json``'s entry): held-out, per seed
    and what holds on every seed, then the final training loss."""
    stats = entry["stats"]
    per_seed = ", ".join(
        f"{100 * v['heldout_vs_fp32']:+.2f}%" if v["heldout_vs_fp32"] is not None
        else "diverged" for v in entry["per_seed"].values()
    )  # fmt: skip
    return (
        f"held-out {_spread(stats['heldout_vs_fp32'], percent=True)} (per seed "
        f"{per_seed}; {_every_seed(entry['per_seed'])}), final training loss "
        f"{_spread(stats['train_vs_fp32'], percent=True)}"
    )


def _seeds_claims(document: dict[str, Any]) -> list[str]:
    """The FP8 claim from the multi-seed result: each FP8 run's gap to its own FP32 run, on
    the held-out and on the final training loss, mean ± spread over the seeds."""
    runs = document["runs"]
    seeds = document["seeds"]

    scaled = [r for r in _SCALED_RUNS if r in runs]
    lines = [
        f"- **The u-μP model in simulated FP8 with no per-tensor scales, against its own FP32 "
        f"run: {seed_gaps(runs['unit-scaled-fp8'])}**; the plain model under per-tensor "
        "scaling, each against the plain FP32 run of the same seed: "
        + "; ".join(f"`{run}` {seed_gaps(runs[run])}" for run in scaled)
        + (
            f"; with no scaling `plain-fp8` {seed_gaps(runs['plain-fp8'])}"
            if "plain-fp8" in runs
            else ""
        )
        + f" (mean ± sample standard deviation [min, max] over seeds "
        f"{', '.join(map(str, seeds))}; {document['fp8_recipe']} recipe on the "
        f"{document['fp8_ops']} ops of both models; one model size: evidence, not a "
        "guarantee). What this shows is each model's FP8 gap to its own FP32 run, not which "
        "model reaches the lower loss.",
        f"- {_BASELINE_NOTE}. {_scaling_cost_line()}",
    ]
    return lines


def fp8_claims() -> str:
    """The FP8 claim: from the multi-seed run where one is committed, else from the one-seed
    hardware-recipe run (with its scope and its single seed said): where the unit-scaled model
    with no scales ends relative to its FP32 run, against the plain model under per-tensor
    scaling recipes relative to its own; and what those recipes' scales cost."""
    document = _seeds_document()
    if document is not None:
        lines = _seeds_claims(document)
        folder = paths.TRAIN / SEEDS_FOLDER
    else:
        folder = paths.TRAIN / "hardware-recipe-seed0"
        lines = _one_seed_claims(folder)
    timing = timing_line(folder)
    if timing:
        lines.append(timing)
    return "\n".join(lines)


def timing_line(folder: Path) -> str:
    """How long the ``unitscale train`` run committed in ``folder`` took, with its cores,
    threads and load (``run.json`` of ``benchmarks/train_wall_time.py``); "" without one."""
    timing = folder / "run.json"
    if not timing.exists():
        return ""
    run = json.loads(timing.read_text())
    if "load_average_1min_peak_during" not in run:
        return ""
    machine = (
        "an idle machine"
        if run.get("idle")
        else "a machine shared with other work: not an idle-machine time"
    )
    return (
        f"- `{run['command']}` took {run['wall_s']:.0f} s from start to report "
        f"({run['cpus']} cores, {run['torch_threads']} threads, 1-minute load "
        f"{run['load_average_before'][0]:.1f} before, at most "
        f"{run['load_average_1min_peak_during']:.1f} during it, itself included: "
        f"{machine}; `{timing.relative_to(paths.ROOT)}`)."
    )


def _one_seed_claims(folder: Path) -> list[str]:
    """The claim from a one-seed ``summary.txt``, recorded with every matmul-like op rounded."""
    rows = summary_rows(folder / "summary.txt")
    held = {
        run: _gap(row, rows[_baseline(run)], "heldout")
        for run, row in rows.items()
        if row["scales"] and _baseline(run) in rows
    }
    train = {
        run: _gap(row, rows[_baseline(run)], "train")
        for run, row in rows.items()
        if row["scales"] and _baseline(run) in rows
    }
    unit = held["unit-scaled-fp8"]
    scaled = [run for run in ("plain-fp8-tensorwise", "plain-fp8-delayed") if run in held]
    against = "; ".join(f"`{run}` {held[run]:+.2f}% (train {train[run]:+.2f}%)" for run in scaled)
    comparisons = " and ".join(
        f"{abs(abs(unit) - abs(held[run])):.2f} points "
        f"{'closer to' if abs(unit) <= abs(held[run]) else 'farther from'} its FP32 run than "
        f"the plain model with {run.removeprefix('plain-fp8-')} scaling is to its own"
        for run in scaled
    )
    absolute = "; ".join(
        f"`unit-scaled-fp8` {rows['unit-scaled-fp8']['heldout']:.4f} vs `{run}` "
        f"{rows[run]['heldout']:.4f}"
        for run in scaled
    )
    fp32_gap = _gap(rows["unit-scaled-fp32"], rows["plain-fp32"], "heldout")
    return [
        f"- **The u-μP model in simulated FP8 with no per-tensor scales ends {unit:+.2f}% from "
        f"its FP32 held-out loss** (train {train['unit-scaled-fp8']:+.2f}%); the plain model "
        f"under per-tensor scaling, each against the plain FP32 run: {against}; the plain "
        f"model with no scaling {held['plain-fp8']:+.2f}% (hardware recipe, seed 0: one "
        f"seed, one model size, evidence, not a guarantee; the held-out and the training "
        f"loss can tell different stories at one seed). So on the held-out loss the "
        f"unit-scaled model with no scales ends {comparisons}. "
        f"Absolute held-out losses (different models): {absolute}; in FP32 the u-μP model "
        f"at its default learning rate ends {fp32_gap:+.2f}% "
        f"from the plain model ({rows['unit-scaled-fp32']['heldout']:.4f} vs "
        f"{rows['plain-fp32']['heldout']:.4f}), so what this shows is each model's FP8 gap "
        "to its own FP32 run, not which model reaches the lower loss.",
        f"- This run rounded every matmul-like op ({LEGACY_OPS!r} in the table: attention's "
        "too), as `unitscale train` did before its FP8 runs were restricted to the linear "
        "ops; its `plain-fp8-tensorwise` is therefore torchao's scaling on a wider scope than "
        "torchao's recipe. A multi-seed run in the linear scope "
        "(`python benchmarks/train_wall_time.py --results "
        f"benchmarks/results/train/{SEEDS_FOLDER} -- --seeds 0,1,2`) "
        f"replaces it here once committed. Today's runs: {_BASELINE_NOTE[0].lower()}"
        f"{_BASELINE_NOTE[1:]}"
        + (
            "; `plain-fp8-delayed` takes each scale from an amax history of earlier steps "
            '(`scaling="delayed"`)'
            if "plain-fp8-delayed" in rows
            else ""
        )
        + f". {_scaling_cost_line()}",
    ]
