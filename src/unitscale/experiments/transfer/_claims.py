"""The README's four claims, evaluated on a sweep's table alone (:func:`evaluate_claims`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ._frames import _size_column, best_points, seed_mean

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class Claim:
    """One of the README's claims, evaluated on a sweep's table.

    Attributes:
        number: 1 to 4.
        statement: what is claimed.
        held: True or False, or None where the claim is a measurement (claim 2), could not
            be evaluated (e.g. no FP8 runs), the run cannot decide it (``detail`` starts
            with ``inconclusive``: an optimum on the grid's edge) or is not judged at all
            (``detail`` starts with ``not judged``: a quick run).
        detail: the numbers it rests on.
    """

    number: int
    statement: str
    held: bool | None
    detail: str

    @property
    def verdict(self) -> str:
        """``"held"``, ``"NOT held"``, or ``"measured"``/``"not evaluated"``/``"inconclusive"``/
        ``"not judged"`` for None."""
        if self.held is not None:
            return "held" if self.held else "NOT held"
        for verdict in ("not evaluated", "inconclusive", "not judged"):
            if self.detail.startswith(verdict):
                return verdict
        return "measured"


def _steps_text(best: pd.DataFrame, size: str) -> str:
    parts = []
    for _, row in best.iterrows():
        k = row["lr_step"]
        edge = " (grid edge)" if row["at_edge"] else ""
        shown = f"k={int(k):+d} (lr {row['lr']:g}){edge}" if math.isfinite(k) else "all diverged"
        parts.append(f"{size} {int(row[size])}: {shown}")
    return "; ".join(parts)


def _gap(a: float, b: float) -> float:
    return (a - b) / b if math.isfinite(a) and math.isfinite(b) and b else math.nan


def evaluate_claims(
    final: pd.DataFrame, tolerance: float = 0.02, quick: bool = False
) -> list[Claim]:
    """The four claims of the README, evaluated from a table of final losses.

    1. u-μP's best learning rate at every size is within one grid step of its best at the
       smallest (judged size by size, not only at the largest).
    2. How far the standard parametrisation's best learning rate moves over the same sizes
       (a measurement: ``held`` is None).
    3. u-μP at its default learning rate (grid step 0) ends within ``tolerance`` of the best
       point of its sweep at every size.
    4. u-μP in simulated FP8 at its best learning rate ends within ``tolerance`` of its FP32
       loss at every size.

    A claim is only reported held where the table supports it: claims 1 and 3 are
    ``inconclusive`` when a u-μP optimum lies on the grid's edge (the true optimum may lie
    beyond it, so neither where it is nor how far the default is from it is known; claim 3
    still fails when the default is already too far from the grid's best), and with
    ``quick`` no claim is judged, held or not (every verdict is ``not judged``: a smoke
    run's numbers are shown, but they are no evidence either way).

    Over several seeds (a ``seed`` column with more than one value), every claim is judged
    on the mean over seeds of each grid point's loss (:func:`seed_mean`); claims 1 and 2 also
    state each seed's optimum per size, and how many seeds would hold claim 1 on their own.

    Args:
        final: :func:`final_frame`, or any table with its columns.
        tolerance: the relative gap claims 3 and 4 allow.
        quick: the table comes from a quick smoke run (:attr:`TransferConfig.quick`).

    Returns:
        The four :class:`Claim` objects.

    Example:
        >>> import pandas as pd
        >>> rows = [("u-muP", "fp32", w, 2, k, 2.0**k, 2 + abs(k - 0.1 * (w == 64)))
        ...         for w in (32, 64) for k in (-1, 0, 1)]
        >>> t = pd.DataFrame(rows, columns=["parametrisation", "precision", "width", "depth",
        ...                                 "lr_step", "lr", "heldout_loss"])
        >>> [c.verdict for c in evaluate_claims(t)]
        ['held', 'not evaluated', 'held', 'not evaluated']
    """
    size = _size_column(final)
    per_seed = _per_seed_best(final, size)
    final = seed_mean(final)
    best = best_points(final).sort_values(["parametrisation", size], kind="stable")
    mup = best[best["parametrisation"] == "u-muP"]
    standard = best[best["parametrisation"] == "standard"]
    claims = [
        _claim_transfer(mup, size, per_seed),
        _claim_standard_moves(standard, size, per_seed),
        _claim_default(mup, size, tolerance),
        _claim_fp8(final, mup, size, tolerance),
    ]
    if quick:
        reason = "not judged: a --quick smoke run is no evidence either way; "
        claims = [replace(c, held=None, detail=reason + c.detail) for c in claims]
    return claims


def _edges(best: pd.DataFrame, size: str) -> str:
    """The sizes whose optimum lies on the grid's edge, as text ("" when none)."""
    at_edge = best[best["at_edge"].astype(bool)]
    return ", ".join(f"{size} {int(v)}" for v in at_edge[size])


def _moved(best: pd.DataFrame) -> int | None:
    """Grid steps from the smallest size's best to the largest's (None: not measurable)."""
    if len(best) < 2 or not best["lr_step"].notna().all():
        return None
    return int(best["lr_step"].iloc[-1] - best["lr_step"].iloc[0])


def _offsets(best: pd.DataFrame) -> list[int] | None:
    """Grid steps from the smallest size's best to each larger size's (None: a size is
    missing or diverged)."""
    if len(best) < 2 or not best["lr_step"].notna().all():
        return None
    steps = [int(k) for k in best["lr_step"]]
    return [k - steps[0] for k in steps[1:]]


def _per_seed_best(final: pd.DataFrame, size: str) -> dict[int, pd.DataFrame]:
    """Each seed's best points, sorted like the mean's ({} for a table of one seed)."""
    if "seed" not in final.columns or final["seed"].nunique() <= 1:
        return {}
    return {
        int(seed): best_points(group).sort_values(["parametrisation", size], kind="stable")
        for seed, group in final.groupby("seed", sort=True)
    }


def _seed_optima(per_seed: dict[int, pd.DataFrame], parametrisation: str, size: str) -> str:
    """Each seed's optimum per size, as text ("" for one seed)."""
    parts = []
    for seed, best in per_seed.items():
        chosen = best[best["parametrisation"] == parametrisation]
        steps = ", ".join(
            f"{int(r[size])} " + (f"k={int(r['lr_step']):+d}" if math.isfinite(r["lr_step"])
                                  else "diverged")
            for _, r in chosen.iterrows()
        )  # fmt: skip
        parts.append(f"seed {seed}: {steps}")
    return f"; per seed ({size} and best step): {'; '.join(parts)}" if parts else ""


def _transfers(best: pd.DataFrame) -> bool | None:
    """Claim 1 on one table: every size's optimum within one step of the smallest's (None:
    not measurable, or an optimum on the grid's edge)."""
    offsets = _offsets(best)
    if offsets is None or best["at_edge"].astype(bool).any():
        return None
    return all(abs(k) <= 1 for k in offsets)


def _claim_transfer(mup: pd.DataFrame, size: str, per_seed: dict[int, pd.DataFrame]) -> Claim:
    statement = (
        f"u-muP's best learning rate at every {size} is within one grid step (2x) of its best "
        f"at the smallest"
    )
    offsets = _offsets(mup)
    if offsets is None:
        return Claim(1, statement, None, "not evaluated: a size is missing or diverged")
    of_mean = "optima of the mean over seeds; " if per_seed else ""
    sizes = [int(v) for v in mup[size]]
    moves = ", ".join(f"{size} {s} {k:+d}" for s, k in zip(sizes[1:], offsets, strict=True))
    detail = (
        f"{of_mean}moves {offsets[-1]:+d} steps (from the smallest {size}'s optimum: {moves}); "
        f"{_steps_text(mup, size)}"
    )
    if per_seed:
        verdicts = [_transfers(b[b["parametrisation"] == "u-muP"]) for b in per_seed.values()]
        held_seeds = sum(v is True for v in verdicts)
        detail += (
            f"{_seed_optima(per_seed, 'u-muP', size)}; held on its own by {held_seeds} of "
            f"{len(verdicts)} seeds"
        )
    edges = _edges(mup, size)
    if edges:
        return Claim(1, statement, None, f"inconclusive: the optimum at {edges} is on the "
                     f"grid's edge (it may lie beyond); {detail}")  # fmt: skip
    return Claim(1, statement, all(abs(k) <= 1 for k in offsets), detail)


def _claim_standard_moves(
    standard: pd.DataFrame, size: str, per_seed: dict[int, pd.DataFrame]
) -> Claim:
    statement = f"how far the standard parametrisation's best learning rate moves over the {size}s"
    moved = _moved(standard)
    if moved is None:
        return Claim(2, statement, None, "not evaluated: a size is missing or diverged")
    detail = (
        f"moves {moved:+d} steps ({2.0**moved:g}x) from the smallest to the largest {size}; "
        f"{_steps_text(standard, size)}{_seed_optima(per_seed, 'standard', size)}"
    )
    return Claim(2, statement, None, detail)


def _claim_default(mup: pd.DataFrame, size: str, tolerance: float) -> Claim:
    statement = (
        f"u-muP at its default learning rate (every mult 1) ends within {tolerance:.0%} of the "
        f"best point of its sweep at every {size}"
    )
    gaps = [(int(r[size]), _gap(r["default_loss"], r["heldout_loss"])) for _, r in mup.iterrows()]
    if not gaps:
        return Claim(3, statement, None, "not evaluated: no u-muP runs")
    held = all(math.isfinite(g) and g <= tolerance for _, g in gaps)
    detail = "default vs best: " + "; ".join(f"{size} {s}: {_pct(g)}" for s, g in gaps)
    edges = _edges(mup, size)
    if held and edges:  # the true best may be lower: the gap may be larger
        return Claim(3, statement, None, f"inconclusive: the optimum at {edges} is on the "
                     f"grid's edge (the true best may be lower); {detail}")  # fmt: skip
    return Claim(3, statement, held, detail)


def _claim_fp8(final: pd.DataFrame, mup: pd.DataFrame, size: str, tolerance: float) -> Claim:
    statement = (
        f"u-muP in simulated FP8 at its best learning rate ends within {tolerance:.0%} of its "
        f"FP32 loss at every {size}, with no loss scaling"
    )
    fp8 = final[(final["precision"] == "fp8") & (final["parametrisation"] == "u-muP")]
    gaps = []
    for _, r in mup.iterrows():
        match = fp8[(fp8["width"] == r["width"]) & (fp8["depth"] == r["depth"])]
        if len(match):
            loss = float(match["heldout_loss"].iloc[0])
            gaps.append((int(r[size]), _gap(loss, r["heldout_loss"])))
    if not gaps or len(gaps) != len(mup):
        return Claim(4, statement, None, f"not evaluated: no FP8 run at some {size}")
    held = all(math.isfinite(g) and abs(g) <= tolerance for _, g in gaps)
    detail = "; ".join(f"{size} {s}: {_pct(g)}" for s, g in gaps)
    return Claim(4, statement, held, f"FP8 vs FP32 held-out: {detail}")


def _pct(value: float) -> str:
    return f"{value:+.2%}" if math.isfinite(value) else "n/a (diverged)"
