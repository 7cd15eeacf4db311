"""TensorBoard export of ``ScaleMonitor`` records (``torch.utils.tensorboard`` imported on use)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import MonitorError

if TYPE_CHECKING:
    from ..tracking import MonitorRecord

__all__ = ["summary_writer", "tensorboard_available", "write_scalars"]


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
