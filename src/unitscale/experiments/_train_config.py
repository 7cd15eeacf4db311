"""Configuration of ``unitscale train`` (:mod:`unitscale.experiments.training`): the run
kinds (:data:`RUN_KINDS`: each run's model family, the transform that makes it what it is
and the FP32 run it is compared with) and :class:`TrainConfig`, the settings of one
invocation."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from ..errors import UnitScaleError
from ..formats import FPFormat
from .models import GPTConfig
from .runner import (
    Schedule,
    check_positive_int,
    check_warmup,
)
from .transfer import DEFAULT_MUP_LR

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
        """``"fp32"``, ``"fp8"``, ``"fp16"``, or a block-scaled format (``"mxfp8"``,
        ``"mxfp4"``, ``"nvfp4"``): what the run's transform simulates."""
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
    def block_scaled(self) -> bool:
        """Whether the run simulates a block-scaled format (MX, NVFP4)."""
        return isinstance(self.transform, _SimulateBlocks)

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


class _SimulateBlocks:
    """A run's transform: ``simulate_format`` with block-scaled formats (forward operands in
    ``fwd``, gradients in ``bwd``, both preset names), the linear ops only (the scope of
    torchao's MX training and Transformer Engine's block-scaled recipes), compiled as the FP8
    runs are. ``precision`` (``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"``) labels the run."""

    def __init__(self, precision: str, fwd: str, bwd: str, stochastic_grads: bool) -> None:
        self.precision = precision
        self.formats = (fwd, bwd, stochastic_grads)
        self.options = {"ops": "linear"}

    def __call__(self, model: nn.Module, config: TrainConfig) -> nn.Module:
        from ..formats import get_format
        from ..transforms import compile as compile_module
        from ..transforms import simulate_format

        fwd, bwd, stochastic = self.formats
        grads = get_format(bwd, rounding="stochastic" if stochastic else None)
        model = simulate_format(model, fwd, grads, ops="linear")
        if config.compile_fp8 and config.monitor_every is None:
            model = compile_module(model)
        return model

    def __repr__(self) -> str:
        fwd, bwd, stochastic = self.formats
        grads = f"get_format({bwd!r}, rounding='stochastic')" if stochastic else repr(bwd)
        return f"simulate_format({fwd!r}, {grads}, ops='linear')"


#: The block-scaled run kinds' transforms: MXFP8 as torchao's MX training and Transformer
#: Engine's ``MXFP8BlockScaling`` default (E4M3 everywhere, gradients included), MXFP4 and
#: NVFP4 with stochastically rounded gradients (as FP4 training recipes round them).
BLOCK_RUNS: dict[str, _SimulateBlocks] = {
    "mxfp8": _SimulateBlocks("mxfp8", "mxfp8_e4m3", "mxfp8_e4m3", stochastic_grads=False),
    "mxfp4": _SimulateBlocks("mxfp4", "mxfp4_e2m1", "mxfp4_e2m1", stochastic_grads=True),
    "nvfp4": _SimulateBlocks("nvfp4", "nvfp4", "nvfp4", stochastic_grads=True),
}


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
    # torchao's rowwise recipe (torchtitan's float8 default), simulated and in real FP8:
    # only with --runs (each GEMM operand scaled per row or column: more scale work).
    RunKind(
        "plain-fp8-rowwise",
        "plain",
        _SimulateFP8(scaling="rowwise", ops=FP8_OPS),
        "plain-fp32",
        default=False,
    ),
    RunKind(
        "plain-fp8-rowwise-real",
        "plain",
        _RealFP8(scaling="rowwise"),
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
    # Block-scaled formats (MX, NVFP4), both families, each against its own FP32 run: only
    # with --runs.
    *(
        RunKind(f"{family}-{name}", family, transform, f"{family}-fp32", default=False)
        for name, transform in BLOCK_RUNS.items()
        for family in ("plain", "unit-scaled")
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
