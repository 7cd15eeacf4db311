"""An eager tracer: the fallback capture when TorchDynamo cannot take a forward pass whole.

TorchDynamo gives up on a whole frame in some cases (a graph break inside a loop, for
example: it then runs that frame eagerly and only compiles the frames it calls), so the ops
of that frame would be missing from a tracked graph. For those modules scale tracking runs
the forward eagerly under a ``TorchFunctionMode`` that records every torch call as a graph
node, in execution order, with the same meta a Dynamo capture gives:

- node names come from the user's source, like Dynamo's: the last op on a line that assigns
  a variable is named after the variable (``x``, then ``x_1`` for the next assignment), other
  ops after the function (``linear``, ``softmax``);
- ``nn_module_stack`` (innermost module) comes from forward hooks on the copy's submodules;
- parameters and buffers are placeholders named by their qualified names, and the forward's
  arguments placeholders named after its parameters.

The computation itself is untouched (each call runs as it would eagerly), so outputs are
bit-identical. The result is one :class:`~unitscale.capture.Piece` and its
:class:`~unitscale.capture.Invocation`, which the tracking pass joins like any other piece.
"""

from __future__ import annotations

import inspect
import linecache
import operator
import os
import re
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ._core import Invocation, Piece
from ._naming import identifier

__all__ = ["EagerTrace", "trace_eagerly"]

_ASSIGNMENT = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\*\*|//|>>|<<|[-+*/@%&|^])?=(?!=)")
# Frames in these folders are not "the user's source" (the built-in models are).
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP_DIRS = (
    os.path.dirname(str(torch.__file__)) + os.sep,
    os.path.dirname(inspect.__file__) + os.sep,
    *(os.path.join(_PACKAGE, sub) + os.sep for sub in ("capture", "tracking", "transforms")),
)


def _user_frame() -> tuple[int, str, int] | None:
    """(frame id, file, line) of the innermost frame outside torch, unitscale and stdlib."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIP_DIRS) and not filename.startswith("<"):
            return id(frame), filename, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _op_of(func: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, Any, tuple[Any, ...]]:
    """Dynamo-style (op, target, args) for a torch function call."""
    name = getattr(func, "__name__", type(func).__name__)
    if name == "__get__":  # a tensor property such as .T or .mT
        return "call_method", getattr(func.__self__, "__name__", "property"), args  # type: ignore[attr-defined]
    if name.startswith("__") and name.endswith("__"):
        bare = name[2:-2]
        if bare.startswith("r") and hasattr(operator, bare[1:]) and len(args) == 2:
            return "call_function", getattr(operator, bare[1:]), (args[1], args[0])
        if hasattr(operator, bare):
            return "call_function", getattr(operator, bare), args
    if getattr(func, "__objclass__", None) is torch._C.TensorBase or (
        getattr(torch.Tensor, name, None) is func
    ):
        return "call_method", name, args
    return "call_function", func, args


@dataclass
class _Record:
    op: str
    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    group: tuple[int, str, int, int] | None  # (frame id, file, line, visit) of the user's line
    module: nn.Module | None
    module_name: str
    value: Any  # example value: a meta tensor, or a tuple of them
    stack_trace: str


class _Tracer(TorchFunctionMode):
    def __init__(self, trace: EagerTrace) -> None:
        super().__init__()
        self.trace = trace

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.trace.paused:
            self.trace.add(func, args, kwargs, out)
        return out


class EagerTrace:
    """Records one forward call op by op (see the module docstring)."""

    def __init__(self, module: nn.Module, record: Callable[[Any, int], None]) -> None:
        self.module = module
        self.record = record
        self.paused = False
        self.records: list[_Record] = []
        self.placeholders: list[tuple[str, str, Tensor]] = []  # (kind, name, tensor)
        # id(tensor) -> (weakref, record index)
        self.ids: dict[int, tuple[Any, tuple[str, int]]] = {}
        self.params = {id(p): n for n, p in reversed(list(module.named_parameters()))}
        self.buffers = {id(b): n for n, b in reversed(list(module.named_buffers()))}
        self.module_stack: list[tuple[nn.Module, str]] = []
        self.last_line: tuple[int, str, int] | None = None
        self.visit = 0

    # -- recording ---------------------------------------------------------------------------
    def ref(self, value: Any) -> Any:
        """Replace tensors by references (``("ph", i)``/``("op", i)``) in a nested arg."""
        if isinstance(value, Tensor):
            hit = self.ids.get(id(value))
            if hit is not None and hit[0]() is value:
                return hit[1]
            kind, name = "input", "tensor"
            if id(value) in self.params:
                kind, name = "param", self.params[id(value)]
            elif id(value) in self.buffers:
                kind, name = "buffer", self.buffers[id(value)]
            index = ("ph", len(self.placeholders))
            self.placeholders.append((kind, name, value))
            self.ids[id(value)] = (weakref.ref(value), index)
            self._record_value(value, index)
            return index
        if isinstance(value, (list, tuple)):  # namedtuples become plain tuples
            items = [self.ref(v) for v in value]
            return items if isinstance(value, list) else tuple(items)
        if isinstance(value, dict):
            return {k: self.ref(v) for k, v in value.items()}
        return value

    def _record_value(self, value: Tensor, index: tuple[str, int]) -> None:
        if value.is_floating_point():
            self.paused = True
            try:
                self.record(value, self._slot(index))
            finally:
                self.paused = False

    @staticmethod
    def _slot(index: tuple[str, int]) -> int:
        # Placeholders and ops share one slot space: even for ops, odd for placeholders.
        return 2 * index[1] + (1 if index[0] == "ph" else 0)

    def add(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict, out: Any) -> None:
        tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, Tensor)]
        if not tensors:
            return  # .shape, .dim(), .item(): no tensor, nothing to track
        self.paused = True
        try:
            op, target, call_args = _op_of(func, args)
            ref_args = self.ref(call_args)
            ref_kwargs = self.ref(kwargs)
            line = _user_frame()
            if line != self.last_line:
                self.visit += 1
                self.last_line = line
            group = None if line is None else (*line, self.visit)
            module, module_name = self.module_stack[-1] if self.module_stack else (None, "")
            meta = torch.utils._pytree.tree_map(
                lambda t: t.to("meta") if isinstance(t, Tensor) else t, out
            )
            index = ("op", len(self.records))
            self.records.append(
                _Record(
                    op, target, ref_args, ref_kwargs, group, module, module_name, meta,
                    "" if line is None else f'  File "{line[1]}", line {line[2]}, in forward\n'
                    f"    {linecache.getline(line[1], line[2]).strip()}\n",
                )
            )  # fmt: skip
        finally:
            self.paused = False
        if isinstance(out, Tensor):
            self.ids[id(out)] = (weakref.ref(out), index)
            self._record_value(out, index)
        # Tuple outputs: elements are reached through getitem nodes made at build time.
        else:
            for position, value in enumerate(tensors):
                sub = ("op", len(self.records))
                self.records.append(
                    _Record(
                        "call_function", operator.getitem, (index, position), {},
                        None, module, module_name, value.to("meta"), "",
                    )
                )  # fmt: skip
                self.ids[id(value)] = (weakref.ref(value), sub)
                self._record_value(value, sub)

    # -- module paths ------------------------------------------------------------------------
    def install_hooks(self) -> list[Any]:
        handles = []
        for name, sub in self.module.named_modules():
            if not name:
                continue

            def pre(mod: nn.Module, _args: Any, name: str = name) -> None:
                self.module_stack.append((mod, name))

            def post(mod: nn.Module, _args: Any, _out: Any) -> None:
                if self.module_stack and self.module_stack[-1][0] is mod:
                    self.module_stack.pop()

            handles.append(sub.register_forward_pre_hook(pre))
            handles.append(sub.register_forward_hook(post, always_call=True))
        return handles

    # -- building ----------------------------------------------------------------------------
    def build(self, arg_names: dict[int, str]) -> tuple[Piece, Invocation]:
        """The recorded call as a piece and its invocation."""
        graph = fx.Graph()
        env: dict[tuple[str, int], fx.Node] = {}
        kinds: list[tuple[str, str]] = []
        slots: dict[str, int] = {}
        used: dict[str, int] = {}
        for i, (kind, name, value) in enumerate(self.placeholders):
            if kind == "input":
                name = arg_names.get(id(value), name)
            node = graph.placeholder(identifier(name))
            node.meta["example_value"] = value.to("meta")
            kinds.append((kind, name))
            env[("ph", i)] = node
            slots[node.name] = self._slot(("ph", i))
        # The last op of each visit of a user's line that assigns a variable takes its name.
        last_of_group: dict[tuple[int, str, int, int], int] = {}
        for i, rec in enumerate(self.records):
            if rec.group is not None:
                last_of_group[rec.group] = i

        def lookup(value: Any) -> Any:
            if isinstance(value, tuple) and len(value) == 2 and value[0] in ("ph", "op"):
                return env[value]
            if isinstance(value, (list, tuple)):
                return type(value)(lookup(v) for v in value)
            if isinstance(value, dict):
                return {k: lookup(v) for k, v in value.items()}
            return value

        for i, rec in enumerate(self.records):
            name = _default_name(rec.target)
            if rec.group is not None and last_of_group.get(rec.group) == i:
                source = linecache.getline(rec.group[1], rec.group[2])
                match = _ASSIGNMENT.match(source)
                if match:
                    name = match.group(1)
            count = used.get(name, 0)
            used[name] = count + 1
            node = graph.create_node(
                rec.op,
                rec.target,
                lookup(rec.args),
                lookup(rec.kwargs),
                name=name if count == 0 else f"{name}_{count}",
            )
            node.meta["example_value"] = rec.value
            if rec.module is not None:
                node.meta["nn_module_stack"] = {
                    str(id(rec.module)): (rec.module_name, type(rec.module))
                }
            if rec.stack_trace:
                node.meta["stack_trace"] = rec.stack_trace
            env[("op", i)] = node
            slots[node.name] = self._slot(("op", i))
        graph.output(None)
        piece = Piece(index=-1, graph=graph, placeholders=kinds)
        piece.data["tracked_graph"] = graph
        piece.data["slots"] = slots
        invocation = Invocation(
            piece, [id(v) for _, _, v in self.placeholders], [None] * len(self.placeholders)
        )
        return piece, invocation


def _default_name(target: Any) -> str:
    if isinstance(target, str):
        return identifier(target)
    name = getattr(target, "__name__", "op")
    return identifier(name.strip("_") or "op")


def _argument_names(module: nn.Module, args: tuple[Any, ...], kwargs: dict) -> dict[int, str]:
    """id(tensor) -> the forward parameter (or ``param.key``/``param_i``) it was passed as."""
    names: dict[int, str] = {}
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        items = list(bound.arguments.items())
    except (TypeError, ValueError):
        items = [(f"args_{i}", a) for i, a in enumerate(args)] + list(kwargs.items())
    for name, value in items:
        if isinstance(value, Tensor):
            names.setdefault(id(value), name)
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, Tensor):
                    names.setdefault(id(item), f"{name}.{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, Tensor):
                    names.setdefault(id(item), f"{name}_{i}")
    return names


def trace_eagerly(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    record: Callable[[Any, int], None],
    set_current: Callable[[Invocation | None], None],
) -> tuple[Any, Piece, Invocation]:
    """Run ``module(*args, **kwargs)`` eagerly, recording every torch call.

    ``record(tensor, slot)`` is called for every float tensor (inputs, parameters and op
    outputs) while the invocation returned is current (``set_current``).
    """
    trace = EagerTrace(module, record)
    # The invocation must be current while recording: make a provisional one and fill it in.
    provisional = Invocation(Piece(-1, fx.Graph(), []), [], [])
    set_current(provisional)
    handles = trace.install_hooks()
    try:
        with _Tracer(trace):
            out = module(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
        set_current(None)
    piece, invocation = trace.build(_argument_names(module, args, kwargs))
    invocation.data = provisional.data
    return out, piece, invocation
