"""The scale-tracking pass: instrument captured graphs and record statistics as they run.

:class:`TrackScalesPass` is a :class:`~unitscale.capture.GraphPass`. For every piece Dynamo
captures it inserts, after each node whose value is a floating-point tensor, one call to
:meth:`TrackScalesPass.record` with the node's slot number. At run time ``record`` computes the
tensor's statistics (:func:`~unitscale.tracking.metrics.deferred_stats`: on an accelerator, on its
device and asynchronously; on the CPU, at once) and, when a
gradient will flow, registers a tensor hook that does the same for the gradient. Nothing is
copied to the host until :func:`~unitscale.tracking._join.build_scales_graph` joins the pieces
of the call (:mod:`unitscale.tracking._join`) and reads the whole call at once
(:mod:`unitscale.tracking._read`).

Node meta written on the joined graph (see docs/guide/tracking.rst): ``metrics``
(:class:`Metrics`), ``clean_name``, ``module_path``, ``outputs_float_tensor``,
``requires_grad``, ``subgraph`` (index of the piece, in execution order), ``shape``, ``dtype``,
and Dynamo's ``stack_trace``/``nn_module_stack``/``source_fn_stack`` where it had them.

What the pass reads off a graph is in ``_recorder_graph.py``; how it hooks and aliases the
user's tensors without changing them, in ``_recorder_tensors.py``.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor
from torch._C import _functorch

from ...capture import (
    NOT_INTERCEPTED,
    Capture,
    GraphPass,
    Invocation,
    Piece,
    Stage,
    TransformedModule,
    example_value,
    iter_tensors,
    outside_inputs,
    received_parameters,
    trace_eagerly,
    warn_user,
)
from ...formats import BlockFormat
from .. import _distributed
from .._join import _Joined, build_scales_graph
from .._read import _Stats
from ..blocks import attach_block_metrics, block_metrics
from ..metrics import _mode, deferred_stats, fast_stats
from ._graph import _replicated_slots, _same_values_source, _static_shape
from ._tensors import _add_grad_hook, _alias_requiring_grad, _can_alias, _Snapshot

__all__ = ["TrackScalesPass", "build_scales_graph"]


class TrackScalesPass(GraphPass):
    """Record forward and backward scale statistics of every floating-point tensor.

    Reads: Dynamo's ``example_value`` meta (which nodes output float tensors).
    Writes: ``piece.data["slots"]`` (node name -> slot); per invocation,
    ``invocation.data["fwd"]``/``["bwd"]`` (slot -> statistics vector on the device).
    """

    stage = Stage.TRACK
    applied = "is tracked by track_scales"
    order_fix = "apply track_scales last, e.g. track_scales({op}(model))"

    def __init__(self, block_formats: tuple[tuple[str, BlockFormat], ...] = ()) -> None:
        #: ``(name, format)`` of the block-scaled formats whose metrics each tensor gets
        #: (:mod:`unitscale.tracking.blocks`); empty (the default): none, no cost.
        self.block_formats = block_formats
        #: Block metrics of the parameters' gradients in the running call, by tensor id.
        self._param_blocks: dict[int, dict[str, float]] = {}
        #: When False, ``record`` returns at once: the module runs at (nearly) untracked speed
        #: and the last recorded call's statistics are kept. See ``ScaleMonitor``.
        self.enabled = True
        #: "dynamo", or "eager" once Dynamo failed to capture a call whole.
        self.engine = "dynamo"
        self._partial = ""
        #: Values the last Dynamo-recorded call's graphs received from code run outside them
        #: (see :func:`~unitscale.tracking._coverage.outside_inputs`).
        self.outside: list[str] = []
        self._warned = False
        self._handles: list[Any] = []
        #: (hook dict of a tensor, our hook in it): gradient hooks added without a handle.
        self._plain_hooks: list[tuple[dict[Any, Any], Any]] = []
        self._hooked: set[int] = set()
        self._param_grads: dict[int, _Stats] = {}
        #: ``_distributed.active_group()`` when the last recorded call ran (inside DDP's
        #: forward, which declares the data-parallel group), used when it is read.
        self._reduce_over: tuple[bool, Any] = (False, None)
        #: The last joined graph, refilled by the next ``scales_graph()`` when unchanged.
        self._joined: _Joined | None = None
        #: The joined graph before it, refilled when the caller has let go of it.
        self._spare: _Joined | None = None
        # id(tensor) -> (weakref, version, invocation, slot) of its first record in this call.
        self._seen: dict[int, tuple[Any, int, Invocation, int]] = {}
        self._call_inputs: list[int] = []
        # id(caller's tensor) -> (tensor, its alias, the alias's version) for the running call.
        self._aliases: dict[int, tuple[Tensor, Tensor, int]] = {}
        self._capture: Capture | None = None
        #: Under data parallelism: keep the gradients of replicated values (see _distributed).
        self._keep_replicated = False
        #: ``UNITSCALE_STATS`` as read at the start of the running call (see deferred_stats).
        self._stats_mode = "auto"
        #: The native extension's ``summary`` for the running call (see before_call), or None.
        self._fast: Any = None

    def without_state(self) -> TrackScalesPass:
        clone = TrackScalesPass(self.block_formats)
        clone.engine = self.engine
        return clone

    def __getstate__(self) -> dict[str, Any]:
        return {"engine": self.engine, "block_formats": self.block_formats}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.get("block_formats", ()))  # type: ignore[misc]
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
        self.outside = []  # the eager tracer records every op
        return out

    def after_call(self, module: TransformedModule, capture: Capture, output: Any) -> None:
        """Note whether ops ran outside the captured graphs (see :meth:`intercept_call`):
        an output, or a value a later graph received, that no captured graph computed."""
        self._partial = ""
        self.outside = []
        if not self.enabled:
            return
        # Ids of tensors alive for the whole call (its arguments, the parameters and
        # buffers): such a tensor was not computed. (Ids of pieces' inputs may be reused by
        # now, but not these.) Collected only when needed (walking the parameters at every
        # call costs about 1% of a tiny model's tracked step).
        known: set[int] | None = None

        def known_ids() -> set[int]:
            nonlocal known
            if known is None:
                inner = module.module
                known = set(self._call_inputs) | {id(p) for p in inner.parameters()}
                known.update(id(b) for b in inner.buffers())
            return known

        missing = 0
        for tensor in iter_tensors(output):
            if not tensor.is_floating_point():
                continue
            hit = capture.produced.get(id(tensor))
            if hit is not None and hit[0]() is tensor:
                continue
            if id(tensor) not in known_ids():
                missing += 1
        reasons = []
        if missing:
            reasons.append(
                f"{missing} floating-point output(s) of {type(module.module).__name__} were "
                "computed outside the graphs TorchDynamo captured"
            )
        self.outside = outside_inputs(capture, known_ids)
        if self.outside:
            shown = ", ".join(self.outside[:4]) + (" ..." if len(self.outside) > 4 else "")
            reasons.append(
                f"{len(self.outside)} value(s) entering captured graphs were computed outside "
                f"them ({shown})"
            )
        if not reasons:
            return
        self._partial = (
            " and ".join(reasons) + " (TorchDynamo ran some code eagerly: a graph break "
            "inside a loop, a data-dependent shape, or a skipped function)"
        )
        if len(module.passes) > 1 and not self._warned:
            self._warned = True
            params = {n for n, _ in module.module.named_parameters()}
            outside = sorted(params - received_parameters(capture))
            listed = ", ".join(outside[:8]) + (
                f" and {len(outside) - 8} more" if len(outside) > 8 else ""
            )
            warn_user(
                f"track_scales: {self._partial}; the ops computing them are missing from "
                "scales_graph()"
                + (f", and these parameters have no node there: {listed}" if outside else "")
                + "; unitscale.transforms.tracking_coverage(model) lists them"
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
        for hooks, hook in self._plain_hooks:
            hooks.pop(hook, None)
        self._handles = []
        self._plain_hooks = []
        self._hooked = set()

    def scales_graph(self, module: TransformedModule) -> fx.Graph:
        """Join and read the last call of ``module`` (see :func:`build_scales_graph`)."""
        graph = build_scales_graph(module, self)
        if self.block_formats:
            attach_block_metrics(graph, self, module)
        return graph

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
                invocation.data.setdefault("fwd", {})[slot] = (
                    x.numel(),
                    deferred_stats(x, mode=self._stats_mode),
                )
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
            fast = self._fast
            entry = fast(x) if fast is not None else None
            if entry is None:
                entry = (x.numel(), deferred_stats(x, mode=self._stats_mode))
            invocation.data.setdefault("fwd", {})[slot] = entry
            if self.block_formats:
                blocks = block_metrics(x, self.block_formats)
                invocation.data.setdefault("blocks", {})[("fwd", slot)] = blocks
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
                hook = self._grad_hook(invocation, slot, keep)
                if type(x) is Tensor:
                    self._plain_hooks.append((_add_grad_hook(x, hook), hook))
                else:  # a subclass may handle register_hook itself
                    self._handles.append(x.register_hook(hook))

    def record_shape(self, x: Any, slot: int) -> None:
        """Store only the shape of ``x`` for ``slot`` (its statistics are another slot's)."""
        capture = self._capture
        invocation = capture.current if capture is not None else None
        if self.enabled and invocation is not None and isinstance(x, Tensor):
            invocation.data.setdefault("shape", {})[slot] = tuple(x.shape)

    def _grad_hook(self, invocation: Invocation, slot: int, keep: bool = False) -> Any:
        fast = self._fast

        def hook(grad: Tensor) -> None:
            entry = fast(grad) if fast is not None else None
            if entry is None:
                entry = (grad.numel(), deferred_stats(grad, mode=self._stats_mode))
            invocation.data.setdefault("bwd", {})[slot] = entry
            if self.block_formats:
                blocks = block_metrics(grad, self.block_formats)
                invocation.data.setdefault("blocks", {})[("bwd", slot)] = blocks
            if keep:
                # Equal values on every rank, partial gradients: averaged when read.
                invocation.data.setdefault("replicated_grads", {})[slot] = grad

        return hook

    def _leaf_hook(self, key: int) -> Any:
        """Statistics of a leaf's (a parameter's) ``.grad`` once this call's gradient has been
        added to it: the gradient the optimiser sees, accumulated over calls, the same
        quantity as under DDP (where ``param.grad`` is read after its all-reduce)."""

        fast = self._fast

        def hook(leaf: Tensor) -> None:
            grad = leaf.grad
            if grad is not None:
                entry = fast(grad) if fast is not None else None
                if entry is None:
                    entry = (grad.numel(), deferred_stats(grad, mode=self._stats_mode))
                self._param_grads[key] = entry
                if self.block_formats:
                    self._param_blocks[key] = block_metrics(grad, self.block_formats)

        return hook

    def before_call(self, module: TransformedModule, args: tuple[Any, ...], kwargs: dict) -> None:
        # The last call's gradient hooks go first in any case: parameter hooks would otherwise
        # keep firing on calls that are not recorded and overwrite the recorded statistics.
        for handle in self._handles:
            handle.remove()
        for hooks, hook in self._plain_hooks:
            hooks.pop(hook, None)
        self._handles = []
        self._plain_hooks = []
        self._hooked = set()
        self._aliases = {}
        if not self.enabled:
            return
        self._seen = {}
        self._param_grads = {}
        self._param_blocks = {}
        self._stats_mode = _mode()
        # The native extension's one-call path (None: every tensor takes deferred_stats).
        fast = fast_stats() if self._stats_mode == "auto" else None
        self._fast = fast.summary if fast is not None else None
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
