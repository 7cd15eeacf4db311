"""Non-finite localisation: where a NaN or Inf first appeared in a tracked step.

:class:`~unitscale.tracking.ScaleMonitor` checks every step for NaN/Inf and, the first time it
finds one, replays the step with recording on; :func:`_first_non_finite` reads that step's
tracked graph in execution order (forward values first, then gradients in backward order)
and returns a :class:`NonFiniteReport`, given to the user as a :class:`NonFiniteWarning` or
raised as a :class:`NonFiniteError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from ..errors import UnitScaleError
from .metrics import Metrics
from .records import op_name

__all__ = ["NonFiniteError", "NonFiniteReport", "NonFiniteWarning"]


class NonFiniteWarning(RuntimeWarning):
    """A NaN or Inf appeared during training (``on_non_finite="warn"``)."""


@dataclass(frozen=True)
class NonFiniteReport:
    """Where a NaN or Inf first appeared: which tensor, which direction, which step.

    Attributes:
        step: the training step (0-based, as counted by :meth:`ScaleMonitor.step`).
        trigger: what the per-step check saw: ``"loss"`` (the loss or module output) and/or
            ``"gradients"`` (a parameter gradient), e.g. ``"loss and gradients"``.
        tensor: the first tensor holding a NaN or Inf in the replayed step (its clean name, as
            in ``track_scales``), or None when every tracked tensor was finite in the replay.
        direction: ``"fwd"`` (the tensor's value) or ``"bwd"`` (its gradient), or None.
        module: qualified name of the module that produced it ("" at top level).
        op: what computed it (``"linear"``, ``"add"``, ``"parameter"``, ...).
        nan_count: NaN elements in that tensor.
        inf_count: Inf elements in that tensor.
        numel: its number of elements.
        neighbours: for a forward value, ``(name, abs_max)`` of the tensors it was computed
            from; for a gradient, of the gradients it was computed from (its consumers').
        note: why ``tensor`` is None, when it is.
    """

    step: int
    trigger: str
    tensor: str | None = None
    direction: str | None = None
    module: str = ""
    op: str = ""
    nan_count: int = 0
    inf_count: int = 0
    numel: int = 0
    neighbours: tuple[tuple[str, float], ...] = ()
    note: str = ""

    @property
    def message(self) -> str:
        """One readable sentence (used for the warning and the exception)."""
        if self.tensor is None:
            return f"non-finite {self.trigger} at step {self.step}: {self.note}"
        what = "value" if self.direction == "fwd" else "gradient"
        where = f"module {self.module!r}, " if self.module else ""
        text = (
            f"non-finite {self.trigger} at step {self.step}: first NaN/Inf in the {what} of "
            f"{self.tensor!r} ({where}op {self.op}): {self.nan_count} NaN and {self.inf_count} "
            f"Inf of {self.numel} elements"
        )
        if self.neighbours:
            source = "inputs" if self.direction == "fwd" else "incoming gradients"
            parts = ", ".join(f"{name}={value:.3g}" for name, value in self.neighbours)
            text += f"; largest magnitude of its {source}: {parts}"
        return text

    def __str__(self) -> str:
        return self.message


class NonFiniteError(UnitScaleError, FloatingPointError):
    """A NaN or Inf appeared during training (``on_non_finite="raise"``).

    Attributes:
        report: the :class:`NonFiniteReport`.
    """

    def __init__(self, report: NonFiniteReport) -> None:
        super().__init__(f"ScaleMonitor: {report.message}")
        self.report = report


def _first_non_finite(graph: fx.Graph, step: int, trigger: str) -> NonFiniteReport:
    nodes = [n for n in graph.nodes if isinstance(n.meta.get("metrics"), Metrics)]

    def name(node: fx.Node) -> str:
        return str(node.meta.get("clean_name", node.name))

    def report(node: fx.Node, direction: str, neighbours: list[tuple[str, float]]) -> Any:
        data = getattr(node.meta["metrics"], direction)
        return NonFiniteReport(
            step=step,
            trigger=trigger,
            tensor=name(node),
            direction=direction,
            module=str(node.meta.get("module_path", "")),
            op=op_name(node),
            nan_count=data.nan_count,
            inf_count=data.inf_count,
            numel=data.numel,
            neighbours=tuple(neighbours),
        )

    for node in nodes:  # forward, in execution order
        data = node.meta["metrics"].fwd
        if data is not None and not data.finite:
            inputs = [
                (name(n), n.meta["metrics"].fwd.abs_max)
                for n in node.all_input_nodes
                if isinstance(n.meta.get("metrics"), Metrics) and n.meta["metrics"].fwd
            ]
            return report(node, "fwd", inputs)
    for node in reversed(nodes):  # backward: reverse execution order
        data = node.meta["metrics"].bwd
        if data is not None and not data.finite:
            incoming = [
                (name(n), n.meta["metrics"].bwd.abs_max)
                for n in node.users
                if isinstance(n.meta.get("metrics"), Metrics) and n.meta["metrics"].bwd
            ]
            return report(node, "bwd", incoming)
    return NonFiniteReport(
        step,
        trigger,
        note=(
            "every tensor tracked inside the module was finite when the step was replayed: the "
            "NaN/Inf arose outside it (in a loss computed outside the module, or in a "
            "non-deterministic op that the replay did not reproduce)"
        ),
    )
