"""``unitscale transfer``: learning-rate sweeps across width (or depth), standard vs u-μP.

The work is done by :mod:`unitscale.experiments.transfer` (the runs, the table, the claims,
the figure and the report); this module parses options, shows progress on stderr, prints the
summary on stdout and writes the files.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import Parser, usage_error
from ._args import positive_int
from ._output import add_out_options, finish_summary, prepare_out_folder, start_command

if TYPE_CHECKING:
    from ..experiments.transfer import SweepInterrupted

__all__ = ["HELP", "add_parser", "run"]

#: The files ``unitscale transfer`` writes (``glob`` patterns): a folder that holds one of
#: them is refused unless ``--overwrite`` is given.
OUTPUTS: tuple[str, ...] = (
    "transfer.csv",
    "transfer.json",
    "transfer.png",
    "report.html",
    "summary.txt",
)
#: The one-line help that ``unitscale --help`` lists (without building this parser).
HELP = (
    "sweep the learning rate across widths (or depths) for the standard parametrisation and "
    "u-muP; show whether the best learning rate transfers"
)

DEFAULT_OUT = "unitscale-transfer"


def _size_list(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers, e.g. ``32,64,128``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    values = []
    for part in parts:
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} is not an integer") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{part!r} in {text!r} must be at least 1")
        values.append(value)
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} lists no sizes; give e.g. 32,64,128,256")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} lists a size twice")
    return tuple(values)


def _model_name(text: str) -> str:
    """One of the sweep's model families (checking it imports the sweep, and torch)."""
    from ..experiments.transfer import MODELS

    if text not in MODELS:
        choices = ", ".join(repr(m) for m in MODELS)
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {choices})")
    return text


def _load_help_defaults(parser: argparse.ArgumentParser) -> None:
    """Fill the sweep's defaults into ``unitscale transfer --help`` (imports torch): the
    options parse as None, and :func:`~unitscale.experiments.transfer.default_config`
    chooses their values (a quick run's differ)."""
    from ..experiments.transfer import DEFAULT_CONFIG, MODELS

    values = {
        "steps": str(DEFAULT_CONFIG.steps),
        "seed": str(DEFAULT_CONFIG.seed),
        "seeds": str(DEFAULT_CONFIG.seeds),
        "threads": str(DEFAULT_CONFIG.threads),
        "models": ",".join(MODELS),
    }
    for action in parser._actions:
        if action.help is not None:
            for name, value in values.items():
                action.help = action.help.replace(f"{{{name}}}", value)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``transfer`` and its options (parsing them imports no torch)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "transfer",
        help=HELP,
        description=(
            "Train the same decoder at several widths (or depths), at every learning rate of "
            "a 2x grid, in two parametrisations: standard (plain PyTorch, GPT-2 init, "
            "torch.optim.AdamW) and u-muP (unitscale.TransformerDecoder's default, "
            "unitscale.optim.AdamW), or with --model hf:llama a transformers Llama (as "
            "transformers initialises it against unit_scale of it), on the bundled text with "
            "the same batches and seed; then "
            "u-muP in simulated FP8 (no loss scaling) at each size's best learning rate. "
            "Print the final held-out losses and the four claims of the README (held or not, "
            "with the numbers); write transfer.csv, transfer.json, transfer.png, report.html, "
            "effective_rates.csv (every u-muP parameter's rate and decay at each size) "
            "and summary.txt."
        ),
    )
    _add_size_options(parser)
    _add_run_options(parser)
    parser.add_argument("--no-fp8", action="store_true", help="skip the simulated-FP8 runs")
    add_out_options(parser, DEFAULT_OUT)
    parser.add_argument("--no-progress", action="store_true", help="no progress lines")
    parser.set_defaults(run=run)
    if isinstance(parser, Parser):
        parser.load_help_defaults = _load_help_defaults
    return parser


def _add_size_options(parser: argparse.ArgumentParser) -> None:
    """What is swept: ``--vary``, ``--widths``, ``--depths``."""
    parser.add_argument(
        "--vary",
        choices=("width", "depth"),
        default="width",
        help="sweep widths 32,64,128,256 at depth 2 (default) or depths 1,2,4,8 at width 64",
    )
    parser.add_argument(
        "--widths",
        type=_size_list,
        default=None,
        metavar="LIST",
        help="comma-separated widths, multiples of 32 (one width with --vary depth)",
    )
    parser.add_argument(
        "--depths",
        type=_size_list,
        default=None,
        metavar="LIST",
        help="comma-separated depths (one depth with --vary width)",
    )


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """How each run trains: steps, seeds, quick, threads, model."""
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        metavar="N",
        help="optimiser steps per run (default {steps})",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="initialisation, data order and evaluation seed (default {seed}); the first "
        "of --seeds",
    )
    parser.add_argument(
        "--seeds",
        type=positive_int,
        default=None,
        metavar="N",
        help="run every sweep over N seeds (--seed, --seed + 1, ...; default {seeds}): tables "
        "and figure use the mean over seeds; each claim is judged on the mean and on every "
        "seed, with the worst seed and the spread (N times the runs and the time)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run of a minute or two: two sizes, 3 learning rates, 24 short steps "
        "(its outputs say so, and it judges no claim)",
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch threads (default {threads}: the models are small, and one thread per "
        "process is fastest on a busy machine)",
    )
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default=None,
        help="u-muP's optimiser: adamw (default, unitscale.optim.AdamW) or muon "
        "(unitscale.optim.Muon: Muon for hidden matrices, u-muP AdamW for the rest; torch "
        "2.9+); the standard parametrisation keeps torch's AdamW",
    )
    parser.add_argument(
        "--depth-rule",
        choices=("depth-mup", "completep"),
        default=None,
        help="the u-muP models' depth rule: depth-mup (default; branch multipliers "
        "1/sqrt(depth)) or completep (CompleteP, alpha = 1: multipliers 1/depth, no depth "
        "factor on Adam's rates)",
    )
    parser.add_argument(
        "--model",
        type=_model_name,
        default=None,
        metavar="NAME",
        help="the model family, of {models}: builtin (default: unitscale's decoder against a "
        "plain-PyTorch GPT) or hf:llama (a transformers Llama config at each width, random "
        "weights, plain against unit_scale)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``unitscale transfer`` with parsed options; return the exit status."""
    progress = start_command("transfer")
    from ..experiments import report
    from ..experiments import transfer as sweep

    try:
        config = sweep.default_config(
            args.vary,
            quick=args.quick,
            widths=args.widths,
            depths=args.depths,
            steps=args.steps,
            seed=args.seed,
            seeds=args.seeds,
            threads=args.threads,
            model=args.model,
            optimizer=args.optimizer,
            depth_rule=args.depth_rule,
            fp8=False if args.no_fp8 else None,
        )
    except sweep.TransferConfigError as exc:  # options that do not go together
        raise usage_error("transfer", str(exc).removeprefix("TransferConfig: ")) from None
    out = prepare_out_folder(args, OUTPUTS)
    sweeps = len(config.sizes) * len(config.lr_steps) * len(sweep.PARAMETRISATIONS)
    runs = (sweeps + (len(config.sizes) if config.fp8 else 0)) * config.seeds
    progress(
        f"{runs} runs of {config.steps} steps of model {config.model} across {config.vary} "
        f"(sizes {[w if config.vary == 'width' else d for w, d in config.sizes]}"
        + (f", seeds {config.seed_list}" if config.seeds > 1 else "")
        + ") "
        "on the bundled CPython documentation text"
    )
    try:
        result = sweep.run_transfer(config, progress=None if args.no_progress else progress)
    except sweep.SweepInterrupted as exc:
        return _keep_interrupted(exc, out)
    out.mkdir(parents=True, exist_ok=True)

    written = [sweep.write_transfer_csv(result, out / "transfer.csv")]
    written.append(sweep.write_transfer_json(result, out / "transfer.json"))
    figure = sweep.plot_transfer(sweep.final_frame(sweep.runs_frame(result.runs)), config)
    written.append(report.save_png(figure, out / "transfer.png"))
    written.append(sweep.write_transfer_report(result, out / "report.html"))
    written.append(sweep.write_effective_rates(config, out / "effective_rates.csv"))
    return finish_summary(sweep.summary_text(result), out, written, progress)


def _keep_interrupted(exc: SweepInterrupted, out: Path) -> int:
    """Ctrl-C: keep the runs that completed (``transfer.csv``) and say so in
    ``summary.txt``; return 130 (the status of an interrupt). No claim is judged on a part
    of a sweep, and no table or figure drawn from one; an earlier run's outputs in ``out``
    (replaced under ``--overwrite``) are removed, so that none is taken for this one's."""
    from ..experiments import transfer as sweep

    runs = exc.partial.runs
    lines = [
        f"INTERRUPTED (Ctrl-C) after {len(runs)} of {exc.planned} runs, "
        f"{exc.partial.seconds:.0f}s: not a complete result; no claim judged.",
        f"runs completed: {len(runs)}" + (" (every number in transfer.csv)" if runs else ""),
    ]
    for run in runs:
        loss = run.final_heldout_loss
        shown = f"{loss:.4f}" if math.isfinite(loss) else f"diverged at step {run.stopped_at}"
        lines.append(
            f"  seed {run.seed} {run.parametrisation} {run.precision} width {run.width} "
            f"depth {run.depth} lr {run.lr:g}: held-out {shown}"
        )
    out.mkdir(parents=True, exist_ok=True)
    written = [sweep.write_transfer_csv(exc.partial, out / "transfer.csv")] if runs else []
    summary = out / "summary.txt"
    for stale in (*OUTPUTS, "effective_rates.csv"):  # an earlier run's (--overwrite): not ours
        if out / stale not in (*written, summary):
            (out / stale).unlink(missing_ok=True)
    names = [p.name for p in [*written, summary]]
    lines.append(f"\nwrote {len(names)} outputs to {out}/: " + ", ".join(names))
    text = "\n".join(lines) + "\n"
    summary.write_text(text, encoding="utf-8")
    sys.stdout.write(text)
    print("unitscale transfer: interrupted; kept what finished", file=sys.stderr)
    return 130
