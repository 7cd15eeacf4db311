"""Watch tensor scales during an ordinary training loop, and catch the first NaN or Inf.

:class:`ScaleMonitor` wraps a model for scale tracking (:func:`unitscale.transforms.track_scales`)
without copying it: ``monitor.module`` trains the model's own parameters, so the optimiser the
user already has keeps working. Every ``every`` steps the tracked call records the statistics
of every tensor, forward and backward, into a long table (``step, tensor, direction, metric,
value``); on the other steps recording is switched off (``TrackScalesPass.enabled``) and the
module runs at nearly untracked speed.

Each step the monitor also checks, with one host synchronisation, that the module's output (or
the loss passed to :meth:`ScaleMonitor.step`) and every parameter gradient are finite. The
first time they are not, it replays that step's forward and backward with recording on (same
inputs, same RNG state, same incoming gradient, same weights) and names the first tensor that
held a NaN or Inf in execution order: forward values first, then gradients in backward order.

Design constraints:

- the monitor never copies or changes the user's model; it keeps, per step, only references
  to the inputs, the RNG state, the outputs and the output gradients (dropped at ``step()``);
- nothing is copied to the host on steps that do not record, except the one finiteness flag;
- the records come from :func:`~unitscale.tracking.records.graph_records`, the same as
  ``graph_to_dataframe`` of ``track_scales`` on the same step (:mod:`._monitor_table`); the
  non-finite localisation is :mod:`._nonfinite`. pandas is imported where it is used.
- the monitor only collects: it returns its table (:meth:`ScaleMonitor.table`) and its
  records (:attr:`ScaleMonitor.records`), and hands each recorded step to ``on_record``
  receivers. Presentation is :mod:`unitscale.analysis`, a later layer, which
  :mod:`unitscale.tracking` does not import: ``scale_heatmap(monitor.table())``,
  ``write_tensorboard(monitor.records, folder)``, ``on_record=tensorboard_sink(folder)``.
  (The earlier methods ``heatmap()`` and ``write_tensorboard()`` and the ``tensorboard=``
  argument, which reached up into :mod:`unitscale.analysis`, are removed: see CHANGELOG.md.)
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.fx as fx
from torch import Tensor, nn

from .._lazy_dynamo import is_optimized_module
from ..capture import GraphPass, Stage, TransformedModule, iter_tensors
from ..errors import MonitorError
from . import _distributed
from ._monitor_table import LONG_COLUMNS, MonitorRecord, long_table, step_records
from ._nonfinite import NonFiniteError, NonFiniteReport, NonFiniteWarning, _first_non_finite
from ._recording._pass import TrackScalesPass
from .records import METRIC_NAMES

if TYPE_CHECKING:
    import pandas as pd

__all__ = [  # noqa: RUF022 (grouped by kind)
    # errors and warnings
    "MonitorError",
    "NonFiniteError",
    "NonFiniteWarning",
    # records
    "LONG_COLUMNS",
    "MonitorRecord",
    "NonFiniteReport",
    # the monitor
    "ScaleMonitor",
]

OnNonFinite = Literal["warn", "raise", "ignore"]


class _MonitoredModule(TransformedModule):
    """The tracked module of a :class:`ScaleMonitor`: tells the monitor about each call.

    A :class:`~unitscale.capture.TransformedModule` (same passes as ``track_scales``, so the
    same capture, including the eager fallback), whose ``forward`` also hands the monitor the
    call's inputs and outputs. A deep copy or an unpickled copy is not monitored.
    """

    def __init__(self, module: nn.Module, passes: Sequence[GraphPass]) -> None:
        super().__init__(module, passes)
        self._monitor: weakref.ReferenceType[ScaleMonitor] | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        monitor = None if self._monitor is None else self._monitor()
        if monitor is not None:
            monitor._before_call(args, kwargs)
        output = super().forward(*args, **kwargs)
        if monitor is not None:
            monitor._after_call(output)
        return output

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_monitor"] = None
        return state


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MonitorError(f"ScaleMonitor: {name}={value!r} must be a positive integer")
    return value


class ScaleMonitor:
    """Record tensor scales every ``every`` steps of a training loop; catch the first NaN/Inf.

    Use ``monitor.module`` in place of the model in the training step (it shares the model's
    parameters: the optimiser of ``model.parameters()`` keeps working), then call
    :meth:`step` after ``backward()`` and before ``optimizer.step()``::

        monitor = ScaleMonitor(model, every=100)
        for batch in data:
            loss = monitor.module(**batch)
            loss.backward()
            monitor.step()
            optimizer.step()
            optimizer.zero_grad()
        table = monitor.table()   # long DataFrame: step, tensor, direction, metric, value, ...
        unitscale.analysis.scale_heatmap(table, "rms").figure.savefig("scales.png")

    Steps are counted from 0 by :meth:`step`; steps ``0, every, 2 * every, ...`` are recorded
    (all of them with ``every=1``). On the other steps the tracked module runs without
    computing any statistic. Call ``monitor.module`` once per step (the last call before
    :meth:`step` is the one recorded and checked).

    Every step, unless ``check_finite=False``, the output of ``monitor.module`` (or the
    ``loss`` given to :meth:`step`) and every parameter gradient are checked for NaN and Inf
    (one host synchronisation). The first time one is not finite, the step is replayed with
    recording on to find the first non-finite tensor (see :class:`NonFiniteReport`); the
    report is stored in :attr:`non_finite`, returned by :meth:`step`, and, by
    ``on_non_finite``, given as a :class:`NonFiniteWarning` (default), raised as a
    :class:`NonFiniteError`, or only stored (``"ignore"``).

    Args:
        model: the model to watch: a ``torch.nn.Module``, or one returned by
            ``unit_scale``/``simulate_format``/``simulate_fp8`` (not ``compile``, not
            ``track_scales``). It is not copied.
        every: record every ``every``-th step (a positive integer), or None to only check
            for non-finite values.
        metrics: the metrics kept in the table (default: all of
            :data:`unitscale.tracking.METRIC_NAMES`).
        on_non_finite: ``"warn"``, ``"raise"`` or ``"ignore"``.
        check_finite: check for NaN/Inf every step (and replay the first bad step).
        on_record: called with the :class:`~unitscale.tracking.MonitorRecord` list of each
            recorded step as it is recorded, on the process that writes files (rank 0 under
            ``torch.distributed``; the records are global): e.g.
            ``unitscale.analysis.tensorboard_sink("runs/scales")`` writes TensorBoard
            scalars while training.

    Raises:
        MonitorError: for a model that cannot be monitored or a bad argument.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> monitor = ScaleMonitor(model, every=2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> for _ in range(3):
        ...     monitor.module(torch.randn(4, 8)).pow(2).mean().backward()
        ...     _ = monitor.step()
        ...     opt.step(); opt.zero_grad()
        >>> sorted(set(monitor.table()["step"]))
        [0, 2]
    """

    def __init__(
        self,
        model: nn.Module,
        every: int | None = 100,
        *,
        metrics: Sequence[str] | None = None,
        on_non_finite: OnNonFinite = "warn",
        check_finite: bool = True,
        on_record: Callable[[list[MonitorRecord]], Any] | None = None,
    ) -> None:
        self.every = None if every is None else _positive_int("every", every)
        if on_non_finite not in ("warn", "raise", "ignore"):
            raise MonitorError(
                f"ScaleMonitor: on_non_finite={on_non_finite!r} must be 'warn', 'raise' or 'ignore'"
            )
        self.on_non_finite: OnNonFinite = on_non_finite
        self.check_finite = bool(check_finite)
        self.metrics: tuple[str, ...] = tuple(METRIC_NAMES if metrics is None else metrics)
        unknown = [m for m in self.metrics if m not in METRIC_NAMES]
        if unknown or not self.metrics:
            raise MonitorError(
                f"ScaleMonitor: metrics={list(self.metrics)!r}: unknown metric(s) {unknown}; "
                f"choose from {list(METRIC_NAMES)}"
            )
        self.module: _MonitoredModule = self._wrap(model)
        self.module._monitor = weakref.ref(self)
        self._track: TrackScalesPass = self.module.passes[-1]  # type: ignore[assignment]
        if on_record is not None and not callable(on_record):
            raise MonitorError(
                f"ScaleMonitor: on_record={on_record!r} must be callable (it is called with "
                "each recorded step's list of MonitorRecord)"
            )
        self._sinks: list[Callable[[list[MonitorRecord]], Any]] = []
        if on_record is not None:
            self._sinks.append(on_record)
        #: The first non-finite value found, or None.
        self.non_finite: NonFiniteReport | None = None
        self._step = 0
        self._records: list[MonitorRecord] = []
        self._table: pd.DataFrame | None = None
        self._mutated_buffers: set[int] = set()  # ids of buffers the last call changed
        self._forget_call()
        self._track.enabled = self.recording

    # -- construction ------------------------------------------------------------------------
    @staticmethod
    def _wrap(model: nn.Module) -> _MonitoredModule:
        if is_optimized_module(model):
            raise MonitorError(
                "ScaleMonitor: the model is torch.compile'd; pass the original module "
                "(model._orig_mod): tracked code cannot run compiled"
            )
        if not isinstance(model, nn.Module):
            raise MonitorError(
                f"ScaleMonitor: expected a torch.nn.Module, got {type(model).__name__}"
            )
        inner, passes = (
            (model.module, model.passes) if isinstance(model, TransformedModule) else (model, ())
        )
        if passes and passes[-1].stage is Stage.COMPILE:
            raise MonitorError(
                "ScaleMonitor: the model is compiled by unitscale.transforms.compile, whose "
                "statistics cannot be recorded; monitor the chain without compile, e.g. "
                "ScaleMonitor(simulate_fp8(unit_scale(model)))"
            )
        if any(p.stage is Stage.TRACK for p in passes):
            raise MonitorError(
                "ScaleMonitor: the model is already tracked (track_scales or another "
                "ScaleMonitor); pass the untracked model"
            )
        # No copy: the monitored module runs the user's own parameters. The earlier passes
        # (unit_scale, simulate_format) are configuration and are applied again, fresh.
        chain = (*(p.without_state() for p in passes), TrackScalesPass())
        return _MonitoredModule(inner, chain)

    # -- state --------------------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """The step the next call of ``monitor.module`` belongs to (number of ``step()`` calls)."""
        return self._step

    @property
    def recording(self) -> bool:
        """Whether the current step (:attr:`step_count`) records statistics."""
        return self.every is not None and self._step % self.every == 0

    @property
    def records(self) -> tuple[MonitorRecord, ...]:
        """The records so far, in the order recorded.

        The rows of :meth:`table` before it is laid out long: one per step, tensor and
        direction, with the kept metrics in ``metrics``.
        """
        return tuple(self._records)

    @property
    def recorded_steps(self) -> list[int]:
        """The steps recorded so far, in order."""
        return sorted({r.step for r in self._records})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call ``monitor.module`` (shorthand)."""
        return self.module(*args, **kwargs)

    def __repr__(self) -> str:
        return (
            f"ScaleMonitor(every={self.every}, step={self._step}, recorded="
            f"{len(self.recorded_steps)}, non_finite={self.non_finite is not None})"
        )

    # -- per call (from _MonitoredModule) ---------------------------------------------------------
    def _forget_call(self) -> None:
        self._called = False
        self._args: tuple[Any, ...] | None = None
        self._kwargs: dict[str, Any] = {}
        self._rng: dict[str, Tensor] = {}
        self._outputs: list[Tensor] = []
        self._output_grads: dict[int, Tensor] = {}
        self._versions: list[int] = []
        self._buffer_versions: list[tuple[Tensor, int]] = []
        self._saved_buffers: list[tuple[Tensor, Tensor]] = []
        self._replaying = False

    def _parameters(self) -> list[Tensor]:
        return [p for p in self.module.module.parameters() if p.requires_grad]

    def _before_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._replaying:
            return
        self._called = True
        self._outputs = []
        self._output_grads = {}
        if not self.check_finite:
            return
        # What an exact replay needs: the inputs, the RNG state and the weights' versions.
        self._args, self._kwargs = args, dict(kwargs)
        self._rng = {"cpu": torch.get_rng_state()}
        params = self._parameters()
        for device in {p.device for p in params if p.device.type == "cuda"}:
            self._rng[str(device)] = torch.cuda.get_rng_state(device)
        self._versions = [p._version for p in params]
        # Buffers the forward changed on the last call (running statistics) are saved, so that
        # a replay starts from this step's values; other buffers are not copied every step.
        buffers = [b for b in self.module.module.buffers() if not b.is_inference()]
        self._saved_buffers = [
            (b, b.detach().clone()) for b in buffers if id(b) in self._mutated_buffers
        ]
        self._buffer_versions = [(b, b._version) for b in buffers]

    def _after_call(self, output: Any) -> None:
        if self._replaying or not self.check_finite:
            return
        self._mutated_buffers = {id(b) for b, v in self._buffer_versions if b._version != v}
        self._outputs = [t for t in iter_tensors(output) if t.is_floating_point()]
        for i, tensor in enumerate(self._outputs):
            if tensor.requires_grad:
                tensor.register_hook(self._output_grad_hook(i))

    def _output_grad_hook(self, index: int) -> Any:
        def hook(grad: Tensor) -> None:
            self._output_grads[index] = grad

        return hook

    # -- per step ------------------------------------------------------------------------------
    def step(self, loss: Tensor | None = None) -> NonFiniteReport | None:
        """End the current training step: collect its records, check for NaN/Inf.

        Call it after ``loss.backward()`` and before ``optimizer.step()`` (the replay that
        locates a NaN needs the weights the step ran with).

        Args:
            loss: the loss, when it is computed outside ``monitor.module`` (checked for
                finiteness instead of the module's output).

        Returns:
            The :class:`NonFiniteReport` when this step is the first with a NaN or Inf,
            otherwise None.

        Raises:
            MonitorError: ``monitor.module`` was not called since the last step, or the
                weights changed since the call (``optimizer.step()`` came first).
            NonFiniteError: with ``on_non_finite="raise"``, on the first non-finite step.
        """
        if not self._called:
            raise MonitorError(
                f"ScaleMonitor.step: monitor.module was not called during step {self._step}; "
                "call monitor.module(...) (not the original model) in each training step, then "
                "loss.backward(), then monitor.step()"
            )
        step = self._step
        report: NonFiniteReport | None = None
        try:
            graph = self.module.scales_graph() if self.recording else None
            if graph is not None:
                self._collect(step, graph)
            if self.check_finite and self.non_finite is None:
                self._check_weights_unchanged()
                trigger = self._non_finite_trigger(loss)
                if graph is not None:
                    # A recorded step needs no replay, and also shows a NaN/Inf that never
                    # reaches the loss or a weight gradient (e.g. masked by a ReLU's backward).
                    found = _first_non_finite(graph, step, trigger or "tracked tensor")
                    report = found if found.tensor is not None else None
                if report is None and trigger:
                    report = self._locate(step, trigger)
                self.non_finite = report
        finally:
            self._track.release_hooks()
            self._step += 1
            self._track.enabled = self.recording
            self._forget_call()
        if report is not None:
            if self.on_non_finite == "raise":
                raise NonFiniteError(report)
            if self.on_non_finite == "warn":
                warnings.warn(f"ScaleMonitor: {report.message}", NonFiniteWarning, stacklevel=2)
        return report

    def _collect(self, step: int, graph: fx.Graph) -> None:
        new = step_records(graph, step, self.metrics)
        if not new:
            return
        self._records.extend(new)
        self._table = None
        if _distributed.writes_files():
            for sink in self._sinks:
                sink(new)

    def _check_weights_unchanged(self) -> None:
        versions = [p._version for p in self._parameters()]
        if self._versions and versions != self._versions:
            raise MonitorError(
                "ScaleMonitor.step: the weights changed since monitor.module was called "
                "(optimizer.step() ran first); call monitor.step() after loss.backward() and "
                "before optimizer.step(), so that a NaN can be located by replaying the step"
            )

    def _non_finite_trigger(self, loss: Tensor | None) -> str:
        watched = [loss.detach()] if loss is not None else [t.detach() for t in self._outputs]
        grads = [p.grad for p in self._parameters() if p.grad is not None]
        flags: dict[torch.device, list[Tensor]] = {}
        kinds: dict[torch.device, list[str]] = {}
        for kind, tensors in (("loss", watched), ("gradients", grads)):
            for tensor in tensors:
                if tensor.is_floating_point() and tensor.numel():
                    flags.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
                    kinds.setdefault(tensor.device, []).append(kind)
        bad: list[str] = []
        for device, device_flags in flags.items():
            # One blocking copy per device and step: it waits for the flags to be computed
            # (a non-blocking copy to the host could be read before it lands: stale flags).
            ok = torch.stack(device_flags).to("cpu").tolist()
            bad += [k for k, good in zip(kinds[device], ok, strict=True) if not good]
        return " and ".join(k for k in ("loss", "gradients") if k in bad)

    def _locate(self, step: int, trigger: str) -> NonFiniteReport:
        try:
            graph = self._replay()
        except Exception as error:  # the report must not hide the user's own error
            return NonFiniteReport(
                step, trigger, note=f"replaying the step failed ({type(error).__name__}: {error})"
            )
        return _first_non_finite(graph, step, trigger)

    def _replay(self) -> fx.Graph:
        """Run the step's forward and backward again with recording on; return its graph."""
        if self._args is None:
            raise MonitorError("no call to replay")
        params = self._parameters()
        saved_grads = [p.grad for p in params]
        # The step's results (e.g. BatchNorm's running statistics) stay as the step left them:
        # the replay starts from the values the step started from and its updates are undone.
        step_buffers = [(b, b.detach().clone()) for b, _ in self._buffer_versions]
        devices = [torch.device(k) for k in self._rng if k != "cpu"]
        self._replaying = True
        self._track.enabled = True
        try:
            with torch.no_grad():
                for buffer, start in self._saved_buffers:
                    buffer.copy_(start)
            with torch.random.fork_rng(devices=devices, enabled=True):
                torch.set_rng_state(self._rng["cpu"])
                for device in devices:
                    torch.cuda.set_rng_state(self._rng[str(device)], device)
                for p in params:
                    p.grad = None
                with torch.enable_grad():
                    output = self.module(*self._args, **self._kwargs)
                    outputs = [t for t in iter_tensors(output) if t.is_floating_point()]
                    pairs = [
                        (t, self._output_grads[i])
                        for i, t in enumerate(outputs)
                        if t.requires_grad and i in self._output_grads
                    ]
                    if pairs:
                        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        finally:
            for p, grad in zip(params, saved_grads, strict=True):
                p.grad = grad
            with torch.no_grad():
                for buffer, result in step_buffers:
                    buffer.copy_(result)
            self._replaying = False
        return self.module.scales_graph()

    # -- results -------------------------------------------------------------------------------
    def table(self) -> pd.DataFrame:
        """The recorded scales as a long table, one row per step, tensor, direction and metric.

        Columns (:data:`LONG_COLUMNS`): ``step``, ``tensor`` (clean name, as in
        ``track_scales``), ``direction`` (``"fwd"``/``"bwd"``), ``metric``, ``value``,
        ``module``, ``op``, ``tensor_type`` (``x``, ``w``, ``grad_x``, ``grad_w``), ``label``
        (readable, as in :func:`unitscale.analysis.plot`), ``row`` (display order: graph order
        with each parameter just before its first use) and ``same_scale`` (True where the
        tensor has the same scale as its single input in both directions, e.g. a view).

        Raises:
            MonitorError: when pandas is not installed.
        """
        if self._table is None:
            self._table = long_table(self._records)
        return self._table.copy()

    def to_csv(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`table` to a CSV file (floats in full precision); return the path.

        Under ``torch.distributed`` only rank 0 writes (every rank holds the same global
        table); the others return the path without writing.
        """
        out = Path(path)
        if not _distributed.writes_files():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.table().to_csv(out, index=False, lineterminator="\n")
        return out

    def close(self) -> None:
        """Flush each ``on_record`` receiver that has a ``flush()`` (a TensorBoard writer)."""
        for sink in self._sinks:
            flush = getattr(sink, "flush", None)
            if callable(flush):
                flush()
