"""Hyperparameter transfer across width (or depth): learning-rate sweeps, standard vs u-μP.

The library behind ``unitscale transfer``. :func:`run_transfer` trains a decoder of one
model family (:attr:`TransferConfig.model`) in two parametrisations, at every size of
:class:`TransferConfig` and every learning rate of a 2x grid, on the bundled text:

- ``standard``: the plain-PyTorch decoder (:class:`unitscale.models.PlainGPT` without a
  position embedding, GPT-2's layout and N(0, 0.02) initialisation), or for ``hf:llama`` a
  transformers Llama as transformers initialises it, with ``torch.optim.AdamW``;
- ``u-muP``: the library's default :class:`unitscale.TransformerDecoder` (the paper's
  scheme, every mult 1), or for ``hf:llama`` :func:`~unitscale.transforms.unit_scale` of the
  same Llama, with :class:`unitscale.optim.AdamW` (per-parameter learning rates from the
  u-μP tags);

then u-μP once more per size in simulated FP8 (:func:`unitscale.transforms.simulate_fp8`,
the ``"hardware"`` recipe, no loss scaling) at the learning rate that was best in FP32.
:func:`final_frame` and :func:`evaluate_claims` turn the runs into the table and the four
claims of the README; :func:`summary_text`, :func:`plot_transfer` and
:func:`write_transfer_report` present them.

The data, the evaluation samples (the same as ``unitscale train``'s at the same batch size,
sequence length and seed, by construction), the schedule and the loop are the experiment
runner's (:mod:`unitscale.experiments.runner`), the files its report writer's
(:mod:`unitscale.experiments.report`); what is this experiment's own is its
parametrisations, its grid, its claims and its tables.

To add a model family, add its name to :data:`MODELS` and append one
:class:`Parametrisation` per parametrisation (``standard`` and ``u-muP``) to
:data:`PARAMETRISATION_SPECS`: its name, how it builds the model at a width and depth, its
optimiser, the configuration field holding the centre of its learning-rate grid, the family
and a short description. The sweep, the tables, the CSV, the figure and ``--model`` pick it
up.

Design constraints:

- the grid, steps, schedule and sizes are fixed in :data:`DEFAULT_CONFIG` (written down
  before the committed run was made, and not tuned on its results);
- every run of a sweep trains on the same list of batches in the same order, every run of
  one size and parametrisation starts from the same weights (seeded by ``config.seed``),
  and the whole sweep is deterministic under the seed (same machine and thread count:
  identical CSV); the global RNG is left as it was;
- collection (:func:`run_transfer`) is separate from presentation; claims are computed from
  the table alone, so that they can be checked on any table;
- nothing here parses options or prints; progress goes to a callback.
"""

from __future__ import annotations

import html
import math
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from .. import modules as us
from .. import optim as us_optim
from ..errors import UnitScaleError
from . import report
from .data import Batch
from .models import GPTConfig, plain_gpt
from .runner import (
    Schedule,
    check_positive_int,
    check_warmup,
    evaluation_batches,
    train_loop,
    training_batches,
)

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = [  # noqa: RUF022 (grouped by kind, see STYLE.md)
    # errors
    "TransferConfigError",
    # configuration
    "Parametrisation",
    "PARAMETRISATION_SPECS",
    "PARAMETRISATIONS",
    "MODELS",
    "DEFAULT_MUP_LR",
    "DEFAULT_STANDARD_LR",
    "DEFAULT_CONFIG",
    "TransferConfig",
    "default_config",
    # runs
    "TransferRun",
    "TransferResult",
    "build_model",
    "build_optimiser",
    "train_one",
    "run_transfer",
    # tables and claims
    "CSV_COLUMNS",
    "Claim",
    "runs_frame",
    "final_frame",
    "best_points",
    "evaluate_claims",
    # presentation
    "sweep_tables",
    "table_lines",
    "transfer_claims",
    "summary_text",
    "plot_transfer",
    "write_transfer_csv",
    "command_line",
    "write_transfer_json",
    "write_transfer_report",
]

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

#: ``hf:llama``'s MLP (SwiGLU) intermediate size over its width: 4, the built-in decoder's
#: ratio, rather than Llama's usual ~8/3, so that every width gives an integer size and the
#: fan-ins keep one ratio to the width (8/3 of 32 is not an integer).
LLAMA_MLP_RATIO = 4

#: The columns of ``transfer.csv``, one row per run and evaluation.
CSV_COLUMNS: tuple[str, ...] = (
    "parametrisation",
    "precision",
    "width",
    "depth",
    "lr_step",
    "lr",
    "step",
    "train_loss",
    "heldout_loss",
    "final",
    "data_digest",
)


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
        seed: initialisation, data order and evaluation sample.
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
            JSON and the report say so, and no claim is reported held on it (a few dozen
            steps on three grid points cannot support one).

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
    fp8: bool = True
    fp8_recipe: str = "hardware"
    model: str = "builtin"
    threads: int = 1
    quick: bool = False

    def __post_init__(self) -> None:
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
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches"):
            check_positive_int("TransferConfig", name, getattr(self, name), TransferConfigError)
        check_warmup("TransferConfig", self.warmup_steps, TransferConfigError)
        from ..transforms import FP8_RECIPES

        if self.fp8_recipe not in FP8_RECIPES:
            raise TransferConfigError(
                f"TransferConfig: fp8_recipe={self.fp8_recipe!r}; choose from "
                f"{', '.join(FP8_RECIPES)}"
            )
        if self.model not in MODELS:
            raise TransferConfigError(
                f"TransferConfig: model={self.model!r}; choose from {', '.join(MODELS)}"
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
    def sizes(self) -> list[tuple[int, int]]:
        """The ``(width, depth)`` of every size swept, smallest first."""
        return [(w, d) for d in self.depths for w in self.widths]

    def grid(self, parametrisation: str) -> list[tuple[int, float]]:
        """``(k, learning rate)`` for each grid step ``k`` of ``parametrisation``."""
        centre = getattr(self, _spec(parametrisation, self.model).centre_field)
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


# -- runs ------------------------------------------------------------------------------------
@dataclass
class TransferRun:
    """One training run of a sweep.

    Attributes:
        parametrisation: ``"standard"`` or ``"u-muP"``.
        precision: ``"fp32"`` or ``"fp8"`` (simulated).
        width, depth: the model's size.
        lr_step: its grid step ``k`` (learning rate ``centre * 2**k``).
        lr: its peak learning rate (u-μP: the base rate each parameter's rule scales).
        evals: ``(step, mean training loss since the previous evaluation, held-out loss)``
            at every evaluation; the last one is at ``steps``.
        final_train_loss: mean loss over the fixed training evaluation batches at the end.
        stopped_at: the step whose loss was not finite (training stopped there), or None.
        data_digest: SHA-256 (first 16 hex digits) of the token ids of every batch trained on.
        seconds: wall time (building, training and evaluating).
    """

    parametrisation: str
    precision: str
    width: int
    depth: int
    lr_step: int
    lr: float
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    final_train_loss: float = math.nan
    stopped_at: int | None = None
    data_digest: str = ""
    seconds: float = 0.0

    @property
    def final_heldout_loss(self) -> float:
        """The held-out loss after the last step (NaN for a run that diverged)."""
        return self.evals[-1][2] if self.stopped_at is None and self.evals else math.nan


@dataclass
class TransferResult:
    """A sweep's runs, its settings and how long it took.

    Attributes:
        config: the sweep.
        runs: every run, FP32 sweeps first, then the FP8 runs.
        seconds: wall time of the whole sweep.
        load_average: the 1-minute load average before and after (None where unknown).
    """

    config: TransferConfig
    runs: list[TransferRun]
    seconds: float = 0.0
    load_average: tuple[float | None, float | None] = (None, None)


def _standard_model(width: int, depth: int, config: TransferConfig) -> nn.Module:
    gpt = GPTConfig(
        hidden_size=width,
        depth=depth,
        heads=width // HEAD_SIZE,
        seq_len=config.seq_len,
        position_embedding=False,
    )
    return plain_gpt(gpt, seed=config.seed)


def _mup_model(width: int, depth: int, config: TransferConfig) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return us.TransformerDecoder(width, depth, width // HEAD_SIZE, 256)


class _CausalLMLoss(nn.Module):
    """A transformers causal LM that returns the mean cross-entropy of its logits against
    already-shifted ``labels`` (the runner's :class:`~unitscale.experiments.data.Batch`).

    The loss is computed inside ``forward`` so that :func:`~unitscale.transforms.unit_scale`
    makes it the unit-scaled ``U.cross_entropy`` (as it does for the built-in decoder), and
    ``get_output_embeddings`` hands on the wrapped model's head so that ``unit_scale`` finds
    the readout it makes u-μP's.
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm: Any = lm  # a transformers model: its methods are not nn.Module's

    def get_output_embeddings(self) -> nn.Module:
        head: nn.Module = self.lm.get_output_embeddings()
        return head

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=input_ids).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _llama(width: int, depth: int, config: TransferConfig) -> nn.Module:
    """A randomly initialised transformers Llama (no download) seeded by ``config.seed``."""
    try:
        import transformers
    except ModuleNotFoundError as exc:
        raise TransferConfigError(
            "transfer model 'hf:llama' needs the transformers package: pip install 'unitscale[hf]'"
        ) from exc
    options: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": width,
        "intermediate_size": LLAMA_MLP_RATIO * width,
        "num_hidden_layers": depth,
        "num_attention_heads": width // HEAD_SIZE,
        "num_key_value_heads": width // HEAD_SIZE,
        "max_position_embeddings": config.seq_len,
        "tie_word_embeddings": False,
        "use_cache": False,
        "attn_implementation": "sdpa",  # a config argument the stubs do not declare
    }
    llama = transformers.LlamaConfig(**options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return _CausalLMLoss(transformers.LlamaForCausalLM(llama))


def _llama_mup(width: int, depth: int, config: TransferConfig) -> nn.Module:
    from ..transforms import unit_scale

    return unit_scale(_llama(width, depth, config))


def _torch_adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def _mup_adamw(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    return us_optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


@dataclass(frozen=True)
class Parametrisation:
    """One parametrisation a sweep trains: its model, its optimiser and its grid's centre.

    Attributes:
        name: as the tables and the CSV show it (``"standard"`` or ``"u-muP"``).
        build: ``build(width, depth, config)``, the model seeded by ``config.seed``; it takes
            ``model(input_ids, labels=labels)`` and returns the mean cross-entropy.
        optimiser: ``optimiser(model, lr)`` at peak ``lr``.
        centre_field: the :class:`TransferConfig` field holding the grid's centre.
        model: the model family it belongs to (:attr:`TransferConfig.model`).
        description: the model and optimiser in a few words, for the summary and the figure.
    """

    name: str
    build: Callable[[int, int, TransferConfig], nn.Module]
    optimiser: Callable[[nn.Module, float], torch.optim.Optimizer]
    centre_field: str
    model: str = "builtin"
    description: str = ""


#: The parametrisations of every model family, each family's in the order they are run and
#: shown. ``builtin`` is the library's own decoder; ``hf:llama`` a transformers Llama (made
#: u-μP by :func:`~unitscale.transforms.unit_scale`).
PARAMETRISATION_SPECS: tuple[Parametrisation, ...] = (
    Parametrisation(
        "standard", _standard_model, _torch_adamw, "standard_lr", "builtin",
        "plain PyTorch decoder (GPT-2 init) + torch.optim.AdamW",
    ),
    Parametrisation(
        "u-muP", _mup_model, _mup_adamw, "mup_lr", "builtin",
        "unitscale.TransformerDecoder (u-muP default) + unitscale.optim.AdamW",
    ),
    Parametrisation(
        "standard", _llama, _torch_adamw, "standard_lr", "hf:llama",
        "transformers LlamaForCausalLM (HF init) + torch.optim.AdamW",
    ),
    Parametrisation(
        "u-muP", _llama_mup, _mup_adamw, "mup_lr", "hf:llama",
        "unit_scale(LlamaForCausalLM) + unitscale.optim.AdamW",
    ),
)  # fmt: skip

#: The parametrisations' names (every model family has one of each).
PARAMETRISATIONS: tuple[str, ...] = ("standard", "u-muP")


def _spec(name: str, model: str = "builtin") -> Parametrisation:
    for spec in PARAMETRISATION_SPECS:
        if spec.name == name and spec.model == model:
            return spec
    if model not in MODELS:
        raise TransferConfigError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    raise TransferConfigError(
        f"unknown parametrisation {name!r}; choose from {', '.join(PARAMETRISATIONS)}"
    )


def build_model(parametrisation: str, width: int, depth: int, config: TransferConfig) -> nn.Module:
    """The decoder of ``parametrisation`` at ``width`` x ``depth`` for ``config.model``,
    seeded by ``config.seed``.

    Every model has ``width / 32`` heads of 32, ``depth`` pre-norm blocks, a final norm, an
    untied readout, a 256-byte vocabulary and no learned position embedding, and takes
    ``model(input_ids, labels=labels)`` (labels already shifted) and returns the mean
    cross-entropy. The weight matrices of the two parametrisations of a model family have
    the same shapes; what differs is the parametrisation:

    - ``builtin``: ``standard`` is :class:`unitscale.models.PlainGPT`
      (``position_embedding=False``: LayerNorms with weight and bias, biased linear layers,
      a 4x GELU MLP, GPT-2's N(0, 0.02) initialisation); ``u-muP`` is the library's default
      decoder, ``unitscale.TransformerDecoder(width, depth, heads, 256)``: the paper's
      recommended scheme (Blake et al., ICLR 2025, arXiv 2407.17465), so no biases and norms
      without trainable parameters.
    - ``hf:llama``: a randomly initialised ``transformers.LlamaForCausalLM`` (RMSNorm, RoPE,
      SwiGLU MLP of ``4 x width``, no biases; no download); ``standard`` as transformers
      initialises it, ``u-muP`` through :func:`~unitscale.transforms.unit_scale` (u-μP
      readout, every parameter tagged; its RMSNorm weights stay, tagged ``"norm"``).

    Example:
        >>> ids = torch.zeros(2, 16, dtype=torch.long)
        >>> [type(build_model(p, 64, 2, TransferConfig())).__name__ for p in PARAMETRISATIONS]
        ['PlainGPT', 'TransformerDecoder']
        >>> build_model("standard", 64, 2, TransferConfig())(ids, labels=ids).shape
        torch.Size([])
    """
    return _spec(parametrisation, config.model).build(width, depth, config)


def build_optimiser(
    parametrisation: str, model: nn.Module, lr: float, family: str = "builtin"
) -> torch.optim.Optimizer:
    """AdamW (betas 0.9, 0.95, no weight decay) at peak ``lr``: torch's for ``standard``,
    :class:`unitscale.optim.AdamW` (each parameter ``lr`` times its u-μP rule, the factor in
    its param group's ``"lr_scale"``) for ``u-muP``, for the model family ``family``.

    Example:
        >>> m = build_model("u-muP", 64, 2, TransferConfig())
        >>> groups = build_optimiser("u-muP", m, 1.0).param_groups
        >>> rates = sorted({g["lr"] * g["lr_scale"] for g in groups})
        >>> [round(r * math.sqrt(2), 4) for r in rates[:2]]  # 1/sqrt(fan_in * depth)
        [0.0625, 0.125]
    """
    return _spec(parametrisation, family).optimiser(model, lr)


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
    run = TransferRun(parametrisation, precision, width, depth, lr_step, lr)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = build_model(parametrisation, width, depth, config)
        if precision == "fp8":
            from ..transforms import simulate_fp8

            model = simulate_fp8(model, recipe=config.fp8_recipe)
        model.train()
        done = train_loop(
            model,
            build_optimiser(parametrisation, model, lr, config.model),
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
    then (``config.fp8``) u-μP in simulated FP8 at each size's best FP32 learning rate, on
    ``config.threads`` threads.

    Args:
        config: the sweep.
        progress: called with one line after each run.

    Returns:
        The :class:`TransferResult`.

    Example:
        >>> c = default_config(quick=True, steps=2, eval_every=2, eval_batches=1,
        ...                    lr_steps=(0,), fp8=False, widths=(32, 64))
        >>> [(r.parametrisation, r.width) for r in run_transfer(c).runs]
        [('standard', 32), ('standard', 64), ('u-muP', 32), ('u-muP', 64)]
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _run_transfer(config, progress)
    finally:
        torch.set_num_threads(threads)


def _run_transfer(config: TransferConfig, progress: Callable[[str], None] | None) -> TransferResult:
    start = time.perf_counter()
    load_before = _load()
    data = _train_data(config)
    heldout, train_eval = _eval_data(config, "heldout"), _eval_data(config, "train")
    plan = [
        (p, width, depth, k, "fp32")
        for p in PARAMETRISATIONS
        for width, depth in config.sizes
        for k, _ in config.grid(p)
    ]
    total = len(plan) + (len(config.sizes) if config.fp8 else 0)
    runs: list[TransferRun] = []

    def one(p: str, width: int, depth: int, k: int, precision: str) -> None:
        run = train_one(p, width, depth, k, config, data, heldout, train_eval, precision)
        runs.append(run)
        if progress is not None:
            loss = run.final_heldout_loss
            shown = f"{loss:.4f}" if math.isfinite(loss) else f"diverged at step {run.stopped_at}"
            progress(
                f"[{len(runs)}/{total}] {p} {precision} width {width} depth {depth} "
                f"lr {run.lr:g}: held-out {shown} ({run.seconds:.1f}s)"
            )

    for item in plan:
        one(*item)
    if config.fp8:
        best = best_points(final_frame(runs_frame(runs)))
        for width, depth in config.sizes:
            row = best[
                (best.parametrisation == "u-muP") & (best.width == width) & (best.depth == depth)
            ]
            if len(row) and row.lr_step.notna().all():
                one("u-muP", width, depth, int(row.lr_step.iloc[0]), "fp8")
    return TransferResult(config, runs, time.perf_counter() - start, (load_before, _load()))


# -- tables and claims -----------------------------------------------------------------------
def runs_frame(runs: Sequence[TransferRun]) -> pd.DataFrame:
    """One row per run and evaluation (:data:`CSV_COLUMNS`); ``final`` marks the row of the
    run's last evaluation. A run that diverged has one row, at the step it stopped, with
    empty losses."""
    import pandas as pd

    rows: list[tuple[Any, ...]] = []
    for r in runs:
        head = (r.parametrisation, r.precision, r.width, r.depth, r.lr_step, r.lr)
        evals = list(r.evals)
        if r.stopped_at is not None:
            evals.append((r.stopped_at, math.nan, math.nan))
        for i, (step, train, held) in enumerate(evals):
            rows.append((*head, step, train, held, i == len(evals) - 1, r.data_digest))
    return pd.DataFrame(rows, columns=list(CSV_COLUMNS))


def final_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of :func:`runs_frame` with ``final`` set: one per run, its final losses."""
    return frame[frame["final"].astype(bool)].reset_index(drop=True)


def _size_column(frame: pd.DataFrame) -> str:
    """The column that varies across the sweep's sizes (``width`` unless only depth does)."""
    return "depth" if frame["width"].nunique() == 1 and frame["depth"].nunique() > 1 else "width"


def best_points(final: pd.DataFrame) -> pd.DataFrame:
    """The best FP32 grid point of each parametrisation and size.

    Args:
        final: :func:`final_frame` (any table with ``parametrisation``, ``precision``,
            ``width``, ``depth``, ``lr_step``, ``lr`` and ``heldout_loss``).

    Returns:
        One row per parametrisation and size: ``lr_step`` and ``lr`` of the lowest finite
        held-out loss (ties: the smaller step), that ``heldout_loss``, ``at_edge`` (the best is
        the grid's first or last step, so the true optimum may lie outside the grid) and
        ``default_loss`` (the loss at step 0). A size whose every run diverged has NaNs.

    Example:
        >>> import pandas as pd
        >>> t = pd.DataFrame({"parametrisation": "u-muP", "precision": "fp32", "width": 32,
        ...                   "depth": 2, "lr_step": [-1, 0, 1], "lr": [0.25, 0.5, 1.0],
        ...                   "heldout_loss": [2.0, 1.5, float("nan")]})
        >>> best_points(t)[["lr_step", "heldout_loss", "at_edge"]].values.tolist()
        [[0.0, 1.5, False]]
    """
    import pandas as pd

    fp32 = final[final["precision"] == "fp32"]
    rows = []
    for (p, width, depth), group in fp32.groupby(["parametrisation", "width", "depth"], sort=False):
        steps = sorted(group["lr_step"])
        finite = group[group["heldout_loss"].map(lambda v: math.isfinite(float(v)))]
        default = group.loc[group["lr_step"] == 0, "heldout_loss"]
        row: dict[str, Any] = {
            "parametrisation": p,
            "width": width,
            "depth": depth,
            "default_loss": float(default.iloc[0]) if len(default) else math.nan,
        }
        if len(finite):
            best = finite.sort_values(["heldout_loss", "lr_step"], kind="stable").iloc[0]
            k = int(best["lr_step"])
            row.update(
                lr_step=float(k),
                lr=float(best["lr"]),
                heldout_loss=float(best["heldout_loss"]),
                at_edge=k in (steps[0], steps[-1]),
            )
        else:
            row.update(lr_step=math.nan, lr=math.nan, heldout_loss=math.nan, at_edge=False)
        rows.append(row)
    columns = ["parametrisation", "width", "depth", "lr_step", "lr", "heldout_loss"]
    return pd.DataFrame(rows, columns=[*columns, "at_edge", "default_loss"])


@dataclass(frozen=True)
class Claim:
    """One of the README's claims, evaluated on a sweep's table.

    Attributes:
        number: 1 to 4.
        statement: what is claimed.
        held: True or False, or None where the claim is a measurement (claim 2), could not
            be evaluated (e.g. no FP8 runs) or the run cannot decide it (``detail`` starts
            with ``inconclusive``: an optimum on the grid's edge, a quick run).
        detail: the numbers it rests on.
    """

    number: int
    statement: str
    held: bool | None
    detail: str

    @property
    def verdict(self) -> str:
        """``"held"``, ``"NOT held"``, or ``"measured"``/``"not evaluated"``/``"inconclusive"``
        for None."""
        if self.held is not None:
            return "held" if self.held else "NOT held"
        for verdict in ("not evaluated", "inconclusive"):
            if self.detail.startswith(verdict):
                return verdict
        return "measured"


def _steps_text(best: pd.DataFrame, size: str) -> str:
    parts = []
    for _, row in best.iterrows():
        k = row["lr_step"]
        edge = " (grid edge)" if row["at_edge"] else ""
        shown = f"k={int(k):+d} (lr {row['lr']:g}){edge}" if math.isfinite(k) else "all diverged"
        parts.append(f"{size} {int(row[size])}: {shown}")
    return "; ".join(parts)


def _gap(a: float, b: float) -> float:
    return (a - b) / b if math.isfinite(a) and math.isfinite(b) and b else math.nan


def evaluate_claims(
    final: pd.DataFrame, tolerance: float = 0.02, quick: bool = False
) -> list[Claim]:
    """The four claims of the README, evaluated from a table of final losses.

    1. u-μP's best learning rate at the largest size is within one grid step of its best at
       the smallest.
    2. How far the standard parametrisation's best learning rate moves over the same sizes
       (a measurement: ``held`` is None).
    3. u-μP at its default learning rate (grid step 0) ends within ``tolerance`` of the best
       point of its sweep at every size.
    4. u-μP in simulated FP8 at its best learning rate ends within ``tolerance`` of its FP32
       loss at every size.

    A claim is only reported held where the table supports it: claims 1 and 3 are
    ``inconclusive`` when a u-μP optimum lies on the grid's edge (the true optimum may lie
    beyond it, so neither where it is nor how far the default is from it is known; claim 3
    still fails when the default is already too far from the grid's best), and with
    ``quick`` no claim is held (a smoke run's verdict would be ``inconclusive``).

    Args:
        final: :func:`final_frame`, or any table with its columns.
        tolerance: the relative gap claims 3 and 4 allow.
        quick: the table comes from a quick smoke run (:attr:`TransferConfig.quick`).

    Returns:
        The four :class:`Claim` objects.

    Example:
        >>> import pandas as pd
        >>> rows = [("u-muP", "fp32", w, 2, k, 2.0**k, 2 + abs(k - 0.1 * (w == 64)))
        ...         for w in (32, 64) for k in (-1, 0, 1)]
        >>> t = pd.DataFrame(rows, columns=["parametrisation", "precision", "width", "depth",
        ...                                 "lr_step", "lr", "heldout_loss"])
        >>> [c.verdict for c in evaluate_claims(t)]
        ['held', 'not evaluated', 'held', 'not evaluated']
    """
    size = _size_column(final)
    best = best_points(final).sort_values(["parametrisation", size], kind="stable")
    mup = best[best["parametrisation"] == "u-muP"]
    standard = best[best["parametrisation"] == "standard"]
    claims = [
        _claim_transfer(mup, size),
        _claim_standard_moves(standard, size),
        _claim_default(mup, size, tolerance),
        _claim_fp8(final, mup, size, tolerance),
    ]
    if quick:
        reason = "inconclusive: a --quick smoke run cannot support it; "
        claims = [replace(c, held=None, detail=reason + c.detail) if c.held else c for c in claims]
    return claims


def _edges(best: pd.DataFrame, size: str) -> str:
    """The sizes whose optimum lies on the grid's edge, as text ("" when none)."""
    at_edge = best[best["at_edge"].astype(bool)]
    return ", ".join(f"{size} {int(v)}" for v in at_edge[size])


def _moved(best: pd.DataFrame) -> int | None:
    """Grid steps from the smallest size's best to the largest's (None: not measurable)."""
    if len(best) < 2 or not best["lr_step"].notna().all():
        return None
    return int(best["lr_step"].iloc[-1] - best["lr_step"].iloc[0])


def _claim_transfer(mup: pd.DataFrame, size: str) -> Claim:
    statement = (
        f"u-muP's best learning rate at the largest {size} is within one grid step (2x) of its "
        f"best at the smallest"
    )
    moved = _moved(mup)
    if moved is None:
        return Claim(1, statement, None, "not evaluated: a size is missing or diverged")
    detail = f"moves {moved:+d} steps; {_steps_text(mup, size)}"
    edges = _edges(mup, size)
    if edges:
        return Claim(1, statement, None, f"inconclusive: the optimum at {edges} is on the "
                     f"grid's edge (it may lie beyond); {detail}")  # fmt: skip
    return Claim(1, statement, abs(moved) <= 1, detail)


def _claim_standard_moves(standard: pd.DataFrame, size: str) -> Claim:
    statement = f"how far the standard parametrisation's best learning rate moves over the {size}s"
    moved = _moved(standard)
    if moved is None:
        return Claim(2, statement, None, "not evaluated: a size is missing or diverged")
    detail = (
        f"moves {moved:+d} steps ({2.0**moved:g}x) from the smallest to the largest {size}; "
        f"{_steps_text(standard, size)}"
    )
    return Claim(2, statement, None, detail)


def _claim_default(mup: pd.DataFrame, size: str, tolerance: float) -> Claim:
    statement = (
        f"u-muP at its default learning rate (every mult 1) ends within {tolerance:.0%} of the "
        f"best point of its sweep at every {size}"
    )
    gaps = [(int(r[size]), _gap(r["default_loss"], r["heldout_loss"])) for _, r in mup.iterrows()]
    if not gaps:
        return Claim(3, statement, None, "not evaluated: no u-muP runs")
    held = all(math.isfinite(g) and g <= tolerance for _, g in gaps)
    detail = "default vs best: " + "; ".join(f"{size} {s}: {_pct(g)}" for s, g in gaps)
    edges = _edges(mup, size)
    if held and edges:  # the true best may be lower: the gap may be larger
        return Claim(3, statement, None, f"inconclusive: the optimum at {edges} is on the "
                     f"grid's edge (the true best may be lower); {detail}")  # fmt: skip
    return Claim(3, statement, held, detail)


def _claim_fp8(final: pd.DataFrame, mup: pd.DataFrame, size: str, tolerance: float) -> Claim:
    statement = (
        f"u-muP in simulated FP8 at its best learning rate ends within {tolerance:.0%} of its "
        f"FP32 loss at every {size}, with no loss scaling"
    )
    fp8 = final[(final["precision"] == "fp8") & (final["parametrisation"] == "u-muP")]
    gaps = []
    for _, r in mup.iterrows():
        match = fp8[(fp8["width"] == r["width"]) & (fp8["depth"] == r["depth"])]
        if len(match):
            loss = float(match["heldout_loss"].iloc[0])
            gaps.append((int(r[size]), _gap(loss, r["heldout_loss"])))
    if not gaps or len(gaps) != len(mup):
        return Claim(4, statement, None, f"not evaluated: no FP8 run at some {size}")
    held = all(math.isfinite(g) and abs(g) <= tolerance for _, g in gaps)
    detail = "; ".join(f"{size} {s}: {_pct(g)}" for s, g in gaps)
    return Claim(4, statement, held, f"FP8 vs FP32 held-out: {detail}")


def _pct(value: float) -> str:
    return f"{value:+.2%}" if math.isfinite(value) else "n/a (diverged)"


# -- presentation ----------------------------------------------------------------------------
def _loss_text(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else "div."


def sweep_tables(
    final: pd.DataFrame, config: TransferConfig
) -> list[tuple[str, list[str], list[list[str]]]]:
    """The final held-out loss of every run, one table per parametrisation: its title, its
    header and one row per size (a column per grid step, the best marked ``*``, the best
    learning rate, then the FP8 run's loss)."""
    size = _size_column(final)
    best = best_points(final)
    steps = list(config.lr_steps)
    header = [f"{size}", *(f"k={k:+d}" for k in steps), "best lr", "fp8 at best"]
    tables = []
    for p in PARAMETRISATIONS:
        grid = dict(config.grid(p))
        rows = []
        chosen = final[final["parametrisation"] == p]
        for (width, depth), group in chosen.groupby(["width", "depth"], sort=True):
            fp32 = group[group["precision"] == "fp32"]
            b = best[(best.parametrisation == p) & (best.width == width) & (best.depth == depth)]
            k_best = b["lr_step"].iloc[0] if len(b) else math.nan
            cells = [str(width if size == "width" else depth)]
            for k in steps:
                value = fp32.loc[fp32["lr_step"] == k, "heldout_loss"]
                text = _loss_text(float(value.iloc[0])) if len(value) else ""
                cells.append(text + ("*" if k == k_best else " "))
            cells.append(f"{grid[int(k_best)]:g}" if math.isfinite(k_best) else "n/a")
            fp8 = group[group["precision"] == "fp8"]
            cells.append(_loss_text(float(fp8["heldout_loss"].iloc[0])) if len(fp8) else "")
            rows.append(cells)
        tables.append((f"{p}: final held-out loss at lr = {grid[0]:g} x 2^k", header, rows))
    return tables


def table_lines(final: pd.DataFrame, config: TransferConfig) -> list[str]:
    """:func:`sweep_tables` as text: a title line, then the columns right-aligned."""
    lines: list[str] = []
    for title, header, rows in sweep_tables(final, config):
        lines.append(title)
        widths_ = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths_, strict=True)))
        lines.append("")
    return lines


def _quick_note(config: TransferConfig) -> str:
    """The line that marks a quick run ("" for a full one)."""
    if not config.quick:
        return ""
    return (
        f"QUICK SMOKE RUN (--quick): {config.steps} steps, {len(config.lr_steps)} learning "
        "rates per size; it checks that the command works and is no evidence for the "
        "claims: none is reported held"
    )


def _header_lines(result: TransferResult) -> list[str]:
    """What was run: sizes, steps, batch, seed, the parametrisations (and a quick run's note)."""
    config = result.config
    (width,) = config.widths if config.vary == "depth" else (None,)
    (depth,) = config.depths if config.vary == "width" else (None,)
    fixed = f"depth {depth}" if width is None else f"width {width}"
    sizes = ", ".join(str(s) for s in (config.widths if width is None else config.depths))
    standard, mup = (_spec(p, config.model).description for p in PARAMETRISATIONS)
    lines = [
        f"unitscale transfer: learning-rate sweeps across {config.vary} ({sizes}; {fixed}), "
        f"model {config.model}, {config.steps} steps, batch {config.batch_size} x "
        f"{config.seq_len} bytes, seed {config.seed}",
        f"standard: {standard}; u-muP: {mup} (default lr {config.mup_lr:g}, every mult 1); "
        f"fp8: u-muP under simulate_fp8 ({config.fp8_recipe!r} recipe, no loss scaling) at "
        "its best lr",
    ]
    return [*lines, _quick_note(config)] if config.quick else lines


def _losses_note(config: TransferConfig) -> str:
    return (
        "losses: mean next-byte cross-entropy (nats) over "
        f"{config.eval_batches} fixed held-out batches after the last step; * best of the row; "
        "div.: diverged (non-finite loss)"
    )


def _time_note(result: TransferResult) -> str:
    load = ", ".join("n/a" if v is None else f"{v:.1f}" for v in result.load_average)
    return (
        f"time: {result.seconds:.0f}s for {len(result.runs)} runs on {result.config.threads} "
        f"thread(s) (1-minute load average before, after: {load})"
    )


def transfer_claims(result: TransferResult) -> list[Claim]:
    """:func:`evaluate_claims` of a sweep's runs (no claim held for a quick run)."""
    final = final_frame(runs_frame(result.runs))
    return evaluate_claims(final, quick=result.config.quick)


def summary_text(result: TransferResult) -> str:
    """What ``unitscale transfer`` prints: the settings, the loss table and the claims."""
    config = result.config
    final = final_frame(runs_frame(result.runs))
    lines = [
        *_header_lines(result),
        "",
        *table_lines(final, config),
        _losses_note(config),
        "",
    ]
    for claim in transfer_claims(result):
        lines.append(f"claim ({claim.number}) {claim.statement}: {claim.verdict}")
        lines.append(f"    {claim.detail}")
    lines += ["", _time_note(result)]
    return "\n".join(lines) + "\n"


def plot_transfer(final: pd.DataFrame, config: TransferConfig) -> Figure:
    """Final held-out loss against learning rate: one panel per parametrisation, one curve
    per size, each curve's optimum starred; u-μP's FP8 runs as crosses; the default learning
    rate (grid step 0) dotted."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    size = _size_column(final)
    best = best_points(final)
    fig = Figure(figsize=(11.0, 4.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PARAMETRISATIONS), sharey=True)
    values = sorted(final[size].unique())
    colours = colormaps["viridis"]([i / max(len(values) - 1, 1) * 0.9 for i in range(len(values))])
    finite = [float(v) for v in final["heldout_loss"] if math.isfinite(float(v))]
    for ax, p in zip(axes, PARAMETRISATIONS, strict=True):
        chosen = final[final["parametrisation"] == p]
        for colour, value in zip(colours, values, strict=True):
            runs = chosen[chosen[size] == value]
            fp32 = runs[runs["precision"] == "fp32"].sort_values("lr")
            ax.plot(fp32["lr"], fp32["heldout_loss"], "o-", color=colour, ms=4, lw=1.4,
                    label=f"{size} {value}")  # fmt: skip
            b = best[(best.parametrisation == p) & (best[size] == value)]
            if len(b) and math.isfinite(b["lr"].iloc[0]):
                ax.plot(b["lr"], b["heldout_loss"], "*", color=colour, ms=15, mec="black", mew=0.6)
            fp8 = runs[runs["precision"] == "fp8"]
            if len(fp8):
                ax.plot(fp8["lr"], fp8["heldout_loss"], "x", color=colour, ms=9, mew=2)
        ax.axvline(dict(config.grid(p))[0], color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("peak learning rate" + (" (base lr of every rule)" if p == "u-muP" else ""))
        title = _spec(p, config.model).description
        ax.set_title(title if p == "standard" else f"{title}; x: FP8 at best lr", fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("final held-out loss (nats per byte)")
    if finite:
        low, high = min(finite), min(max(finite), math.log(256))
        pad = 0.05 * (high - low) + 1e-3
        axes[0].set_ylim(low - pad, high + pad)
    axes[0].legend(fontsize=8, title="star: best; dotted: default / centre", title_fontsize=7)
    fig.suptitle(
        f"unitscale transfer (model {config.model}): {config.steps} steps, batch "
        f"{config.batch_size} x "
        f"{config.seq_len}, seed {config.seed}",
        fontsize=11,
    )
    fig.tight_layout()
    return fig


def write_transfer_csv(result: TransferResult, path: str | os.PathLike[str]) -> Path:
    """Write :func:`runs_frame` to ``path`` (6 decimals, ``\\n`` line ends); return it."""
    return report.write_csv(runs_frame(result.runs), path)


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def command_line(config: TransferConfig) -> str:
    """The ``unitscale transfer`` options that give ``config`` (without ``--out``).

    Example:
        >>> command_line(default_config("depth", model="hf:llama", seed=3))
        'unitscale transfer --vary depth --model hf:llama --seed 3'
    """
    parts = ["unitscale transfer"]
    if config.vary != "width":
        parts.append(f"--vary {config.vary}")
    if config.model != "builtin":
        parts.append(f"--model {config.model}")
    if config.quick:
        parts.append("--quick")
    base = default_config(config.vary, quick=config.quick)
    for name in ("widths", "depths", "steps", "seed", "threads"):
        value = getattr(config, name)
        if value != getattr(base, name):
            shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            parts.append(f"--{name} {shown}")
    if not config.fp8:
        parts.append("--no-fp8")
    return " ".join(parts)


def write_transfer_json(result: TransferResult, path: str | os.PathLike[str]) -> Path:
    """Write the settings, every run's final losses and seconds, the claims, the time and the
    load to ``path`` as JSON (the committed results README's table is generated from)."""
    document = {
        "command": command_line(result.config),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
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
            {"number": c.number, "statement": c.statement, "verdict": c.verdict, "detail": c.detail}
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
    claims = [(str(c.number), c.statement, c.verdict, c.detail) for c in transfer_claims(result)]
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
