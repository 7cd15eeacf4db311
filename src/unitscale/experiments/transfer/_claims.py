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
        every_seed: over several seeds, what holds on every seed, with the worst seed and
            the spread over seeds (``""`` for one seed): the claim as the seeds support it,
            never a mean that hides a seed.
    """

    number: int
    statement: str
    held: bool | None
    detail: str
    every_seed: str = ""

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

    Over several seeds (a ``seed`` column with more than one value), claims 1, 3 and 4 are
    judged on the mean over seeds of each grid point's loss (:func:`seed_mean`) AND on every
    seed on its own: a claim that one seed breaks is NOT held, however well the mean does.
    Each claim's :attr:`Claim.every_seed` then states what holds on every seed, with the
    worst seed and the spread over seeds (claim 1: the largest move of any seed and how
    many seeds hold it alone; claim 2: each seed's move; claim 3: the largest gap of any
    seed's default to that seed's best; claim 4: the largest FP8 gap of any seed).

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
    seeds = _per_seed_tables(final)
    per_seed = {
        seed: best_points(t).sort_values(["parametrisation", size], kind="stable")
        for seed, t in seeds.items()
    }
    mean = seed_mean(final)
    best = best_points(mean).sort_values(["parametrisation", size], kind="stable")
    mup = best[best["parametrisation"] == "u-muP"]
    standard = best[best["parametrisation"] == "standard"]
    claims = [
        _claim_transfer(mup, size, per_seed),
        _claim_standard_moves(standard, size, per_seed),
        _claim_default(mup, size, tolerance, per_seed),
        _claim_fp8(mean, mup, size, tolerance, seeds),
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


def _per_seed_tables(final: pd.DataFrame) -> dict[int, pd.DataFrame]:
    """Each seed's final rows ({} for a table of one seed)."""
    if "seed" not in final.columns or final["seed"].nunique() <= 1:
        return {}
    return {int(seed): group for seed, group in final.groupby("seed", sort=True)}


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


def _combine(verdicts: list[bool | None]) -> bool | None:
    """One verdict from the mean's and every seed's: False if any is False, else None if any
    is None (inconclusive or not measurable), else True."""
    if any(v is False for v in verdicts):
        return False
    return None if any(v is None for v in verdicts) else True


def _every_seed_transfer(mup: dict[int, pd.DataFrame], size: str) -> tuple[str, list[bool | None]]:
    """Claim 1 on every seed: the worst seed's largest move, and each seed's verdict."""
    verdicts = [_transfers(b) for b in mup.values()]
    worst: tuple[int, int, int] | None = None  # (|move|, seed, size)
    for seed, best in mup.items():
        offsets = _offsets(best)
        if offsets is None:
            return f"not measurable on seed {seed} (a size is missing or diverged)", verdicts
        for s, k in zip(best[size].iloc[1:], offsets, strict=True):
            if worst is None or abs(k) > worst[0]:
                worst = (abs(k), seed, int(s))
    if worst is None:  # pragma: no cover - _offsets is None below two sizes
        return "not measurable (fewer than two sizes)", verdicts
    held = sum(v is True for v in verdicts)
    text = (
        f"on every seed, the optimum within {worst[0]} grid step(s) of the smallest {size}'s "
        f"(worst: seed {worst[1]}, {worst[0]} step(s) at {size} {worst[2]}); within one step "
        f"on its own on {held} of {len(verdicts)} seeds"
    )
    return text, verdicts


def _claim_transfer(mup: pd.DataFrame, size: str, per_seed: dict[int, pd.DataFrame]) -> Claim:
    statement = (
        f"u-muP's best learning rate at every {size} is within one grid step (2x) of its best "
        f"at the smallest" + (", on the mean over seeds and on every seed" if per_seed else "")
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
    held: bool | None = all(abs(k) <= 1 for k in offsets)
    seeds_break = False
    every = ""
    if per_seed:
        chosen = {s: b[b["parametrisation"] == "u-muP"] for s, b in per_seed.items()}
        every, verdicts = _every_seed_transfer(chosen, size)
        held_seeds = sum(v is True for v in verdicts)
        detail += (
            f"{_seed_optima(per_seed, 'u-muP', size)}; held on its own by {held_seeds} of "
            f"{len(verdicts)} seeds"
        )
        held = _combine([held, *verdicts])
        seeds_break = any(v is False for v in verdicts)
    edges = _edges(mup, size)
    if edges and not seeds_break:  # a seed that breaks it on its own decides
        return Claim(1, statement, None, f"inconclusive: the optimum at {edges} is on the "
                     f"grid's edge (it may lie beyond); {detail}", every)  # fmt: skip
    if held is None:
        detail = (
            f"inconclusive: a seed's optimum is on the grid's edge, or a seed diverged at "
            f"every rate of a size; {detail}"
        )
    return Claim(1, statement, held, detail, every)


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
    moves = {s: _moved(b[b["parametrisation"] == "standard"]) for s, b in per_seed.items()}
    every = ""
    if moves:
        shown = ", ".join(f"seed {s} " + ("n/a" if m is None else f"{m:+d}")
                          for s, m in moves.items())  # fmt: skip
        known = [m for m in moves.values() if m is not None]
        spread = f"{min(known):+d} to {max(known):+d} steps" if known else "n/a"
        every = f"per seed, smallest to largest {size}: {shown} (spread {spread})"
    return Claim(2, statement, None, detail, every)


def _spread_text(gaps: dict[int, dict[int, float]], size: str, signed: bool) -> tuple[str, float]:
    """The worst seed and each size's spread (min to max over seeds) of per-seed gaps
    (``gaps[seed][size]``) as text, and the worst gap's magnitude (NaN where a seed
    diverged); ``signed``: the worst is the largest magnitude, else the largest."""
    flat = [(g, seed, s) for seed, by_size in gaps.items() for s, g in by_size.items()]
    if not all(math.isfinite(g) for g, _, _ in flat):
        bad = sorted({seed for g, seed, _ in flat if not math.isfinite(g)})
        return f"n/a on seed(s) {', '.join(map(str, bad))} (diverged)", math.nan
    worst = max(flat, key=lambda t: abs(t[0]) if signed else t[0])
    sizes = sorted({s for _, _, s in flat})
    spread = "; ".join(
        f"{size} {s}: {_pct(min(v))} to {_pct(max(v))}"
        for s in sizes
        for v in [[by_size[s] for by_size in gaps.values() if s in by_size]]
    )
    return f"(worst: seed {worst[1]} at {size} {worst[2]}, {_pct(worst[0])}); spread over " \
        f"seeds: {spread}", abs(worst[0])  # fmt: skip


def _default_gaps(best: pd.DataFrame, size: str) -> list[tuple[int, float]]:
    return [(int(r[size]), _gap(r["default_loss"], r["heldout_loss"])) for _, r in best.iterrows()]


def _claim_default(
    mup: pd.DataFrame, size: str, tolerance: float, per_seed: dict[int, pd.DataFrame]
) -> Claim:
    statement = (
        f"u-muP at its default learning rate (every mult 1) ends within {tolerance:.0%} of the "
        f"best point of its sweep at every {size}" + (", on every seed" if per_seed else "")
    )
    gaps = _default_gaps(mup, size)
    if not gaps:
        return Claim(3, statement, None, "not evaluated: no u-muP runs")
    held = all(math.isfinite(g) and g <= tolerance for _, g in gaps)
    of_mean = "on the mean over seeds, " if per_seed else ""
    detail = f"{of_mean}default vs best: " + "; ".join(f"{size} {s}: {_pct(g)}" for s, g in gaps)
    edges = _edges(mup, size)
    every = ""
    if per_seed:
        chosen = {s: b[b["parametrisation"] == "u-muP"] for s, b in per_seed.items()}
        seed_gaps = {seed: dict(_default_gaps(b, size)) for seed, b in chosen.items()}
        text, worst = _spread_text(seed_gaps, size, signed=False)
        every = f"the default within {_pct(worst).lstrip('+')} of each seed's best point on " \
            f"every seed {text}" if math.isfinite(worst) else f"default vs best {text}"  # fmt: skip
        held = held and math.isfinite(worst) and worst <= tolerance
        seed_edges = [f"seed {s}: {e}" for s, b in chosen.items() if (e := _edges(b, size))]
        edges = "; ".join(([edges] if edges else []) + seed_edges)
    if held and edges:  # the true best may be lower: the gap may be larger
        return Claim(3, statement, None, f"inconclusive: the optimum at {edges} is on the "
                     f"grid's edge (the true best may be lower); {detail}", every)  # fmt: skip
    return Claim(3, statement, held, detail, every)


def _fp8_gaps(
    table: pd.DataFrame, mup: pd.DataFrame, size: str
) -> tuple[list[tuple[int, float]], list[str]]:
    """Each size's FP8 loss against the FP32 loss of ``table`` at the step best on ``mup``;
    and the sizes whose FP8 runs ran at another step (not comparable)."""
    fp8 = table[(table["precision"] == "fp8") & (table["parametrisation"] == "u-muP")]
    fp32 = table[(table["precision"] == "fp32") & (table["parametrisation"] == "u-muP")]
    gaps, elsewhere = [], []
    for _, r in mup.iterrows():
        here = (fp8["width"] == r["width"]) & (fp8["depth"] == r["depth"])
        match = fp8[here & (fp8["lr_step"] == r["lr_step"])]
        if len(fp8[here]) > len(match):
            steps = sorted({int(k) for k in fp8[here]["lr_step"]} - {int(r["lr_step"])})
            elsewhere.append(f"{size} {int(r[size])} (FP8 at k={steps}, best k="
                             f"{int(r['lr_step']):+d})")  # fmt: skip
        base = fp32[(fp32["width"] == r["width"]) & (fp32["depth"] == r["depth"])
                    & (fp32["lr_step"] == r["lr_step"])]  # fmt: skip
        if len(match) and len(base):
            loss = float(match["heldout_loss"].iloc[0])
            gaps.append((int(r[size]), _gap(loss, float(base["heldout_loss"].iloc[0]))))
    return gaps, elsewhere


def _claim_fp8(
    mean: pd.DataFrame,
    mup: pd.DataFrame,
    size: str,
    tolerance: float,
    seeds: dict[int, pd.DataFrame],
) -> Claim:
    statement = (
        f"u-muP in simulated FP8 at its best learning rate ends within {tolerance:.0%} of its "
        f"FP32 loss at every {size}, with no loss scaling" + (", on every seed" if seeds else "")
    )
    gaps, elsewhere = _fp8_gaps(mean, mup, size)
    if elsewhere:
        return Claim(4, statement, None, "not evaluated: not comparable: the FP8 runs at "
                     f"{'; '.join(elsewhere)} ran at a learning rate that is not the best of "
                     "the mean over seeds: re-run them there")  # fmt: skip
    if not gaps or len(gaps) != len(mup):
        return Claim(4, statement, None, f"not evaluated: no FP8 run at some {size}")
    held = all(math.isfinite(g) and abs(g) <= tolerance for _, g in gaps)
    of_mean = "on the mean over seeds, " if seeds else ""
    detail = f"{of_mean}FP8 vs FP32 held-out: " + "; ".join(f"{size} {s}: {_pct(g)}"
                                                            for s, g in gaps)  # fmt: skip
    every = ""
    if seeds:
        seed_gaps = {seed: dict(_fp8_gaps(t, mup, size)[0]) for seed, t in seeds.items()}
        missing = [s for s, g in seed_gaps.items() if len(g) != len(mup)]
        if missing:
            return Claim(4, statement, None, f"not evaluated: no FP8 run at some {size} on "
                         f"seed(s) {', '.join(map(str, missing))}; {detail}")  # fmt: skip
        text, worst = _spread_text(seed_gaps, size, signed=True)
        every = f"FP8 within {_pct(worst).lstrip('+')} of FP32 on every seed {text}" \
            if math.isfinite(worst) else f"FP8 vs FP32 {text}"  # fmt: skip
        held = held and math.isfinite(worst) and worst <= tolerance
    return Claim(4, statement, held, detail, every)


def _pct(value: float) -> str:
    return f"{value:+.2%}" if math.isfinite(value) else "n/a (diverged)"
