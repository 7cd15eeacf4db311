"""Which depth rule transfers better: two ``unitscale transfer --vary depth`` sweeps, one per
rule (depth-μP and CompleteP), compared on the same seeds, depths and grid.

    python benchmarks/compare_depth_rules.py DEPTH_MUP_DIR COMPLETEP_DIR [--out FILE]

Each DIR is a folder ``unitscale transfer --vary depth [--depth-rule completep]`` wrote. Only
the u-μP FP32 runs are compared (the standard parametrisation's runs do not depend on the
rule). For each rule, on the mean over the seeds both sweeps share and on every seed:

- the optimum's movement: the grid steps (2x each) between the best learning rate at the
  shallowest depth and at each other depth; the rule whose optimum moves less transfers
  better (the criterion of u-μP's and CompleteP's papers: the rate tuned on a shallow model
  is the deep model's best);
- the default's gap: how far the loss at the default rate (grid step 0) ends from the best
  point of its sweep at each depth;
- the best loss at each depth (CompleteP reports lower losses at depth: compute savings).

The numbers go to ``--out`` (default ``benchmarks/results/depth_rules.json``) and a text
summary is printed; the docs quote them from that file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from unitscale.experiments.transfer import final_frame, load_transfer, runs_frame, seed_mean

RESULTS = Path(__file__).parent / "results" / "depth_rules.json"


def _mup_fp32(folder: Path, seeds: set[int] | None = None) -> Any:
    result = load_transfer(folder)
    final = final_frame(runs_frame(result.runs))
    final = final[(final.parametrisation == "u-muP") & (final.precision == "fp32")]
    if seeds is not None:
        final = final[final.seed.isin(sorted(seeds))]
    return result.config, final


def _best_steps(table: Any) -> dict[int, int | None]:
    """The best grid step at each depth (None where every point diverged)."""
    best: dict[int, int | None] = {}
    for depth, rows in table.groupby("depth"):
        finite = rows.dropna(subset=["heldout_loss"])
        best[int(depth)] = (
            None if finite.empty else int(finite.loc[finite.heldout_loss.idxmin(), "lr_step"])
        )
    return best


def _default_gaps(table: Any) -> dict[int, float | None]:
    """At each depth, the loss at grid step 0 relative to the depth's best point."""
    gaps: dict[int, float | None] = {}
    for depth, rows in table.groupby("depth"):
        finite = rows.dropna(subset=["heldout_loss"])
        default = finite[finite.lr_step == 0]
        if finite.empty or default.empty:
            gaps[int(depth)] = None
            continue
        best = float(finite.heldout_loss.min())
        gaps[int(depth)] = float(default.heldout_loss.iloc[0]) / best - 1.0
    return gaps


def _movement(best: dict[int, int | None]) -> int | None:
    """The largest |step| between the shallowest depth's optimum and any other depth's."""
    depths = sorted(best)
    first = best[depths[0]]
    steps = [best[d] for d in depths[1:]]
    if first is None or any(s is None for s in steps):
        return None
    return max((abs(s - first) for s in steps if s is not None), default=0)


def rule_numbers(final: Any) -> dict[str, Any]:
    """One rule's numbers: on the mean over seeds, and per seed."""
    mean = seed_mean(final)
    best = _best_steps(mean)
    per_seed = {int(s): _best_steps(rows) for s, rows in final.groupby("seed")}
    moves = {s: _movement(b) for s, b in per_seed.items()}
    finite_moves = [m for m in moves.values() if m is not None]
    gaps = _default_gaps(mean)
    seed_gaps = {int(s): _default_gaps(rows) for s, rows in final.groupby("seed")}
    worst_gap = max(
        (g for by_depth in seed_gaps.values() for g in by_depth.values() if g is not None),
        default=None,
    )
    best_loss = {
        int(d): float(rows.dropna(subset=["heldout_loss"]).heldout_loss.min())
        for d, rows in mean.groupby("depth")
    }
    return {
        "best_step_of_mean": best,
        "movement_of_mean": _movement(best),
        "best_step_per_seed": per_seed,
        "movement_per_seed": moves,
        "worst_seed_movement": max(finite_moves) if finite_moves else None,
        "default_gap_of_mean": gaps,
        "default_gap_per_seed": seed_gaps,
        "worst_seed_default_gap": worst_gap,
        "best_heldout_loss_of_mean": best_loss,
    }


def compare(depth_mup: Path, completep: Path) -> dict[str, Any]:
    """Both rules' numbers on the seeds both sweeps ran, and which transfers better."""
    config_a, a = _mup_fp32(depth_mup)
    config_b, b = _mup_fp32(completep)
    if (config_a.depth_rule, config_b.depth_rule) != ("depth-mup", "completep"):
        raise SystemExit(
            f"compare_depth_rules: expected a depth-mup sweep then a completep sweep, got "
            f"{config_a.depth_rule!r} ({depth_mup}) and {config_b.depth_rule!r} ({completep})"
        )
    if config_a.vary != "depth" or config_b.vary != "depth":
        raise SystemExit("compare_depth_rules: both folders must be --vary depth sweeps")
    seeds = set(a.seed.unique()) & set(b.seed.unique())
    depths = set(a.depth.unique()) & set(b.depth.unique())
    if not seeds or len(depths) < 2:
        raise SystemExit("compare_depth_rules: the sweeps share no seed or fewer than 2 depths")
    a = a[a.seed.isin(sorted(seeds)) & a.depth.isin(sorted(depths))]
    b = b[b.seed.isin(sorted(seeds)) & b.depth.isin(sorted(depths))]
    numbers = {"depth-mup": rule_numbers(a), "completep": rule_numbers(b)}
    return {
        "folders": {"depth-mup": str(depth_mup), "completep": str(completep)},
        "seeds": sorted(int(s) for s in seeds),
        "depths": sorted(int(d) for d in depths),
        "width": int(config_a.widths[0]),
        "steps": config_a.steps,
        "rules": numbers,
        "verdict": verdict(numbers),
    }


def verdict(numbers: dict[str, dict[str, Any]]) -> str:
    """Which rule's optimum moves less across depth (worst seed first, then the mean), and
    whose default rate is nearer its best, in words."""
    a, b = numbers["depth-mup"], numbers["completep"]

    def key(n: dict[str, Any]) -> tuple[float, float]:
        worst, mean = n["worst_seed_movement"], n["movement_of_mean"]
        return (99.0 if worst is None else worst, 99.0 if mean is None else mean)

    if key(a) == key(b):
        moves = "the optimum moves as far under both rules"
    else:
        better = "depth-mup" if key(a) < key(b) else "completep"
        moves = f"the optimum moves less under {better}"
    parts = [
        f"{moves} (worst seed: depth-mup {a['worst_seed_movement']} step(s), completep "
        f"{b['worst_seed_movement']}; mean over seeds: depth-mup {a['movement_of_mean']}, "
        f"completep {b['movement_of_mean']})"
    ]
    gap_a, gap_b = a["worst_seed_default_gap"], b["worst_seed_default_gap"]
    if gap_a is not None and gap_b is not None:
        parts.append(
            f"the default rate ends within {100 * gap_a:.2f}% of the best on every seed with "
            f"depth-mup, {100 * gap_b:.2f}% with completep"
        )
    return "; ".join(parts)


def summary_text(document: dict[str, Any]) -> str:
    lines = [
        f"depth rules compared: u-muP FP32, width {document['width']}, depths "
        f"{document['depths']}, seeds {document['seeds']}, {document['steps']} steps",
    ]
    for rule, n in document["rules"].items():
        lines.append(f"{rule}:")
        lines.append(
            f"  best step of the mean by depth {n['best_step_of_mean']} "
            f"(moves {n['movement_of_mean']})"
        )
        for seed, steps in n["best_step_per_seed"].items():
            lines.append(
                f"  seed {seed}: best steps {steps} (moves {n['movement_per_seed'][seed]})"
            )
        gaps = {
            d: None if g is None else round(100 * g, 2) for d, g in n["default_gap_of_mean"].items()
        }
        lines.append(f"  default (k=0) vs best, mean over seeds, %: {gaps}")
        losses = {d: round(v, 4) for d, v in n["best_heldout_loss_of_mean"].items()}
        lines.append(f"  best held-out loss of the mean by depth: {losses}")
    lines.append(f"verdict: {document['verdict']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("depth_mup", type=Path, help="a --vary depth sweep (depth-mup)")
    parser.add_argument("completep", type=Path, help="a --vary depth --depth-rule completep sweep")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON written")
    args = parser.parse_args(argv)
    document = compare(args.depth_mup, args.completep)
    args.out.write_text(json.dumps(document, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    sys.stdout.write(summary_text(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
