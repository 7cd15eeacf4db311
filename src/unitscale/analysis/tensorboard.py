"""TensorBoard export of ``ScaleMonitor`` records (``torch.utils.tensorboard`` imported on use).

:mod:`unitscale.tracking` collects the records (:attr:`ScaleMonitor.records
<unitscale.tracking.ScaleMonitor.records>`); this module writes them:
:func:`write_tensorboard` after training, :func:`tensorboard_sink` while training (as the
monitor's ``on_record``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import MonitorError

if TYPE_CHECKING:
    from ..tracking import MonitorRecord

__all__ = [
    "TensorBoardSink",
    "summary_writer",
    "tensorboard_available",
    "tensorboard_sink",
    "write_scalars",
    "write_tensorboard",
]


def summary_writer(log_dir: str | os.PathLike[str]) -> Any:
    """A ``SummaryWriter`` on ``log_dir``.

    Raises:
        MonitorError: the tensorboard package is not installed.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ModuleNotFoundError as error:  # torch's module imports the tensorboard package
        raise MonitorError(
            f"ScaleMonitor: writing TensorBoard scalars to {str(log_dir)!r} needs the "
            "tensorboard package: pip install tensorboard (or pass any writer object with "
            "add_scalar)"
        ) from error
    return SummaryWriter(log_dir=str(log_dir))


def tensorboard_available() -> bool:
    """True when ``torch.utils.tensorboard`` (the ``tensorboard`` package) can be imported."""
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def write_scalars(writer: Any, records: Iterable[MonitorRecord], metrics: Sequence[str]) -> None:
    """Write ``metrics`` of each record as ``<metric>/<direction>/<label>`` at its step."""
    for r in records:
        for metric in metrics:
            value = r.metrics.get(metric)
            if value is not None:
                writer.add_scalar(f"{metric}/{r.direction}/{r.label}", float(value), r.step)
    if hasattr(writer, "flush"):
        writer.flush()


def _check_metrics(records: Sequence[MonitorRecord], metrics: Sequence[str], where: str) -> None:
    if not records:
        return
    kept = records[0].metrics
    missing = [m for m in metrics if m not in kept]
    if missing:
        raise MonitorError(
            f"{where}: metric(s) {missing} were not kept by the monitor (kept: {list(kept)}); "
            "add them to ScaleMonitor(metrics=...)"
        )


def write_tensorboard(
    records: Iterable[MonitorRecord],
    writer: str | os.PathLike[str] | Any,
    metrics: Sequence[str] = ("mean_abs",),
) -> None:
    """Write every record to TensorBoard as scalars ``<metric>/<direction>/<label>``.

    Under ``torch.distributed`` call it on one rank (the records are the same on all).

    Args:
        records: :attr:`ScaleMonitor.records <unitscale.tracking.ScaleMonitor.records>`.
        writer: a log folder (needs the ``tensorboard`` package; opened and closed here) or
            an object with ``add_scalar(tag, value, global_step)``.
        metrics: the metrics written.

    Raises:
        MonitorError: tensorboard is not installed (for a folder), or a metric was not kept.

    Example:
        >>> from unitscale.tracking import MonitorRecord
        >>> class Writer:
        ...     def add_scalar(self, tag, value, step): print(tag, value, step)
        >>> record = MonitorRecord(0, "x", "fwd", "", "input", "x", "x", 0, False, {"rms": 1.5})
        >>> write_tensorboard([record], Writer(), metrics=["rms"])
        rms/fwd/x 1.5 0
    """
    chosen = list(records)
    _check_metrics(chosen, metrics, "write_tensorboard")
    target = writer if hasattr(writer, "add_scalar") else summary_writer(writer)
    write_scalars(target, chosen, metrics)
    if target is not writer and hasattr(target, "close"):
        target.close()


class TensorBoardSink:
    """Writes each recorded step as it comes (a ``ScaleMonitor``'s ``on_record``)."""

    def __init__(self, writer: Any, metrics: Sequence[str]) -> None:
        self.writer = writer
        self.metrics = tuple(metrics)

    def __call__(self, records: Sequence[MonitorRecord]) -> None:
        _check_metrics(records, self.metrics, "tensorboard_sink")
        write_scalars(self.writer, records, self.metrics)

    def flush(self) -> None:
        """Flush the writer (when it can)."""
        if hasattr(self.writer, "flush"):
            self.writer.flush()

    def __repr__(self) -> str:
        return f"TensorBoardSink({self.writer!r}, metrics={list(self.metrics)})"


def tensorboard_sink(
    writer: str | os.PathLike[str] | Any, metrics: Sequence[str] = ("mean_abs",)
) -> TensorBoardSink:
    """A receiver for ``ScaleMonitor(on_record=...)`` that writes each recorded step to
    TensorBoard while training (tags as :func:`write_tensorboard`).

    Args:
        writer: a log folder (needs the ``tensorboard`` package) or an object with
            ``add_scalar(tag, value, global_step)``.
        metrics: the metrics written (each must be kept by the monitor).

    Raises:
        MonitorError: tensorboard is not installed (for a folder).

    Example:
        >>> import torch
        >>> from unitscale.tracking import ScaleMonitor
        >>> class Writer:
        ...     tags = set()
        ...     def add_scalar(self, tag, value, step): self.tags.add(tag)
        >>> writer = Writer()
        >>> monitor = ScaleMonitor(torch.nn.Linear(2, 2), every=1,
        ...                        on_record=tensorboard_sink(writer, ["rms"]))
        >>> monitor.module(torch.randn(3, 2)).sum().backward(); _ = monitor.step()
        >>> "rms/fwd/weight" in writer.tags, "rms/bwd/weight" in writer.tags
        (True, True)
    """
    target = writer if hasattr(writer, "add_scalar") else summary_writer(writer)
    return TensorBoardSink(target, metrics)
