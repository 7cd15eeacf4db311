"""What ``unitscale transfer`` prints: the settings, the loss tables and the claims."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ._claims import Claim, evaluate_claims
from ._config import TransferConfig
from ._frames import (
    _size_column,
    best_points,
    final_frame,
    fp8_not_at_best,
    runs_frame,
    seed_mean,
)
from ._models import PARAMETRISATIONS, describe
from ._records import TransferResult

if TYPE_CHECKING:
    import pandas as pd


# -- presentation ----------------------------------------------------------------------------
def _loss_text(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else "div."


def sweep_tables(
    final: pd.DataFrame, config: TransferConfig
) -> list[tuple[str, list[str], list[list[str]]]]:
    """The final held-out loss of every run, one table per parametrisation: its title, its
    header and one row per size (a column per grid step, the best marked ``*``, the best
    learning rate, then the FP8 run's loss); over several seeds, the means over seeds."""
    final = seed_mean(final)
    size = _size_column(final)
    best = best_points(final)
    steps = list(config.lr_steps)
    header = [f"{size}", *(f"k={k:+d}" for k in steps), "best lr", "fp8 at best"]
    tables = []
    for p in PARAMETRISATIONS:
        grid = dict(config.grid(p))
        rows = []
        chosen = final[final["parametrisation"] == p]
        for (width, depth), group in chosen.groupby(["width", "depth"], sort=True):
            fp32 = group[group["precision"] == "fp32"]
            b = best[(best.parametrisation == p) & (best.width == width) & (best.depth == depth)]
            k_best = b["lr_step"].iloc[0] if len(b) else math.nan
            cells = [str(width if size == "width" else depth)]
            for k in steps:
                value = fp32.loc[fp32["lr_step"] == k, "heldout_loss"]
                text = _loss_text(float(value.iloc[0])) if len(value) else ""
                cells.append(text + ("*" if k == k_best else " "))
            cells.append(f"{grid[int(k_best)]:g}" if math.isfinite(k_best) else "n/a")
            fp8 = group[(group["precision"] == "fp8") & (group["lr_step"] == k_best)]
            cells.append(_loss_text(float(fp8["heldout_loss"].iloc[0])) if len(fp8) else "")
            rows.append(cells)
        tables.append((f"{p}: final held-out loss at lr = {grid[0]:g} x 2^k", header, rows))
    return tables


def table_lines(final: pd.DataFrame, config: TransferConfig) -> list[str]:
    """:func:`sweep_tables` as text: a title line, then the columns right-aligned."""
    lines: list[str] = []
    for title, header, rows in sweep_tables(final, config):
        lines.append(title)
        widths_ = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths_, strict=True)))
        lines.append("")
    return lines


def _quick_note(config: TransferConfig) -> str:
    """The line that marks a quick run ("" for a full one)."""
    if not config.quick:
        return ""
    return (
        f"QUICK SMOKE RUN (--quick): {config.steps} steps, {len(config.lr_steps)} learning "
        "rates per size; it checks that the command works and is no evidence for the "
        "claims: none is judged (each is shown 'not judged', with its numbers)"
    )


def _header_lines(result: TransferResult) -> list[str]:
    """What was run: sizes, steps, batch, seed, the parametrisations (and a quick run's note)."""
    config = result.config
    (width,) = config.widths if config.vary == "depth" else (None,)
    (depth,) = config.depths if config.vary == "width" else (None,)
    fixed = f"depth {depth}" if width is None else f"width {width}"
    sizes = ", ".join(str(s) for s in (config.widths if width is None else config.depths))
    standard, mup = (describe(p, config) for p in PARAMETRISATIONS)
    lines = [
        f"unitscale transfer: learning-rate sweeps across {config.vary} ({sizes}; {fixed}), "
        f"model {config.model}, {config.steps} steps, batch {config.batch_size} x "
        f"{config.seq_len} bytes, {_seeds_text(config)}",
        f"standard: {standard}; u-muP: {mup} (default lr {config.mup_lr:g}, every mult 1); "
        f"fp8: u-muP under simulate_fp8 ({config.fp8_recipe!r} recipe, no loss scaling) at "
        "its best lr",
    ]
    return [*lines, _quick_note(config)] if config.quick else lines


def _seeds_text(config: TransferConfig) -> str:
    """``seed 0``, or ``seeds 0-2 (losses: means over seeds)``."""
    seeds = config.seed_list
    if len(seeds) == 1:
        return f"seed {seeds[0]}"
    return f"seeds {_seed_range(seeds)} (losses: means over seeds)"


def _seed_range(seeds: list[int]) -> str:
    """``0-2`` for consecutive seeds, else ``0, 1, 2, 17``."""
    if seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def _losses_note(config: TransferConfig) -> str:
    over = f" (means over {config.seeds} seeds)" if config.seeds > 1 else ""
    return (
        f"losses{over}: mean next-byte cross-entropy (nats) over "
        f"{config.eval_batches} fixed held-out batches after the last step; * best of the row; "
        "div.: diverged (non-finite loss)"
    )


def _time_note(result: TransferResult) -> str:
    load = ", ".join("n/a" if v is None else f"{v:.1f}" for v in result.load_average)
    return (
        f"time: {result.seconds:.0f}s for {len(result.runs)} runs on {result.config.threads} "
        f"thread(s) (1-minute load average before, after: {load})"
    )


def transfer_claims(result: TransferResult) -> list[Claim]:
    """:func:`evaluate_claims` of a sweep's runs (none judged for a quick run)."""
    final = final_frame(runs_frame(result.runs))
    return evaluate_claims(final, quick=result.config.quick)


def summary_text(result: TransferResult) -> str:
    """What ``unitscale transfer`` prints: the settings, the loss table and the claims."""
    config = result.config
    final = final_frame(runs_frame(result.runs))
    lines = [
        *_header_lines(result),
        "",
        *table_lines(final, config),
        _losses_note(config),
        "",
    ]
    for claim in transfer_claims(result):
        lines.append(f"claim ({claim.number}) {claim.statement}: {claim.verdict}")
        lines.append(f"    {claim.detail}")
        if claim.every_seed:
            lines.append(f"    {claim.every_seed}")
    stale = fp8_not_at_best(final)
    if stale:
        points = ", ".join(f"seed {s} {config.vary} {w if config.vary == 'width' else d} k={k:+d}"
                           for s, w, d, k in stale)  # fmt: skip
        lines.append(
            f"FP8 runs not at the best learning rate of the mean over seeds (claim 4 not "
            f"comparable until re-run: benchmarks/transfer_combine_seeds.py --rerun-fp8): {points}"
        )
    lines += ["", _time_note(result)]
    return "\n".join(lines) + "\n"
