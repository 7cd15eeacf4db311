"""Join the pieces of a tracked call into one graph carrying ``metrics`` meta.

Dynamo captures a forward as one piece per graph break; :func:`build_scales_graph` copies
the nodes of every piece the last call ran, in execution order, into one ``torch.fx.Graph``:
parameters and buffers become shared placeholders named by their qualified names, a piece's
input that an earlier piece returned is wired to that output, ops of inlined functions get
readable ``function.variable`` names. The statistics the pass recorded
(:mod:`unitscale.tracking._recording._pass`) are read onto the nodes by
:mod:`unitscale.tracking._read`.
The last joined graph is kept and refilled when the next call has the same structure.

Writes the node meta listed in :mod:`unitscale.tracking._recording._pass`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch import Tensor, nn

from ..capture import (
    Invocation,
    Piece,
    TransformedModule,
    example_value,
    identifier,
    is_float_node,
    module_path_of,
    readable_name,
)
from . import _distributed
from ._read import _queue, _read_stats, _replication, _resolved, _Stats
from .metrics import Metrics, fast_stats, host_stats, stats_to_data

__all__ = ["build_scales_graph"]


class TrackScalesState(Protocol):
    """What joining reads and keeps on the tracking pass
    (:class:`unitscale.tracking._recording._pass.TrackScalesPass`), so that this module does not
    import the pass (the pass imports this module)."""

    _joined: _Joined | None  # the last joined graph, refilled when unchanged
    _spare: _Joined | None  # the joined graph before it
    _param_grads: dict[int, _Stats]  # parameter gradient statistics of the call
    _fast: Any  # the native extension's ``summary`` for the call, or None
    _reduce_over: tuple[bool, Any]  # ``_distributed.active_group()`` when the call ran


_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack")


def _hint(size: Any) -> int:
    """An int size, or the example size Dynamo traced a symbolic one with (-1 if unknown)."""
    if isinstance(size, int):
        return size
    hint = getattr(getattr(size, "node", None), "hint", None)
    return int(hint) if isinstance(hint, int) else -1


def build_scales_graph(module: TransformedModule, track: TrackScalesState) -> fx.Graph:
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

    A user's loop holds the last graph until the next read returns (``graph =
    tracked.scales_graph()``), so the graph before it is kept too (``track._spare``): by
    then the caller has let go of it, and it is refilled in place of copying the held one's
    nodes (the copy costs several times the refill on small models). The two alternate.
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
    if cached is not None and cached.key == key:
        if cached.unshared() and cached.intact():
            return cached.refill(trace, track)
        # The caller holds the last graph (a loop's ``graph = scales_graph()``), which must
        # not change: refill the graph before it if nobody holds that one any more, else a
        # copy of the held one's nodes, instead of joining the pieces again.
        spare = track._spare
        if spare is not None and spare.key == key and spare.unshared() and spare.intact():
            spare.refill(trace, track)
            track._spare, track._joined = cached, spare
            return spare.graph
        if cached.intact():
            joined = cached.copy()
            joined.refill(trace, track)
            joined.seal()
            track._spare, track._joined = cached, joined
            return joined.graph
    track._joined = track._spare = None  # drop the old graphs before building the new one
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
        counts = self.counts
        if counts is None or sys.getrefcount(self.graph) != counts[0]:
            return False  # the caller holds the graph: known without counting the nodes
        return self._counts() == counts

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

    def refill(self, trace: Sequence[Invocation], track: TrackScalesState) -> fx.Graph:
        """The kept graph with this call's shapes and statistics (new ``Metrics``)."""
        resolved = [_resolved(invocation) for invocation in trace]
        shapes = [invocation.data.get("shape", {}) for invocation in trace]
        pending: list[tuple[fx.Node, str, _Stats]] = []
        param_grads = track._param_grads
        # The native extension's records where the call used it (UNITSCALE_STATS=auto).
        to_data = fast_stats().to_data if track._fast is not None else stats_to_data
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
            if not meta.get("outputs_float_tensor"):
                meta["metrics"] = None
                continue
            # Statistics on the host are written here, in this one pass over the nodes (it
            # runs for every tracked tensor at every read); the rest are read together.
            # Written out for both directions (no loop, no call for statistics already in a
            # list), and Metrics built with both records.
            fwd_data = bwd_data = None
            entry = fwd.get(slot)
            if entry is not None:
                values = entry[1] if type(entry[1]) is list else host_stats(entry[1])
                if values is None:
                    pending.append((node, "fwd", entry))
                else:
                    fwd_data = to_data(values, entry[0])
            if grad is not None:
                values = grad[1] if type(grad[1]) is list else host_stats(grad[1])
                if values is None:
                    pending.append((node, "bwd", grad))
                else:
                    bwd_data = to_data(values, grad[0])
            meta["metrics"] = Metrics(fwd_data, bwd_data)
        if pending:
            _read_stats(pending)
        return self.graph


def _build(
    module: TransformedModule,
    track: TrackScalesState,
    trace: Sequence[Invocation],
    all_kinds: list[list[tuple[str, str]]],
    named_params: dict[str, nn.Parameter],
    state_names: dict[int, str],
    parallel: tuple[Any] | None,
) -> tuple[fx.Graph, list[_PlanEntry]]:
    """Build the joined graph of ``trace`` and read its statistics; ``parallel`` is
    ``(process group,)`` under data parallelism (the group None for the default one), None
    otherwise. Returns the graph and its plan (see :class:`_Joined`)."""
    joiner = _Joiner(module, track, trace, named_params, parallel)
    for k, invocation in enumerate(trace):
        joiner.add_piece(k, invocation, all_kinds[k])
    graph = joiner.graph
    graph.output(joiner.last_outputs)

    # Nodes with float outputs get Metrics (bwd stays None where no gradient flowed).
    for node in graph.nodes:
        if node.op != "output":
            node.meta["metrics"] = Metrics() if node.meta.get("outputs_float_tensor") else None
    distributed = joiner.distributed
    _read_stats(joiner.pending, (joiner.group, joiner.replicated) if distributed else None)
    return graph, joiner.plan


class _PieceRun:
    """What joining one invocation of a piece reads: its statistics, shapes and names."""

    def __init__(
        self,
        k: int,
        invocation: Invocation,
        fwd: dict[Any, _Stats],
        bwd: dict[Any, _Stats],
        relocate: Callable[[str], str],
    ) -> None:
        self.k = k
        self.piece = invocation.piece
        self.slots: dict[str, int] = self.piece.data.get("slots", {})
        self.fwd, self.bwd = fwd, bwd
        # Shapes of this call (a graph captured with dynamic sizes serves several).
        self.shapes: dict[int, tuple[int, ...]] = invocation.data.get("shape", {})
        self.env: dict[fx.Node, Any] = {}  # a node, or an int standing for a symbolic size
        self.relocate = relocate


class _Joiner:
    """One join in progress: the joined graph, its plan, the statistics to read, and what
    the pieces joined so far have produced and named."""

    def __init__(
        self,
        module: TransformedModule,
        track: TrackScalesState,
        trace: Sequence[Invocation],
        named_params: dict[str, nn.Parameter],
        parallel: tuple[Any] | None,
    ) -> None:
        self.graph = fx.Graph()
        self.track = track
        self.named_params = named_params
        self.distributed = parallel is not None
        self.group = parallel[0] if parallel is not None else None
        self.module_names = {
            id(m): name for name, m in module.module.named_modules(remove_duplicate=False)
        }
        self.trainable = {n for n, p in named_params.items() if p.requires_grad}
        self.replicated: set[int] = set()  # ids of statistics equal on every rank (parameters)
        self.reduced_grads = (
            _distributed.reduce_replicated_grads(trace, self.group) if self.distributed else {}
        )
        self.shared: dict[str, fx.Node] = {}  # parameter/buffer name -> placeholder
        self.outputs: list[list[fx.Node | None]] = []  # per invocation, each output's node
        self.pending: list[tuple[fx.Node, str, _Stats]] = []  # (node, "fwd"/"bwd", statistics)
        self.plan: list[_PlanEntry] = []
        self.last_outputs: Any = ()
        self.input_names: set[str] = set()
        self.function_names: set[str] = set()  # names of ops of inlined functions, kept unique

    def add_piece(self, k: int, invocation: Invocation, kinds: list[tuple[str, str]]) -> None:
        """Copy the nodes of the ``k``-th invocation's piece into the joined graph."""
        piece = invocation.piece
        adjust = (
            _replication(k, piece, self.reduced_grads, self.replicated)
            if self.distributed
            else None
        )
        fwd, bwd = _resolved(invocation, adjust)
        run = _PieceRun(k, invocation, fwd, bwd, _module_relocation(piece.placeholders, kinds))
        lookup = run.env.__getitem__
        inputs = iter(zip(kinds, invocation.input_ids, invocation.sources, strict=True))
        for node in piece.data.get("tracked_graph", piece.graph).nodes:
            if node.op == "placeholder":
                (kind, name), input_id, source = next(inputs)
                example = example_value(node)
                if isinstance(example, torch.SymInt):
                    # A size Dynamo passes to a graph captured with dynamic sizes: not a
                    # model input; the joined graph shows its example value instead.
                    run.env[node] = _hint(example)
                elif kind in ("param", "buffer"):
                    run.env[node] = self._state(run, node, kind, name, input_id)
                else:
                    produced = self.outputs[source[0]][source[1]] if source is not None else None
                    if produced is None:
                        produced = self._input(run, node, name, input_id)
                    run.env[node] = produced
            elif node.op == "output":
                outs = node.args[0]
                flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
                self.outputs.append([run.env[a] if isinstance(a, fx.Node) else None for a in flat])
                self.last_outputs = fx.node.map_arg(outs, lookup)
            else:
                run.env[node] = self._op(run, node)
        if len(self.outputs) <= k:  # a piece whose graph has no output node
            self.outputs.append([])

    def _state(self, run: _PieceRun, node: fx.Node, kind: str, name: str, input_id: int) -> fx.Node:
        """The shared placeholder of parameter or buffer ``name`` (made at its first use)."""
        new = self.shared.get(name)
        if new is not None:
            return new
        k, slot = run.k, run.slots.get(node.name)
        new = _new_placeholder(self.graph, identifier(name), name, node, k)
        new.meta["module_path"] = name.rpartition(".")[0]
        new.meta["requires_grad"] = kind == "param" and name in self.trainable
        self.shared[name] = new
        self.plan.append(("param", new, dict(new.meta), k, slot, input_id))
        grad = self.track._param_grads.get(input_id)
        if self.distributed and name in self.named_params:
            # The reduced gradient exists once backward() has returned.
            grad, same = _distributed.parameter_grad_stats(self.named_params[name])
            if same and grad is not None:
                self.replicated.add(id(grad))
        if self.distributed and slot in run.fwd:
            self.replicated.add(id(run.fwd[slot]))
        _queue(self.pending, new, run.fwd.get(slot), grad)
        return new

    def _input(self, run: _PieceRun, node: fx.Node, name: str, input_id: int) -> fx.Node:
        """A placeholder for a tensor no earlier piece returned: a model input, or (in a
        later piece) a value computed by code Dynamo ran eagerly."""
        k, slot = run.k, run.slots.get(node.name)
        clean = name if name not in self.input_names else f"{name}_{k}"
        self.input_names.add(clean)
        new = _new_placeholder(self.graph, identifier(clean), clean, node, k)
        new.meta["module_path"] = ""
        new.meta["requires_grad"] = False
        # A tensor entering a later piece that no earlier piece returned was computed
        # by code Dynamo ran eagerly: say so rather than pretend it is a model input.
        new.meta["outside_graph"] = k > 0
        self.plan.append(("input", new, dict(new.meta), k, slot, input_id))
        if slot in run.shapes:
            new.meta["shape"] = run.shapes[slot]
        grad = run.bwd.get(slot) or self.track._param_grads.get(input_id)
        _queue(self.pending, new, run.fwd.get(slot), grad)
        return new

    def _op(self, run: _PieceRun, node: fx.Node) -> fx.Node:
        """A copy of op ``node``, named and placed in its module, with its statistics queued."""
        new = self.graph.node_copy(node, run.env.__getitem__)
        # An op of a submodule's own frame (Dynamo compiled its forward alone, around
        # a graph break) has no module stack: it belongs to that frame's module.
        path = module_path_of(node, self.module_names) or run.piece.frame_module or ""
        _set_meta(new, node, run.k, run.relocate(path))
        new.meta["clean_name"] = _function_scoped(node, new.name, self.function_names)
        new.meta["requires_grad"] = False
        slot = run.slots.get(node.name)
        self.plan.append(("node", new, dict(new.meta), run.k, slot, 0))
        if slot in run.shapes:
            new.meta["shape"] = run.shapes[slot]
        _queue(self.pending, new, run.fwd.get(slot), run.bwd.get(slot))
        return new


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
