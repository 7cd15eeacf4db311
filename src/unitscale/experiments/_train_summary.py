"""Summaries of ``unitscale train``'s results (:mod:`unitscale.experiments.training`): the
loss table (:func:`losses_frame`), the FP8 and FP16 gaps, the printed table
(:func:`summary_text`), the seed statistics (:func:`seeds_document`) and the report
(:func:`write_train_report`)."""

from __future__ import annotations

import html
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _train_config, report
from ._train_config import FP8_OPS, RunKind, TrainConfig, _kind
from ._train_loop import RunResult
from ._train_plots import plot_losses

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure


def losses_frame(results: dict[str, RunResult]) -> pd.DataFrame:
    """The losses as a table: ``step``, ``run``, ``train_loss``, ``heldout_loss``.

    One row per run and step (``step`` counts optimiser steps done: the training loss of row
    ``s`` is that of the batch of step ``s``, the held-out loss of row ``s`` was measured after
    ``s`` steps, and is empty where none was measured), plus a row ``step = steps`` per run
    with the final held-out loss.
    """
    import pandas as pd

    rows: list[tuple[int, str, float, float]] = []
    for name, result in results.items():
        steps = len(result.train_losses)
        for step in range(steps + 1):
            train = result.train_losses[step] if step < steps else math.nan
            rows.append((step, name, train, result.heldout.get(step, math.nan)))
    return pd.DataFrame(rows, columns=["step", "run", "train_loss", "heldout_loss"])


def write_losses_csv(results: dict[str, RunResult], path: str | os.PathLike[str]) -> Path:
    """Write :func:`losses_frame` to ``path`` (6 decimals, ``\\n`` line ends); return it."""
    return report.write_csv(losses_frame(results), path)


def _relative(a: float, b: float) -> float:
    return (a - b) / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def fp8_gaps(results: dict[str, RunResult]) -> dict[str, tuple[float, float]]:
    """Per family with both runs: relative gap of FP8 to FP32, ``(train, held-out)``."""
    gaps = {}
    for family in ("plain", "unit-scaled"):
        fp32, fp8 = results.get(f"{family}-fp32"), results.get(f"{family}-fp8")
        if fp32 is not None and fp8 is not None:
            gaps[family] = (
                _relative(fp8.final_train_loss, fp32.final_train_loss),
                _relative(fp8.final_heldout_loss, fp32.final_heldout_loss),
            )
    return gaps


def _fmt(value: float, spec: str = ".4f") -> str:
    return format(value, spec) if math.isfinite(value) else "diverged"


def summary_rows(results: dict[str, RunResult]) -> list[tuple[str, ...]]:
    """The summary table's rows: run, lr, final train loss, held-out loss, vs FP32, time."""
    rows: list[tuple[str, ...]] = []
    for name, r in results.items():
        baseline = _kind(name).baseline
        fp32 = results.get(baseline) if baseline is not None else None
        versus = ""
        if fp32 is not None:
            gap = _relative(r.final_heldout_loss, fp32.final_heldout_loss)
            versus = f"{gap:+.2%}" if math.isfinite(gap) else "n/a"
        stopped = f" (NaN at step {r.stopped_at})" if r.stopped_at is not None else ""
        rows.append(
            (
                name,
                f"{r.lr:g}",
                _fmt(r.final_train_loss),
                _fmt(r.final_heldout_loss) + stopped,
                versus,
                f"{r.seconds:.0f}",
                _scales_label(_kind(name)),
            )
        )
    return rows


_HEADER = (
    "run",
    "peak lr",
    "final train loss",
    "final held-out loss",
    "vs FP32",
    "time (s)",
    "scaling",
)
_SCALING_LABELS = {"none": "no scaling", "tensorwise": "tensorwise", "delayed": "delayed"}


def _scales_label(kind: RunKind) -> str:
    """The table's scales cell: the FP8 scaling, or for FP16 runs whether the loss is scaled."""
    if kind.precision == "fp16":
        return "FP16, loss scaling" if kind.loss_scaling else "FP16, no scaling"
    if kind.block_scaled:
        return f"{kind.precision.upper()}, per-block scales"
    label = _SCALING_LABELS.get(kind.scaling, kind.scaling)
    return f"{label}, real FP8" if kind.real else label


def fp16_gaps(results: dict[str, RunResult]) -> dict[str, tuple[float, float]]:
    """Per simulated-FP16 run with its FP32 run: relative gap ``(train, held-out)``."""
    gaps = {}
    for name, r in results.items():
        kind = _kind(name)
        fp32 = results.get(kind.baseline) if kind.baseline is not None else None
        if kind.precision == "fp16" and fp32 is not None:
            gaps[name] = (
                _relative(r.final_train_loss, fp32.final_train_loss),
                _relative(r.final_heldout_loss, fp32.final_heldout_loss),
            )
    return gaps


def _fp16_lines(results: dict[str, RunResult], config: TrainConfig) -> list[str]:
    """The summary's notes on the simulated-FP16 runs: gap to FP32, the loss scaler's work."""
    lines = []
    gaps = fp16_gaps(results)
    for name, r in results.items():
        kind = _kind(name)
        if kind.precision != "fp16":
            continue
        how = "with dynamic loss scaling" if kind.loss_scaling else "without loss scaling"
        line = f"{kind.family} in simulated FP16 {how} ({name})"
        if name in gaps:
            train_gap, heldout_gap = gaps[name]
            line += f" vs FP32: held-out {_pct(heldout_gap)}, train {_pct(train_gap)}"
        if r.skipped_steps is not None:
            line += (
                f"; the loss scaler skipped {r.skipped_steps} of {len(r.train_losses)} steps "
                f"(gradients beyond FP16's range), final loss scale {r.loss_scale:g}"
            )
        lines.append(line)
    if lines:
        lines.append(
            "FP16 runs: IEEE half precision (round to nearest, overflow to inf as a float16 "
            f"cast does) on the tensors of the {config.fp8_recipe!r} FP8 recipe; loss "
            "scaling is torch.amp.GradScaler's defaults (initial scale 2**16, x2 after 2000 "
            "steps without overflow, x0.5 and the step skipped on an overflow)."
        )
    return lines


def scaled_fp8_gaps(results: dict[str, RunResult]) -> dict[str, tuple[float, float]]:
    """Per FP8 run with per-tensor scales (or in real FP8) and its FP32 run: ``(train,
    held-out)`` gap."""
    gaps = {}
    for name, r in results.items():
        kind = _kind(name)
        fp32 = results.get(kind.baseline) if kind.baseline is not None else None
        if (kind.scaling not in ("", "none") or kind.real) and fp32 is not None:
            gaps[name] = (
                _relative(r.final_train_loss, fp32.final_train_loss),
                _relative(r.final_heldout_loss, fp32.final_heldout_loss),
            )
    return gaps


def summary_text(results: dict[str, RunResult], config: TrainConfig) -> str:
    """The table ``unitscale train`` prints, with the settings and the FP8 claim checked."""
    rows = [_HEADER, *summary_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADER))]
    lines = [
        f"unitscale train: {config.steps} steps, batch {config.batch_size} x {config.seq_len} "
        f"bytes, width {config.hidden_size}, depth {config.depth}, seed {config.seed}, "
        f"FP8 recipe {config.fp8_recipe!r}{_ops_note(results)}",
        "",
    ]
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        lines.append("  ".join(cells))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(
        "losses: mean next-byte cross-entropy (nats) over "
        f"{config.eval_batches} fixed batches of the training / held-out text after the last "
        "step; 'vs FP32': held-out loss relative to the same model in FP32."
    )
    for family, (train_gap, heldout_gap) in fp8_gaps(results).items():
        verdict = (
            "within 2%"
            if math.isfinite(heldout_gap) and abs(heldout_gap) <= 0.02
            else "NOT within 2%"
        )
        lines.append(
            f"{family} in simulated FP8 vs FP32: held-out {_pct(heldout_gap)}, train "
            f"{_pct(train_gap)} ({verdict})"
        )
    for name, (train_gap, heldout_gap) in scaled_fp8_gaps(results).items():
        kind = _kind(name)
        how = "real FP8 (to_fp8)" if kind.real else "simulated FP8"
        scaled = "no" if kind.scaling == "none" else kind.scaling
        lines.append(
            f"{kind.family} in {how} with {scaled} scaling ({name}) vs FP32: "
            f"held-out {_pct(heldout_gap)}, train {_pct(train_gap)}"
        )
    lines += _fp16_lines(results, config)
    lines += _block_lines(results)
    for name, r in results.items():
        if r.non_finite is not None:
            lines.append(f"{name}: {r.non_finite.message}")
    return "\n".join(lines) + "\n"


def _block_lines(results: dict[str, RunResult]) -> list[str]:
    """The summary's notes on the block-scaled runs: each one's gap to its FP32 run."""
    lines = []
    for name, r in results.items():
        kind = _kind(name)
        fp32 = results.get(kind.baseline) if kind.baseline is not None else None
        if not kind.block_scaled or fp32 is None:
            continue
        heldout = _relative(r.final_heldout_loss, fp32.final_heldout_loss)
        train = _relative(r.final_train_loss, fp32.final_train_loss)
        lines.append(
            f"{kind.family} in simulated {kind.precision.upper()} ({name}, "
            f"{kind.transform!r}) vs FP32: held-out {_pct(heldout)}, train {_pct(train)}"
        )
    return lines


def _ops_note(results: dict[str, RunResult]) -> str:
    """``, FP8 ops 'linear'``: the ops the low-precision runs round (one scope per family
    of runs: FP8 and FP16 may differ), or "" without such runs."""
    scopes: dict[str, list[str]] = {}
    for name in results:
        kind = _kind(name)
        if kind.fp8:
            scopes.setdefault(kind.precision.upper(), [])
            if kind.ops not in scopes[kind.precision.upper()]:
                scopes[kind.precision.upper()].append(kind.ops)
    return "".join(f", {p} ops {'/'.join(map(repr, o))}" for p, o in scopes.items())


# -- several seeds ----------------------------------------------------------------------------
def seed_stats(values: Sequence[float]) -> dict[str, float | None]:
    """``mean``, ``std`` (sample, n - 1; None for one value), ``min`` and ``max`` of the
    finite ``values`` (all None when none is finite: a run that diverged at every seed).

    Example:
        >>> seed_stats([1.0, 2.0, 3.0])
        {'mean': 2.0, 'std': 1.0, 'min': 1.0, 'max': 3.0, 'n': 3}
    """
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    mean = sum(finite) / len(finite)
    std = None
    if len(finite) > 1:
        std = math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1))
    return {"mean": mean, "std": std, "min": min(finite), "max": max(finite), "n": len(finite)}


def _json_number(value: float) -> float | None:
    return value if math.isfinite(value) else None


def seeds_document(
    results_by_seed: dict[int, dict[str, RunResult]], config: TrainConfig
) -> dict[str, Any]:
    """The results of every seed as JSON-ready data: per run, each seed's final training and
    held-out loss and, for an FP8/FP16 run, each relative to its own FP32 run of the same
    seed (``train_vs_fp32``, ``heldout_vs_fp32``, fractions), then :func:`seed_stats` of each
    over the seeds. Non-finite values (a diverged run) are None.

    Example:
        >>> r = {0: {"plain-fp32": RunResult("plain-fp32", 0.003, final_train_loss=1.0,
        ...                                  final_heldout_loss=2.0),
        ...          "plain-fp8": RunResult("plain-fp8", 0.003, final_train_loss=1.1,
        ...                                 final_heldout_loss=2.2)}}
        >>> doc = seeds_document(r, TrainConfig(runs=("plain-fp32", "plain-fp8")))
        >>> round(doc["runs"]["plain-fp8"]["stats"]["heldout_vs_fp32"]["mean"], 3)
        0.1
    """
    seeds = list(results_by_seed)
    runs: dict[str, Any] = {}
    names = [n for n in _train_config.RUN_NAMES if any(n in r for r in results_by_seed.values())]
    for name in names:
        kind = _kind(name)
        per_seed: dict[str, dict[str, Any]] = {}
        columns: dict[str, list[float]] = {}
        for seed, results in results_by_seed.items():
            r = results.get(name)
            if r is None:
                continue
            values = {"final_train_loss": r.final_train_loss,
                      "final_heldout_loss": r.final_heldout_loss}  # fmt: skip
            fp32 = results.get(kind.baseline) if kind.baseline is not None else None
            if fp32 is not None:
                values["train_vs_fp32"] = _relative(r.final_train_loss, fp32.final_train_loss)
                values["heldout_vs_fp32"] = _relative(r.final_heldout_loss, fp32.final_heldout_loss)
            for key, value in values.items():
                columns.setdefault(key, []).append(value)
            per_seed[str(seed)] = {k: _json_number(v) for k, v in values.items()}
            per_seed[str(seed)]["stopped_at"] = r.stopped_at
            per_seed[str(seed)]["seconds"] = round(r.seconds, 1)
        runs[name] = {
            "family": kind.family,
            "precision": kind.precision,
            "scaling": _scales_label(kind) if kind.fp8 else "",
            "ops": kind.ops,
            "real": kind.real,
            "baseline": kind.baseline,
            "lr": config.lr_for(name),
            "per_seed": per_seed,
            "stats": {key: seed_stats(values) for key, values in columns.items()},
        }
    settings = {k: v for k, v in report.settings_rows(config, {})}
    settings.pop("seed", None)
    return {
        "seeds": seeds,
        "fp8_recipe": config.fp8_recipe,
        "fp8_ops": FP8_OPS,
        "settings": settings,
        "runs": runs,
    }


def write_seeds_json(
    results_by_seed: dict[int, dict[str, RunResult]],
    config: TrainConfig,
    path: str | os.PathLike[str],
) -> Path:
    """Write :func:`seeds_document` to ``path`` (indented JSON); return it."""
    import json

    path = Path(path)
    path.write_text(json.dumps(seeds_document(results_by_seed, config), indent=1) + "\n")
    return path


def _mean_spread(stats: dict[str, float | None], percent: bool = False) -> str:
    """``1.2345 ± 0.0123 [1.2200, 1.2500]`` (percentages with ``percent``); n/a if none."""
    if stats["mean"] is None:
        return "diverged"

    def show(value: float | None) -> str:
        if value is None:
            return "n/a"
        return f"{100 * value:+.2f}%" if percent else f"{value:.4f}"

    spread = "" if stats["std"] is None else f" ± {show(stats['std']).lstrip('+')}"
    return f"{show(stats['mean'])}{spread} [{show(stats['min'])}, {show(stats['max'])}]"


def every_seed_text(run: dict[str, Any], key: str = "heldout_vs_fp32") -> str:
    """What holds on every seed for one low-precision run of :func:`seeds_document`: its
    largest gap to its FP32 run in magnitude (the worst seed) and the spread over seeds, as
    ``on every seed within 1.58% of FP32 (worst: seed 2, +1.58%; spread -0.72% to
    +1.58%)``; a seed that diverged is named ("" for a run without an FP32 baseline).

    Example:
        >>> run = {"per_seed": {"0": {"heldout_vs_fp32": -0.0072},
        ...                     "1": {"heldout_vs_fp32": 0.0158}}}
        >>> every_seed_text(run)
        'on every seed within 1.58% of FP32 (worst: seed 1, +1.58%; spread -0.72% to +1.58%)'
    """
    values = {seed: v.get(key) for seed, v in run["per_seed"].items() if key in v}
    if not values:
        return ""
    diverged = [seed for seed, v in values.items() if v is None]
    if diverged:
        return f"diverged on seed(s) {', '.join(diverged)}: no bound holds on every seed"
    finite = {seed: float(v) for seed, v in values.items() if v is not None}
    seed, worst = max(finite.items(), key=lambda item: abs(item[1]))
    low, high = min(finite.values()), max(finite.values())
    return (
        f"on every seed within {abs(worst):.2%} of FP32 (worst: seed {seed}, {worst:+.2%}; "
        f"spread {low:+.2%} to {high:+.2%})"
    )


def seeds_summary_text(
    results_by_seed: dict[int, dict[str, RunResult]], config: TrainConfig
) -> str:
    """The table ``unitscale train --seeds`` prints: per run, the mean ± sample standard
    deviation [min, max] over the seeds of the final training and held-out losses and of
    each relative to the run's own FP32 run of the same seed."""
    doc = seeds_document(results_by_seed, config)
    seeds = ", ".join(str(s) for s in doc["seeds"])
    header = ("run", "final train loss", "final held-out loss", "train vs FP32",
              "held-out vs FP32", "scaling")  # fmt: skip
    rows = [header]
    for name, run in doc["runs"].items():
        stats = run["stats"]
        gaps = [_mean_spread(stats[k], percent=True) if k in stats else ""
                for k in ("train_vs_fp32", "heldout_vs_fp32")]  # fmt: skip
        rows.append((name, _mean_spread(stats["final_train_loss"]),
                     _mean_spread(stats["final_heldout_loss"]), *gaps, run["scaling"]))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    any_results = next(iter(results_by_seed.values()))
    lines = [
        f"unitscale train: {config.steps} steps, batch {config.batch_size} x {config.seq_len} "
        f"bytes, width {config.hidden_size}, depth {config.depth}, seeds {seeds}, "
        f"FP8 recipe {config.fp8_recipe!r}{_ops_note(any_results)}",
        "",
    ]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [
        "",
        f"each cell: mean ± sample standard deviation [min, max] over {len(doc['seeds'])} "
        "seed(s) (initialisation, data order and held-out sample); losses: mean next-byte "
        f"cross-entropy (nats) over {config.eval_batches} fixed batches after the last step; "
        "'vs FP32': each seed's loss relative to the same model's FP32 run of that seed. "
        "Each seed's own table is in seed<N>/summary.txt; every number in results.json.",
    ]
    claims = [(name, every_seed_text(run)) for name, run in doc["runs"].items()]
    claims = [(name, text) for name, text in claims if text]
    if claims:
        lines += ["", "held-out loss vs FP32, what holds on every seed (never only the mean):"]
        lines += [f"  {name}: {text}" for name, text in claims]
    return "\n".join(lines) + "\n"


def _settings_rows(config: TrainConfig) -> list[tuple[str, str]]:
    """The settings as the report shows them: resolved defaults in words, never ``None``."""
    shown = {}
    if config.warmup_steps is None:
        shown["warmup_steps"] = f"{config.warmup} (default: 5% of steps)"
    if config.monitor_every is None:
        shown["monitor_every"] = "off"
    return report.settings_rows(config, shown)


def _pct(value: float) -> str:
    return f"{value:+.2%}" if math.isfinite(value) else "n/a"


#: Steps of the moving average the loss curves show.
def write_train_report(
    results: dict[str, RunResult],
    config: TrainConfig,
    path: str | os.PathLike[str],
    figures: Sequence[tuple[str, Figure]] = (),
) -> Path:
    """Write a self-contained HTML report: settings, the summary table and every figure inline.

    Args:
        results: from :func:`train_runs`.
        config: their settings.
        path: the HTML file to write.
        figures: ``(caption, figure)`` pairs; the loss curves come first by default.

    Returns:
        The path written.
    """
    notes = summary_text(results, config).split("\n\n", 2)[-1].strip().splitlines()
    body = [
        "<h2>Results</h2>",
        report.html_table(_HEADER, summary_rows(results)),
        # The notes under the printed table (the table itself is already above, as HTML).
        *report.html_paragraphs(notes),
        "<h2>Settings</h2>",
        report.html_table(None, _settings_rows(config)),
        "<p>Models and optimisers: the plain GPT with torch.optim.Adam; the unit-scaled runs "
        "the default u-μP unitscale.TransformerDecoder with unitscale.optim.AdamW (per-parameter "
        "learning rates from the u-μP rules). Betas 0.9, 0.95, no weight decay, linear warm-up "
        "then cosine decay to 10% of the peak learning rate; the FP8 runs use simulate_fp8 "
        f"with the {html.escape(repr(config.fp8_recipe))} recipe (operands in E4M3, "
        "gradients in E5M2, round to nearest; see unitscale.transforms.FP8_RECIPES) on the "
        "linear ops (ops='linear', attention in FP32, as real FP8 training and torchao's "
        "recipe) with no loss scaling.</p>",
        "<h2>Figures</h2>",
    ]
    all_figures = [("Loss curves", plot_losses(results)), *figures]
    body += [report.html_figure(caption, fig) for caption, fig in all_figures]
    return report.write_html_page(
        path,
        "unitscale train",
        "unitscale train: plain vs unit-scaled, FP32 vs simulated FP8",
        body,
    )
