"""What a sweep produces: one :class:`TransferRun` per training run, a :class:`TransferResult`
per sweep."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ._config import TransferConfig


@dataclass
class TransferRun:
    """One training run of a sweep.

    Attributes:
        parametrisation: ``"standard"`` or ``"u-muP"``.
        precision: ``"fp32"`` or ``"fp8"`` (simulated).
        width, depth: the model's size.
        lr_step: its grid step ``k`` (learning rate ``centre * 2**k``).
        lr: its peak learning rate (u-μP: the base rate each parameter's rule scales).
        seed: the seed of its weights, data order and evaluation sample.
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
    seed: int = 0
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
        runs: every run: the FP32 sweep of each seed in turn, then the FP8 runs.
        seconds: wall time of the whole sweep.
        load_average: the 1-minute load average before and after (None where unknown).
        date: when the sweep ran (``transfer.json``'s UTC ``date``), kept by a sweep loaded
            back (:func:`load_transfer`); empty for a new one (the writer takes the time).
    """

    config: TransferConfig
    runs: list[TransferRun]
    seconds: float = 0.0
    load_average: tuple[float | None, float | None] = (None, None)
    date: str = ""


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep, carrying the runs that completed before it.

    A :class:`KeyboardInterrupt`, so code that stops on Ctrl-C still stops; ``unitscale
    transfer`` keeps ``partial`` (its completed runs) in ``transfer.csv`` and says in
    ``summary.txt`` where the sweep stopped.

    Attributes:
        partial: the sweep so far: the runs that completed, its wall time until the interrupt.
        planned: how many runs the whole sweep would have trained (the FP8 runs included).
    """

    def __init__(self, partial: TransferResult, planned: int) -> None:
        super().__init__(f"sweep interrupted after {len(partial.runs)} of {planned} run(s)")
        self.partial = partial
        self.planned = planned
