"""Training of ``unitscale train``'s runs (:mod:`unitscale.experiments.training`): the
model and optimiser of each run kind and the loop that trains one run
(:func:`train_run`) or all of a configuration's (:func:`train_runs`)."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..data import Batch
from ..tracking import NonFiniteReport, ScaleMonitor
from . import _train_config
from ._train_config import (
    MONITOR_METRICS,
    TrainConfig,
    TrainConfigError,
    _family,
    _is_fp8,
    _kind,
)
from .models import plain_gpt
from .runner import (
    data_parallel,
    evaluation_batches,
    train_loop,
    training_batches,
)


@dataclass
class RunResult:
    """What one training run produced.

    Attributes:
        name: the run (one of :data:`RUN_NAMES`).
        lr: its peak learning rate.
        train_losses: the training loss of every step (minibatch mean), NaN after a stop.
        heldout: ``{step: held-out loss}`` at each evaluation (the step count done so far).
        final_train_loss: mean loss over ``eval_batches`` fixed training batches at the end.
        final_heldout_loss: the same over held-out batches (the last entry of ``heldout``).
        seconds: wall time of the run (building, compiling, training and evaluating).
        compiled: whether it ran through Inductor.
        stopped_at: the step whose loss was not finite (training stopped there), or None.
        non_finite: the monitor's report of the first NaN/Inf (monitored runs), or None.
        monitor: the :class:`~unitscale.tracking.ScaleMonitor` of a monitored run.
        skipped_steps: runs with loss scaling: the steps the ``GradScaler`` skipped (their
            gradients overflowed); None without loss scaling.
        loss_scale: runs with loss scaling: the scale at the end; None without.
    """

    name: str
    lr: float
    train_losses: list[float] = field(default_factory=list)
    heldout: dict[int, float] = field(default_factory=dict)
    final_train_loss: float = math.nan
    final_heldout_loss: float = math.nan
    seconds: float = 0.0
    compiled: bool = False
    stopped_at: int | None = None
    non_finite: NonFiniteReport | None = None
    monitor: ScaleMonitor | None = None
    skipped_steps: int | None = None
    loss_scale: float | None = None


def build_run_model(run: str, config: TrainConfig) -> nn.Module:
    """The model of ``run``, initialised from ``config.seed`` (FP8 siblings share weights).

    Returns the plain GPT or the default u-μP decoder (``unit_scaled_model``), wrapped
    in ``simulate_fp8`` for the FP8 runs and in ``compile`` when ``config.compile_fp8`` (FP8
    runs without a monitor).

    Raises:
        TrainConfigError: for an unknown run name.

    Example:
        >>> m = build_run_model("unit-scaled-fp8", TrainConfig(hidden_size=32, heads=2))
        >>> type(m.module).__name__, [type(p).__name__ for p in m.passes]
        ('TransformerDecoder', ['SimulateFormatPass'])
    """
    kinds = _train_config._KINDS  # read at call time: the registry may be extended
    if run not in kinds:
        raise TrainConfigError(
            f"build_run_model: unknown run {run!r}; choose from {_train_config.RUN_NAMES}"
        )
    kind = kinds[run]
    model: nn.Module
    if kind.family == "unit-scaled":
        model = unit_scaled_model(config)
    else:
        model = plain_gpt(config.model_config, seed=config.seed)
    if kind.transform is not None:
        model = kind.transform(model, config)
    return model


def unit_scaled_model(config: TrainConfig) -> nn.Module:
    """The unit-scaled family's model: the library's default u-μP decoder at ``config``'s size.

    ``unitscale.TransformerDecoder(hidden_size, depth, heads, 256)`` with every default (u-μP,
    Blake et al., ICLR 2025, arXiv 2407.17465: its residual rule, ``1/d_head`` logits, the
    ``1/fan_in`` readout, no biases, norms without trainable parameters, RoPE),
    initialised from ``config.seed`` (the global RNG is left as it was).

    Example:
        >>> m = unit_scaled_model(TrainConfig(hidden_size=32, heads=2))
        >>> type(m).__name__, m.mup, sorted({p.mup_type for p in m.parameters()})
        ('TransformerDecoder', True, ['output', 'weight'])
    """
    from .. import modules

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return modules.TransformerDecoder(
            config.hidden_size, config.depth, config.heads, config.model_config.vocab_size
        )


def build_optimiser(run: str, model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """The optimiser of ``run``: betas (0.9, 0.95), no weight decay, its family's peak lr.

    The plain family gets ``torch.optim.Adam``; the unit-scaled (u-μP) family
    :class:`unitscale.optim.AdamW`, which gives each parameter the peak lr times its u-μP
    rule (:func:`unitscale.optim.lr_scale_func_adam`). The schedule scales both alike.

    Example:
        >>> c = TrainConfig(hidden_size=32, heads=2)
        >>> type(build_optimiser("unit-scaled-fp32", unit_scaled_model(c), c)).__module__
        'unitscale.optim'
    """
    lr = config.lr_for(run)
    if _family(run) == "unit-scaled":
        from .. import optim

        return optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    return torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def write_effective_rates(config: TrainConfig, path: str | os.PathLike[str]) -> Path:
    """Write the unit-scaled (u-μP) family's optimiser's per-parameter rates and decay at
    ``config``'s peak rate (:func:`unitscale.optim.effective_rates`) to ``path`` as CSV;
    return it. Builds the model and optimiser afresh; trains nothing.

    Example:
        >>> import tempfile, pandas
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     c = TrainConfig(hidden_size=32, heads=2)
        ...     table = pandas.read_csv(write_effective_rates(c, f"{tmp}/rates.csv"))
        >>> list(table.columns[:3]), table.name[0]
        (['name', 'tag', 'shape'], 'embedding.weight')
    """
    from ..optim import effective_rates
    from . import report

    model = unit_scaled_model(config)
    optimiser = build_optimiser("unit-scaled-fp32", model, config)
    return report.write_csv(effective_rates(optimiser, model), path)


def _grad_scaler(model: nn.Module) -> torch.amp.GradScaler:
    """Dynamic loss scaling as mixed-precision FP16 training does it: ``torch.amp.GradScaler``
    on the model's device type with its defaults (initial scale ``2**16``, growth factor 2
    every 2000 steps without overflow, backoff 0.5 and the step skipped on an overflow)."""
    device = next(model.parameters()).device
    return torch.amp.GradScaler(device.type)


def _eval_batches(config: TrainConfig, split: Literal["train", "heldout"]) -> list[Batch]:
    return evaluation_batches(
        config.batch_size, config.seq_len, config.seed, split, config.eval_batches
    )


def train_run(
    run: str,
    config: TrainConfig,
    progress: bool = True,
    data: Iterable[Batch] | None = None,
) -> RunResult:
    """Train one run of ``config`` and return its losses.

    The run's optimiser (``build_optimiser``: Adam for the plain family, u-μP's AdamW for
    the unit-scaled one; ``betas=(0.9, 0.95)``, no weight decay) at the family's peak learning
    rate with linear warm-up and cosine decay (:meth:`TrainConfig.lr_at`). The training loss
    of each step is read once (one synchronisation per step); a non-finite loss stops the run
    (the remaining steps are NaN). With ``config.monitor_every``, a
    :class:`~unitscale.tracking.ScaleMonitor` records scales every that many steps and reports
    the first NaN/Inf.

    When ``torch.distributed`` is initialised with more than one rank, the run is
    data-parallel: every rank reads the same global batches, trains
    ``DistributedDataParallel`` on its block of ``batch_size / world size`` rows and records
    the global loss (one ``all_reduce`` per step); evaluation runs the whole batches on every
    rank. Every gradient a rank computes per example (what the FP8 runs round) and every
    parameter gradient equal one process's on the global batch, within floating-point
    reduction order: the plain runs' mean loss is normalised by the global row count and
    the gradients summed, the unit-scaled runs' loss is unit per example and the gradients
    averaged (:func:`unitscale.experiments.runner.train_loop`).

    Args:
        run: one of :data:`RUN_NAMES`.
        config: the comparison's settings.
        progress: show a progress bar on stderr.
        data: the training batches (default: the bundled text's training stream of
            ``config.seed``).

    Returns:
        The :class:`RunResult`.

    Raises:
        TrainConfigError: for an unknown run.

    Example:
        >>> c = TrainConfig(steps=2, batch_size=2, seq_len=16, hidden_size=16, heads=2,
        ...                 depth=1, eval_batches=1)
        >>> r = train_run("plain-fp32", c, progress=False)
        >>> len(r.train_losses), abs(r.train_losses[0] - math.log(256)) < 0.1
        (2, True)
    """
    _, world = data_parallel()
    if config.batch_size % world:
        raise TrainConfigError(
            f"batch_size={config.batch_size} must be a multiple of the {world} data-parallel "
            "processes (each trains on an equal share of every batch)"
        )
    start = time.perf_counter()
    heldout_data = _eval_batches(config, "heldout")
    train_eval_data = _eval_batches(config, "train")
    stream = data if data is not None else training_batches(
        config.batch_size, config.seq_len, config.seed
    )  # fmt: skip
    result = RunResult(name=run, lr=config.lr_for(run))
    with torch.random.fork_rng(devices=[]), _unscaled_on_purpose(run):
        torch.manual_seed(config.seed)
        model = build_run_model(run, config)
        result.compiled = _is_fp8(run) and config.compile_fp8 and config.monitor_every is None
        monitor: ScaleMonitor | None = None
        step_module: Callable[..., Tensor] = model
        if config.monitor_every is not None:
            monitor = ScaleMonitor(
                model, every=config.monitor_every, metrics=MONITOR_METRICS, on_non_finite="ignore"
            )
            step_module = monitor.module
            result.monitor = monitor
        model.train()
        optimiser = build_optimiser(run, model, config)
        scaler = _grad_scaler(model) if _kind(run).loss_scaling else None
        bar = _StepProgress(run, config.steps, enabled=progress)
        try:
            done = train_loop(
                model,
                optimiser,
                stream,
                config.schedule,
                eval_every=config.eval_every,
                heldout=heldout_data,
                train_eval=train_eval_data,
                step_module=step_module,
                unit_scaled_loss=_family(run) == "unit-scaled",
                after_backward=None if monitor is None else monitor.step,
                on_step=bar.update,
                grad_scaler=scaler,
            )
        finally:
            bar.close()
        if monitor is not None:
            result.non_finite = monitor.non_finite
        if scaler is not None:
            result.skipped_steps = done.skipped_steps
            result.loss_scale = float(scaler.get_scale())
    result.train_losses = done.losses + [math.nan] * (config.steps - len(done.losses))
    result.heldout = done.heldout
    result.stopped_at = done.stopped_at
    if done.stopped_at is None:
        result.final_heldout_loss = done.heldout[config.steps]
        result.final_train_loss = done.final_train_loss
    result.seconds = time.perf_counter() - start
    return result


@contextlib.contextmanager
def _unscaled_on_purpose(run: str) -> Iterator[None]:
    """Silence the FP8 transforms' warning about a model with no unit scaling and no scales
    for the plain family's runs: ``plain-fp8`` is that model on purpose (the baseline that
    shows what goes wrong), and its table says so."""
    with warnings.catch_warnings():
        if _family(run) == "plain":
            warnings.filterwarnings(
                "ignore", message=r".* has no unit scaling", category=UserWarning
            )
        yield


class _StepProgress:
    """Training progress on stderr: a tqdm bar on a terminal, else a plain line per 10%.

    A bar redraws itself with ``\\r``, which floods a log file or CI output with one
    fragment per update; when stderr is not a terminal, one line is written at every tenth of
    the steps (and at the last) instead.
    """

    def __init__(self, run: str, steps: int, enabled: bool) -> None:
        self.run, self.steps, self.done = run, steps, 0
        self.bar: Any = None
        self.plain = enabled and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())
        if enabled and not self.plain:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=steps, desc=f"{run:<16}", file=sys.stderr, dynamic_ncols=True, leave=True
            )
        self.every = max(1, math.ceil(steps / 10))
        self.start = time.perf_counter()

    def update(self, loss: float) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {loss:.3f}", refresh=False)
        elif self.plain and (self.done % self.every == 0 or self.done == self.steps):
            seconds = time.perf_counter() - self.start
            print(
                f"{self.run}: step {self.done}/{self.steps}, loss {loss:.3f}, {seconds:.0f}s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train_runs(config: TrainConfig, progress: bool = True) -> dict[str, RunResult]:
    """Train every run of ``config.runs``, one after the other, on the same data.

    Example:
        >>> c = TrainConfig(steps=1, batch_size=1, seq_len=8, hidden_size=8, heads=1, depth=1,
        ...                 eval_batches=1, runs=("plain-fp32", "unit-scaled-fp32"))
        >>> list(train_runs(c, progress=False))
        ['plain-fp32', 'unit-scaled-fp32']
    """
    return {run: train_run(run, config, progress=progress) for run in config.runs}


# -- presentation ----------------------------------------------------------------------------
