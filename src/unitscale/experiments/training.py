"""Training runs that compare a plain model and its unit-scaled twin, in FP32 and simulated FP8.

The library behind ``unitscale train``: :func:`train_runs` trains up to six runs of the
built-in GPT (:mod:`unitscale.models`) on the bundled text (:mod:`unitscale.data`), with the
same initialisation, data order and seed:

- ``plain-fp32``: the plain-PyTorch model;
- ``plain-fp8``: the same model under :func:`unitscale.transforms.simulate_fp8` (by default
  the ``"hardware"`` recipe: operands in E4M3, the gradient of each op's output in E5M2,
  round to nearest; ``TrainConfig.fp8_recipe``), with no loss scaling and no per-tensor
  scales ("no scaling" in the table). Every FP8 run rounds the linear ops
  (``ops="linear"``, :data:`FP8_OPS`): the scope of real FP8 training and of torchao's
  recipe, attention's matmuls staying in FP32, so that both models are measured in the
  same scope as the baseline;
- ``plain-fp8-tensorwise``: the same with ``scaling="tensorwise"``, exactly torchao's default
  float8 training recipe (in the default run set; tested against
  ``torchao.float8.convert_to_float8_training``), and ``plain-fp8-delayed`` with
  ``scaling="delayed"`` (``--runs`` adds it): the baselines practitioners would run;
- ``plain-fp8-tensorwise-real`` and ``unit-scaled-fp8-real`` (``--runs`` adds them): the
  tensorwise baseline and the unit-scaled FP8 run in real FP8 (``unitscale.transforms.to_fp8``:
  float8 GEMMs), for an accelerator; on a CPU their losses equal the simulated runs';
- ``unit-scaled-fp32``: the library's default u-μP decoder,
  ``unitscale.TransformerDecoder(width, depth, heads, 256)`` (Blake et al., ICLR 2025, arXiv
  2407.17465: unit scaling, the paper's residual rule, ``1/d_head`` attention logits, the
  ``1/fan_in`` readout, no biases, norms without parameters) trained with
  :class:`unitscale.optim.AdamW` at u-μP's documented default learning rate
  (``unitscale.experiments.transfer.DEFAULT_MUP_LR``);
- ``unit-scaled-fp8``: that decoder under ``simulate_fp8``, again with no loss scaling;
- ``plain-fp16-loss-scaling`` and ``unit-scaled-fp16`` (``--runs`` adds them): the same two
  models in simulated IEEE FP16 on the tensors of the ``"hardware"`` recipe (every matmul-like
  op's operands, ``ops="matmuls"`` as when their committed results were recorded, and the
  gradient of each matmul's output), rounded to nearest and
  overflowing to ``±inf`` as a real float16 cast does (``FPFormat(5, 10,
  overflow="inf")``). The plain model is trained with dynamic loss scaling,
  ``torch.amp.GradScaler`` at its defaults (initial scale ``2**16``, doubled after 2000
  steps without overflow, halved and the step skipped on an overflow), what FP16 training
  needs in practice; the unit-scaled model with none. The skipped steps are counted
  (:attr:`RunResult.skipped_steps`) and reported.

Then :func:`losses_frame` (the per-step losses), :func:`summary_text` (the table the command
prints), :func:`plot_losses` and :func:`write_train_report` present the results.

The data, the evaluation samples, the schedule and the loop are the experiment runner's
(:mod:`unitscale.experiments.runner`), the files its report writer's
(:mod:`unitscale.experiments.report`); what is this experiment's own is its run kinds, its
FP8 claim and its tables.

To add a run kind, append a :class:`RunKind` to :data:`RUN_KINDS`: its name, its model family
(``"plain"`` or ``"unit-scaled"``: the model and the learning rate), the transform that
makes it what it is (e.g. ``simulate_fp8`` with another ``scaling``) and the FP32 run it is
compared with. ``unitscale train --runs`` accepts it at once, and the summary, the CSV,
the curves and the report show it (with ``default=False`` it runs only when asked for by
``--runs``)::

    RunKind("plain-fp8-tensorwise", "plain", _SimulateFP8(scaling="tensorwise"), "plain-fp32")

Design constraints:

- every run of a :class:`TrainConfig` sees the same batches in the same order, starts from the
  same weights as its FP32/FP8 sibling, and is deterministic under the seed (same seed, same
  machine and thread count: byte-identical loss table);
- each model family has its own learning rate, fixed from FP32 evidence only, before any FP8
  run is looked at (the plain model's by a sweep of its FP32 runs; the u-μP model's is u-μP's
  documented default, which ``unitscale transfer``'s FP32 sweep checks); the FP8 runs reuse
  the FP32 rate;
- the global RNG is left as it was; progress goes to stderr; nothing here parses options.
"""

from __future__ import annotations

import html
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from ..errors import UnitScaleError
from ..formats import FPFormat
from ..tracking import NonFiniteReport, ScaleMonitor
from . import report
from .data import Batch
from .models import GPTConfig, plain_gpt
from .runner import (
    Schedule,
    check_positive_int,
    check_warmup,
    data_parallel,
    evaluation_batches,
    train_loop,
    training_batches,
)
from .transfer import DEFAULT_MUP_LR

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = [  # noqa: RUF022 (grouped by kind)
    # errors
    "TrainConfigError",
    # configuration
    "RunKind",
    "RUN_KINDS",
    "RUN_NAMES",
    "FP8_OPS",
    "DEFAULT_RUNS",
    "MONITOR_METRICS",
    "TrainConfig",
    # training
    "RunResult",
    "build_run_model",
    "build_optimiser",
    "unit_scaled_model",
    "FP16_CAST",
    "train_run",
    "train_runs",
    # presentation
    "losses_frame",
    "seed_stats",
    "seeds_document",
    "seeds_summary_text",
    "write_seeds_json",
    "plot_losses",
    "zoom_limits",
    "summary_text",
    "write_losses_csv",
    "write_train_report",
]

#: Metrics the monitor keeps during training (a subset, to keep the scales table small).
MONITOR_METRICS: tuple[str, ...] = (
    "mean_abs",
    "rms",
    "abs_max",
    "underflow_e4m3",
    "overflow_e4m3",
    "underflow_e5m2",
    "overflow_e5m2",
    "nan_count",
    "inf_count",
)

Family = Literal["plain", "unit-scaled"]


class TrainConfigError(UnitScaleError, ValueError):
    """A training configuration is invalid."""


Transform = Callable[[nn.Module, "TrainConfig"], nn.Module]


@dataclass(frozen=True)
class RunKind:
    """One run ``unitscale train`` can do: a model family, a transform and its baseline.

    Attributes:
        name: the run's name (``--runs``, the CSV's ``run`` column).
        family: ``"plain"`` (:func:`unitscale.models.plain_gpt` with ``torch.optim.Adam``
            at ``TrainConfig.lr_plain``) or ``"unit-scaled"`` (the default u-μP
            :class:`unitscale.TransformerDecoder` with :class:`unitscale.optim.AdamW` at
            ``TrainConfig.lr_unit_scaled``). Runs of one family start from the same weights.
        transform: applied to the freshly built model (None: the model as built), e.g.
            ``simulate_fp8``.
        baseline: the FP32 run this one is compared with ("vs FP32"), or None.
        default: whether ``unitscale train`` runs it when ``--runs`` is not given
            (:data:`DEFAULT_RUNS`); any kind can be asked for by name.
        loss_scaling: train with dynamic loss scaling (``torch.amp.GradScaler`` at its
            defaults, on the model's device type); skipped steps are counted.
    """

    name: str
    family: Family
    transform: Transform | None = None
    baseline: str | None = None
    default: bool = True
    loss_scaling: bool = False

    @property
    def fp8(self) -> bool:
        """Whether the run simulates a low-precision format, FP8 or FP16 (it has a transform;
        drawn dashed, compiled with ``--compile``); :attr:`precision` says which."""
        return self.transform is not None

    @property
    def precision(self) -> str:
        """``"fp32"``, ``"fp8"`` or ``"fp16"``: what the run's transform simulates."""
        if self.transform is None:
            return "fp32"
        return str(getattr(self.transform, "precision", "fp8"))

    @property
    def scaling(self) -> str:
        """The run's per-tensor scaling (``simulate_fp8``'s ``scaling``), "" for FP32."""
        if self.transform is None:
            return ""
        return str(getattr(self.transform, "options", {}).get("scaling", "none"))

    @property
    def ops(self) -> str:
        """Which ops the run's transform covers (``simulate_fp8``'s ``ops``), "" for FP32."""
        if self.transform is None:
            return ""
        return str(getattr(self.transform, "options", {}).get("ops", "matmuls"))

    @property
    def real(self) -> bool:
        """Whether the run is real FP8 (float8 GEMMs through ``to_fp8``), not simulated."""
        return isinstance(self.transform, _RealFP8)


class _SimulateFP8:
    """A run's transform: ``simulate_fp8`` with the config's recipe and ``options`` (e.g.
    ``scaling=``, ``ops=``), compiled with Inductor when ``config.compile_fp8`` (and no
    monitor)."""

    def __init__(self, **options: Any) -> None:
        self.options = options

    def __call__(self, model: nn.Module, config: TrainConfig) -> nn.Module:
        from ..transforms import compile as compile_module
        from ..transforms import simulate_fp8

        model = simulate_fp8(model, recipe=config.fp8_recipe, **self.options)
        if config.compile_fp8 and config.monitor_every is None:
            model = compile_module(model)
        return model

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"simulate_fp8(recipe=config.fp8_recipe{options})"


class _RealFP8:
    """A run's transform: real FP8 (``unitscale.transforms.to_fp8``, float8 GEMMs of the linear
    ops) with ``options`` (``scaling=``), compiled as the simulated runs are. On a CPU it is
    slow (``torch._scaled_mm`` there is a reference, not a speed-up) and its losses equal the
    simulated run's (``simulate_fp8(ops="linear")``)."""

    def __init__(self, **options: Any) -> None:
        self.options = {**options, "ops": "linear"}

    def __call__(self, model: nn.Module, config: TrainConfig) -> nn.Module:
        from .. import transforms
        from ..transforms import compile as compile_module

        to_fp8 = getattr(transforms, "to_fp8", None)
        if to_fp8 is None:
            raise TrainConfigError(
                "real-FP8 runs need unitscale.transforms.to_fp8, which this installation "
                "does not have; run the simulated FP8 runs instead (e.g. unit-scaled-fp8)"
            )
        options = {k: v for k, v in self.options.items() if k != "ops"}
        model = to_fp8(model, recipe=config.fp8_recipe, **options)
        if config.compile_fp8 and config.monitor_every is None:
            model = compile_module(model)
        return model

    def __repr__(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options.items() if k != "ops")
        return f"to_fp8(recipe=config.fp8_recipe{options})"


#: IEEE half precision as a real cast makes it: round to nearest, overflow to ``±inf``.
FP16_CAST = FPFormat(5, 10, rounding="nearest", overflow="inf")


class _SimulateFP16:
    """A run's transform: ``simulate_fp8`` with the config's recipe's tensors (by default
    the ``"hardware"`` recipe's: matmul operands, and each matmul's output gradient) in
    :data:`FP16_CAST` instead of E4M3/E5M2, compiled as the FP8 runs are."""

    precision = "fp16"

    def __init__(self, ops: str = "matmuls") -> None:
        self.options = {"ops": ops}

    def __call__(self, model: nn.Module, config: TrainConfig) -> nn.Module:
        from ..transforms import FP8_RECIPES, FP8Recipe, simulate_fp8
        from ..transforms import compile as compile_module

        recipe = FP8_RECIPES[config.fp8_recipe]
        fp16 = FP8Recipe(
            operands=FP16_CAST,
            output_grad=None if recipe.output_grad is None else FP16_CAST,
            operand_grads=None if recipe.operand_grads is None else FP16_CAST,
            ops=self.options["ops"],  # type: ignore[arg-type]
        )
        model = simulate_fp8(model, recipe=fp16)
        if config.compile_fp8 and config.monitor_every is None:
            model = compile_module(model)
        return model

    def __repr__(self) -> str:
        return (
            f"simulate_fp8(recipe=config.fp8_recipe's tensors in FP16_CAST, "
            f"ops={self.options['ops']!r})"
        )


#: The ops every FP8 run rounds: the linear ops (``simulate_fp8(ops="linear")``), the scope
#: of real FP8 training and of torchao's recipe, so that both models are measured in the
#: scope in which real FP8 runs.
FP8_OPS = "linear"

#: Every run ``unitscale train`` can do, in the order it does them.
RUN_KINDS: tuple[RunKind, ...] = (
    RunKind("plain-fp32", "plain"),
    RunKind("plain-fp8", "plain", _SimulateFP8(ops=FP8_OPS), baseline="plain-fp32"),
    # The recipes practitioners run on plain models, as baselines: torchao's default
    # (tensorwise dynamic scaling, linear ops only: exactly torchao's recipe) and delayed
    # scaling (Transformer Engine's).
    RunKind(
        "plain-fp8-tensorwise",
        "plain",
        _SimulateFP8(scaling="tensorwise", ops=FP8_OPS),
        "plain-fp32",
    ),
    # Not in the default run set (``--runs`` adds it), to keep the default run short on 2
    # cores (benchmarks/bench_train_kinds.py estimates its time).
    RunKind(
        "plain-fp8-delayed",
        "plain",
        _SimulateFP8(scaling="delayed", ops=FP8_OPS),
        "plain-fp32",
        default=False,
    ),
    # torchao's tensorwise recipe in real FP8 (float8 GEMMs): not in the default run set
    # (on a CPU, torch._scaled_mm is slower than an FP32 matmul; its losses equal the
    # simulated run's).
    RunKind(
        "plain-fp8-tensorwise-real",
        "plain",
        _RealFP8(scaling="tensorwise"),
        "plain-fp32",
        default=False,
    ),
    # FP16 as practitioners run it (dynamic loss scaling), against the unit-scaled model in
    # FP16 with none (below): only with --runs. Every matmul-like op, as when these runs
    # were recorded (benchmarks/results/train/fp16-recipe-seed0).
    RunKind(
        "plain-fp16-loss-scaling",
        "plain",
        _SimulateFP16(ops="matmuls"),
        "plain-fp32",
        default=False,
        loss_scaling=True,
    ),
    RunKind("unit-scaled-fp32", "unit-scaled"),
    RunKind(
        "unit-scaled-fp8", "unit-scaled", _SimulateFP8(ops=FP8_OPS), baseline="unit-scaled-fp32"
    ),
    # The unit-scaled model in real FP8 with no scales (to_fp8): only with --runs.
    RunKind("unit-scaled-fp8-real", "unit-scaled", _RealFP8(), "unit-scaled-fp32", default=False),
    RunKind(
        "unit-scaled-fp16",
        "unit-scaled",
        _SimulateFP16(ops="matmuls"),
        "unit-scaled-fp32",
        default=False,
    ),
)

#: The names of :data:`RUN_KINDS`, in the order ``unitscale train`` does them.
RUN_NAMES: tuple[str, ...] = tuple(kind.name for kind in RUN_KINDS)

#: The runs ``unitscale train`` does when ``--runs`` is not given.
DEFAULT_RUNS: tuple[str, ...] = tuple(kind.name for kind in RUN_KINDS if kind.default)

_KINDS: dict[str, RunKind] = {kind.name: kind for kind in RUN_KINDS}


@dataclass(frozen=True)
class TrainConfig:
    """One comparison of training runs: model size, data, optimiser and schedule.

    The defaults are what ``unitscale train`` runs with no options (its committed run, with
    the measured time and the machine's load, is in
    ``benchmarks/results/train/hardware-recipe-seed0/``; ``benchmarks/bench_train_kinds.py``
    estimates the time on an idle machine).

    Attributes:
        steps: optimiser steps per run.
        batch_size: sequences per batch.
        seq_len: tokens (bytes) per sequence.
        hidden_size: model width (a multiple of ``heads``).
        depth: transformer blocks.
        heads: attention heads.
        lr_plain: peak learning rate of the plain model's runs (Adam). 3e-3 was the best final
            held-out loss of an FP32-only sweep (seed 1) over 1e-3, 2e-3, 3e-3, 5e-3 and 1e-2.
        lr_unit_scaled: peak base learning rate of the unit-scaled (u-μP) runs:
            :class:`unitscale.optim.AdamW` gives each parameter this times its u-μP rule
            (a hidden weight ``lr / sqrt(fan_in)``). The default is u-μP's documented default
            ``unitscale.experiments.transfer.DEFAULT_MUP_LR`` (0.5), fixed before any FP8
            run: u-μP's claim is that this default is near-optimal without a sweep, and
            ``unitscale transfer``'s FP32 sweep checks it.
        warmup_steps: linear warm-up steps (None: 5% of ``steps``), then cosine decay to
            10% of the peak.
        seed: model initialisation, data order and held-out sample.
        eval_every: held-out loss every this many steps (and at the end).
        eval_batches: batches in each evaluation (held-out and final training loss).
        monitor_every: record tensor scales every this many steps (None: no monitor).
        runs: which of :data:`RUN_NAMES` to train (default :data:`DEFAULT_RUNS`); they are
            trained in the order of :data:`RUN_NAMES`.
        compile_fp8: run the FP8 runs through :func:`unitscale.transforms.compile` (Inductor);
            ignored for monitored runs, which cannot be compiled.
        fp8_recipe: the :data:`unitscale.transforms.FP8_RECIPES` key the FP8 runs use
            (``"hardware"``: E4M3 matmul inputs, E5M2 output gradients; ``"all-operands"``:
            the gradients of every matmul input, weights included, in E5M2 as well).

    Example:
        >>> TrainConfig(steps=10, runs=("plain-fp32",)).lr_for("plain-fp32")
        0.003
    """

    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 64
    hidden_size: int = 128
    depth: int = 2
    heads: int = 4
    lr_plain: float = 3e-3
    lr_unit_scaled: float = DEFAULT_MUP_LR
    warmup_steps: int | None = None
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 8
    monitor_every: int | None = None
    runs: tuple[str, ...] = DEFAULT_RUNS
    compile_fp8: bool = False
    fp8_recipe: str = "hardware"

    def __post_init__(self) -> None:
        from ..transforms import FP8_RECIPES

        if self.fp8_recipe not in FP8_RECIPES:
            raise TrainConfigError(
                f"TrainConfig: fp8_recipe={self.fp8_recipe!r}; choose from {', '.join(FP8_RECIPES)}"
            )
        for name in ("steps", "batch_size", "seq_len", "hidden_size", "depth", "heads"):
            check_positive_int("TrainConfig", name, getattr(self, name), TrainConfigError)
        for name in ("eval_every", "eval_batches"):
            check_positive_int("TrainConfig", name, getattr(self, name), TrainConfigError)
        if self.monitor_every is not None:
            check_positive_int("TrainConfig", "monitor_every", self.monitor_every, TrainConfigError)
        check_warmup("TrainConfig", self.warmup_steps, TrainConfigError)
        for name in ("lr_plain", "lr_unit_scaled"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise TrainConfigError(f"TrainConfig: {name}={value!r} must be a positive number")
        if self.hidden_size % self.heads:
            raise TrainConfigError(
                f"TrainConfig: hidden_size={self.hidden_size} must be a multiple of "
                f"heads={self.heads}"
            )
        runs = tuple(self.runs)
        unknown = [r for r in runs if r not in RUN_NAMES]
        if unknown or not runs:
            raise TrainConfigError(
                f"TrainConfig: runs={list(runs)!r}: unknown run(s) {unknown}; choose from "
                f"{', '.join(RUN_NAMES)}"
            )
        if len(set(runs)) != len(runs):
            raise TrainConfigError(f"TrainConfig: runs={list(runs)!r} lists a run twice")
        object.__setattr__(self, "runs", tuple(r for r in RUN_NAMES if r in runs))

    @property
    def model_config(self) -> GPTConfig:
        """The :class:`~unitscale.models.GPTConfig` of both model families (labels aligned
        with ``input_ids``: the runner passes ``Batch.targets``)."""
        return GPTConfig(
            hidden_size=self.hidden_size,
            depth=self.depth,
            heads=self.heads,
            seq_len=self.seq_len,
            aligned_labels=True,
        )

    @property
    def schedule(self) -> Schedule:
        """The learning-rate schedule of every run (the experiment runner's)."""
        return Schedule(self.steps, self.warmup_steps)

    @property
    def warmup(self) -> int:
        """Warm-up steps (``warmup_steps``, or 5% of ``steps`` when it is None)."""
        return self.schedule.warmup_steps

    def lr_for(self, run: str) -> float:
        """The peak learning rate of ``run`` (its family's)."""
        return self.lr_unit_scaled if _family(run) == "unit-scaled" else self.lr_plain

    def lr_at(self, run: str, step: int) -> float:
        """The learning rate of ``run`` at ``step``: linear warm-up, cosine decay to 10%.

        Example:
            >>> c = TrainConfig(steps=100, warmup_steps=10, lr_plain=1.0)
            >>> [round(c.lr_at("plain-fp32", s), 3) for s in (0, 9, 10, 99)]
            [0.1, 1.0, 1.0, 0.1]
        """
        return self.schedule.lr(self.lr_for(run), step)


def _kind(run: str) -> RunKind:
    kind = _KINDS.get(run)
    if kind is None:
        raise TrainConfigError(f"unknown run {run!r}; choose from {', '.join(RUN_NAMES)}")
    return kind


def _family(run: str) -> Family:
    return _kind(run).family


def _is_fp8(run: str) -> bool:
    return _kind(run).fp8


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
    if run not in _KINDS:
        raise TrainConfigError(f"build_run_model: unknown run {run!r}; choose from {RUN_NAMES}")
    kind = _KINDS[run]
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
    with torch.random.fork_rng(devices=[]):
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
    for name, r in results.items():
        if r.non_finite is not None:
            lines.append(f"{name}: {r.non_finite.message}")
    return "\n".join(lines) + "\n"


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
    names = [n for n in RUN_NAMES if any(n in r for r in results_by_seed.values())]
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
SMOOTHING_WINDOW = 10


def _smoothed(losses: Sequence[float]) -> list[float]:
    """The ``SMOOTHING_WINDOW``-step moving average of ``losses`` (shorter at the start)."""
    values = torch.tensor(list(losses), dtype=torch.float64)
    return [
        float(values[max(0, i - SMOOTHING_WINDOW + 1) : i + 1].mean()) for i in range(len(values))
    ]


def zoom_limits(
    results: dict[str, RunResult],
) -> tuple[tuple[int, int], tuple[float, float]] | None:
    """The zoomed panel's ``(x range, y range)``: the last quarter of the steps, and the span
    of the unit-scaled runs' curves there (their smoothed training loss and held-out points;
    every run's when there is no unit-scaled run), padded by 10%. None: nothing finite.

    Derived from the curves' final parts, so that the gap between a unit-scaled run in FP8
    and in FP32 (a percent or two) fills the panel, not the distance to a run that did not
    train (plain FP8 without loss scaling stays near 3.3 nats, the start is 5.5).
    """
    steps = max((len(r.train_losses) for r in results.values()), default=0)
    if steps == 0:
        return None
    first = steps - max(steps // 4, 1)
    focus = [n for n in results if _family(n) == "unit-scaled"] or list(results)
    values = []
    for name in focus:
        r = results[name]
        values += _smoothed(r.train_losses)[first:]
        values += [v for s, v in r.heldout.items() if s >= first]
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    low, high = min(finite), max(finite)
    pad = 0.1 * (high - low) + 1e-3
    return (first, steps), (low - pad, high + pad)


#: Line styles of a family's FP8 kinds, in :data:`RUN_KINDS` order (its FP32 run is solid).
_FP8_STYLES: tuple[Any, ...] = ("--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (8, 2)))


def _line_style(run: str) -> Any:
    """Solid for a family's FP32 run; its FP8 kinds dashed, dotted, dash-dotted... in turn."""
    kind = _kind(run)
    if not kind.fp8:
        return "-"
    siblings = [k.name for k in RUN_KINDS if k.family == kind.family and k.fp8]
    return _FP8_STYLES[siblings.index(run) % len(_FP8_STYLES)]


def plot_losses(results: dict[str, RunResult], title: str = "") -> Figure:
    """Training loss (a 10-step moving average) and held-out loss of every run, per step:
    the whole run, and the last quarter zoomed onto the unit-scaled runs (:func:`zoom_limits`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10.0, 4.6))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    colours = {"plain": "tab:blue", "unit-scaled": "tab:red"}
    for name, r in results.items():
        colour = colours[_family(name)]
        style = _line_style(name)
        smoothed = _smoothed(r.train_losses)
        steps = sorted(r.heldout)
        for ax in (left, right):
            ax.plot(range(len(smoothed)), smoothed, linestyle=style, color=colour, lw=1.2,
                    label=name)  # fmt: skip
            if steps:
                ax.plot(steps, [r.heldout[s] for s in steps], linestyle=style, color=colour,
                        marker="o", ms=3.5, lw=0.8, alpha=0.6)  # fmt: skip
    left.set_title("whole run", fontsize=10)
    focus = "unit-scaled runs" if any(_family(n) == "unit-scaled" for n in results) else "all runs"
    right.set_title(f"last quarter, zoomed onto the {focus}", fontsize=10)
    limits = zoom_limits(results)
    if limits is not None:
        right.set_xlim(*limits[0])
        right.set_ylim(*limits[1])
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per byte)")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8, title="line: train (10-step mean); dots: held-out", title_fontsize=7)
    fig.suptitle(title or "unitscale train: loss curves", fontsize=11)
    fig.tight_layout()
    return fig


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
