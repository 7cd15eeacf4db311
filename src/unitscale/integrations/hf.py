"""Hugging Face ``Trainer`` integration: :class:`~unitscale.integrations.ScaleMonitorCallback`.

A ``transformers.TrainerCallback`` that runs a :class:`~unitscale.tracking.ScaleMonitor`
inside ``trainer.train()``: the scales of every tensor and gradient every ``every`` optimiser
steps, heatmaps and a CSV at the end, TensorBoard scalars while training (when tensorboard is
installed), and the first NaN/Inf located.

How it hooks in, and why:

- ``ScaleMonitor`` does not copy the model: ``monitor.module`` runs the model's own
  parameters, so the optimiser the Trainer already built keeps training them.
- The Trainer's loop calls a local reference to the model it prepared before
  ``on_train_begin`` (replacing ``trainer.model`` there would change nothing), so the callback
  routes the *model's* own calls instead: it sets an instance ``forward`` on the model that
  hands training calls (``model.training`` and grad mode on) to ``monitor.module``, and puts
  the original ``forward`` back while the monitor's capture runs, so what is captured is
  exactly what ``track_scales(model)`` captures. Evaluation and prediction calls go straight
  to the original ``forward``. ``on_train_end`` removes the instance ``forward`` (also when
  training stops on a NaN with ``on_non_finite="raise"``).
- ``ScaleMonitor.step()`` must run after ``backward()`` and before ``optimizer.step()``:
  the callback calls it in ``on_pre_optimizer_step`` (transformers 4.44 or later). Monitor
  step ``n`` is the optimiser step that takes ``state.global_step`` from
  ``first_step + n`` to ``first_step + n + 1`` (``first_step`` is 0 unless the run resumed
  from a checkpoint).
  With gradient accumulation, the last micro-batch of each step is the one recorded and
  replayed; parameter-gradient statistics are those of ``param.grad``, accumulated over the
  step's micro-batches (and clipped, when the Trainer clips: it does so before this event).
  A unit-scaled model under accumulation needs the settings of the "Gradient accumulation"
  section of the distributed-training guide (the Trainer otherwise divides its loss).

Design constraints: ``transformers`` is imported by this module only (``import unitscale``
and ``import unitscale.integrations`` do not import it); files are written by the main
process only (``state.is_world_process_zero``); nothing is downloaded.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from torch import nn
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..tracking import METRIC_NAMES, MonitorError, NonFiniteReport, ScaleMonitor
from ._errors import IntegrationError

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = ["ScaleMonitorCallback"]

OnNonFinite = Literal["warn", "raise", "ignore", "stop"]

_UNSET = object()

#: Arguments the ``Trainer`` adds to the model's call that are bookkeeping, not data: left
#: out of the callback's CSV and heatmaps.
TRAINER_ARGUMENTS: tuple[str, ...] = ("num_items_in_batch",)


class _ForwardRedirect:
    """An instance ``forward`` on ``model`` that sends its training calls to ``target``."""

    def __init__(self, model: nn.Module, target: Any) -> None:
        self.model = model
        self.previous = model.__dict__.get("forward", _UNSET)
        original = model.forward

        @functools.wraps(original)  # inspect.signature(model.forward) stays the model's own
        def forward(*args: Any, **kwargs: Any) -> Any:
            if not (model.training and torch.is_grad_enabled()):
                return original(*args, **kwargs)
            with self.original():
                return target(*args, **kwargs)

        self.redirect = forward
        model.__dict__["forward"] = forward

    def _put_back(self) -> None:
        if self.previous is _UNSET:
            self.model.__dict__.pop("forward", None)
        else:
            self.model.__dict__["forward"] = self.previous

    @contextmanager
    def original(self) -> Iterator[None]:
        """The model's own ``forward`` while the block runs (the monitor's capture, replay)."""
        self._put_back()
        try:
            yield
        finally:
            self.model.__dict__["forward"] = self.redirect

    def remove(self) -> None:
        if self.model.__dict__.get("forward") is self.redirect:
            self._put_back()


class ScaleMonitorCallback(TrainerCallback):
    """Run a :class:`~unitscale.tracking.ScaleMonitor` inside ``transformers.Trainer.train()``.

    Pass it to the Trainer (``Trainer(..., callbacks=[ScaleMonitorCallback(every=100)])``).
    While training, steps ``0, every, 2 * every, ...`` record the scale of every tensor and
    gradient of the model (as :func:`~unitscale.transforms.track_scales` would on that step),
    each is written to TensorBoard when tensorboard is installed, and every step is checked
    for NaN/Inf (the first one located as :class:`~unitscale.tracking.NonFiniteReport`). At
    the end of training it writes, to ``output_dir``, ``scales.csv`` (the long table of
    :meth:`ScaleMonitor.table <unitscale.tracking.ScaleMonitor.table>`) and a heatmap per
    metric in ``heatmaps`` and direction (``scales_<metric>_fwd.png``, ``..._bwd.png``).
    The file and the heatmaps show the model's tensors: the arguments the Trainer adds to the
    model's call (``TRAINER_ARGUMENTS`` of ``unitscale.integrations.hf``:
    ``num_items_in_batch``, the count the loss is divided by, is not data, and its "gradient"
    means nothing) are left out (:meth:`model_table`). The monitor stays available as
    :attr:`monitor` (``callback.monitor.table()``, every recorded tensor).

    Losses and gradients are those of the same run without the callback (the monitored
    module's outputs are bit-identical to the model's). The model is not copied; during
    training it has an instance ``forward`` that routes training calls through the monitor
    (see the module docstring), removed at the end.

    Args:
        every: record every ``every``-th optimiser step (a positive integer), or None to only
            check for NaN/Inf.
        output_dir: folder of the CSV, heatmaps and TensorBoard scalars (default: the
            ``unitscale-scales`` folder in the Trainer's ``args.output_dir``).
        save: write the CSV and heatmaps at the end of training (needs pandas and matplotlib).
        heatmaps: the metrics drawn as heatmaps (forward and backward each).
        metrics: the metrics kept (default: all of :data:`unitscale.tracking.METRIC_NAMES`).
        tensorboard: write each recorded step to ``<output_dir>/tensorboard`` while training:
            None (default) when the tensorboard package is installed, True always (an error
            without it), False never.
        tensorboard_metrics: the metrics written to TensorBoard.
        on_non_finite: on the first NaN/Inf: ``"warn"`` (a
            :class:`~unitscale.tracking.NonFiniteWarning`), ``"raise"`` (a
            :class:`~unitscale.tracking.NonFiniteError` out of ``trainer.train()``),
            ``"ignore"`` (only stored in :attr:`non_finite`), or ``"stop"`` (warn and stop
            training at the end of that step).
        check_finite: check for NaN/Inf every step.

    Raises:
        IntegrationError: transformers is older than 4.44, an argument is wrong, or (when
            training starts) the Trainer compiles the model (``torch_compile=True``).

    Example:
        >>> callback = ScaleMonitorCallback(every=50, heatmaps=("rms",))
        >>> callback.every, callback.monitor is None
        (50, True)

    Use it like any other callback::

        trainer = Trainer(model=model, args=args, train_dataset=data,
                          callbacks=[ScaleMonitorCallback(every=100)])
        trainer.train()   # writes <output_dir>/unitscale-scales/scales.csv, heatmaps, TensorBoard
    """

    def __init__(
        self,
        every: int | None = 100,
        *,
        output_dir: str | os.PathLike[str] | None = None,
        save: bool = True,
        heatmaps: Sequence[str] = ("rms",),
        metrics: Sequence[str] | None = None,
        tensorboard: bool | None = None,
        tensorboard_metrics: Sequence[str] = ("rms",),
        on_non_finite: OnNonFinite = "warn",
        check_finite: bool = True,
    ) -> None:
        if not hasattr(TrainerCallback, "on_pre_optimizer_step"):
            import transformers

            raise IntegrationError(
                "ScaleMonitorCallback needs transformers 4.44 or later (the "
                f"on_pre_optimizer_step event); found {transformers.__version__}: "
                "pip install -U transformers"
            )
        if on_non_finite not in ("warn", "raise", "ignore", "stop"):
            raise IntegrationError(
                f"ScaleMonitorCallback: on_non_finite={on_non_finite!r} must be 'warn', "
                "'raise', 'ignore' or 'stop'"
            )
        kept = tuple(METRIC_NAMES if metrics is None else metrics)
        for name, chosen in (("heatmaps", heatmaps), ("tensorboard_metrics", tensorboard_metrics)):
            missing = [m for m in chosen if m not in kept]
            if missing:
                raise IntegrationError(
                    f"ScaleMonitorCallback: {name}={list(chosen)!r}: {missing} not among the "
                    f"metrics kept ({list(kept)}); choose from {list(METRIC_NAMES)}"
                )
        bad_every = isinstance(every, bool) or not isinstance(every, int) or every < 1
        if every is not None and bad_every:
            raise IntegrationError(
                f"ScaleMonitorCallback: every={every!r} must be a positive integer or None"
            )
        self.every = every
        self.output_dir = None if output_dir is None else Path(output_dir)
        self.save = bool(save)
        self.heatmaps = tuple(heatmaps)
        self.metrics = kept
        self.tensorboard = tensorboard
        self.tensorboard_metrics = tuple(tensorboard_metrics)
        self.on_non_finite: OnNonFinite = on_non_finite
        self.check_finite = bool(check_finite)
        #: The :class:`~unitscale.tracking.ScaleMonitor` of the current or last training run
        #: (None before ``trainer.train()``).
        self.monitor: ScaleMonitor | None = None
        #: ``state.global_step`` when the current or last run began (monitor step 0).
        self.first_step = 0
        #: The files written at the end of the last training run.
        self.written: list[Path] = []
        self._redirect: _ForwardRedirect | None = None
        self._main_process = True

    @property
    def non_finite(self) -> NonFiniteReport | None:
        """The first NaN/Inf found in the current or last run, or None."""
        return None if self.monitor is None else self.monitor.non_finite

    def __repr__(self) -> str:
        return (
            f"ScaleMonitorCallback(every={self.every}, monitor="
            f"{self.monitor!r}, on_non_finite={self.on_non_finite!r})"
        )

    # -- Trainer events ----------------------------------------------------------------------
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Build the monitor on the Trainer's model and route its training calls through it."""
        if model is None:
            raise IntegrationError("ScaleMonitorCallback: the Trainer passed no model")
        if getattr(args, "torch_compile", False):
            raise IntegrationError(
                "ScaleMonitorCallback: the Trainer compiles the model (torch_compile=True), "
                "whose statistics cannot be recorded; train with torch_compile=False while "
                "monitoring"
            )
        self.close()
        self.first_step = int(getattr(state, "global_step", 0) or 0)
        self._main_process = bool(getattr(state, "is_world_process_zero", True))
        out = self._out(args)
        sink: Any = None
        try:
            if self._main_process and self._tensorboard_wanted():
                from ..analysis import tensorboard_sink

                sink = tensorboard_sink(out / "tensorboard", self.tensorboard_metrics)
            self.monitor = ScaleMonitor(
                model,
                self.every,
                metrics=self.metrics,
                on_non_finite="ignore",  # reported here, with the Trainer's step
                check_finite=self.check_finite,
                on_record=sink,
            )
        except MonitorError as error:
            raise IntegrationError(f"ScaleMonitorCallback: {error}") from error
        self.written = []
        self._redirect = _ForwardRedirect(model, self.monitor.module)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """End the monitor's step: after the backward pass, before ``optimizer.step()``."""
        if self.monitor is None or self._redirect is None:
            return
        with self._redirect.original():  # a replay runs the model's own forward
            report = self.monitor.step()
        if report is None or self.on_non_finite == "ignore":
            return
        message = f"ScaleMonitorCallback (optimiser step {state.global_step + 1}): {report}"
        if self.on_non_finite == "raise":
            self.close()
            from ..tracking import NonFiniteError

            raise NonFiniteError(report)
        from ..tracking import NonFiniteWarning

        warnings.warn(message, NonFiniteWarning, stacklevel=2)
        if self.on_non_finite == "stop":
            control.should_training_stop = True

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Restore the model's ``forward``; write the CSV and heatmaps (main process only)."""
        self.close()
        monitor = self.monitor
        if monitor is None or not self.save or not self._main_process:
            return
        if not monitor.recorded_steps:
            return
        from ..analysis import scale_heatmap

        out = self._out(args)
        table = self.model_table()
        out.mkdir(parents=True, exist_ok=True)
        table.to_csv(out / "scales.csv", index=False, lineterminator="\n")
        self.written.append(out / "scales.csv")
        for metric in self.heatmaps:
            for direction, what in (("fwd", "values"), ("bwd", "gradients")):
                try:
                    title = f"{metric} of tensor {what}"
                    ax = scale_heatmap(table, metric, direction, title=title)
                except MonitorError:  # no records in that direction (e.g. forward-only)
                    continue
                figure = cast("Figure", ax.figure)
                path = out / f"scales_{metric}_{direction}.png"
                figure.savefig(path, dpi=100, metadata={"Software": None})
                self.written.append(path)
                import matplotlib.pyplot as plt

                plt.close(figure)

    def model_table(self) -> pd.DataFrame:
        """The monitor's table without the Trainer's own arguments (``TRAINER_ARGUMENTS``):
        what the CSV and heatmaps show.

        Raises:
            IntegrationError: before training started (no monitor yet).
        """
        if self.monitor is None:
            raise IntegrationError("ScaleMonitorCallback.model_table: call trainer.train() first")
        table = self.monitor.table()
        trainer_input = (table["op"] == "input") & table["tensor"].isin(TRAINER_ARGUMENTS)
        return table[~trainer_input].reset_index(drop=True)

    # -- helpers -------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the instance ``forward`` from the model and flush TensorBoard (idempotent)."""
        if self._redirect is not None:
            self._redirect.remove()
            self._redirect = None
        if self.monitor is not None:
            self.monitor.close()

    def _out(self, args: TrainingArguments) -> Path:
        if self.output_dir is not None:
            return self.output_dir
        return Path(getattr(args, "output_dir", None) or "trainer_output") / "unitscale-scales"

    def _tensorboard_wanted(self) -> bool:
        from ..analysis import tensorboard_available

        if self.tensorboard is None:
            return tensorboard_available()
        if self.tensorboard and not tensorboard_available():
            raise IntegrationError(
                "ScaleMonitorCallback(tensorboard=True) needs the tensorboard package: "
                "pip install tensorboard (or pass tensorboard=None to write it only when "
                "installed)"
            )
        return bool(self.tensorboard)
