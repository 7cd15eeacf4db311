"""Sweeps loaded back from their files, and sweeps of other seeds combined into one: load
(:func:`load_transfer`), combine (:func:`combine_results`), re-run the FP8 points a combined
mean moved (:func:`rerun_fp8`) and write every output again (:func:`write_transfer_outputs`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from .. import report
from ._config import TransferConfig, TransferConfigError
from ._frames import final_frame, fp8_not_at_best, runs_frame
from ._plot import plot_transfer
from ._records import TransferResult, TransferRun
from ._summary import summary_text
from ._writers import write_transfer_csv, write_transfer_json, write_transfer_report

#: The files :func:`write_transfer_outputs` writes, in order (``summary.txt`` last).
OUTPUT_FILES: tuple[str, ...] = (
    "transfer.csv",
    "transfer.json",
    "transfer.png",
    "report.html",
    "summary.txt",
)

_RunKey = tuple[str, str, int, int, int, int]


def _key(
    parametrisation: str, precision: str, seed: int, width: int, depth: int, k: int
) -> _RunKey:
    return (str(parametrisation), str(precision), int(seed), int(width), int(depth), int(k))


def _config_from_json(document: dict[str, Any], path: Path) -> TransferConfig:
    names = {f.name for f in fields(TransferConfig)}
    stored = document.get("config")
    if not isinstance(stored, dict):
        raise TransferConfigError(f"load_transfer: {path} has no 'config'; is it a transfer.json?")
    values: dict[str, Any] = {
        k: tuple(v) if isinstance(v, list) else v for k, v in stored.items() if k in names
    }
    return TransferConfig(**values)


def _evals_from_csv(path: Path) -> dict[_RunKey, tuple[list[tuple[int, float, float]], str]]:
    """Each run's evaluations (6 decimals, as written) and data digest from ``transfer.csv``;
    the row a diverged run stopped at (empty losses) is not an evaluation."""
    import pandas as pd

    frame = pd.read_csv(path, dtype={"data_digest": str}, keep_default_na=True)
    out: dict[_RunKey, tuple[list[tuple[int, float, float]], str]] = {}
    for row in frame.itertuples(index=False):
        key = _key(row.parametrisation, row.precision, row.seed, row.width, row.depth, row.lr_step)
        evals, _ = out.get(key, ([], ""))
        digest = "" if not isinstance(row.data_digest, str) else row.data_digest
        if math.isfinite(row.heldout_loss):
            evals.append((int(row.step), float(row.train_loss), float(row.heldout_loss)))
        out[key] = (evals, digest)
    return out


def load_transfer(folder: str | os.PathLike[str]) -> TransferResult:
    """A sweep written by ``unitscale transfer`` (or :func:`write_transfer_outputs`), read
    back from ``folder``'s ``transfer.json`` (settings, every run's final losses at full
    precision, seconds, date) and ``transfer.csv`` (every run's evaluations, at the CSV's 6
    decimals, and its data digest): writing it again gives the same CSV, tables and claims.

    Raises:
        TransferConfigError: a file is missing, or the two files do not hold the same runs.
    """
    root = Path(folder)
    json_path, csv_path = root / "transfer.json", root / "transfer.csv"
    for path in (json_path, csv_path):
        if not path.is_file():
            raise TransferConfigError(
                f"load_transfer: {path} not found; pass a folder unitscale transfer wrote"
            )
    document = json.loads(json_path.read_text(encoding="utf-8"))
    config = _config_from_json(document, json_path)
    evals = _evals_from_csv(csv_path)
    runs = []
    for r in document["runs"]:
        key = _key(
            r["parametrisation"], r["precision"], r["seed"], r["width"], r["depth"], r["lr_step"]
        )
        if key not in evals:
            raise TransferConfigError(
                f"load_transfer: run {key} of {json_path} has no rows in {csv_path}"
            )
        steps, digest = evals[key]
        held = r["final_heldout_loss"]
        if held is not None and steps:  # the JSON keeps the final loss at full precision
            steps = [*steps[:-1], (steps[-1][0], steps[-1][1], float(held))]
        train = r["final_train_loss"]
        runs.append(
            TransferRun(
                r["parametrisation"],
                r["precision"],
                r["width"],
                r["depth"],
                r["lr_step"],
                r["lr"],
                r["seed"],
                list(steps),
                math.nan if train is None else float(train),
                r["stopped_at"],
                digest,
                float(r.get("seconds", 0.0)),
            )
        )
    if len(runs) != len(evals):
        raise TransferConfigError(
            f"load_transfer: {csv_path} holds {len(evals)} runs, {json_path} {len(runs)}"
        )
    load = (document.get("load_average_before"), document.get("load_average_after"))
    return TransferResult(
        config, runs, float(document.get("seconds", 0.0)), load, str(document.get("date", ""))
    )


def _same_settings(a: TransferConfig, b: TransferConfig) -> None:
    """Raise unless ``a`` and ``b`` differ in their seeds alone."""
    skip = {"seed", "seeds", "seed_values"}
    one, two = asdict(a), asdict(b)
    differ = [k for k in one if k not in skip and one[k] != two[k]]
    if differ:
        shown = "; ".join(f"{k}: {one[k]!r} vs {two[k]!r}" for k in differ)
        raise TransferConfigError(
            f"combine_results: the sweeps differ in more than their seeds ({shown}); only "
            "sweeps run with the same settings and other seeds combine"
        )


def combine_results(*results: TransferResult) -> TransferResult:
    """One sweep from sweeps of the same settings over disjoint seeds, as if run with all
    their seeds: the FP32 runs seed by seed (ascending), then the FP8 runs seed by seed.

    Each part ran its FP8 runs at the learning rate best on its own mean over seeds; the
    combined mean's best can differ at some size. :func:`fp8_not_at_best` lists those FP8
    points: re-run them (:func:`rerun_fp8`), or claim (4) says they are not comparable.

    Raises:
        TransferConfigError: the settings differ in more than the seeds, or a seed repeats.
    """
    if len(results) < 2:
        raise TransferConfigError(f"combine_results: got {len(results)} sweep(s); pass two or more")
    first = results[0].config
    for other in results[1:]:
        _same_settings(first, other.config)
    seeds = [s for result in results for s in result.config.seed_list]
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise TransferConfigError(
            f"combine_results: seed(s) {repeated} ran in more than one sweep; combine sweeps "
            "of disjoint seeds"
        )
    runs = [r for result in results for r in result.runs]
    ordered = sorted(range(len(runs)), key=lambda i: (runs[i].precision == "fp8", runs[i].seed, i))
    return TransferResult(
        replace(first, seed_values=tuple(sorted(seeds))),
        [runs[i] for i in ordered],
        sum(r.seconds for r in results),
        (None, None),
        max(r.date for r in results),
    )


def rerun_fp8(
    result: TransferResult, progress: Any = None
) -> tuple[TransferResult, list[tuple[int, int, int, int]]]:
    """Train exactly the FP8 runs :func:`fp8_not_at_best` lists (through :func:`train_one`,
    at the combined mean's best step, on each seed's data), replace that seed and size's
    FP8 run with each; return the new result and the points re-run.

    Args:
        result: a sweep, typically :func:`combine_results`'s.
        progress: called with one line after each run (None: silent).
    """
    import torch

    from ._sweep import _each_report_once, _eval_data, _train_data, train_one

    todo = fp8_not_at_best(final_frame(runs_frame(result.runs)))
    if not todo:
        return result, []
    config = result.config
    done = {(seed, w, d) for seed, w, d, _ in todo}
    runs = [
        r for r in result.runs if not (r.precision == "fp8" and (r.seed, r.width, r.depth) in done)
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        with _each_report_once():
            for i, (seed, width, depth, k) in enumerate(todo, 1):
                c = replace(config, seed=seed, seeds=1, seed_values=())
                data = (_train_data(c), _eval_data(c, "heldout"), _eval_data(c, "train"))
                run = train_one("u-muP", width, depth, k, c, *data, precision="fp8")
                runs.append(run)
                if progress is not None:
                    progress(
                        f"[{i}/{len(todo)}] seed {seed} u-muP fp8 width {width} depth "
                        f"{depth} lr {run.lr:g}: held-out {run.final_heldout_loss:.4f}"
                    )
    finally:
        torch.set_num_threads(threads)
    ordered = sorted(range(len(runs)), key=lambda i: (runs[i].precision == "fp8", runs[i].seed, i))
    seconds = result.seconds + sum(r.seconds for r in runs[len(runs) - len(todo) :])
    new = replace(result, runs=[runs[i] for i in ordered], seconds=seconds)
    return new, todo


def write_transfer_outputs(
    result: TransferResult, folder: str | os.PathLike[str], note: str = ""
) -> list[Path]:
    """Write :data:`OUTPUT_FILES` of ``result`` to ``folder`` (made if missing), as
    ``unitscale transfer`` writes them; ``note``: a line added to the summary (e.g. how the
    sweep was combined). Returns the paths written."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    figure = plot_transfer(final_frame(runs_frame(result.runs)), result.config)
    written = [
        write_transfer_csv(result, out / "transfer.csv"),
        write_transfer_json(result, out / "transfer.json"),
        report.save_png(figure, out / "transfer.png"),
        write_transfer_report(result, out / "report.html"),
    ]
    summary = out / "summary.txt"
    names = [p.name for p in [*written, summary]]
    text = summary_text(result) + (f"{note}\n" if note else "")
    text += f"\nwrote {len(names)} outputs to {out}/: " + ", ".join(names) + "\n"
    summary.write_text(text, encoding="utf-8")
    return [*written, summary]
