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
- ``plain-fp8-rowwise`` (``--runs`` adds it): the same with ``scaling="rowwise"``, exactly
  torchao's rowwise recipe (torchtitan's float8 choice; tested against
  ``convert_to_float8_training`` with ``Float8LinearConfig.from_recipe_name("rowwise")``);
- ``plain-fp8-tensorwise-real``, ``plain-fp8-rowwise-real`` and ``unit-scaled-fp8-real``
  (``--runs`` adds them): the scaled baselines and the unit-scaled FP8 run in real FP8
  (``unitscale.transforms.to_fp8``: float8 GEMMs), for an accelerator; on a CPU their losses
  equal the simulated runs';
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

The code lives in modules of one idea each, all re-exported here: the run kinds and the
configuration (``_train_config.py``), the training loop (``_train_loop.py``), the loss curves
(``_train_plots.py``) and the summaries and report (``_train_summary.py``).
"""

from __future__ import annotations

# Also re-exported outside __all__, as before the split (tests and benchmarks read them here):
# _eval_batches, _line_style, fp8_gaps, fp16_gaps, scaled_fp8_gaps, summary_rows, GPTConfig
# and plain_gpt (the noqa: F401 below).
from ._train_config import (
    DEFAULT_RUNS,
    FP8_OPS,
    FP16_CAST,
    MONITOR_METRICS,
    RUN_KINDS,
    RUN_NAMES,
    RunKind,
    TrainConfig,
    TrainConfigError,
)
from ._train_loop import (
    RunInterrupted,
    RunResult,
    _eval_batches,  # noqa: F401
    build_optimiser,
    build_run_model,
    train_run,
    train_runs,
    unit_scaled_model,
    write_effective_rates,
)
from ._train_plots import (
    _line_style,  # noqa: F401
    plot_losses,
    zoom_limits,
)
from ._train_summary import (  # noqa: F401
    every_seed_text,
    fp8_gaps,
    fp16_gaps,
    losses_frame,
    scaled_fp8_gaps,
    seed_stats,
    seeds_document,
    seeds_summary_text,
    summary_rows,
    summary_text,
    write_losses_csv,
    write_seeds_json,
    write_train_report,
)
from .models import GPTConfig, plain_gpt  # noqa: F401

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
    "RunInterrupted",
    "build_run_model",
    "build_optimiser",
    "unit_scaled_model",
    "FP16_CAST",
    "train_run",
    "train_runs",
    # presentation
    "losses_frame",
    "seed_stats",
    "every_seed_text",
    "seeds_document",
    "seeds_summary_text",
    "write_seeds_json",
    "plot_losses",
    "zoom_limits",
    "summary_text",
    "write_losses_csv",
    "write_effective_rates",
    "write_train_report",
]
