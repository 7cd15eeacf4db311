"""The scale-tracking pass: instrument captured graphs, then join and read their statistics.

:class:`TrackScalesPass` is a :class:`~unitscale.capture.GraphPass`. For every piece Dynamo
captures it inserts, after each node whose value is a floating-point tensor, one call to
:meth:`TrackScalesPass.record` with the node's slot number. At run time ``record`` computes the
tensor's statistics (:func:`~unitscale.tracking.metrics.deferred_stats`: on an accelerator, on its
device and asynchronously; on the CPU, small tensors batched) and, when a
gradient will flow, registers a tensor hook that does the same for the gradient. Nothing is
copied to the host until :func:`build_scales_graph` reads the whole call at once.

Node meta written on the joined graph (see DESIGN.md section 3): ``metrics``
(:class:`Metrics`), ``clean_name``, ``module_path``, ``outputs_float_tensor``,
``requires_grad``, ``subgraph`` (index of the piece, in execution order), ``shape``, ``dtype``,
and Dynamo's ``stack_trace``/``nn_module_stack``/``source_fn_stack`` where it had them.
"""

from __future__ import annotations

import copy
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn
from torch._C import _functorch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..capture import (
    NOT_INTERCEPTED,
    Capture,
    GraphPass,
    Invocation,
    Piece,
    Stage,
    TransformedModule,
    example_value,
    identifier,
    is_float_node,
    iter_tensors,
    module_path_of,
    readable_name,
    trace_eagerly,
    warn_user,
)
from . import _distributed
from .metrics import Metrics, Stats, deferred_stats, host_stats, stats_to_data

__all__ = ["TrackScalesPass", "build_scales_graph"]

_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack")
_Stats = tuple[int, Stats]  # (numel, statistics: see metrics.deferred_stats)


def _static_shape(value: Tensor) -> bool:
    return all(isinstance(size, int) for size in value.shape)


def _hint(size: Any) -> int:
    """An int size, or the example size Dynamo traced a symbolic one with (-1 if unknown)."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if isinstance(hint, int) else -1


class TrackScalesPass(GraphPass):
    """Record forward and backward scale statistics of every floating-point tensor.

    Reads: Dynamo's ``example_value`` meta (which nodes output float tensors).
    Writes: ``piece.data["slots"]`` (node name -> slot); per invocation,
    ``invocation.data["fwd"]``/``["bwd"]`` (slot -> statistics vector on the device).
    """

    stage = Stage.TRACK
    applied = "is tracked by track_scales"
    order_fix = "apply track_scales last, e.g. track_scales({op}(model))"

    def __init__(self) -> None:
        #: When False, ``record`` returns at once: the module runs at (nearly) untracked speed
        #: and the last recorded call's statistics are kept. See ``ScaleMonitor``.
        self.enabled = True
        #: "dynamo", or "eager" once Dynamo failed to capture a call whole.
        self.engine = "dynamo"
        self._partial = ""
        self._warned = False
        self._handles: list[Any] = []
        self._hooked: set[int] = set()
        self._param_grads: dict[int, _Stats] = {}
        #: ``_distributed.active_group()`` when the last recorded call ran (inside DDP's
        #: forward, which declares the data-parallel group), used when it is read.
        self._reduce_over: tuple[bool, Any] = (False, None)
        #: The last joined graph, refilled by the next ``scales_graph()`` when unchanged.
        self._joined: _Joined | None = None
        # id(tensor) -> (weakref, version, invocation, slot) of its first record in this call.
        self._seen: dict[int, tuple[Any, int, Invocation, int]] = {}
        self._call_inputs: list[int] = []
        # id(caller's tensor) -> (tensor, its alias, the alias's version) for the running call.
        self._aliases: dict[int, tuple[Tensor, Tensor, int]] = {}
        self._capture: Capture | None = None
        #: Under data parallelism: keep the gradients of replicated values (see _distributed).
        self._keep_replicated = False

    def without_state(self) -> TrackScalesPass:
        clone = TrackScalesPass()
        clone.engine = self.engine
        return clone

    def __getstate__(self) -> dict[str, Any]:
        return {"engine": self.engine}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]
        self.engine = state.get("engine", "dynamo")

    # -- capture time ------------------------------------------------------------------------
    def transform(self, gm: fx.GraphModule, piece: Piece, capture: Capture) -> fx.GraphModule:
        self._capture = capture
        slots: dict[str, int] = {}
        graph = gm.graph
        # The graph as this pass sees it (after earlier passes such as unit_scale), uninstrumented.
        piece.data["tracked_graph"] = copy.deepcopy(graph)
        nodes = list(graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder"]
        # Records for inputs go after the last placeholder so the signature stays intact.
        after_inputs = placeholders[-1] if placeholders else None
        aliases: dict[int, int] = {}
        full_aliases: set[int] = set()
        users = {node: list(node.users) for node in nodes}  # before records are inserted
        # One bound-method object for every record node: torch < 2.6's fx code generation
        # requires a global's name to map to the identical object each time it appears.
        record_fn = self.record
        for node in nodes:
            value = example_value(node)
            if node.op in ("output", "get_attr") or not isinstance(value, Tensor):
                continue
            slot = len(slots)
            slots[node.name] = slot
            anchor = after_inputs if node.op == "placeholder" else node
            if anchor is None:  # pragma: no cover - placeholders always precede
                continue
            if not value.is_floating_point():
                if not _static_shape(value):
                    # A graph reused across sizes: only the call knows this one's shape.
                    with graph.inserting_after(anchor):
                        shape = graph.call_function(self.record_shape, (node, slot))
                    if node.op == "placeholder":
                        after_inputs = shape
                continue
            source = _same_values_source(node)
            if source is not None and source.name in slots:
                # A reshape of a recorded tensor: same values, so the same forward statistics
                # (read from the source). If it is the source's only use, its gradient is the
                # source's gradient too: nothing to record at all.
                aliases[slot] = slots[source.name]
                if users[source] == [node] and source.op != "placeholder":
                    full_aliases.add(slot)
                    if not _static_shape(value):
                        # A graph reused across sizes: only the call knows this one's shape.
                        with graph.inserting_after(anchor):
                            graph.call_function(self.record_shape, (node, slot))
                    continue
                with graph.inserting_after(anchor):
                    graph.call_function(record_fn, (node, slot, False))
                continue
            with graph.inserting_after(anchor):
                record = graph.call_function(record_fn, (node, slot))
            if node.op == "placeholder":
                after_inputs = record
        piece.data["slots"] = slots
        piece.data["replicated_slots"] = _replicated_slots(nodes, piece, slots)
        piece.data["aliases"] = aliases
        piece.data["full_aliases"] = full_aliases
        return gm

    def intercept_call(
        self,
        module: TransformedModule,
        capture: Capture,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Use the eager tracer where Dynamo could not capture the forward whole.

        The first call goes through Dynamo with the RNG and buffers saved; if some of its ops
        ran outside the captured graphs (Dynamo skipped a frame, e.g. for a graph break in a
        loop), the state is restored and the call replayed under the eager tracer, whose
        outputs are returned. Python side effects cannot be restored: those of that first call
        happen twice, and the warning says so. Later calls then use the eager tracer directly.
        Only when tracking is the sole transform: other passes need Dynamo graphs to rewrite.
        """
        self._capture = capture
        if not self.enabled or len(module.passes) != 1:
            return NOT_INTERCEPTED
        if self.engine == "eager":
            return self._eager_call(module, capture, args, kwargs)
        snapshot = _Snapshot(module.module) if capture.calls == 0 else None
        out = capture.dynamo_call(args, kwargs)
        if not self._partial:
            return out
        self.engine = "eager"
        reason = self._partial
        if snapshot is None:
            warn_user(
                f"track_scales: {reason}; the graph of this call is incomplete, later calls "
                "are traced eagerly and complete"
            )
            return out
        warn_user(
            f"track_scales: {reason}; this call was replayed with unitscale's eager tracer, "
            "which records every op (names from source lines). Outputs are those of the replay; "
            "RNG and buffers were restored before it, but Python side effects of the forward "
            "(prints, counters on the module) happened twice in this call"
        )
        snapshot.restore()
        self.before_call(module, args, kwargs)
        return self._eager_call(module, capture, args, kwargs)

    def _eager_call(
        self,
        module: TransformedModule,
        capture: Capture,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        def set_current(invocation: Invocation | None) -> None:
            capture.current = invocation

        out, _, invocation = trace_eagerly(module.module, args, kwargs, self.record, set_current)
        capture.last_trace = [invocation]
        return out

    def after_call(self, module: TransformedModule, capture: Capture, output: Any) -> None:
        """Note whether ops ran outside the captured graphs (see :meth:`intercept_call`)."""
        self._partial = ""
        if not self.enabled:
            return
        # Ids of tensors alive for the whole call (its arguments, the parameters): an output
        # that is one of them was not computed. (Ids of pieces' inputs may be reused by now.)
        known = set(self._call_inputs) | {id(p) for p in module.module.parameters()}
        missing = 0
        for tensor in iter_tensors(output):
            hit = capture.produced.get(id(tensor))
            if tensor.is_floating_point() and id(tensor) not in known:
                if hit is None or hit[0]() is not tensor:
                    missing += 1
        if missing:
            self._partial = (
                f"{missing} floating-point output(s) of {type(module.module).__name__} were "
                "computed outside the graphs TorchDynamo captured (it ran some code eagerly: "
                "a graph break inside a loop, or a skipped function)"
            )
            if len(module.passes) > 1 and not self._warned:
                self._warned = True
                warn_user(
                    f"track_scales: {self._partial}; the ops computing them are missing from "
                    "scales_graph()"
                )

    def release_hooks(self) -> None:
        """Remove the gradient hooks of the last recorded call.

        The pass keeps its hooks on parameters (leaves) until its next *enabled* call, so
        while recording is off they would still compute gradient statistics and overwrite
        the recorded ones; a caller that reads each recorded call at once (``ScaleMonitor``)
        drops them with this.
        """
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._hooked = set()

    def scales_graph(self, module: TransformedModule) -> fx.Graph:
        """Join and read the last call of ``module`` (see :func:`build_scales_graph`)."""
        return build_scales_graph(module, self)

    # -- run time (the hot path) -------------------------------------------------------------
    def record(self, x: Any, slot: int, forward: bool = True) -> None:
        """Store the statistics of ``x`` (if ``forward``) and of its gradient for ``slot``."""
        if not self.enabled:
            return
        capture = self._capture
        invocation = capture.current if capture is not None else None
        if invocation is None or not isinstance(x, Tensor):
            return
        invocation.data.setdefault("shape", {})[slot] = tuple(x.shape)
        if _functorch.is_functorch_wrapped_tensor(x):
            # Inside torch.vmap (or torch.func.grad) the value is a wrapper of a plain tensor
            # that holds every batch element: record that tensor's statistics. Its gradient
            # is recorded where the vmapped result leaves vmap, not on the wrapper.
            while _functorch.is_functorch_wrapped_tensor(x):
                x = _functorch.get_unwrapped(x)
            if forward:
                invocation.data.setdefault("fwd", {})[slot] = (x.numel(), deferred_stats(x))
            return
        # The same tensor object, unmodified, seen again in this call (``x.float()`` on a
        # float32 tensor returns ``x``; a tensor crossing a graph break enters the next piece):
        # same values and, hooks firing on the same object, the same gradient. Share the
        # first node's statistics.
        # Inference tensors have no version counter: they are never shared, only recorded.
        version = None if x.is_inference() else x._version
        first = self._seen.get(id(x))
        if first is not None and first[0]() is x and version is not None and first[1] == version:
            invocation.data.setdefault("same", {})[slot] = (first[2], first[3])
            return
        if version is not None:
            self._seen[id(x)] = (weakref.ref(x), version, invocation, slot)
        if forward:
            invocation.data.setdefault("fwd", {})[slot] = (x.numel(), deferred_stats(x))
        if x.requires_grad and torch.is_grad_enabled():
            if x.is_leaf:
                # Leaves (parameters, inputs) keep hooks across calls: hook each once a call.
                if id(x) in self._hooked:
                    return
                self._hooked.add(id(x))
                self._handles.append(x.register_post_accumulate_grad_hook(self._leaf_hook(id(x))))
            else:
                keep = self._keep_replicated and slot in invocation.piece.data.get(
                    "replicated_slots", ()
                )
                self._handles.append(x.register_hook(self._grad_hook(invocation, slot, keep)))

    def record_shape(self, x: Any, slot: int) -> None:
        """Store only the shape of ``x`` for ``slot`` (its statistics are another slot's)."""
        capture = self._capture
        invocation = capture.current if capture is not None else None
        if self.enabled and invocation is not None and isinstance(x, Tensor):
            invocation.data.setdefault("shape", {})[slot] = tuple(x.shape)

    def _grad_hook(self, invocation: Invocation, slot: int, keep: bool = False) -> Any:
        def hook(grad: Tensor) -> None:
            invocation.data.setdefault("bwd", {})[slot] = (grad.numel(), deferred_stats(grad))
            if keep:
                # Equal values on every rank, partial gradients: averaged when read.
                invocation.data.setdefault("replicated_grads", {})[slot] = grad

        return hook

    def _leaf_hook(self, key: int) -> Any:
        """Statistics of a leaf's (a parameter's) ``.grad`` once this call's gradient has been
        added to it: the gradient the optimiser sees, accumulated over calls, the same
        quantity as under DDP (where ``param.grad`` is read after its all-reduce)."""

        def hook(leaf: Tensor) -> None:
            grad = leaf.grad
            if grad is not None:
                self._param_grads[key] = (grad.numel(), deferred_stats(grad))

        return hook

    def before_call(self, module: TransformedModule, args: tuple[Any, ...], kwargs: dict) -> None:
        # The last call's gradient hooks go first in any case: parameter hooks would otherwise
        # keep firing on calls that are not recorded and overwrite the recorded statistics.
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._hooked = set()
        self._aliases = {}
        if not self.enabled:
            return
        self._seen = {}
        self._param_grads = {}
        self._reduce_over = _distributed.active_group()
        self._keep_replicated = self._reduce_over[0]

    def prepare_inputs(
        self, module: TransformedModule, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Give the forward aliases of the caller's float tensors that require grad.

        So the gradient with respect to each input is tracked while the caller's tensors stay
        as they were (no ``requires_grad_()``). An alias shares the tensor's storage, so an
        in-place op of the forward changes the caller's tensor as it would untracked. Tensors
        passed directly or inside tuples are aliased; those inside lists, dicts or other
        objects are left as they are (the forward may mutate the container), and so are
        tensors that already require grad (their gradients are tracked on them).
        """
        if self.enabled and torch.is_grad_enabled():
            args = self._alias_tree(args)
            kwargs = {key: self._alias_tree(value) for key, value in kwargs.items()}
        self._call_inputs = [id(t) for t in iter_tensors((args, kwargs))]
        return args, kwargs

    def _alias_tree(self, value: Any) -> Any:
        if isinstance(value, Tensor):
            if not _can_alias(value):
                return value
            hit = self._aliases.get(id(value))
            if hit is None:
                alias = _alias_requiring_grad(value)
                hit = self._aliases[id(value)] = (value, alias, alias._version)
            return hit[1]
        if type(value) is tuple:
            return tuple(self._alias_tree(v) for v in value)
        return value

    def finish_outputs(self, module: TransformedModule, output: Any) -> Any:
        """Hand back the caller's own tensors where the forward returned an input's alias, and
        make an in-place change of an alias visible on the tensor's version counter."""
        aliases, self._aliases = self._aliases, {}
        if not aliases:
            return output
        by_alias: dict[int, Tensor] = {}
        for original, alias, version in aliases.values():
            by_alias[id(alias)] = original
            if alias._version != version:
                torch.autograd.graph.increment_version(original)

        def unalias(value: Any) -> Any:
            if isinstance(value, Tensor):
                return by_alias.get(id(value), value)
            if type(value) in (tuple, list):
                return type(value)(unalias(v) for v in value)
            return value

        return unalias(output)


class _RequireGrad(torch.autograd.Function):
    """The identity on ``x``, made differentiable through ``anchor`` (see
    :func:`_alias_requiring_grad`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, anchor: Tensor) -> Tensor:
        # Marked dirty, ``x`` itself is returned with a gradient history: not a leaf and not a
        # view, so the forward may modify it in place as it could the caller's tensor.
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _replicated_slots(nodes: list[fx.Node], piece: Piece, slots: dict[str, int]) -> set[int]:
    """Slots of values computed from parameters, buffers and constants alone (no model
    input): equal on every data-parallel rank, e.g. a position embedding's output."""
    kinds = iter(piece.placeholders)
    replicated: set[fx.Node] = set()
    for node in nodes:
        if node.op == "placeholder":
            kind = next(kinds, ("input", ""))[0]
            if kind in ("param", "buffer"):
                replicated.add(node)
        elif node.op == "get_attr" or (
            node.op in ("call_function", "call_method", "call_module")
            and all(arg in replicated for arg in node.all_input_nodes)
        ):
            replicated.add(node)
    return {slots[node.name] for node in replicated if node.name in slots}


def _can_alias(tensor: Tensor) -> bool:
    return (
        type(tensor) is Tensor
        and tensor.is_floating_point()
        and not tensor.requires_grad
        and tensor.layout == torch.strided
        and not tensor.is_inference()
        and not _functorch.is_functorch_wrapped_tensor(tensor)
    )


def _alias_requiring_grad(tensor: Tensor) -> Tensor:
    """A tensor that shares ``tensor``'s storage and requires grad; ``tensor`` is untouched.

    A new tensor on the same storage has its own version counter, so making it require grad
    (which counts as an in-place change) does not bump the caller's.
    """
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    with torch.no_grad():
        alias.set_(
            tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
        )
    anchor = torch.zeros((), requires_grad=True)
    return _RequireGrad.apply(alias, anchor)


# Ops whose output holds exactly the values of their first argument, rearranged (dtype
# conversions count only when the dtype does not change: `logits.float()` on float32).
_SAME_VALUES_METHODS = frozenset(
    "view reshape flatten unflatten permute transpose t contiguous unsqueeze squeeze view_as "
    "reshape_as movedim swapaxes swapdims float double half bfloat16".split()
)
_SAME_VALUES_FUNCTIONS = frozenset(
    (torch.reshape, torch.flatten, torch.permute, torch.transpose, torch.t, torch.unsqueeze)
) | frozenset((torch.squeeze, torch.movedim, torch.swapaxes))


def _same_values_source(node: fx.Node) -> fx.Node | None:
    if node.op == "call_method" and node.target in _SAME_VALUES_METHODS:
        pass
    elif node.op == "call_function" and node.target in _SAME_VALUES_FUNCTIONS:
        pass
    else:
        return None
    source = node.args[0] if node.args else None
    if not isinstance(source, fx.Node):
        return None
    if not (is_float_node(source) and is_float_node(node)):
        return None
    before, after = example_value(source), example_value(node)
    if before is None or after is None:  # pragma: no cover - float nodes have values
        return None
    # Sizes may be symbolic (dynamic shapes): decide without adding guards.
    same_numel = statically_known_true(before.numel() == after.numel())
    return source if before.dtype == after.dtype and same_numel else None


def build_scales_graph(module: TransformedModule, track: TrackScalesPass) -> fx.Graph:
    """Join the pieces of the last call into one graph carrying metrics meta.

    One host synchronisation per device: every statistics vector is stacked and read at once.
    Under data parallelism the statistics are reduced over the ranks first (a collective:
    see :mod:`unitscale.tracking._distributed`).

    Building the joined graph (fx nodes, meta) costs more than reading the statistics, and it
    is the same at every call of an unchanged model. So the last graph is kept and, when the
    next call has the same structure and nobody else holds that graph, any of its nodes or
    their meta dicts (their reference counts are those it was returned with) and it was not
    edited, the same graph object is returned again, its meta refilled with this call's
    shapes and new ``Metrics``. A graph (or node, meta dict, ``Metrics``) the caller still
    holds is never changed: a new graph is built instead.
    """
    capture = module.capture
    if capture is None or not capture.last_trace:
        return fx.Graph()
    trace = capture.last_trace
    inner = module.module
    # A piece is compiled once per code object and may run for several modules (a graph
    # break inside a repeated layer: Dynamo reuses the layer's graph for every layer, its
    # parameters being inputs), so names come from the tensors each invocation received.
    named_params, state_names = _state_names(inner)
    kinds = [_invocation_kinds(inv.piece.placeholders, inv.input_ids, state_names) for inv in trace]
    distributed, group = _distributed.read_group(track._reduce_over)
    if distributed:  # statistics are reduced over the ranks: always built afresh
        return _build(module, track, trace, kinds, named_params, state_names, (group,))[0]
    key = _structure_key(trace, kinds, named_params)
    cached = track._joined
    if cached is not None and cached.key == key and cached.intact():
        if cached.unshared():
            return cached.refill(trace, track)
        # The caller holds the last graph (a loop's ``graph = scales_graph()``), which must
        # not change: refill a copy of its nodes instead of joining the pieces again.
        joined = cached.copy()
        joined.refill(trace, track)
        joined.seal()
        track._joined = joined
        return joined.graph
    track._joined = None  # drop the old graph before building the new one
    graph, plan = _build(module, track, trace, kinds, named_params, state_names, None)
    joined = _Joined(key, graph, plan, [inv.piece for inv in trace])
    del graph, plan
    joined.seal()
    track._joined = joined
    return joined.graph


def _state_names(module: nn.Module) -> tuple[dict[str, nn.Parameter], dict[int, str]]:
    """``dict(module.named_parameters(remove_duplicate=False))``, and each parameter's or
    buffer's first qualified name by its id (a parameter's before a buffer's), from one walk
    over the modules (it runs at every read: three walks cost a millisecond on small BERT)."""
    named_params: dict[str, nn.Parameter] = {}
    buffer_names: dict[int, str] = {}
    for prefix, child in module.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        for name, param in child._parameters.items():
            if param is not None:
                named_params[dot + name] = param
        for name, buffer in child._buffers.items():
            if buffer is not None:
                buffer_names.setdefault(id(buffer), dot + name)
    state_names: dict[int, str] = {}
    for name, param in named_params.items():
        state_names.setdefault(id(param), name)
    for key, name in buffer_names.items():
        state_names.setdefault(key, name)
    return named_params, state_names


def _structure_key(
    trace: Sequence[Invocation], kinds: list[list[tuple[str, str]]], named_params: dict
) -> tuple[Any, ...]:
    """What decides the joined graph's nodes: the pieces, what each received (parameter
    names, outputs of earlier pieces) and which parameters are trainable."""
    parts: list[Any] = []
    for invocation, invocation_kinds in zip(trace, kinds, strict=True):
        trainable = tuple(
            name in named_params and named_params[name].requires_grad
            for kind, name in invocation_kinds
            if kind == "param"
        )
        parts.append(
            (id(invocation.piece), tuple(invocation_kinds), tuple(invocation.sources), trainable)
        )
    return tuple(parts)


# One entry per node of a joined graph: (kind, node, meta without the call's own values,
# piece index, slot, input id). ``kind`` is "param" (parameter or buffer placeholder), "input"
# or "node"; it says where the node's gradient statistics come from.
_PlanEntry = tuple[str, fx.Node, dict[str, Any], int, Any, int]


class _Joined:
    """The last joined graph of a tracked module, kept to be refilled (see
    :func:`build_scales_graph`)."""

    def __init__(
        self, key: tuple[Any, ...], graph: fx.Graph, plan: list[_PlanEntry], pieces: list[Piece]
    ) -> None:
        self.key = key
        self.graph = graph
        self.plan = plan
        self.pieces = pieces  # held so that their ids in ``key`` cannot be reused
        self.nodes = [
            (node, node.name, node.op, node.target, node.args, node.kwargs) for node in graph.nodes
        ]
        self.counts: list[int] | None = None

    def _counts(self) -> list[int] | None:
        getrefcount = getattr(sys, "getrefcount", None)
        if getrefcount is None:  # pragma: no cover - CPython has it
            return None
        nodes = [entry[0] for entry in self.nodes]
        return (
            [getrefcount(self.graph)]
            + [getrefcount(node) for node in nodes]
            + [getrefcount(node.meta) for node in nodes]
        )

    def seal(self) -> None:
        """Note the reference counts the graph is returned with."""
        self.counts = self._counts()

    def unshared(self) -> bool:
        """True when only this object refers to the graph, its nodes and their meta dicts
        (and the nodes are as built: see :meth:`intact`)."""
        return self.counts is not None and self._counts() == self.counts

    def intact(self) -> bool:
        """True when the graph's nodes are as built (none added, removed or edited)."""
        nodes = self.graph.nodes
        if len(nodes) != len(self.nodes):
            return False
        for node, (kept, name, op, target, args, kwargs) in zip(nodes, self.nodes, strict=True):
            if not (
                node is kept
                and node.name == name
                and node.op == op
                and node.target is target
                and node.args is args
                and node.kwargs is kwargs
            ):
                return False
        return True

    def copy(self) -> _Joined:
        """A new graph with this one's nodes (names, ops, targets, args; their meta left to
        :meth:`refill`), for when this graph is held elsewhere and must not change: copying
        nodes costs a fraction of joining the pieces again."""
        graph = fx.Graph()
        copies: dict[fx.Node, fx.Node] = {}
        for node in self.graph.nodes:
            duplicate = graph.node_copy(node, lambda arg: copies[arg])
            duplicate.meta = {}  # a plan node's meta is refilled; no other node has any
            copies[node] = duplicate
        plan = [(kind, copies[node], *rest) for kind, node, *rest in self.plan]
        return _Joined(self.key, graph, plan, self.pieces)

    def refill(self, trace: Sequence[Invocation], track: TrackScalesPass) -> fx.Graph:
        """The kept graph with this call's shapes and statistics (new ``Metrics``)."""
        resolved = [_resolved(invocation) for invocation in trace]
        shapes = [invocation.data.get("shape", {}) for invocation in trace]
        pending: list[tuple[fx.Node, str, _Stats]] = []
        param_grads = track._param_grads
        for kind, node, base, k, slot, input_id in self.plan:
            meta = node.meta  # nobody else holds it (see unshared): refilled in place
            meta.clear()
            meta.update(base)
            fwd, bwd = resolved[k]
            if kind == "param":
                grad = param_grads.get(input_id)
            else:
                grad = bwd.get(slot)
                if kind == "input":
                    grad = grad or param_grads.get(input_id)
                if slot in shapes[k]:
                    meta["shape"] = shapes[k][slot]
            meta["metrics"] = Metrics() if meta.get("outputs_float_tensor") else None
            _queue(pending, node, fwd.get(slot), grad)
        _read_stats(pending)
        return self.graph


def _resolved(
    invocation: Invocation, adjust: Callable[[dict, dict], None] | None = None
) -> tuple[dict[Any, _Stats], dict[Any, _Stats]]:
    """The forward and gradient statistics of each slot of one invocation, those a slot shares
    with another (the same tensor seen again; a reshape) included. ``adjust`` may change them
    before aliases are resolved (data parallelism)."""
    piece = invocation.piece
    fwd = dict(invocation.data.get("fwd", {}))
    bwd = dict(invocation.data.get("bwd", {}))
    for slot, (other, source) in invocation.data.get("same", {}).items():
        for stats, direction in ((fwd, "fwd"), (bwd, "bwd")):
            same = other.data.get(direction, {}).get(source)
            if same is not None:
                stats[slot] = same
    if adjust is not None:
        adjust(fwd, bwd)
    full_aliases = piece.data.get("full_aliases", set())
    for slot, source in piece.data.get("aliases", {}).items():
        if source in fwd:
            fwd[slot] = fwd[source]
        if slot in full_aliases and source in bwd:
            bwd[slot] = bwd[source]
    return fwd, bwd


def _replication(
    k: int, piece: Piece, reduced_grads: dict[tuple[int, Any], Any], replicated: set[int]
) -> Callable[[dict, dict], None]:
    """Under data parallelism: note the statistics equal on every rank (``replicated``) and
    put the averaged gradients of replicated values in place."""

    def adjust(fwd: dict, bwd: dict) -> None:
        for slot in piece.data.get("replicated_slots", ()):
            if slot in fwd:
                replicated.add(id(fwd[slot]))
        for (index, slot), averaged in reduced_grads.items():
            if index == k:
                bwd[slot] = averaged
                replicated.add(id(averaged))

    return adjust


def _build(
    module: TransformedModule,
    track: TrackScalesPass,
    trace: Sequence[Invocation],
    all_kinds: list[list[tuple[str, str]]],
    named_params: dict[str, nn.Parameter],
    state_names: dict[int, str],
    parallel: tuple[Any] | None,
) -> tuple[fx.Graph, list[_PlanEntry]]:
    """Build the joined graph of ``trace`` and read its statistics; ``parallel`` is
    ``(process group,)`` under data parallelism (the group None for the default one), None
    otherwise. Returns the graph and its plan (see :class:`_Joined`)."""
    graph = fx.Graph()
    distributed = parallel is not None
    group = parallel[0] if parallel is not None else None
    module_names = {id(m): name for name, m in module.module.named_modules(remove_duplicate=False)}
    trainable = {n for n, p in named_params.items() if p.requires_grad}
    replicated: set[int] = set()  # ids of statistics equal on every rank (parameters)
    reduced_grads = _distributed.reduce_replicated_grads(trace, group) if distributed else {}
    shared: dict[str, fx.Node] = {}  # parameter/buffer name -> placeholder
    outputs: list[list[fx.Node | None]] = []  # per invocation, the node of each output
    pending: list[tuple[fx.Node, str, _Stats]] = []  # (node, "fwd"/"bwd", statistics)
    plan: list[_PlanEntry] = []
    last_outputs: Any = ()
    input_names: set[str] = set()
    function_names: set[str] = set()  # names of ops of inlined functions, kept unique

    for k, invocation in enumerate(trace):
        piece = invocation.piece
        slots: dict[str, int] = piece.data.get("slots", {})
        adjust = _replication(k, piece, reduced_grads, replicated) if distributed else None
        fwd, bwd = _resolved(invocation, adjust)
        # Shapes of this call (a graph captured with dynamic sizes serves several).
        shapes: dict[int, tuple[int, ...]] = invocation.data.get("shape", {})
        env: dict[fx.Node, Any] = {}  # a node, or an int standing for a symbolic size
        lookup = env.__getitem__
        kinds = all_kinds[k]
        relocate = _module_relocation(piece.placeholders, kinds)
        inputs = iter(zip(kinds, invocation.input_ids, invocation.sources, strict=True))
        for node in piece.data.get("tracked_graph", piece.graph).nodes:
            if node.op == "placeholder":
                (kind, name), input_id, source = next(inputs)
                slot = slots.get(node.name)
                example = example_value(node)
                if isinstance(example, torch.SymInt):
                    # A size Dynamo passes to a graph captured with dynamic sizes: not a
                    # model input; the joined graph shows its example value instead.
                    env[node] = _hint(example)
                    continue
                if kind in ("param", "buffer"):
                    new = shared.get(name)
                    if new is None:
                        new = _new_placeholder(graph, identifier(name), name, node, k)
                        new.meta["module_path"] = name.rpartition(".")[0]
                        new.meta["requires_grad"] = kind == "param" and name in trainable
                        shared[name] = new
                        plan.append(("param", new, dict(new.meta), k, slot, input_id))
                        grad = track._param_grads.get(input_id)
                        if distributed and name in named_params:
                            # The reduced gradient exists once backward() has returned.
                            grad, same = _distributed.parameter_grad_stats(named_params[name])
                            if same and grad is not None:
                                replicated.add(id(grad))
                        if distributed and slot in fwd:
                            replicated.add(id(fwd[slot]))
                        _queue(pending, new, fwd.get(slot), grad)
                    env[node] = new
                    continue
                produced = outputs[source[0]][source[1]] if source is not None else None
                if produced is not None:
                    env[node] = produced
                    continue
                clean = name if name not in input_names else f"{name}_{k}"
                input_names.add(clean)
                new = _new_placeholder(graph, identifier(clean), clean, node, k)
                new.meta["module_path"] = ""
                new.meta["requires_grad"] = False
                # A tensor entering a later piece that no earlier piece returned was computed
                # by code Dynamo ran eagerly: say so rather than pretend it is a model input.
                new.meta["outside_graph"] = k > 0
                plan.append(("input", new, dict(new.meta), k, slot, input_id))
                if slot in shapes:
                    new.meta["shape"] = shapes[slot]
                env[node] = new
                grad = bwd.get(slot) or track._param_grads.get(input_id)
                _queue(pending, new, fwd.get(slot), grad)
            elif node.op == "output":
                outs = node.args[0]
                flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
                outputs.append([env[a] if isinstance(a, fx.Node) else None for a in flat])
                last_outputs = fx.node.map_arg(outs, lookup)
            else:
                new = graph.node_copy(node, lookup)
                # An op of a submodule's own frame (Dynamo compiled its forward alone, around
                # a graph break) has no module stack: it belongs to that frame's module.
                path = module_path_of(node, module_names) or piece.frame_module or ""
                _set_meta(new, node, k, relocate(path))
                new.meta["clean_name"] = _function_scoped(node, new.name, function_names)
                new.meta["requires_grad"] = False
                env[node] = new
                slot = slots.get(node.name)
                plan.append(("node", new, dict(new.meta), k, slot, 0))
                if slot in shapes:
                    new.meta["shape"] = shapes[slot]
                _queue(pending, new, fwd.get(slot), bwd.get(slot))
        if len(outputs) <= k:  # a piece whose graph has no output node
            outputs.append([])
    graph.output(last_outputs)

    # Nodes with float outputs get Metrics (bwd stays None where no gradient flowed).
    for node in graph.nodes:
        if node.op != "output":
            node.meta["metrics"] = Metrics() if node.meta.get("outputs_float_tensor") else None
    _read_stats(pending, (group, replicated) if distributed else None)
    return graph, plan


def _function_scoped(node: fx.Node, name: str, taken: set[str]) -> str:
    """``name``, or for an op of an inlined function its readable ``function.variable``
    name (:func:`unitscale.capture.readable_name`) made unique with a ``_1``, ``_2`` suffix."""
    readable = readable_name(node, name)
    if readable == name:
        return name
    unique, count = readable, 0
    while unique in taken:
        count += 1
        unique = f"{readable}_{count}"
    taken.add(unique)
    return unique


def _invocation_kinds(
    compiled: Sequence[tuple[str, str]], input_ids: Sequence[int], state_names: dict[int, str]
) -> list[tuple[str, str]]:
    """The placeholder kinds of one invocation: a parameter or buffer is named after the
    tensor the invocation received (``layers.1.fc.weight``), not the one the piece was
    compiled with (``layers.0.fc.weight``)."""
    kinds = []
    for (kind, name), input_id in zip(compiled, input_ids, strict=True):
        if kind in ("param", "buffer"):
            name = state_names.get(input_id, name)
        kinds.append((kind, name))
    return kinds


def _module_relocation(
    compiled: Sequence[tuple[str, str]], actual: Sequence[tuple[str, str]]
) -> Callable[[str], str]:
    """Map the module paths of a piece compiled for one module onto the module it ran for.

    From the first parameter whose name differs, the differing prefixes are found by
    stripping the common dotted suffix (``layers.0.fc.weight`` vs ``layers.1.fc.weight``:
    ``layers.0`` -> ``layers.1``); paths under the compiled prefix are moved under the
    actual one. Paths are unchanged when the piece ran for the module it was compiled for.
    """
    prefixes = None
    for (_, before), (_, after) in zip(compiled, actual, strict=True):
        if before != after:
            old, new = before.split("."), after.split(".")
            while old and new and old[-1] == new[-1]:
                old.pop()
                new.pop()
            prefixes = (".".join(old), ".".join(new))
            break
    if prefixes is None:
        return lambda path: path
    old_prefix, new_prefix = prefixes

    def relocate(path: str) -> str:
        if path == old_prefix or path.startswith(old_prefix + "."):
            return new_prefix + path[len(old_prefix) :]
        return path

    return relocate


def _new_placeholder(
    graph: fx.Graph, name: str, clean_name: str, original: fx.Node, k: int
) -> fx.Node:
    # Placeholders go before the first non-placeholder node: after the last placeholder
    # (remembered on the graph, so that this does not scan the graph), or first.
    last = graph.__dict__.get("_unitscale_last_placeholder")
    first = next(iter(graph.nodes), None)
    if last is None and first is None:
        new = graph.placeholder(name)
    elif last is None:
        with graph.inserting_before(first):
            new = graph.placeholder(name)
    else:
        with graph.inserting_after(last):
            new = graph.placeholder(name)
    graph.__dict__["_unitscale_last_placeholder"] = new
    _set_meta(new, original, k, "")
    new.meta["clean_name"] = clean_name
    return new


def _set_meta(new: fx.Node, original: fx.Node, k: int, module_path: str) -> None:
    meta = new.meta  # filled in place: assigning Node attributes goes through fx's __setattr__
    meta.clear()
    source = original.meta
    for key in _KEPT_META:
        if key in source:
            meta[key] = source[key]
    value = example_value(original)
    meta["outputs_float_tensor"] = is_float_node(original)
    if isinstance(value, Tensor):
        # A symbolic size (a graph captured with dynamic sizes) is replaced by the call's own
        # size when the slot was recorded; its hint stands in otherwise.
        meta["shape"] = tuple(_hint(size) for size in value.shape)
        meta["dtype"] = value.dtype
    meta["module_path"] = module_path
    meta["subgraph"] = k


def _queue(
    pending: list[tuple[fx.Node, str, _Stats]],
    node: fx.Node,
    fwd: _Stats | None,
    bwd: _Stats | None,
) -> None:
    if fwd is not None:
        pending.append((node, "fwd", fwd))
    if bwd is not None:
        pending.append((node, "bwd", bwd))


def _read_stats(
    pending: Sequence[tuple[fx.Node, str, _Stats]], reduce: tuple[Any, set[int]] | None = None
) -> None:
    """Read every statistics vector: those on the host as they are, those on a device in one
    transfer per device; with ``reduce`` (``(group, ids of replicated statistics)``), reduce
    them over the ranks first."""
    rows: list[list[float] | None] = [None] * len(pending)
    pending_tensors: dict[int, Tensor] = {}
    numels = [numel for _, _, (numel, _) in pending]
    by_device: dict[torch.device, list[int]] = {}
    for i, (_, _, (_, stats)) in enumerate(pending):
        values = host_stats(stats)
        if values is not None and reduce is None:
            rows[i] = values
            continue
        tensor = torch.tensor(values, dtype=torch.float64) if values is not None else stats
        if not isinstance(tensor, Tensor):  # pragma: no cover - host_stats read the rest
            raise TypeError(f"unitscale: unexpected statistics {type(stats).__name__}")
        by_device.setdefault(tensor.device, []).append(i)
        pending_tensors[i] = tensor
    if reduce is not None and len(by_device) > 1:
        # The ranks must issue the same collectives: one device's worth, in one order.
        device = next(iter(by_device))
        by_device = {device: list(range(len(pending)))}
    for device, indices in by_device.items():
        stacked = torch.stack([pending_tensors[i].to(device) for i in indices])
        counts = [numels[i] for i in indices]
        if reduce is not None:
            group, replicated = reduce
            same = [id(pending[i][2]) in replicated for i in indices]
            stacked, counts = _distributed.reduce_stats(stacked, counts, same, group)
        for i, row, numel in zip(indices, stacked.tolist(), counts, strict=True):
            rows[i] = row
            numels[i] = numel
    for (node, direction, _), row, numel in zip(pending, rows, numels, strict=True):
        metrics = node.meta.get("metrics")
        if metrics is None or row is None:
            continue
        setattr(metrics, direction, stats_to_data(row, numel))


class _Snapshot:
    """RNG states and buffers of a module, to replay a call exactly."""

    def __init__(self, module: nn.Module) -> None:
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.buffers = [(b, b.detach().clone()) for b in module.buffers()]

    def restore(self) -> None:
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        with torch.no_grad():
            for buffer, saved in self.buffers:
                buffer.copy_(saved)
