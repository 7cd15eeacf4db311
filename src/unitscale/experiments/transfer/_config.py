"""A transfer sweep's configuration: :class:`TransferConfig`, its defaults, its presets and
its error."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal

from ...errors import UnitScaleError
from ..runner import Schedule, check_positive_int, check_warmup

#: u-μP's default learning rate (``unitscale.optim.AdamW(lr=...)``, every mult 1): the centre
#: of its grid. Chosen before any transfer run from ``unitscale train``'s unit-scaled model,
#: whose best Adam rate at width 128 was 0.05 on N(0, 1) weights; u-μP gives a hidden weight
#: ``lr / sqrt(fan_in)``, and 0.05 * sqrt(128) = 0.57, rounded to the power of two 0.5.
DEFAULT_MUP_LR = 0.5

#: Centre of the standard parametrisation's grid: ``unitscale train``'s plain learning rate
#: (the best of its FP32 sweep at width 128).
DEFAULT_STANDARD_LR = 3e-3

#: Width of one attention head: a model of width ``w`` has ``w / HEAD_SIZE`` heads.
HEAD_SIZE = 32

#: The model families a sweep can train (``unitscale transfer --model``): ``builtin``, the
#: library's decoder against the plain-PyTorch one; ``hf:llama``, a transformers Llama.
MODELS: tuple[str, ...] = ("builtin", "hf:llama")


#: The parametrisations' names (every model family has one of each), in the order they are
#: run and shown.
PARAMETRISATIONS: tuple[str, ...] = ("standard", "u-muP")

#: The optimisers u-μP can train with (``unitscale transfer --optimizer``):
#: :class:`unitscale.optim.AdamW` or :class:`unitscale.optim.Muon`.
OPTIMIZERS: tuple[str, ...] = ("adamw", "muon")

#: The depth rules of the u-μP models (``unitscale transfer --depth-rule``): depth-μP (the
#: u-μP paper's) or CompleteP (Dey et al. 2025, arXiv 2505.01618).
DEPTH_RULES: tuple[str, ...] = ("depth-mup", "completep")

#: The :class:`TransferConfig` field holding the centre of each parametrisation's grid.
CENTRE_FIELDS: dict[str, str] = {"standard": "standard_lr", "u-muP": "mup_lr"}


class TransferConfigError(UnitScaleError, ValueError):
    """A transfer sweep's configuration is invalid."""


def _positive_ints(name: str, values: Any) -> tuple[int, ...]:
    try:
        out = tuple(values)
    except TypeError:
        raise TransferConfigError(
            f"TransferConfig: {name}={values!r} must be a sequence of positive integers"
        ) from None
    if not out or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in out):
        raise TransferConfigError(
            f"TransferConfig: {name}={values!r} must be a non-empty sequence of positive integers"
        )
    if len(set(out)) != len(out):
        raise TransferConfigError(f"TransferConfig: {name}={list(out)!r} lists a value twice")
    return tuple(sorted(out))


@dataclass(frozen=True)
class TransferConfig:
    """One transfer sweep: sizes, learning-rate grid, data, optimiser and schedule.

    Attributes:
        vary: ``"width"`` (sweep ``widths`` at the one depth in ``depths``) or ``"depth"``
            (sweep ``depths`` at the one width in ``widths``).
        widths: model widths, multiples of :data:`HEAD_SIZE` (one per depth sweep).
        depths: numbers of transformer blocks (one per width sweep).
        lr_steps: the grid: run at ``centre * 2**k`` for each ``k`` (must include 0, the
            default learning rate).
        mup_lr: u-μP's default learning rate, the centre of its grid.
        standard_lr: the centre of the standard parametrisation's grid.
        steps: optimiser steps per run.
        batch_size: sequences per batch.
        seq_len: bytes per sequence.
        warmup_steps: linear warm-up steps (None: 5% of ``steps``), then cosine decay to 10%
            of the peak (:meth:`unitscale.training.TrainConfig.lr_at`).
        eval_every: held-out loss every this many steps, and at the end.
        eval_batches: held-out batches per evaluation (and training batches for the final
            training loss).
        seed: initialisation, data order and evaluation sample (the first seed).
        seeds: how many seeds to run, ``seed``, ``seed + 1``, ...: the whole FP32 sweep once
            per seed, then the FP8 runs once per seed at the learning rate best on the mean
            over seeds. Tables and figure use the mean over seeds of each grid point's
            final loss (a point where a seed diverged counts as diverged); the claims are
            judged on that mean and on every seed (:func:`evaluate_claims`).
        fp8: also train u-μP in simulated FP8 at each size's best FP32 learning rate.
        fp8_recipe: the :data:`unitscale.transforms.FP8_RECIPES` key of those runs.
        model: the model family, a :data:`MODELS` entry: ``"builtin"`` (the library's
            decoder against the plain-PyTorch one) or ``"hf:llama"`` (a transformers Llama
            with ``width / 32`` heads of 32, MLP ``4 x width``, through
            :func:`~unitscale.transforms.unit_scale` for u-μP, as it is for the standard
            parametrisation).
        threads: torch intra-op threads during the sweep (restored afterwards). 1 by
            default: these models are too small for intra-op parallelism to pay (on the
            shared 2-core machine at load 5, measured once ad hoc: a width-64 step took
            25 ms on one thread, 376 ms on two); one thread also makes the results
            independent of the core count.
        quick: a smoke run (:func:`default_config` with ``quick=True``): the summary, the
            JSON and the report say so, and no claim is judged on it, held or not (a few dozen
            steps on three grid points cannot support one).
        optimizer: u-μP's optimiser, an :data:`OPTIMIZERS` entry: ``"adamw"``
            (:class:`unitscale.optim.AdamW`, default) or ``"muon"``
            (:class:`unitscale.optim.Muon`: Muon for hidden matrices, u-μP AdamW for the
            rest; torch 2.9+). The standard parametrisation keeps torch's AdamW.
        depth_rule: the u-μP models' depth rule, a :data:`DEPTH_RULES` entry:
            ``"depth-mup"`` (default) or ``"completep"`` (``TransformerDecoder`` /
            ``unit_scale``'s ``depth_rule=``).
        seed_values: the seeds, where they are not ``seed`` to ``seed + seeds - 1`` (a
            sweep combined from runs of other seeds: :func:`combine_results`); when given,
            ``seed`` and ``seeds`` are set from it (its first seed, its length). Empty: the
            consecutive seeds.

    Example:
        >>> c = TransferConfig(widths=(32, 64), depths=(2,), lr_steps=(-1, 0, 1))
        >>> c.sizes, c.grid("u-muP")
        ([(32, 2), (64, 2)], [(-1, 0.25), (0, 0.5), (1, 1.0)])
    """

    vary: Literal["width", "depth"] = "width"
    widths: tuple[int, ...] = (32, 64, 128, 256)
    depths: tuple[int, ...] = (2,)
    lr_steps: tuple[int, ...] = (-3, -2, -1, 0, 1, 2, 3)
    mup_lr: float = DEFAULT_MUP_LR
    standard_lr: float = DEFAULT_STANDARD_LR
    steps: int = 160
    batch_size: int = 8
    seq_len: int = 32
    warmup_steps: int | None = None
    eval_every: int = 40
    eval_batches: int = 8
    seed: int = 0
    seeds: int = 1
    fp8: bool = True
    fp8_recipe: str = "hardware"
    model: str = "builtin"
    threads: int = 1
    quick: bool = False
    optimizer: str = "adamw"
    depth_rule: str = "depth-mup"
    seed_values: tuple[int, ...] = ()

    def _set_seed_values(self) -> None:
        """Check ``seed_values`` and set ``seed`` and ``seeds`` from it (cleared when the
        seeds are consecutive: ``seed`` and ``seeds`` say it)."""
        values = tuple(sorted(self.seed_values))
        if len(set(values)) != len(values) or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values
        ):
            raise TransferConfigError(
                f"TransferConfig: seed_values={list(self.seed_values)!r} must be distinct "
                "non-negative integers"
            )
        object.__setattr__(self, "seed", values[0])
        object.__setattr__(self, "seeds", len(values))
        consecutive = values == tuple(range(values[0], values[0] + len(values)))
        object.__setattr__(self, "seed_values", () if consecutive else values)

    def __post_init__(self) -> None:
        if self.seed_values:
            self._set_seed_values()
        if self.vary not in ("width", "depth"):
            raise TransferConfigError(
                f"TransferConfig: vary={self.vary!r} must be 'width' or 'depth'"
            )
        widths = _positive_ints("widths", self.widths)
        depths = _positive_ints("depths", self.depths)
        object.__setattr__(self, "widths", widths)
        object.__setattr__(self, "depths", depths)
        varied, fixed = (widths, depths) if self.vary == "width" else (depths, widths)
        other = "depths" if self.vary == "width" else "widths"
        if len(varied) < 2:
            raise TransferConfigError(
                f"TransferConfig: vary={self.vary!r} needs at least two {self.vary}s, got "
                f"{list(varied)}"
            )
        if len(fixed) != 1:
            raise TransferConfigError(
                f"TransferConfig: vary={self.vary!r} takes one value of {other}, got {list(fixed)}"
            )
        bad = [w for w in widths if w % HEAD_SIZE]
        if bad:
            raise TransferConfigError(
                f"TransferConfig: widths {bad} are not multiples of the head size {HEAD_SIZE}; "
                f"use e.g. 32,64,128,256"
            )
        steps = tuple(self.lr_steps)
        if any(isinstance(k, bool) or not isinstance(k, int) for k in steps) or 0 not in steps:
            raise TransferConfigError(
                f"TransferConfig: lr_steps={list(steps)!r} must be integers including 0 (the "
                "default learning rate)"
            )
        if len(set(steps)) != len(steps):
            raise TransferConfigError(f"TransferConfig: lr_steps={list(steps)!r} repeats a step")
        object.__setattr__(self, "lr_steps", tuple(sorted(steps)))
        for name in ("mup_lr", "standard_lr"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise TransferConfigError(f"TransferConfig: {name}={value!r} must be positive")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise TransferConfigError(
                f"TransferConfig: seed={self.seed!r} must be a non-negative integer"
            )
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "seeds"):
            check_positive_int("TransferConfig", name, getattr(self, name), TransferConfigError)
        check_warmup("TransferConfig", self.warmup_steps, TransferConfigError)
        from ...transforms import FP8_RECIPES

        if self.fp8_recipe not in FP8_RECIPES:
            raise TransferConfigError(
                f"TransferConfig: fp8_recipe={self.fp8_recipe!r}; choose from "
                f"{', '.join(FP8_RECIPES)}"
            )
        if self.model not in MODELS:
            raise TransferConfigError(
                f"TransferConfig: model={self.model!r}; choose from {', '.join(MODELS)}"
            )
        for name, allowed in (("optimizer", OPTIMIZERS), ("depth_rule", DEPTH_RULES)):
            if getattr(self, name) not in allowed:
                raise TransferConfigError(
                    f"TransferConfig: {name}={getattr(self, name)!r}; choose from "
                    f"{', '.join(allowed)}"
                )
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise TransferConfigError(
                f"TransferConfig: threads={self.threads!r} must be a positive integer"
            )

    @property
    def schedule(self) -> Schedule:
        """The learning-rate schedule of every run (``unitscale train``'s: the runner's)."""
        return Schedule(self.steps, self.warmup_steps)

    @property
    def seed_list(self) -> list[int]:
        """The seeds of the sweep: ``seed`` to ``seed + seeds - 1`` (or ``seed_values``).

        Example:
            >>> TransferConfig(seed=3, seeds=2).seed_list
            [3, 4]
            >>> TransferConfig(seed_values=(17, 0, 1)).seed_list
            [0, 1, 17]
        """
        if self.seed_values:
            return list(self.seed_values)
        return list(range(self.seed, self.seed + self.seeds))

    @property
    def sizes(self) -> list[tuple[int, int]]:
        """The ``(width, depth)`` of every size swept, smallest first."""
        return [(w, d) for d in self.depths for w in self.widths]

    def grid(self, parametrisation: str) -> list[tuple[int, float]]:
        """``(k, learning rate)`` for each grid step ``k`` of ``parametrisation``."""
        if parametrisation not in CENTRE_FIELDS:
            raise TransferConfigError(
                f"unknown parametrisation {parametrisation!r}; choose from "
                f"{', '.join(PARAMETRISATIONS)}"
            )
        centre = getattr(self, CENTRE_FIELDS[parametrisation])
        return [(k, centre * 2.0**k) for k in self.lr_steps]

    def lr_factor(self, step: int) -> float:
        """The schedule's multiplier of the peak learning rate at ``step``.

        Example:
            >>> c = TransferConfig(steps=100)
            >>> [round(c.lr_factor(s), 3) for s in (0, 4, 5, 99)]
            [0.2, 1.0, 1.0, 0.1]
        """
        return self.schedule.lr(1.0, step)


#: The sweep ``unitscale transfer`` runs with no options (fixed before the committed run).
DEFAULT_CONFIG = TransferConfig()

_QUICK = {
    "steps": 24,
    "batch_size": 4,
    "seq_len": 32,
    "lr_steps": (-1, 0, 1),
    "eval_every": 12,
    "eval_batches": 4,
    "quick": True,
}


def default_config(vary: str = "width", quick: bool = False, **overrides: Any) -> TransferConfig:
    """The command's sweep: :data:`DEFAULT_CONFIG`, or across depth, or the quick version.

    Across width: widths 32, 64, 128, 256 at depth 2. Across depth (``vary="depth"``):
    depths 1, 2, 4, 8 at width 64. ``quick`` (a smoke run of under a minute or two): widths
    32, 64 (depths 1, 2 at width 32), 24 steps of 4 x 32 bytes, grid steps -1, 0, 1,
    4 evaluation batches.
    ``overrides`` replace any field (None values are ignored).

    Example:
        >>> c = default_config("depth", quick=True)
        >>> c.sizes, c.steps
        ([(32, 1), (32, 2)], 24)
    """
    if vary not in ("width", "depth"):
        raise TransferConfigError(f"default_config: vary={vary!r} must be 'width' or 'depth'")
    fields_: dict[str, Any] = {"vary": vary}
    if vary == "depth":
        fields_.update(widths=(64,), depths=(1, 2, 4, 8))
    if quick:
        fields_.update(_QUICK)
        fields_.update(
            {"widths": (32, 64), "depths": (2,)}
            if vary == "width"
            else {"widths": (32,), "depths": (1, 2)}
        )
    fields_.update({k: v for k, v in overrides.items() if v is not None})
    return replace(DEFAULT_CONFIG, **fields_)
