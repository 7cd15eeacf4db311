"""Hyperparameter transfer across width (or depth): learning-rate sweeps, standard vs u-μP.

The library behind ``unitscale transfer``. :func:`run_transfer` trains a decoder of one
model family (:attr:`TransferConfig.model`) in two parametrisations, at every size of
:class:`TransferConfig` and every learning rate of a 2x grid, on the bundled text:

- ``standard``: the plain-PyTorch decoder (:class:`unitscale.models.PlainGPT` without a
  position embedding, GPT-2's layout and N(0, 0.02) initialisation), or for ``hf:llama`` a
  transformers Llama as transformers initialises it, with ``torch.optim.AdamW``;
- ``u-muP``: the library's default :class:`unitscale.TransformerDecoder` (the Llama-style
  block, RMSNorm and SwiGLU, of the committed results) with ``rope=False`` (the paper's
  scheme otherwise, every mult 1), or for ``hf:llama``
  :func:`~unitscale.transforms.unit_scale` of the same Llama, with
  :class:`unitscale.optim.AdamW` (per-parameter learning rates from the u-μP tags);

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
optimiser, the family and a short description (the centre of each parametrisation's
learning-rate grid is a configuration field, :data:`CENTRE_FIELDS`). The sweep, the
tables, the CSV, the figure and ``--model`` pick it up.

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

The package holds one idea per module: the configuration (``_config``), the parametrisations
and their models (``_models``), the records of a sweep (``_records``), the sweep itself
(``_sweep``), its tables (``_frames``), its claims (``_claims``), the printed summary
(``_summary``), the figure (``_plot``), the files (``_writers``) and sweeps loaded back
from them and combined across seeds (``_combine``). Every public name is
importable from here, as it was from the single module this package replaces.
"""

from __future__ import annotations

from ._claims import Claim, evaluate_claims
from ._combine import (
    OUTPUT_FILES,
    combine_results,
    load_transfer,
    rerun_fp8,
    write_transfer_outputs,
)
from ._config import (
    CENTRE_FIELDS,
    DEFAULT_CONFIG,
    DEFAULT_MUP_LR,
    DEFAULT_STANDARD_LR,
    DEPTH_RULES,
    MODELS,
    OPTIMIZERS,
    PARAMETRISATIONS,
    TransferConfig,
    TransferConfigError,
    default_config,
)
from ._config import HEAD_SIZE as HEAD_SIZE
from ._frames import (
    CSV_COLUMNS,
    best_points,
    final_frame,
    fp8_not_at_best,
    runs_frame,
    seed_mean,
)
from ._models import LLAMA_MLP_RATIO as LLAMA_MLP_RATIO
from ._models import (
    PARAMETRISATION_SPECS,
    Parametrisation,
    build_model,
    build_optimiser,
    describe,
)
from ._models import _llama_mup as _llama_mup
from ._plot import plot_transfer
from ._records import SweepInterrupted, TransferResult, TransferRun
from ._summary import summary_text, sweep_tables, table_lines, transfer_claims
from ._sweep import _eval_data as _eval_data
from ._sweep import _train_data as _train_data
from ._sweep import run_transfer, train_one
from ._writers import (
    command_line,
    write_effective_rates,
    write_transfer_csv,
    write_transfer_json,
    write_transfer_report,
)

__all__ = [  # noqa: RUF022 (grouped by kind)
    # errors
    "TransferConfigError",
    # configuration
    "Parametrisation",
    "PARAMETRISATION_SPECS",
    "PARAMETRISATIONS",
    "CENTRE_FIELDS",
    "MODELS",
    "OPTIMIZERS",
    "DEPTH_RULES",
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
    "describe",
    "train_one",
    "run_transfer",
    "SweepInterrupted",
    # tables and claims
    "CSV_COLUMNS",
    "Claim",
    "runs_frame",
    "final_frame",
    "best_points",
    "seed_mean",
    "fp8_not_at_best",
    "evaluate_claims",
    # presentation
    "sweep_tables",
    "table_lines",
    "transfer_claims",
    "summary_text",
    "plot_transfer",
    "write_transfer_csv",
    "write_effective_rates",
    "command_line",
    "write_transfer_json",
    "write_transfer_report",
    # sweeps loaded back and combined
    "OUTPUT_FILES",
    "load_transfer",
    "combine_results",
    "rerun_fp8",
    "write_transfer_outputs",
]
