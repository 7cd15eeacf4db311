"""The files of a sweep: ``transfer.csv``, ``transfer.json`` and ``report.html``."""

from __future__ import annotations

import html
import math
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .. import report
from ._config import TransferConfig, default_config
from ._frames import final_frame, runs_frame
from ._plot import plot_transfer
from ._records import TransferResult
from ._summary import (
    _header_lines,
    _losses_note,
    _quick_note,
    _time_note,
    sweep_tables,
    transfer_claims,
)


def write_transfer_csv(result: TransferResult, path: str | os.PathLike[str]) -> Path:
    """Write :func:`runs_frame` to ``path`` (6 decimals, ``\\n`` line ends); return it."""
    return report.write_csv(runs_frame(result.runs), path)


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def command_line(config: TransferConfig) -> str:
    """The ``unitscale transfer`` options that give ``config`` (without ``--out``).

    Example:
        >>> command_line(default_config("depth", model="hf:llama", seed=3, seeds=3))
        'unitscale transfer --vary depth --model hf:llama --seed 3 --seeds 3'
    """
    parts = ["unitscale transfer"]
    if config.vary != "width":
        parts.append(f"--vary {config.vary}")
    if config.model != "builtin":
        parts.append(f"--model {config.model}")
    if config.optimizer != "adamw":
        parts.append(f"--optimizer {config.optimizer}")
    if config.depth_rule != "depth-mup":
        parts.append(f"--depth-rule {config.depth_rule}")
    if config.quick:
        parts.append("--quick")
    base = default_config(config.vary, quick=config.quick)
    for name in ("widths", "depths", "steps", "seed", "seeds", "threads"):
        value = getattr(config, name)
        if value != getattr(base, name):
            shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            parts.append(f"--{name} {shown}")
    if not config.fp8:
        parts.append("--no-fp8")
    if config.seed_values:  # no option gives them: a sweep combined from several runs
        parts.append(f"(seeds {','.join(map(str, config.seed_values))}, combined)")
    return " ".join(parts)


def write_effective_rates(config: TransferConfig, path: str | os.PathLike[str]) -> Path:
    """Write every u-μP parameter's effective learning rate and decay at each size of
    ``config``, at the centre of the grid (:func:`unitscale.optim.effective_rates`, with
    ``width`` and ``depth`` columns first), to ``path`` as CSV; return it. The table a
    "does not learn" question starts from; building the models trains nothing.

    Example:
        >>> import tempfile, pandas
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = write_effective_rates(default_config(quick=True), f"{tmp}/r.csv")
        ...     table = pandas.read_csv(path)
        >>> list(table.columns[:4]), sorted(set(table.width))
        (['width', 'depth', 'name', 'tag'], [32, 64])
    """
    import pandas as pd

    from ...optim import effective_rates
    from ._models import build_model, build_optimiser

    lr = dict(config.grid("u-muP"))[0]
    frames = []
    for width, depth in config.sizes:
        model = build_model("u-muP", width, depth, config)
        optimiser = build_optimiser("u-muP", model, lr, config.model, config.optimizer)
        table = effective_rates(optimiser, model)
        table.insert(0, "depth", depth)
        table.insert(0, "width", width)
        frames.append(table)
    return report.write_csv(pd.concat(frames, ignore_index=True), path)


def write_transfer_json(result: TransferResult, path: str | os.PathLike[str]) -> Path:
    """Write the settings, every run's final losses and seconds, the claims, the time and the
    load to ``path`` as JSON (the committed results README's table is generated from)."""
    document = {
        "command": command_line(result.config),
        "date": result.date or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": result.config.threads,
        "quick": result.config.quick,
        "seconds": round(result.seconds, 1),
        "load_average_before": result.load_average[0],
        "load_average_after": result.load_average[1],
        "config": {
            k: list(v) if isinstance(v, tuple) else v for k, v in asdict(result.config).items()
        },
        "runs": [
            {
                "parametrisation": r.parametrisation,
                "precision": r.precision,
                "seed": r.seed,
                "width": r.width,
                "depth": r.depth,
                "lr_step": r.lr_step,
                "lr": r.lr,
                "final_heldout_loss": _finite_or_none(r.final_heldout_loss),
                "final_train_loss": _finite_or_none(r.final_train_loss),
                "stopped_at": r.stopped_at,
                "seconds": round(r.seconds, 2),
            }
            for r in result.runs
        ],
        "claims": [
            {
                "number": c.number,
                "statement": c.statement,
                "verdict": c.verdict,
                "detail": c.detail,
                "every_seed": c.every_seed,
            }
            for c in transfer_claims(result)
        ],
    }
    return report.write_json(document, path)


def _settings_rows(config: TransferConfig) -> list[tuple[str, str]]:
    """The settings as the report shows them: resolved defaults in words, never ``None``."""
    shown = {}
    if config.warmup_steps is None:
        shown["warmup_steps"] = f"{config.schedule.warmup_steps} (default: 5% of steps)"
    return report.settings_rows(config, shown)


def write_transfer_report(result: TransferResult, path: str | os.PathLike[str]) -> Path:
    """Write a self-contained HTML page: what was run (a quick run marked), the picture, the
    sweeps and the claims as tables, and the settings."""
    config = result.config
    final = final_frame(runs_frame(result.runs))
    caption = (
        "Final held-out loss against the peak learning rate; one curve per size, the best of "
        "each starred; crosses: u-muP in simulated FP8 at its best learning rate."
    )
    body = report.html_paragraphs(_header_lines(result)[:2])
    if config.quick:
        body.append(f"<p><strong>{html.escape(_quick_note(config))}</strong></p>")
    body += [report.html_figure(caption, plot_transfer(final, config)), "<h2>Sweeps</h2>"]
    for title, header, rows in sweep_tables(final, config):
        body += [f"<h3>{html.escape(title)}</h3>", report.html_table(header, rows)]
    body += report.html_paragraphs([_losses_note(config)])
    claims = [
        (str(c.number), c.statement, c.verdict, f"{c.detail}; {c.every_seed}" if c.every_seed
         else c.detail)
        for c in transfer_claims(result)
    ]  # fmt: skip
    body += [
        "<h2>Claims</h2>",
        report.html_table(("claim", "statement", "verdict", "numbers"), claims, text=True),
        *report.html_paragraphs([_time_note(result)]),
        "<h2>Settings</h2>",
        report.html_table(None, _settings_rows(config)),
    ]
    return report.write_html_page(
        path,
        "unitscale transfer",
        "unitscale transfer: learning-rate transfer, standard vs u-muP",
        body,
    )
