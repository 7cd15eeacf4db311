"""A sweep's runs as tables: one row per run and evaluation (:data:`CSV_COLUMNS`), the final
rows, and the best grid point of each parametrisation and size."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ._records import TransferRun

if TYPE_CHECKING:
    import pandas as pd


#: The columns of ``transfer.csv``, one row per run and evaluation.
CSV_COLUMNS: tuple[str, ...] = (
    "parametrisation",
    "precision",
    "seed",
    "width",
    "depth",
    "lr_step",
    "lr",
    "step",
    "train_loss",
    "heldout_loss",
    "final",
    "data_digest",
)


def runs_frame(runs: Sequence[TransferRun]) -> pd.DataFrame:
    """One row per run and evaluation (:data:`CSV_COLUMNS`); ``final`` marks the row of the
    run's last evaluation. A run that diverged has one row, at the step it stopped, with
    empty losses."""
    import pandas as pd

    rows: list[tuple[Any, ...]] = []
    for r in runs:
        head = (r.parametrisation, r.precision, r.seed, r.width, r.depth, r.lr_step, r.lr)
        evals = list(r.evals)
        if r.stopped_at is not None:
            evals.append((r.stopped_at, math.nan, math.nan))
        for i, (step, train, held) in enumerate(evals):
            rows.append((*head, step, train, held, i == len(evals) - 1, r.data_digest))
    return pd.DataFrame(rows, columns=list(CSV_COLUMNS))


def final_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of :func:`runs_frame` with ``final`` set: one per run, its final losses."""
    return frame[frame["final"].astype(bool)].reset_index(drop=True)


def seed_mean(final: pd.DataFrame) -> pd.DataFrame:
    """The final rows of a sweep over several seeds as one row per grid point: the mean over
    seeds of each loss, NaN where a seed diverged (a point is as good as its worst seed
    allows), and ``seeds``, how many seeds ran the point. A table of one seed (or without a
    ``seed`` column) is returned as it is.

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"parametrisation": "u-muP", "precision": "fp32", "seed": [0, 1],
        ...                   "width": 32, "depth": 2, "lr_step": 0, "lr": 0.5,
        ...                   "train_loss": [2.0, 3.0], "heldout_loss": [2.0, 2.5]})
        >>> seed_mean(t)[["lr_step", "heldout_loss", "seeds"]].values.tolist()
        [[0.0, 2.25, 2.0]]
    """
    if "seed" not in final.columns or final["seed"].nunique() <= 1:
        return final
    keys = ["parametrisation", "precision", "width", "depth", "lr_step", "lr"]
    losses = [c for c in ("train_loss", "heldout_loss") if c in final.columns]
    grouped = final.groupby(keys, sort=False)
    out = grouped[losses].agg(lambda v: v.mean(skipna=False)).reset_index()
    out["seeds"] = grouped.size().to_numpy()
    return out


def _size_column(frame: pd.DataFrame) -> str:
    """The column that varies across the sweep's sizes (``width`` unless only depth does)."""
    return "depth" if frame["width"].nunique() == 1 and frame["depth"].nunique() > 1 else "width"


def best_points(final: pd.DataFrame) -> pd.DataFrame:
    """The best FP32 grid point of each parametrisation and size.

    Args:
        final: :func:`final_frame` (any table with ``parametrisation``, ``precision``,
            ``width``, ``depth``, ``lr_step``, ``lr`` and ``heldout_loss``); over several
            seeds, the mean over seeds (:func:`seed_mean`).

    Returns:
        One row per parametrisation and size: ``lr_step`` and ``lr`` of the lowest finite
        held-out loss (ties: the smaller step), that ``heldout_loss``, ``at_edge`` (the best is
        the grid's first or last step, so the true optimum may lie outside the grid) and
        ``default_loss`` (the loss at step 0). A size whose every run diverged has NaNs.

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"parametrisation": "u-muP", "precision": "fp32", "width": 32,
        ...                   "depth": 2, "lr_step": [-1, 0, 1], "lr": [0.25, 0.5, 1.0],
        ...                   "heldout_loss": [2.0, 1.5, float("nan")]})
        >>> best_points(t)[["lr_step", "heldout_loss", "at_edge"]].values.tolist()
        [[0.0, 1.5, False]]
    """
    import pandas as pd

    fp32 = seed_mean(final[final["precision"] == "fp32"])
    rows = []
    for (p, width, depth), group in fp32.groupby(["parametrisation", "width", "depth"], sort=False):
        steps = sorted(group["lr_step"])
        finite = group[group["heldout_loss"].map(lambda v: math.isfinite(float(v)))]
        default = group.loc[group["lr_step"] == 0, "heldout_loss"]
        row: dict[str, Any] = {
            "parametrisation": p,
            "width": width,
            "depth": depth,
            "default_loss": float(default.iloc[0]) if len(default) else math.nan,
        }
        if len(finite):
            best = finite.sort_values(["heldout_loss", "lr_step"], kind="stable").iloc[0]
            k = int(best["lr_step"])
            row.update(
                lr_step=float(k),
                lr=float(best["lr"]),
                heldout_loss=float(best["heldout_loss"]),
                at_edge=k in (steps[0], steps[-1]),
            )
        else:
            row.update(lr_step=math.nan, lr=math.nan, heldout_loss=math.nan, at_edge=False)
        rows.append(row)
    columns = ["parametrisation", "width", "depth", "lr_step", "lr", "heldout_loss"]
    return pd.DataFrame(rows, columns=[*columns, "at_edge", "default_loss"])


def fp8_not_at_best(final: pd.DataFrame) -> list[tuple[int, int, int, int]]:
    """The FP8 runs a sweep lacks at the learning rate best on its mean over seeds: one
    ``(seed, width, depth, lr_step)`` per seed and size whose FP8 run is missing there or
    ran at another step. Empty for a sweep run in one go (its FP8 runs are at the best by
    construction); after :func:`combine_results`, the best of the combined mean may differ
    from the best of either part's, and these are the FP8 runs to re-run
    (:func:`rerun_fp8`). A size whose every FP32 run diverged is left out.

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"parametrisation": "u-muP", "seed": 0, "width": 32, "depth": 2,
        ...                   "precision": ["fp32", "fp32", "fp8"], "lr_step": [0, 1, 1],
        ...                   "lr": [0.5, 1.0, 1.0], "heldout_loss": [2.0, 2.1, 2.1]})
        >>> fp8_not_at_best(t)
        [(0, 32, 2, 0)]
    """
    mup = final[final["parametrisation"] == "u-muP"]
    fp8 = mup[mup["precision"] == "fp8"]
    if not len(fp8):
        return []
    best = best_points(mup)
    seeds = sorted(int(s) for s in final["seed"].unique()) if "seed" in final.columns else [0]
    missing = []
    for _, r in best.iterrows():
        if not math.isfinite(r["lr_step"]):
            continue
        for seed in seeds:
            ran = fp8[(fp8["width"] == r["width"]) & (fp8["depth"] == r["depth"])]
            if "seed" in fp8.columns:
                ran = ran[ran["seed"] == seed]
            if not (ran["lr_step"] == r["lr_step"]).any():
                missing.append((seed, int(r["width"]), int(r["depth"]), int(r["lr_step"])))
    return missing
