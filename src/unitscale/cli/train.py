"""``unitscale train``: plain vs unit-scaled training, in FP32 and in simulated FP8.

The work is done by :mod:`unitscale.training` (the runs, the tables, the figures, the report)
and :mod:`unitscale.tracking.monitor` (scales over training); this module parses options, shows
progress on stderr, prints the summary on stdout and writes the files.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from matplotlib.figure import Figure

from . import Parser, usage_error
from ._args import non_negative_int, positive_float, positive_int
from ._memory import check_memory
from ._output import check_out_folder, finish_summary, slug, start_command

__all__ = ["DEFAULTS", "HELP", "add_parser", "run", "set_threads"]

DEFAULT_OUT = "unitscale-train"
#: The one-line summary ``unitscale --help`` lists (no import of torch needed to show it).
HELP = (
    "train the built-in model plain and unit-scaled, in FP32 and simulated FP8; "
    "write loss curves, a CSV and a report"
)


def _run_list(text: str) -> tuple[str, ...]:
    from ..experiments.training import RUN_NAMES

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in RUN_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown run(s) {', '.join(unknown) or repr(text)}; choose from {','.join(RUN_NAMES)}"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r} lists a run twice")
    return names


#: :class:`~unitscale.training.TrainConfig`'s defaults, by option dest, repeated here so that
#: parsing and checking a command line (the memory estimate included) imports no torch: a
#: typo fails at once. ``tests/cli`` checks that they equal ``TrainConfig()``'s. ``--runs``
#: parses as None and ``run`` gives it ``DEFAULT_RUNS``.
DEFAULTS: dict[str, Any] = {
    "steps": 1000,
    "batch_size": 16,
    "seq_len": 64,
    "width": 128,
    "depth": 2,
    "heads": 4,
    "lr_plain": 3e-3,
    "lr_unit_scaled": 0.5,
    "eval_every": 50,
    "eval_batches": 8,
    "seed": 0,
    "fp8_recipe": "hardware",
}


def _seed_list(text: str) -> tuple[int, ...]:
    """``--seeds``: ``0,1,2`` (those seeds) or ``3`` (seeds 0, 1, 2)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a count nor a comma-separated list of seeds (e.g. 3 or 0,1,2)"
        ) from None
    if "," not in text and len(values) == 1:
        if values[0] < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: give at least 1 seed")
        return tuple(range(values[0]))
    if not values or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} is empty or lists a seed twice")
    return tuple(values)


def _load_help_defaults(parser: argparse.ArgumentParser) -> None:
    """Name the runs and the default ones in ``unitscale train --help`` (imports torch)."""
    from ..experiments.training import DEFAULT_RUNS, RUN_NAMES

    parser.set_defaults(runs=",".join(DEFAULT_RUNS))
    for action in parser._actions:
        if action.dest == "runs" and action.help is not None:
            action.help = action.help.replace("RUN_NAMES", ",".join(RUN_NAMES))


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``train`` and its options (parsing them imports no torch)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "train",
        help=HELP,
        description=(
            "Train on the bundled text, with the same data order and seed: the built-in "
            "plain GPT in FP32, with simulated FP8 matmuls (E4M3 operands, E5M2 output "
            "gradients, no loss scaling) without per-tensor scales and with torchao's "
            "tensorwise scaling; the library's default u-μP decoder "
            "(unitscale.TransformerDecoder) in FP32 and in simulated FP8 without scales. "
            "Every FP8 run rounds the linear ops (simulate_fp8(ops='linear'), the scope of "
            "real FP8 and of torchao's recipe). "
            "--runs adds plain-fp8-delayed (delayed scaling), plain-fp8-rowwise (torchao's "
            "rowwise recipe), plain-fp8-tensorwise-real, plain-fp8-rowwise-real and "
            "unit-scaled-fp8-real (real FP8 through unitscale.transforms.to_fp8), "
            "plain-fp16-loss-scaling (the "
            "plain GPT in simulated IEEE FP16, overflowing to inf, with torch.amp.GradScaler's "
            "dynamic loss scaling at its defaults) and unit-scaled-fp16 (the u-μP decoder in "
            "simulated FP16 without loss scaling), and plain-/unit-scaled- mxfp8, mxfp4 and "
            "nvfp4 (the linear ops as simulated block-scaled GEMMs, "
            "unitscale.transforms.simulate_format; gradients stochastically rounded in FP4). "
            "Print the final training and held-out losses; write the loss curves (PNG), a "
            "CSV of losses per step and a self-contained HTML report. Linear warm-up, cosine "
            "decay to 10%; the plain runs use Adam at the best rate of an FP32 sweep, the "
            "u-μP runs unitscale.optim.AdamW at u-μP's documented default rate."
        ),
    )
    _add_size_options(parser)
    _add_schedule_options(parser)
    _add_run_options(parser)
    _add_output_options(parser)
    parser.set_defaults(run=run)
    if isinstance(parser, Parser):
        parser.load_help_defaults = _load_help_defaults
    return parser  # fmt: skip


def _add_size_options(parser: argparse.ArgumentParser) -> None:
    """``--steps``, ``--batch-size``, ``--seq-len`` and the model's size."""
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=DEFAULTS["steps"],
        metavar="N",
        help="optimiser steps per run (default %(default)s)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=DEFAULTS["batch_size"],
        metavar="N",
        help="sequences per batch (default %(default)s)",
    )
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        default=DEFAULTS["seq_len"],
        metavar="N",
        help="bytes per sequence (default %(default)s)",
    )
    parser.add_argument(
        "--width",
        type=positive_int,
        default=DEFAULTS["width"],
        metavar="N",
        help="model width, a multiple of --heads (default %(default)s)",
    )
    parser.add_argument(
        "--depth",
        type=positive_int,
        default=DEFAULTS["depth"],
        metavar="N",
        help="transformer blocks (default %(default)s)",
    )
    parser.add_argument(
        "--heads",
        type=positive_int,
        default=DEFAULTS["heads"],
        metavar="N",
        help="attention heads (default %(default)s)",
    )


def _add_schedule_options(parser: argparse.ArgumentParser) -> None:
    """The learning rates, the warm-up and the evaluations."""
    parser.add_argument(
        "--lr-plain",
        type=positive_float,
        default=DEFAULTS["lr_plain"],
        metavar="LR",
        help="peak learning rate of the plain runs (default %(default)s)",
    )
    parser.add_argument(
        "--lr-unit-scaled",
        type=positive_float,
        default=DEFAULTS["lr_unit_scaled"],
        metavar="LR",
        help=(
            "peak base learning rate of the unit-scaled (u-μP) runs, scaled per parameter "
            "by unitscale.optim.AdamW (default %(default)s, u-μP's default)"
        ),
    )
    parser.add_argument(
        "--lr",
        type=positive_float,
        default=None,
        metavar="LR",
        help="one peak learning rate for every run (overrides both)",
    )
    parser.add_argument(
        "--warmup-steps",
        type=non_negative_int,
        default=None,
        metavar="N",
        help="linear warm-up steps (default: 5%% of --steps)",
    )
    parser.add_argument(
        "--eval-every",
        type=positive_int,
        default=DEFAULTS["eval_every"],
        metavar="N",
        help="held-out loss every N steps (default %(default)s)",
    )
    parser.add_argument(
        "--eval-batches",
        type=positive_int,
        default=DEFAULTS["eval_batches"],
        metavar="N",
        help="batches per evaluation (default %(default)s)",
    )


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """Which runs, with which seeds, monitored or compiled, with which FP8 recipe."""
    parser.add_argument(
        "--seed",
        type=int,
        default=DEFAULTS["seed"],
        help="initialisation, data order and evaluation seed (default %(default)s)",
    )
    parser.add_argument(
        "--seeds",
        type=_seed_list,
        default=None,
        metavar="LIST|N",
        help="run every run once per seed: a comma-separated list (0,1,2) or a count N "
        "(seeds 0..N-1); the summary gives each run's mean, spread and range over the seeds, "
        "each seed's outputs go to DIR/seed<N>/ (default: one seed, --seed)",
    )
    parser.add_argument(
        "--runs",
        type=_run_list,
        default=None,
        metavar="LIST",
        help="comma-separated runs, of RUN_NAMES (default %(default)s)",
    )
    parser.add_argument(
        "--monitor-every",
        type=positive_int,
        default=None,
        metavar="N",
        help="record every tensor's scale every N steps (unitscale.tracking."
        "ScaleMonitor): scales CSV and heatmaps per run, first NaN/Inf located; "
        "runs are not compiled then",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run the FP8 runs through Inductor (unitscale.transforms.compile); "
        "on a CPU the compile time exceeds the time saved at the default size",
    )
    parser.add_argument(
        "--fp8-recipe",
        choices=("hardware", "all-operands"),
        default=DEFAULTS["fp8_recipe"],
        help="which tensors the FP8 runs round (unitscale.transforms.FP8_RECIPES): "
        "'hardware' (default): matmul inputs in E4M3 and the gradient of each matmul's "
        "output in E5M2; 'all-operands': the gradient of every matmul input, weights "
        "included, in E5M2",
    )


def _add_output_options(parser: argparse.ArgumentParser) -> None:
    """Where the files go, progress, threads and processes."""
    parser.add_argument(
        "--out", default=DEFAULT_OUT, metavar="DIR", help=f"output folder (default {DEFAULT_OUT})"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch intra-op threads per process (default: torch's, one per core); on a "
        "busy machine fewer threads are often much faster (1 is safest)",
    )
    parser.add_argument(
        "--nproc",
        type=positive_int,
        default=1,
        metavar="N",
        help="data-parallel over N local processes (gloo; each a share of every batch, "
        "which --batch-size must divide); under torchrun, its ranks are used instead",
    )


def set_threads(threads: int | None) -> int:
    """Give torch ``threads`` intra-op threads (None: keep torch's default, one per core);
    return the number it uses."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def run(args: argparse.Namespace) -> int:
    """Run ``unitscale train`` with parsed options; return the exit status."""
    # From the options alone, before torch loads: an impossible run fails at once.
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)  # under torchrun: this machine's share
    share = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world) / max(world, 1)
    check_memory(
        "train", args.batch_size, args.seq_len, args.width, args.depth, args.heads, share=share
    )
    progress: Callable[[str], None] = start_command("train")
    from ..experiments import training
    from ._launch import group_from_environment, launch

    config = _config(args, training)
    set_threads(args.threads)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        _check_shares(config.batch_size, args.nproc, "--nproc")
        check_out_folder(args.out)
        launch(run, args.nproc, argparse.Namespace(**vars(args)))
        return 0
    if "WORLD_SIZE" in os.environ:  # under torchrun: checked before joining the group
        _check_shares(config.batch_size, int(os.environ["WORLD_SIZE"]), "torchrun's WORLD_SIZE")
    import torch.distributed as dist

    torchrun = "WORLD_SIZE" in os.environ and not dist.is_initialized()
    with group_from_environment() as several:
        status = _train(args, config, progress, several)
    if torchrun and several:
        # Every output is written and the group is left. Interpreter finalisation can still
        # abort a rank whose gloo threads outlive the group (see group_from_environment; seen
        # under load even after leaving it), and torchrun would then fail the job: skip it.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _train(
    args: argparse.Namespace, config: Any, progress: Callable[[str], None], several: bool
) -> int:
    """The runs of each seed, and rank 0's outputs (``several``: this process is one of
    several ranks). One seed: its files in ``out``; several: each seed's in ``out/seed<N>``,
    and the summary over the seeds in ``out``; ``results.json`` either way."""
    from ..experiments import training
    from ._launch import is_rank_zero

    if several and not is_rank_zero():
        args.no_progress = True  # rank 0 alone shows progress and writes the outputs
        progress = _silent
        out = Path(args.out)  # checked by rank 0 (ranks checking at once would race)
    else:
        out = check_out_folder(args.out)
    if is_rank_zero():
        out.mkdir(parents=True, exist_ok=True)
    progress(f"torch threads: {set_threads(None)} per process (--threads)")
    seeds = getattr(args, "seeds", None) or (config.seed,)
    progress(
        f"training {len(config.runs)} run(s) of {config.steps} steps "
        f"({', '.join(config.runs)}) on the bundled CPython documentation text"
        + (f", for each of seeds {', '.join(map(str, seeds))}" if len(seeds) > 1 else
           f", seed {seeds[0]} (one seed: --seeds runs several)"),
    )  # fmt: skip
    by_seed: dict[int, dict[str, Any]] = {}
    written: list[Path] = []
    for seed in seeds:
        seed_config = dataclasses.replace(config, seed=seed)
        results = {}
        for name in config.runs:
            results[name] = training.train_run(name, seed_config, progress=not args.no_progress)
            which = f"{name} (seed {seed})" if len(seeds) > 1 else name
            progress(f"{which}: done in {results[name].seconds:.0f}s")
        by_seed[seed] = results
        if is_rank_zero() and len(seeds) > 1:
            folder = out / f"seed{seed}"
            folder.mkdir(exist_ok=True)
            _write_outputs(results, seed_config, folder, progress)
            summary = training.summary_text(results, seed_config)
            (folder / "summary.txt").write_text(summary, encoding="utf-8")
            written.append(folder)
    if not is_rank_zero():
        return 0
    if len(seeds) > 1:
        written.append(training.write_seeds_json(by_seed, config, out / "results.json"))
        text = training.seeds_summary_text(by_seed, config)
        return finish_summary(text, out, written, progress)
    written = _write_outputs(results, seed_config, out, progress)
    written.append(training.write_seeds_json(by_seed, seed_config, out / "results.json"))
    return finish_summary(training.summary_text(results, seed_config), out, written, progress)


def _write_outputs(
    results: dict[str, Any], config: Any, out: Path, progress: Callable[[str], None]
) -> list[Path]:
    """One seed's files in ``out``: losses, curves, scales of monitored runs, the report."""
    from ..analysis import scale_heatmap, tensorboard_available, write_tensorboard
    from ..experiments import report, training
    from ..tracking import MonitorError

    written: list[Path] = [training.write_losses_csv(results, out / "losses.csv")]
    written.append(report.save_png(training.plot_losses(results), out / "loss_curves.png"))

    heatmaps: list[tuple[str, Figure]] = []
    tensorboard = tensorboard_available()
    spans = _shared_spans(results)  # one colour range per direction across the runs
    for name, result in results.items():
        monitor = result.monitor
        if monitor is None or not monitor.recorded_steps:
            continue
        written.append(monitor.to_csv(out / f"scales_{slug(name, 'run')}.csv"))
        for direction, what in (("fwd", "values"), ("bwd", "gradients")):
            try:
                ax = scale_heatmap(
                    monitor.table(),
                    "rms",
                    direction,
                    title=f"{name}: rms of tensor {what}",
                    span=spans[direction],
                )
            except MonitorError as exc:  # no records in that direction: skip the picture
                progress(f"{name}: no {direction} heatmap ({exc})")
                continue
            heatmap = cast("Figure", ax.figure)
            png = out / f"scales_{slug(name, 'run')}_{direction}.png"
            written.append(report.save_png(heatmap, png))
            heatmaps.append((f"{name}: rms of tensor {what} over training (log2)", heatmap))
        if tensorboard:
            write_tensorboard(monitor.records, out / "tensorboard" / slug(name, "run"), ("rms",))
    if config.monitor_every is not None:
        if tensorboard:
            written.append(out / "tensorboard")
        else:
            progress("note: tensorboard is not installed; no TensorBoard scalars written")

    written.append(training.write_train_report(results, config, out / "report.html", heatmaps))
    if any(name.startswith("unit-scaled") for name in results):
        written.append(training.write_effective_rates(config, out / "effective_rates.csv"))
    return written


def _config(args: argparse.Namespace, training: Any) -> Any:
    """The :class:`~unitscale.training.TrainConfig` of the options; options that do not go
    together (``--width 10 --heads 4``) are a usage error, found before any work."""
    try:
        return training.TrainConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            hidden_size=args.width,
            depth=args.depth,
            heads=args.heads,
            lr_plain=args.lr if args.lr is not None else args.lr_plain,
            lr_unit_scaled=args.lr if args.lr is not None else args.lr_unit_scaled,
            warmup_steps=args.warmup_steps,
            seed=args.seed,
            eval_every=args.eval_every,
            eval_batches=args.eval_batches,
            monitor_every=args.monitor_every,
            runs=args.runs if args.runs is not None else training.DEFAULT_RUNS,
            compile_fp8=args.compile,
            fp8_recipe=args.fp8_recipe,
        )
    except training.TrainConfigError as exc:
        raise usage_error("train", _option_terms(str(exc))) from None


#: TrainConfig's field names as the command's options.
_OPTIONS = {"hidden_size=": "--width ", "heads=": "--heads ", "batch_size=": "--batch-size "}


def _option_terms(message: str) -> str:
    """A configuration error in the command's terms (``--width 10``, not ``hidden_size=10``)."""
    message = message.removeprefix("TrainConfig: ")
    for field_, option in _OPTIONS.items():
        message = message.replace(field_, option)
    return message


def _check_shares(batch_size: int, processes: int, source: str) -> None:
    """Every process trains an equal share of each batch: refuse before any process starts."""
    if batch_size % processes:
        raise usage_error(
            "train",
            f"--batch-size {batch_size} is not a multiple of {source} {processes} (each "
            "process trains an equal share of every batch); choose e.g. --batch-size "
            f"{processes * max(1, batch_size // processes)}",
        )


def _silent(message: str) -> None:
    """The stage lines of a rank other than 0: none (rank 0 shows them)."""


def _shared_spans(results: dict[str, Any]) -> dict[str, float | None]:
    """The largest ``|log2(rms)|`` per direction over every monitored run (None: no records).

    Each run's heatmap uses it, so that the same colour is the same scale in every run's map
    (a per-run range made a healthy map look as alarming as a failing one).
    """
    import numpy as np

    spans: dict[str, float | None] = {"fwd": None, "bwd": None}
    for result in results.values():
        monitor = result.monitor
        if monitor is None or not monitor.recorded_steps:
            continue
        table = monitor.table()
        for direction in spans:
            rows = table[(table["metric"] == "rms") & (table["direction"] == direction)]
            values = rows["value"].to_numpy(dtype=float)
            values = values[np.isfinite(values) & (values > 0)]
            if values.size:
                top = max(float(np.abs(np.log2(values)).max()), 1.0)
                spans[direction] = max(spans[direction] or 0.0, top)
    return spans
