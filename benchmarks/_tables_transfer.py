"""The transfer tables (width, depth, hf:llama) and the coordinate check's table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _tables_common as paths
from _tables_common import TRANSFER


def _loss(value: float | None) -> str:
    return "diverged" if value is None else f"{value:.4f}"


def _mean_loss(runs: list[dict[str, Any]]) -> float | None:
    """The mean final held-out loss over seeds (None where a seed diverged)."""
    losses = [r["final_heldout_loss"] for r in runs]
    return None if any(v is None for v in losses) else sum(losses) / len(losses)


def _transfer_cost(groups: dict[tuple[str, int, int], dict[int, dict[str, Any]]], size: str) -> str:
    """How much worse than the widest size's best point the narrowest size's best learning
    rate ends at the widest size, per parametrisation."""
    parts = []
    for parametrisation in ("standard", "u-muP"):
        keys = sorted(k for k in groups if k[0] == parametrisation)
        if len(keys) < 2:
            continue
        key_of = (lambda k: k[1]) if size == "width" else (lambda k: k[2])
        keys.sort(key=key_of)
        narrow, wide = groups[keys[0]], groups[keys[-1]]

        def best(runs: dict[int, dict[str, Any]]) -> int:
            return min((r["final_heldout_loss"], k) for k, r in runs.items()
                       if r["final_heldout_loss"] is not None)[1]  # fmt: skip

        moved = wide[best(narrow)]["final_heldout_loss"]
        top = wide[best(wide)]["final_heldout_loss"]
        cost = "diverged" if moved is None else f"{100 * (moved / top - 1):+.2f}%"
        parts.append(f"{parametrisation} {cost}")
    return (
        f"The narrowest {size}'s best learning rate used at the largest {size}, against the "
        f"largest's best point: {', '.join(parts)}."
    )


def transfer_table(path: Path = TRANSFER) -> str:
    """The final held-out loss of every grid point of the committed ``unitscale transfer`` run
    (the mean over its seeds; best of each row in bold, as ``best_points`` picks it: lowest
    loss, ties to the smaller learning rate), u-muP's FP8 run at its best learning rate, then
    the claims as the command evaluated them, and the time and load of the run."""
    document = json.loads(path.read_text())
    config = document["config"]
    size = config["vary"]
    steps = config["lr_steps"]
    seeds = config.get("seeds", 1)
    by_point: dict[tuple[str, str, int, int, int], list[dict[str, Any]]] = {}
    for run in document["runs"]:
        key = (run["parametrisation"], run["precision"], run["width"], run["depth"])
        by_point.setdefault((*key, run["lr_step"]), []).append(run)
    # one mean run per grid point (the JSON's runs are per seed)
    points = {
        key: {**runs[0], "final_heldout_loss": _mean_loss(runs)} for key, runs in by_point.items()
    }
    fp8 = {(w, d, k): r for (_, precision, w, d, k), r in points.items() if precision == "fp8"}
    lines = [
        f"| parametrisation | {size} | "
        + " | ".join(f"lr x 2^{k}" if k else "lr x 1 (default)" for k in steps)
        + " | best lr | FP8 at best lr (vs FP32) |",
        "|---|--:|" + "--:|" * len(steps) + "--:|--:|",
    ]
    groups: dict[tuple[str, int, int], dict[int, dict[str, Any]]] = {}
    for (parametrisation, precision, width, depth, k), run in points.items():
        if precision == "fp32":
            groups.setdefault((parametrisation, width, depth), {})[k] = run
    for (parametrisation, width, depth), runs in groups.items():
        finite = [(r["final_heldout_loss"], k) for k, r in runs.items()]
        finite = [(loss, k) for loss, k in finite if loss is not None]
        best = min(finite)[1] if finite else None
        cells = []
        for k in steps:
            text = _loss(runs[k]["final_heldout_loss"]) if k in runs else ""
            cells.append(f"**{text}**" if k == best else text)
        centre = runs[0]["lr"]
        best_lr = f"{runs[best]['lr']:g}" if best is not None else "n/a"
        low = fp8.get((width, depth, best)) if parametrisation == "u-muP" else None
        fp8_text = ""
        if low is not None and best is not None:
            base = runs[best]["final_heldout_loss"]
            loss = low["final_heldout_loss"]
            gap = f" ({100 * (loss / base - 1):+.2f}%)" if loss is not None else ""
            fp8_text = _loss(loss) + gap
        label = f"{parametrisation} (lr = {centre:g} x 2^k)"
        lines.append(
            f"| {label} | {width if size == 'width' else depth} | {' | '.join(cells)} "
            f"| {best_lr} | {fp8_text} |"
        )
    lines.append("")
    lines.append(_transfer_cost(groups, size))
    lines.append("")
    for claim in document["claims"]:
        every = claim.get("every_seed", "")
        every = f" {every[:1].upper()}{every[1:]}." if every else ""
        lines.append(
            f"- ({claim['number']}) {claim['statement']}: **{claim['verdict']}**. "
            f"{claim['detail']}.{every}"
        )
    load = [document.get("load_average_before"), document.get("load_average_after")]
    load_text = " / ".join("n/a" if v is None else f"{v:.1f}" for v in load)
    first = config["seed"]
    listed = config.get("seed_values") or list(range(first, first + seeds))
    shown = ", ".join(map(str, listed)) if config.get("seed_values") else f"{first}-{listed[-1]}"
    seed_text = (
        f"seeds {shown}, every loss the mean over the {seeds} seeds"
        if seeds > 1
        else f"seed {first}"
    )
    lines.append("")
    lines.append(
        f"Run `{path.relative_to(paths.ROOT)}` ({document['date'][:10]}, {seed_text}, torch "
        f"{document['torch']}): {len(document['runs'])} runs in {document['seconds']:.0f} s on "
        f"{document['threads']} thread(s), 1-minute load average {load_text} (before / after)."
    )
    return "\n".join(lines)


def coord_table(path: Path | None = None) -> str:
    """The coordinate check's summary: per setup and layer, the change of the layer's output
    at the largest size over the change at the smallest (every layer the JSON holds)."""
    path = paths.COORD_CHECK if path is None else path
    document = json.loads(path.read_text())
    summary = document["summary_change_ratio_largest_over_smallest"]
    columns = list(next(iter(summary.values())))
    lines = [
        "| setup, sweep | " + " | ".join(columns) + " |",
        "|---|" + "--:|" * len(columns),
    ]
    for setup, ratios in summary.items():
        cells = " | ".join(f"{ratios[column]:.2f}x" for column in columns)
        lines.append(f"| {setup} | {cells} |")
    load = document.get("load_average_before", [float("nan")])[0]
    lines += [
        "",
        f"Run `{path.relative_to(paths.ROOT)}` ({document['date'][:10]}, "
        f"torch {document['torch']}, "
        f"{document['steps']} steps, batch {document['batch'][0]} x {document['batch'][1]}), "
        f"1-minute load average {load:.1f} before.",
    ]
    return "\n".join(lines)
