"""``unitscale.training``: the name the README and docs/api/training.rst use for
``unitscale.experiments.training`` (where the code lives)."""

from .experiments.training import (
    DEFAULT_RUNS,
    MONITOR_METRICS,
    RUN_KINDS,
    RUN_NAMES,
    RunInterrupted,
    RunKind,
    RunResult,
    TrainConfig,
    TrainConfigError,
    build_run_model,
    losses_frame,
    plot_losses,
    summary_text,
    train_run,
    train_runs,
    write_losses_csv,
    write_train_report,
    zoom_limits,
)

__all__ = [
    "DEFAULT_RUNS",
    "MONITOR_METRICS",
    "RUN_KINDS",
    "RUN_NAMES",
    "RunInterrupted",
    "RunKind",
    "RunResult",
    "TrainConfig",
    "TrainConfigError",
    "build_run_model",
    "losses_frame",
    "plot_losses",
    "summary_text",
    "train_run",
    "train_runs",
    "write_losses_csv",
    "write_train_report",
    "zoom_limits",
]
