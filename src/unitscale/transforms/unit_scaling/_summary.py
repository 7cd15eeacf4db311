"""What ``unit_scale`` did to each op: :class:`UnitScaleSummary` and :func:`unit_scale_summary`.

``unit_scale`` replaces the ops it has a unit-scaled rule for; every other op keeps its
plain definition, and its output keeps whatever scale it gets (``relu`` of a unit input has
std 0.58). So that this is never silent, each captured graph's ops are sorted, at capture,
into three lists kept in ``piece.data`` (:func:`classify`):

- *replaced*: rewritten to a unit-scaled op (residual adds included);
- *scale-neutral*: ops that only move, select, copy or re-type values (``view``,
  ``transpose``, indexing, ``cat``, ``to``...) or that take no floating-point tensor (they make
  constants: ``arange``, ``ones``, masks): they do not change a scale;
- *left as is*: every other op with a floating-point output (``relu``, ``x * 0.5``, a
  hand-written norm's ``pow``/``rsqrt``...).

The ops left as they are are logged once per model, when the first graph holding them is
captured, at WARNING on the ``"unitscale.unit_scale"`` logger (a child of ``"unitscale"``),
grouped by op with counts (:func:`log_left_as_is`); :func:`unit_scale_summary` lists each
one by node, as a table.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from ...capture import (
    Capture,
    Piece,
    Stage,
    TransformedModule,
    example_value,
    is_float_node,
    unwrap_compiled,
)
from ...errors import UnitScaleError

__all__ = ["UnitScaleSummary", "classify", "log_left_as_is", "op_label", "unit_scale_summary"]

logger = logging.getLogger("unitscale.unit_scale")

# Tensor methods (and the torch functions of the same name) that only move, select, copy or
# re-type values: their output's scale is their input's.
_NEUTRAL_NAMES = frozenset(
    """
    view view_as reshape reshape_as flatten unflatten permute transpose t T mT contiguous
    unsqueeze squeeze expand expand_as repeat tile movedim moveaxis swapaxes swapdims narrow
    select index_select gather take_along_dim split split_with_sizes chunk unbind tensor_split
    cat concat concatenate stack hstack vstack roll flip clone detach to type type_as float
    double half bfloat16 neg negative __getitem__ getitem masked_fill masked_select
    repeat_interleave triu tril diagonal as_strided broadcast_to
    """.split()
)
_NEUTRAL_FUNCTIONS = frozenset((operator.getitem, operator.neg, F.pad, torch.Tensor.__getitem__))


def op_label(node: fx.Node) -> str:
    """The name users write for a node's op (``torch.relu``, ``torch.Tensor.pow``...)."""
    if node.op == "call_method":
        return f"torch.Tensor.{node.target}"
    if node.op == "call_module":
        return str(node.target)
    from ... import functional as U

    target = node.target
    name = getattr(target, "__name__", None)
    if isinstance(name, str):
        for prefix, namespace in (
            ("torch.nn.functional", F),
            ("torch", torch),
            ("operator", operator),
            ("unitscale.functional", U),
        ):
            if getattr(namespace, name, None) is target:
                return f"{prefix}.{name}"
    module = getattr(target, "__module__", None)
    return f"{module}.{name}" if module and name else str(name or target)


def _scale_neutral(node: fx.Node) -> bool:
    if not any(is_float_node(arg) for arg in node.all_input_nodes):
        return True  # a constant (arange, ones, a mask): no scale to change
    if node.op == "call_function" and node.target in _NEUTRAL_FUNCTIONS:
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return name in _NEUTRAL_NAMES


def classify(
    graph: fx.Graph, rewritten: Iterable[fx.Node], in_scope: Callable[[fx.Node], bool]
) -> dict[str, list[Any]]:
    """Sort the ops of ``graph`` (after the rewrite) that have a floating-point output:
    ``{"left_as_is": [(node name, op label)], "scale_neutral": [node name]}``; the nodes in
    ``rewritten``, ops of unitscale itself and ops outside the scope are neither."""
    done = set(rewritten)
    left: list[tuple[str, str]] = []
    neutral: list[str] = []
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module") or node in done:
            continue
        if not in_scope(node) or not isinstance(example_value(node), Tensor):
            continue
        if not is_float_node(node):
            continue
        module = getattr(node.target, "__module__", None) or ""
        if module.startswith("unitscale."):
            continue  # inserted by the rewrite (residual_split) or already unit-scaled
        if _scale_neutral(node):
            neutral.append(node.name)
        else:
            left.append((node.name, op_label(node)))
    return {"left_as_is": left, "scale_neutral": neutral}


#: The op labels each model's capture has logged as left as they are.
_LOGGED: weakref.WeakKeyDictionary[Capture, set[str]] = weakref.WeakKeyDictionary()


def log_left_as_is(capture: Capture, key: str) -> None:
    """Log the ops that the graphs first run in this call left as they are (their
    ``unit_scale`` pass's ``piece.data[key]``): one WARNING line, naming only ops not yet
    logged for this model, so that the graphs a model captures later (each step of
    ``generate()``, a new sequence length) repeat nothing."""
    counts: Counter[str] = Counter()
    graphs = 0
    for invocation in capture.trace:
        data = invocation.piece.data.get(key)
        if not data or data.get("reported"):
            continue
        data["reported"] = True
        graphs += 1
        counts.update(label for _, label in data.get("left_as_is", ()))
    logged = _LOGGED.setdefault(capture, set())
    new = {label: n for label, n in counts.items() if label not in logged}
    if not new:
        return
    earlier = " more" if logged else ""
    logged.update(new)
    listed = ", ".join(f"{label} x{n}" if n > 1 else label for label, n in new.items())
    logger.warning(
        "unit_scale left %d%s op(s) of %d captured graph(s) as they are (no unit-scaled rule: "
        "their outputs keep the scale they get): %s. "
        "unitscale.transforms.unit_scale_summary(model) lists each",
        sum(new.values()),
        earlier,
        graphs,
        listed,
    )


@dataclasses.dataclass(frozen=True)
class UnitScaleSummary:
    """What ``unit_scale`` did to the ops of a model's last call.

    Printed, it is a table with one row per op and outcome, counts first: the ops left as
    they are (their outputs' scale is not unit), the ops replaced and what they became, the
    residual adds, and the scale-neutral ops.

    Attributes:
        replaced: graph nodes rewritten to a unit-scaled op (residual adds included).
        left_as_is: ``(node, op)`` for each op with a floating-point output that keeps its
            plain definition (no unit-scaled rule for it): its output's scale is not unit.
        scale_neutral: nodes of ops that only move, select, copy or re-type values, or take
            no floating-point tensor (constants): they change no scale.
        replacements: ``(node, op, became)`` for each replaced op other than a residual add:
            the op it was (``torch.nn.functional.gelu``, a function of ``replace``) and the
            unit-scaled op it became (``unitscale.functional.gelu``).

    Example:
        >>> s = UnitScaleSummary(
        ...     ("linear", "add"),
        ...     (("relu", "torch.relu"),),
        ...     ("view",),
        ...     (("linear", "torch.nn.functional.linear", "unitscale.functional.linear"),),
        ... )
        >>> print(s)
        unit_scale: 2 op(s) replaced, 1 scale-neutral, 1 left as is
          count  op                          outcome
              1  torch.relu                  left as is (scale not unit): relu
              1  torch.nn.functional.linear  -> unitscale.functional.linear: linear
              1  residual add                -> unitscale residual add: add
              1  (scale-neutral)             scale kept: view
    """

    replaced: tuple[str, ...]
    left_as_is: tuple[tuple[str, str], ...]
    scale_neutral: tuple[str, ...]
    replacements: tuple[tuple[str, str, str], ...] = ()

    def rows(self) -> list[tuple[int, str, str]]:
        """The table's rows: ``(count, op, outcome with the nodes)``, one per op and
        outcome, left as is first, then replaced, residual adds, scale-neutral."""
        groups: dict[tuple[str, str], list[str]] = {}
        for node, op in self.left_as_is:
            groups.setdefault((op, "left as is (scale not unit)"), []).append(node)
        named = set()
        for node, op, became in self.replacements:
            groups.setdefault((op, f"-> {became}"), []).append(node)
            named.add(node)
        for node in self.replaced:  # the rest: residual adds
            if node not in named:
                groups.setdefault(("residual add", "-> unitscale residual add"), []).append(node)
        if self.scale_neutral:
            groups[("(scale-neutral)", "scale kept")] = list(self.scale_neutral)
        return [(len(nodes), op, f"{how}: {_nodes(nodes)}") for (op, how), nodes in groups.items()]

    def __str__(self) -> str:
        left = f"{len(self.left_as_is)} left as is" if self.left_as_is else "none left as is"
        head = (
            f"unit_scale: {len(self.replaced)} op(s) replaced, "
            f"{len(self.scale_neutral)} scale-neutral, {left}"
        )
        rows = self.rows()
        if not rows:
            return head
        width = max(len("op"), *(len(op) for _, op, _ in rows))
        lines = [head, f"  count  {'op':<{width}}  outcome"]
        lines += [f"  {n:>5}  {op:<{width}}  {outcome}" for n, op, outcome in rows]
        return "\n".join(lines)


def _nodes(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def unit_scale_summary(module: nn.Module) -> UnitScaleSummary:
    """Which ops ``unit_scale`` replaced, left as they are, or found scale-neutral in the
    graphs of ``module``'s last call.

    Args:
        module: a model returned by :func:`~unitscale.transforms.unit_scale` (or a chain
            holding it, e.g. ``track_scales(unit_scale(model))``), called at least once.

    Returns:
        The :class:`UnitScaleSummary` over the graphs that ran in the last call (each graph
        once, however often it ran).

    Raises:
        UnitScaleError: ``module`` is not unit-scaled, or has not been called.

    Example:
        >>> from unitscale.transforms import unit_scale
        >>> model = unit_scale(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), mup=False)
        >>> _ = model(torch.randn(2, 8))
        >>> unit_scale_summary(model).left_as_is
        (('input_2', 'torch.nn.functional.relu'),)
    """
    module = unwrap_compiled(module)  # torch.compile's OptimizedModule: its _orig_mod
    passes = module.passes if isinstance(module, TransformedModule) else ()
    # The unit_scale passes: the rewrite passes that say where they write in ``piece.data``
    # (read by attribute, so that this module does not import ``_unit_scale``, which imports it).
    keys = [
        key
        for p in passes
        if p.stage is Stage.REWRITE and isinstance(key := getattr(p, "data_key", None), str)
    ]
    if not keys:
        raise UnitScaleError(
            f"unit_scale_summary: {type(module).__name__} is not unit-scaled; pass a model "
            "returned by unitscale.transforms.unit_scale"
        )
    assert isinstance(module, TransformedModule)
    capture = module.capture
    trace = capture.last_trace if capture is not None else []
    if not trace:
        raise UnitScaleError(
            "unit_scale_summary: the model has not been called yet; call it once, since the "
            "graphs are captured at the first call"
        )
    pieces: list[Piece] = []
    for invocation in trace:
        if invocation.piece not in pieces:
            pieces.append(invocation.piece)
    replaced: list[str] = []
    left: list[tuple[str, str]] = []
    neutral: list[str] = []
    replacements: list[tuple[str, str, str]] = []
    for piece in pieces:
        for key in keys:
            data = piece.data.get(key, {})
            replaced.extend(data.get("replaced", ()))
            replacements.extend(data.get("replacements", ()))
            replaced.extend(name for name, _, _ in data.get("residual_adds", ()))
            left.extend(data.get("left_as_is", ()))
            neutral.extend(data.get("scale_neutral", ()))
    return UnitScaleSummary(tuple(replaced), tuple(left), tuple(neutral), tuple(replacements))
