"""A transformed module traced whole by a ``torch.compile`` of it: :class:`InlinePlans`.

``torch.compile`` of a transformed model (or of a model holding one) traces the wrapper's
``forward`` (:func:`compiled_forward`). Traced as written, Dynamo would inline the wrapped
module and drop the passes; so by default the transform runs as a capture of its own,
behind one graph break (``_run_transformed``). Where an eager call of the transformed model
ran one captured graph as the whole call (the top frame of its forward: no graph break, no
Python side effects for Dynamo to replay after the graph), the capture keeps an
:class:`InlinePlan` of it, and a traced call that matches the plan calls that transformed
graph instead: its ops (unit-scaled ops, simulated roundings and their amax-history
updates, float8 GEMMs) join the user's compiled graph, with no break.

A plan records, from that eager call, how to feed the graph (each input by identity: a
parameter or buffer by qualified name, or a leaf of the call's arguments), how to build the
call's output from the graph's (leaf by leaf: a graph output, an argument, or a constant)
and the conditions of the capture: the arguments' structure, types, shapes, dtypes and
devices, the constant arguments, the parameters' and buffers' types, shapes, dtypes and
devices, grad mode, and every plain attribute (bool, int, float, str, None: ``training``,
flags, sizes) of every module. The traced forward checks them, so that the outer graph
guards on each: a call with other state compiles the outer graph again (and runs another
plan, or the boundary) rather than reuse one made for other state.

Design constraints: a plan is built once per captured graph, from its first eager call,
and an eager call costs nothing more afterwards; there is none where a pass is not
:meth:`~._core.GraphPass.inlinable`, where the last pass compiles the graph itself, where
an input or output is not a value it can map (a global tensor, an object), where hooks run
around the wrapped module's forward (outside the captured frame), where a weight
is a tensor subclass (FSDP2's DTensor), where the inputs' sizes vary between calls (marked
dynamic), or where torch's internals (:func:`whole_frame`) do not say that the graph was a
whole frame without side effects: a torch release that changed them keeps the boundary.
Not covered: Python state outside the modules that the forward branches on (a global
flag); after changing it, run the model eagerly once: two graphs with the same conditions
leave every call behind the boundary.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .._lazy_dynamo import disable

__all__ = ["InlinePlan", "InlinePlans", "compiled_forward", "whole_frame"]

_CONSTANTS = (bool, int, float, str, type(None))
_MISSING = object()  # an attribute deleted since the plan was made
_keys = itertools.count()


def whole_frame(module: nn.Module) -> bool:
    """Whether the frame Dynamo is compiling now (asked from a backend) is the top frame of a
    call of ``module`` (its ``forward``, or the wrapper torch.compile runs a ``torch.nn``
    module through: not a function resumed after a graph break, nor a nested call compiled
    on its own) and replays no Python side effects after its graph (no object that existed
    before the call modified, no hook registered). False where torch's internals do not say
    (a release without ``InstructionTranslator.current_tx``, ``f_code``, or
    ``SideEffects.id_to_variable``, ``is_modified``, ``tensor_hooks``, ``save_for_backward``,
    as torch 2.8 to 2.14 have them)."""
    try:
        from torch._dynamo import external_utils
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        code = tx.f_code
        forward = getattr(type(module).forward, "__code__", None)
        wrapper = code.co_name == "inner" and code.co_filename == external_utils.__file__
        if code is not forward and not wrapper:
            return False
        side_effects = tx.output.side_effects
        for variable in side_effects.id_to_variable.values():
            # Objects the frame created (its output tensors...) are not side effects; what
            # it returns of them is rebuilt from the graph's outputs.
            if type(variable.mutation_type).__name__.endswith("MutationNew"):
                continue
            if side_effects.is_modified(variable):
                return False
        return not (side_effects.tensor_hooks or side_effects.save_for_backward)
    except Exception:  # an internal missing: keep the boundary
        return False


def _meta(tensor: Tensor) -> tuple[type, tuple[int, ...], torch.dtype, torch.device]:
    return type(tensor), tuple(tensor.shape), tensor.dtype, tensor.device


def _hooked(module: nn.Module) -> bool:
    """Whether a call of ``module`` runs hooks around its forward: ``Module.__call__`` runs
    them outside the frame Dynamo captures, so the graph alone would skip them."""
    hooks = ("forward_hooks", "forward_pre_hooks", "backward_hooks", "backward_pre_hooks")
    return any(getattr(module, f"_{name}", None) for name in hooks) or any(
        getattr(nn.modules.module, f"_global_{name}", None) for name in hooks
    )


def _same_meta(tensor: Tensor, meta: tuple[Any, ...]) -> bool:
    """Whether ``tensor`` (traced) has the recorded ``meta``. A symbolic size (``dynamic=
    True``, or a size Dynamo made dynamic after it changed) is not the recorded one: a plan
    is of one size, and comparing would specialise the size. (Specialised, torch 2.13's
    Dynamo then failed to trace the backward of the roundings' autograd function: "lift_
    tracked_freevar_to_input should not be called on root SubgraphTracer".)"""
    kind, shape, dtype, device = meta
    if type(tensor) is not kind or tensor.dtype != dtype or tensor.device != device:
        return False
    if tensor.dim() != len(shape):
        return False
    return all(statically_known_true(n == m) for n, m in zip(tensor.shape, shape, strict=True))


class InlinePlan:
    """How a ``torch.compile`` trace runs one transformed graph in place of the capture.

    Built by :meth:`build` after an eager call; :meth:`matches` and :meth:`run` are traced.
    """

    def __init__(self) -> None:
        #: Unique per plan: read by the traced forward, so the outer graph guards on it.
        self.key = f"plan{next(_keys)}"
        self.gm: fx.GraphModule | None = None
        self.code = ""  # the transformed graph's Python code
        #: Per graph input: ``("input", leaf index)`` or ``("state", attribute path)``.
        self.inputs: list[tuple[str, Any]] = []
        self.state_meta: list[tuple[tuple[str, ...], tuple[Any, ...]]] = []
        self.arg_spec: Any = None
        self.arg_meta: list[Any] = []  # per leaf: tensor metadata or the constant
        #: Per output leaf: ``("graph", index)``, ``("input", leaf index)`` or ``("constant", v)``.
        self.outputs: list[tuple[str, Any]] = []
        self.out_spec: Any = None
        self.grad_enabled = True
        self.module_types: list[type] = []  # of module.modules(), in order
        self.attributes: list[tuple[int, str, Any]] = []  # (module index, name, value)

    @classmethod
    def build(
        cls,
        module: nn.Module,
        gm: fx.GraphModule,
        input_ids: Sequence[int],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        graph_output_ids: dict[int, int],
    ) -> InlinePlan | None:
        """The plan of an eager call whose one piece ran ``gm`` on the tensors ``input_ids``
        and returned the tensors ``graph_output_ids`` (``id`` -> output index); None where
        a value cannot be mapped."""
        if _hooked(module):
            return None
        plan = cls()
        plan.gm, plan.code = gm, gm.code
        leaves, plan.arg_spec = pytree.tree_flatten((args, kwargs))
        for leaf in leaves:
            if isinstance(leaf, Tensor):
                plan.arg_meta.append(_meta(leaf))
            elif isinstance(leaf, _CONSTANTS):
                plan.arg_meta.append(leaf)
            else:
                return None
        leaf_index = {id(leaf): i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)}
        state: dict[int, tuple[str, Tensor]] = {}
        for name, tensor in itertools.chain(
            module.named_parameters(remove_duplicate=False),
            module.named_buffers(remove_duplicate=False),
        ):
            if is_traceable_wrapper_subclass(tensor):  # a DTensor of FSDP2, a float8 weight
                return None
            state.setdefault(id(tensor), (name, tensor))
        for tensor_id in input_ids:
            if tensor_id in leaf_index:
                plan.inputs.append(("input", leaf_index[tensor_id]))
            elif tensor_id in state:
                name, tensor = state[tensor_id]
                path = tuple(name.split("."))
                plan.inputs.append(("state", path))
                plan.state_meta.append((path, _meta(tensor)))
            else:  # a global tensor, a closure's, an attribute of an argument
                return None
        out_leaves, plan.out_spec = pytree.tree_flatten(output)
        for leaf in out_leaves:
            if isinstance(leaf, Tensor):
                if id(leaf) in graph_output_ids:
                    plan.outputs.append(("graph", graph_output_ids[id(leaf)]))
                elif id(leaf) in leaf_index:
                    plan.outputs.append(("input", leaf_index[id(leaf)]))
                else:
                    return None
            elif isinstance(leaf, _CONSTANTS):
                plan.outputs.append(("constant", leaf))
            else:
                return None
        plan.grad_enabled = torch.is_grad_enabled()
        for index, submodule in enumerate(module.modules()):
            plan.module_types.append(type(submodule))
            for name, value in vars(submodule).items():
                if not name.startswith("_") and isinstance(value, _CONSTANTS):
                    plan.attributes.append((index, name, value))
        return plan

    def conditions(self) -> tuple[Any, ...]:
        """What :meth:`matches` checks: two plans with the same conditions are two graphs
        that Dynamo told apart by state the plans do not see."""
        return (
            self.arg_spec, self.arg_meta, self.state_meta, self.grad_enabled,
            self.module_types, self.attributes,
        )  # fmt: skip

    # -- traced by the outer torch.compile ----------------------------------------------------
    def matches(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the call is one the graph was captured for (each check a guard of the
        outer graph)."""
        if not self.key or torch.is_grad_enabled() != self.grad_enabled or _hooked(module):
            return False
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.arg_spec:
            return False
        for leaf, meta in zip(leaves, self.arg_meta, strict=True):
            if isinstance(leaf, Tensor):
                if not isinstance(meta, tuple) or not _same_meta(leaf, meta):
                    return False
            elif isinstance(meta, tuple) or type(leaf) is not type(meta) or leaf != meta:
                return False
        modules = list(module.modules())
        if len(modules) != len(self.module_types):
            return False
        for submodule, kind in zip(modules, self.module_types, strict=True):
            if type(submodule) is not kind:
                return False
        for index, name, value in self.attributes:
            current = getattr(modules[index], name, _MISSING)
            if type(current) is not type(value) or current != value:
                return False
        for path, meta in self.state_meta:
            tensor = _state(module, path)
            if not isinstance(tensor, Tensor) or not _same_meta(tensor, meta):
                return False
        return True

    def run(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call's output, computed by the transformed graph."""
        assert self.gm is not None
        leaves = pytree.tree_leaves((args, kwargs))
        inputs = [
            leaves[where] if kind == "input" else _state(module, where)
            for kind, where in self.inputs
        ]
        out = self.gm(*inputs)
        graph_out = out if isinstance(out, (list, tuple)) else (out,)
        results = [
            graph_out[value] if kind == "graph" else leaves[value] if kind == "input" else value
            for kind, value in self.outputs
        ]
        return pytree.tree_unflatten(results, self.out_spec)


def _state(module: nn.Module, path: tuple[str, ...]) -> Any:
    value: Any = module
    for part in path:
        value = getattr(value, part, None)
    return value


class InlinePlans:
    """The plans of one capture: one per captured graph that ran as a whole call, each built
    at its first eager call (:meth:`note_piece` from the backend, :meth:`after_call` after
    each call), and the one a traced call matches (:meth:`find`)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # every pass of the chain is inlinable (and no clash seen)
        self.plans: tuple[InlinePlan, ...] = ()
        # The transformed graph of each piece that is a whole frame and has no plan yet.
        self._whole: dict[int, fx.GraphModule] = {}

    def __len__(self) -> int:
        return len(self.plans)

    def note_piece(self, index: int, run: Callable[..., Any], module: nn.Module) -> None:
        """Called from the backend with what runs a new piece: the transformed graph's
        ``forward``, unless the last pass compiled it (then it has no plan)."""
        gm = getattr(run, "__self__", None)
        if self.enabled and isinstance(gm, fx.GraphModule) and whole_frame(module):
            self._whole[index] = gm

    def after_call(
        self,
        module: nn.Module,
        trace: Sequence[Any],
        produced: dict[int, tuple[Any, tuple[int, int]]],
        call: tuple[tuple[Any, ...], dict[str, Any], Any],
    ) -> None:
        """Plan the piece a call ran, alone (``trace``: its one :class:`~._core.Invocation`;
        ``produced``: the capture's record of the tensors it returned; ``call``: the
        arguments and the output), where it is a whole frame and has no plan yet."""
        gm = self._whole.pop(trace[0].piece.index, None) if len(trace) == 1 else None
        if gm is None or not self.enabled:
            return
        outputs = {key: where[1] for key, (ref, where) in produced.items() if ref() is not None}
        plan = InlinePlan.build(module, gm, trace[0].input_ids, *call, outputs)
        if plan is None:
            return
        same = [p for p in self.plans if p.conditions() == plan.conditions()]
        if same and all(p.code == plan.code for p in same):
            return  # the graph captured again (after torch.compiler.reset(), say)
        if same:  # Dynamo told the two apart by state a plan does not see: the boundary
            self.plans, self.enabled = (), False
            return
        self.plans = (*self.plans, plan)

    def find(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict) -> InlinePlan | None:
        """The plan whose graph a traced call runs (None: behind the boundary)."""
        for plan in self.plans:
            if plan.matches(module, args, kwargs):
                return plan
        return None


def compiled_forward(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A :class:`~._core.TransformedModule`'s forward traced by a ``torch.compile``: a
    plan's graph where one matches, else the transform behind its boundary."""
    capture = module.capture
    plan = capture.inline.find(module.module, args, kwargs) if capture is not None else None
    if plan is not None:
        return plan.run(module.module, args, kwargs)
    return _run_transformed(module, args, kwargs)


@disable
def _run_transformed(module: Any, args: tuple[Any, ...], kwargs: dict) -> Any:
    """A transformed module's forward, run outside the trace of a ``torch.compile`` of it
    where no plan matches the call: the transform is a capture of its own, with its backend
    (Dynamo would inline it and drop the passes), so the user's graph breaks there, once."""
    return module._transformed_forward(args, kwargs)
