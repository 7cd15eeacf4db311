"""The sweep: one training run (:func:`train_one`) and the whole grid (:func:`run_transfer`),
on the experiment runner's data, evaluation samples, schedule and loop."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Literal

import torch

from ...data import Batch
from ..runner import evaluation_batches, train_loop, training_batches
from ._config import (
    TransferConfig,
    TransferConfigError,
    default_config,  # noqa: F401 (used by the doctests)
)
from ._frames import best_points, final_frame, runs_frame
from ._models import PARAMETRISATIONS, build_model, build_optimiser
from ._records import SweepInterrupted, TransferResult, TransferRun


def _eval_data(config: TransferConfig, split: Literal["train", "heldout"]) -> list[Batch]:
    # The runner's fixed evaluation samples: the same as unitscale train's.
    return evaluation_batches(
        config.batch_size, config.seq_len, config.seed, split, config.eval_batches
    )


def _train_data(config: TransferConfig) -> list[Batch]:
    stream = iter(training_batches(config.batch_size, config.seq_len, config.seed))
    return [next(stream) for _ in range(config.steps)]


def train_one(
    parametrisation: str,
    width: int,
    depth: int,
    lr_step: int,
    config: TransferConfig,
    data: Sequence[Batch],
    heldout: Sequence[Batch],
    train_eval: Sequence[Batch],
    precision: str = "fp32",
) -> TransferRun:
    """Train one run of a sweep on ``data`` (one batch per step) and evaluate it.

    The peak learning rate is the grid's ``lr_step``; every parameter group follows the
    schedule (:meth:`TransferConfig.lr_factor`) from its own peak. A non-finite training
    loss stops the run. ``precision="fp8"`` wraps the model in ``simulate_fp8`` (the
    config's recipe, no loss scaling).

    Example:
        >>> c = default_config(quick=True, steps=2, eval_every=1, eval_batches=1)
        >>> data, held = _train_data(c), _eval_data(c, "heldout")
        >>> r = train_one("standard", 32, 2, 0, c, data, held, held)
        >>> [step for step, _, _ in r.evals], abs(r.evals[0][1] - math.log(256)) < 0.1
        ([1, 2], True)
    """
    if precision not in ("fp32", "fp8"):
        raise TransferConfigError(f"train_one: precision={precision!r} must be 'fp32' or 'fp8'")
    if len(data) < config.steps:
        raise TransferConfigError(
            f"train_one: {len(data)} batches for {config.steps} steps; pass one per step"
        )
    lr = dict(config.grid(parametrisation))[lr_step]
    start = time.perf_counter()
    run = TransferRun(parametrisation, precision, width, depth, lr_step, lr, config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = build_model(parametrisation, width, depth, config)
        if precision == "fp8":
            from ...transforms import simulate_fp8

            model = simulate_fp8(model, recipe=config.fp8_recipe)
        model.train()
        done = train_loop(
            model,
            build_optimiser(parametrisation, model, lr, config.model, config.optimizer),
            data,
            config.schedule,
            eval_every=config.eval_every,
            heldout=heldout,
            train_eval=train_eval,
            # FP8 runs are captured by TorchDynamo, which guards on the grad mode: they
            # evaluate with autograd on (as unitscale train does) rather than be captured twice.
            eval_grad=precision == "fp8",
        )
    previous = 0
    for step in sorted(done.heldout):
        losses = done.losses[previous:step]
        run.evals.append((step, sum(losses) / len(losses), done.heldout[step]))
        previous = step
    run.stopped_at = done.stopped_at
    run.final_train_loss = done.final_train_loss
    run.data_digest = done.data_digest
    run.seconds = time.perf_counter() - start
    return run


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):  # pragma: no cover - not on Linux/macOS
        return None


def run_transfer(
    config: TransferConfig, progress: Callable[[str], None] | None = None
) -> TransferResult:
    """Run the whole sweep of ``config``: every parametrisation, size and grid step in FP32,
    once per seed of :attr:`TransferConfig.seed_list`, then (``config.fp8``) u-μP in
    simulated FP8 at each size's best FP32 learning rate (on the mean over seeds), once per
    seed, on ``config.threads`` threads.

    Args:
        config: the sweep.
        progress: called with one line after each run.

    Returns:
        The :class:`TransferResult`.

    Raises:
        SweepInterrupted: on Ctrl-C (a :class:`KeyboardInterrupt` carrying the runs that
            completed).

    Example:
        >>> c = default_config(quick=True, steps=2, eval_every=2, eval_batches=1,
        ...                    lr_steps=(0,), fp8=False, widths=(32, 64))
        >>> [(r.parametrisation, r.width) for r in run_transfer(c).runs]
        [('standard', 32), ('standard', 64), ('u-muP', 32), ('u-muP', 64)]
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        with _each_report_once():
            return _run_transfer(config, progress)
    finally:
        torch.set_num_threads(threads)


class _Once(logging.Filter):
    """Lets each distinct message through once."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


@contextmanager
def _each_report_once() -> Iterator[None]:
    """unitscale's reports on a transformed model (ops left as they are, FP8 coverage), each
    logged once per sweep rather than once per run: a sweep builds the same model at one
    size dozens of times, and the report is the same each time."""
    once = _Once()
    loggers = [logging.getLogger(name) for name in ("unitscale", "unitscale.unit_scale")]
    for logger in loggers:
        logger.addFilter(once)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(once)


def _run_transfer(config: TransferConfig, progress: Callable[[str], None] | None) -> TransferResult:
    start = time.perf_counter()
    load_before = _load()
    # one configuration per seed: its data, evaluation samples and initial weights
    seeds = [replace(config, seed=seed, seeds=1) for seed in config.seed_list]
    data = {
        c.seed: (_train_data(c), _eval_data(c, "heldout"), _eval_data(c, "train")) for c in seeds
    }
    plan = [
        (c, p, width, depth, k, "fp32")
        for c in seeds
        for p in PARAMETRISATIONS
        for width, depth in config.sizes
        for k, _ in config.grid(p)
    ]
    total = len(plan) + (len(config.sizes) * len(seeds) if config.fp8 else 0)
    runs: list[TransferRun] = []

    def one(c: TransferConfig, p: str, width: int, depth: int, k: int, precision: str) -> None:
        run = train_one(p, width, depth, k, c, *data[c.seed], precision)
        runs.append(run)
        if progress is not None:
            loss = run.final_heldout_loss
            shown = f"{loss:.4f}" if math.isfinite(loss) else f"diverged at step {run.stopped_at}"
            seed = f"seed {c.seed} " if config.seeds > 1 else ""
            progress(
                f"[{len(runs)}/{total}] {seed}{p} {precision} width {width} depth {depth} "
                f"lr {run.lr:g}: held-out {shown} ({run.seconds:.1f}s)"
            )

    try:
        for item in plan:
            one(*item)
        if config.fp8:
            best = best_points(final_frame(runs_frame(runs)))  # on the mean over seeds
            for c in seeds:
                for width, depth in config.sizes:
                    mup = best[best.parametrisation == "u-muP"]
                    row = mup[(mup.width == width) & (mup.depth == depth)]
                    if len(row) and row.lr_step.notna().all():
                        one(c, "u-muP", width, depth, int(row.lr_step.iloc[0]), "fp8")
    except KeyboardInterrupt as exc:  # Ctrl-C: the completed runs go with the interrupt
        partial = TransferResult(config, runs, time.perf_counter() - start, (load_before, None))
        raise SweepInterrupted(partial, total) from exc
    return TransferResult(config, runs, time.perf_counter() - start, (load_before, _load()))
