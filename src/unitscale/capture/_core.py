"""TorchDynamo capture shared by every unitscale transform.

A :class:`TransformedModule` wraps an independent copy of a user's module and runs its
forward through TorchDynamo with a backend of ours. Dynamo inlines ``torch.nn`` modules, so
each captured piece is a graph of functional ops (``embedding``, ``linear``, ``softmax``...)
whose nodes are named after the variables in the user's source. Every piece Dynamo hands us
(one per graph break) goes through the module's chain of :class:`GraphPass` objects, in order;
the last pass may compile it. At run time the core records which pieces ran, in which order,
and which tensors they received and returned, so that a pass such as scale tracking can join
the pieces of one call into a single graph, connected where a tensor crosses a break.

This module holds that run: the pass protocol (:class:`Stage`, :class:`GraphPass`), the
records passes read (:class:`Piece`, :class:`Invocation`), the runtime :class:`Capture` and
:class:`TransformedModule`. How transforms compose is in ``_compose.py``; how the wrapper
behaves like the module it wraps, in ``_wrapper.py``; which input sizes are marked dynamic,
in ``_varying.py``; the names of graph values, in ``_naming.py``.

Design constraints:

- the user's module is never touched: the wrapper owns a deep copy;
- the wrapper keeps the original's ``state_dict()`` keys, deep-copies and pickles (runtime
  state such as compiled code is rebuilt on the next call), moves with ``.to()`` and follows
  ``.train()``/``.eval()`` (Dynamo guards on both and recompiles);
- per call the core does O(number of pieces) Python work, never per op;
- transforms compose through nesting: a transformed submodule is absorbed into the copy
  (its ops captured with the rest, its passes scoped to it), or refused by name;
- where Dynamo runs one captured graph at several places of a call (a repeated layer with a
  graph break inside), a pass whose rewrite depends on the place gets one variant per place.
"""

from __future__ import annotations

import copy
import enum
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch import Tensor, nn

from .._compat import compile_module, dynamo_recompile_limit
from ..errors import CaptureError, UnitScaleError
from ._inline import InlinePlans, compiled_forward
from ._naming import _clean_module_path, _frame_module, _placeholder_kind, _positional_names
from ._quiet import quiet_torch_logs
from ._signature import signed_forward
from ._varying import _VaryingSizes
from ._warn import warn_user
from ._wrapper import _Wrapper

__all__ = [
    "NOT_INTERCEPTED",
    "Capture",
    "GraphPass",
    "Invocation",
    "Piece",
    "Stage",
    "TransformedModule",
    "example_value",
    "is_float_node",
    "iter_tensors",
    "warn_user",
]

# Dynamo compiles a frame again for every new input shape, train/eval mode and tracked copy;
# the default limit of 8 would silently fall back to eager (and lose the graph) in ordinary use.
_RECOMPILE_LIMIT = 512


#: Returned by :meth:`GraphPass.intercept_call` to let the call go through Dynamo as usual.
NOT_INTERCEPTED: Any = object()


class Stage(enum.IntEnum):
    """Where a graph pass belongs in a transform chain; :func:`transformed` keeps chains in
    this order, so that each pass sees what the earlier ones made of the graph."""

    #: Replaces ops (``unit_scale``): formats and statistics must see the replaced ops.
    REWRITE = 1
    #: Rounds values to a number format (``simulate_format``).
    SIMULATE = 2
    #: Records statistics (``track_scales``): they must describe the final values.
    TRACK = 3
    #: Compiles the final graph (``compile``): nothing can change it afterwards, and the
    #: statistics of ``TRACK`` cannot be gathered from compiled code.
    COMPILE = 4


class GraphPass:
    """One step of a transform chain, applied to every piece Dynamo captures.

    Subclasses set :attr:`stage` and override :meth:`transform` (and the call hooks if they
    hold per-call state). A pass must be picklable: it is configuration, plus runtime state
    it can rebuild (:meth:`without_state`).
    """

    #: The pass's place in a chain (see :class:`Stage`).
    stage: ClassVar[Stage]
    #: Whether the chain may hold two passes of this type.
    repeatable: ClassVar[bool] = True
    #: What the module is once this pass is applied, for errors ("is tracked by track_scales").
    applied: ClassVar[str] = "is already transformed"
    #: What to do instead when a pass of an earlier stage comes after this one (``{op}`` is
    #: that pass's transform).
    order_fix: ClassVar[str] = ""
    #: Whether the pass can apply to the ops of one submodule only (:meth:`scoped`).
    scopable: ClassVar[bool] = False
    #: The qualified name of the submodule whose ops this pass transforms, or "" for every
    #: op. Set on the passes of a transformed child when a transform of its parent absorbs it.
    scope: str = ""

    def inlinable(self, module: nn.Module) -> bool:
        """Whether a ``torch.compile`` of ``module`` (the wrapped one) may trace the transformed
        graph in place of the capture (``_inline.py``): all the pass does is in the graph, and
        its call hooks only check and warn. False by default: the transform stays behind a
        graph break."""
        return False

    def transform(self, gm: fx.GraphModule, piece: Piece, capture: Capture) -> fx.GraphModule:
        """Return the graph module to run for ``piece`` (may modify ``gm`` in place)."""
        return gm

    def compile_graph(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], piece: Piece
    ) -> Callable[..., Any] | None:
        """Return a compiled callable for the final graph, or None to run it as Python.

        Called on the last pass of the chain only, after every pass has transformed ``gm``.
        """
        return None

    def before_call(self, module: TransformedModule, args: tuple[Any, ...], kwargs: dict) -> None:
        """Called before every forward of the transformed module."""

    def prepare_inputs(
        self, module: TransformedModule, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Return the arguments the call runs with (after every :meth:`before_call`)."""
        return args, kwargs

    def finish_outputs(self, module: TransformedModule, output: Any) -> Any:
        """Return what the caller receives for ``output`` (undoing :meth:`prepare_inputs`)."""
        return output

    def intercept_call(
        self,
        module: TransformedModule,
        capture: Capture,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run the call another way and return its output, or return :data:`NOT_INTERCEPTED`."""
        return NOT_INTERCEPTED

    def after_call(self, module: TransformedModule, capture: Capture, output: Any) -> None:
        """Called after every forward, while ``capture.produced`` still describes the call."""

    def without_state(self) -> GraphPass:
        """A copy of this pass with no runtime state, for a new transformed module.

        Passes that hold runtime state override this.
        """
        return copy.copy(self)

    def scoped(self, prefix: str) -> GraphPass:
        """A copy of this pass, without runtime state, that transforms only the ops of the
        submodule ``prefix`` (qualified name in the module the chain wraps). Only passes
        that are :attr:`scopable` are scoped; they test each node with :meth:`scope_filter`."""
        clone = self.without_state()
        clone.scope = f"{prefix}.{self.scope}" if self.scope else prefix
        return clone

    def scope_filter(self, capture: Capture, piece: Piece) -> Callable[[fx.Node], bool]:
        """Whether a node of ``piece`` is an op of :attr:`scope`: the piece is a frame of
        that module (or of one inside it), or Dynamo's module stack of the node holds that
        module or one inside it. Every node is when the scope is ""."""
        frame = piece.frame_module
        if not self.scope or (
            frame is not None and (frame == self.scope or frame.startswith(self.scope + "."))
        ):
            return lambda node: True
        root = capture.owner_module.get_submodule(self.scope)
        inside = {str(id(module)) for module in root.modules()}
        names = {name for name, _ in capture.owner_module.named_modules()}
        prefix = self.scope + "."

        def in_scope(node: fx.Node) -> bool:
            for key, (path, _cls) in (node.meta.get("nn_module_stack") or {}).items():
                if str(key) in inside:
                    return True
                if not str(key).isdigit():  # keyed by path, not by id: the path's name
                    name = _clean_module_path(str(path))
                    if name in names and (name == self.scope or name.startswith(prefix)):
                        return True
            return False

        return in_scope

    def state_key(self) -> Hashable:
        """What, outside the module and its inputs, the code this pass builds bakes in (None:
        nothing). Read before every call; for each distinct key the call runs through a
        Dynamo capture of its own, so that a change of the key builds the graphs anew (Dynamo
        guards only on what the traced frame reads). ``compile`` keys on the data-parallel
        size and gradient accumulation, which Inductor folds into the backward."""
        return None

    def variant_key(self, piece: Piece, capture: Capture) -> Hashable:
        """What, besides the graph, this pass's rewrite of ``piece`` depends on at the place
        in the running call where the piece is about to run (None: nothing).

        Dynamo may run one captured graph at several places of a call: the code of a layer
        with a graph break inside, and its resume function, are compiled for the first
        layer and reused for every other one (modules are inputs of its graphs, not
        constants). Where a pass's rewrite depends on that place (``unit_scale``'s residual
        weights depend on the depth), the core builds one variant of the piece per distinct
        key, each rewritten and compiled for its own place. Called before each run of a
        piece, while ``capture.trace`` holds the invocations that ran before it; must be
        cheap.
        """
        return None


@dataclass
class Piece:
    """One graph Dynamo captured (one per graph break and per recompilation), as the pass
    chain rewrote it; one more per variant (see :meth:`GraphPass.variant_key`)."""

    index: int
    #: The graph as Dynamo gave it (before any pass), with Dynamo's node meta.
    graph: fx.Graph
    #: Per placeholder, ``("param", qualified_name)``, ``("buffer", name)`` or ``("input", name)``.
    placeholders: list[tuple[str, str]]
    #: Free-form per-pass data (e.g. the tracking pass's slot of each node).
    data: dict[str, Any] = field(default_factory=dict)
    #: Qualified name of the module whose ``forward`` (as ``self``) the captured frame runs:
    #: "" for the wrapped module, a submodule's name where Dynamo compiled that module's
    #: frame on its own (around a graph break), None where unknown.
    frame_module: str | None = None


@dataclass
class Invocation:
    """One run of a piece during a call of the transformed module.

    Holds no tensors (so that tracking keeps nothing alive): for each input, its ``id`` and,
    where the same tensor was returned by an earlier invocation of this call, its source as
    ``(invocation index, output index)``.
    """

    piece: Piece
    input_ids: list[int]
    sources: list[tuple[int, int] | None]
    data: dict[str, Any] = field(default_factory=dict)


def example_value(node: Any) -> Any:
    """The value Dynamo recorded for ``node`` (a FakeTensor, tuple...), or None."""
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value")
    if value is None and "grapharg" in node.meta:
        value = getattr(node.meta["grapharg"], "fake_tensor", None)
    return value


def is_float_node(node: Any) -> bool:
    """Whether ``node`` is an fx node whose value is a floating-point tensor."""
    value = example_value(node)
    return isinstance(value, Tensor) and value.is_floating_point()


class Capture:
    """Runtime state of one transformed module: compiled code, pieces and the call trace.

    Passes receive it in :meth:`GraphPass.transform` and the call hooks. Read by passes:
    :attr:`pieces` (every piece captured so far), :attr:`trace` (the :class:`Invocation`
    of each piece in the running call, in order), :attr:`last_trace` (the last complete
    recorded call), :attr:`produced` (``id(tensor)`` -> ``(weakref, (invocation index,
    output index))`` for the tensors the running call's pieces returned) and
    :attr:`current` (the invocation running now). Never pickled or deep-copied: rebuilt on
    the first call after either.
    """

    def __init__(self, owner: TransformedModule) -> None:
        self.owner_ref = weakref.ref(owner)
        self.pieces: list[Piece] = []
        self.trace: list[Invocation] = []
        self.last_trace: list[Invocation] = []
        # id(tensor) -> (weakref, (invocation index, output index)) for the running call.
        self.produced: dict[int, tuple[Any, tuple[int, int]]] = {}
        self.current: Invocation | None = None
        self.calls = 0  # calls that went through Dynamo
        # Free-form state of the passes that lives as long as the capture (rebuilt with it).
        self.pass_state: dict[str, Any] = {}
        self.varying = _VaryingSizes()
        # Static shapes by default; the sizes that change between calls are marked dynamic
        # by ``varying`` (per transformed module, not by Dynamo's process-wide automatic
        # dynamic shapes, so a module's graphs do not depend on what ran before it), on the
        # inputs and on the pieces' outputs (which enter the resume function after a graph
        # break: unmarked, it would be recompiled for every new size, then, past Dynamo's
        # recompile limit, run eagerly and untracked).
        self.compiled: Callable[..., Any] = compile_module(
            owner.module, backend=self.backend, dynamic=False
        )
        # One Dynamo capture per state key of the passes (see GraphPass.state_key); the first
        # key seen uses ``compiled``. Each has a backend of its own: Dynamo keeps the code it
        # compiled per backend.
        self._keyed = [p for p in owner.passes if type(p).state_key is not GraphPass.state_key]
        self._by_state: dict[Hashable, Callable[..., Any]] = {}
        #: How a torch.compile of the module traces a graph that was a whole call inline.
        passes = owner.passes
        self.inline = InlinePlans(bool(passes) and all(p.inlinable(owner.module) for p in passes))

    def _compiled_for_state(self) -> Callable[..., Any]:
        if not self._keyed:
            return self.compiled
        key = tuple(graph_pass.state_key() for graph_pass in self._keyed)
        compiled = self._by_state.get(key)
        if compiled is None:
            if not self._by_state:
                compiled = self.compiled
            else:

                def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
                    return self.backend(gm, example_inputs)

                compiled = compile_module(self.owner_module, backend=backend, dynamic=False)
            self._by_state[key] = compiled
        return compiled

    # Dynamo backend: called once per captured piece.
    def backend(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        owner = self.owner_ref()
        if owner is None:  # pragma: no cover - the owner holds us
            return gm.forward
        module = owner.module
        # First name wins for shared tensors (tied weights), as named_parameters() gives it.
        params: dict[int, str] = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            params.setdefault(id(p), n)
        buffers: dict[int, str] = {}
        for n, b in module.named_buffers(remove_duplicate=False):
            buffers.setdefault(id(b), n)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        arg_names = _positional_names(module)

        def classify(values: Sequence[Any]) -> list[tuple[str, str]]:
            return [
                _placeholder_kind(node, value, params, buffers, arg_names)
                for node, value in zip(placeholders, values, strict=False)
            ]

        kinds = classify(example_inputs)
        passes = owner.passes
        keyed = [p for p in passes if type(p).variant_key is not GraphPass.variant_key]
        # The graph as Dynamo gave it, for variants built later (sharing gm's attributes).
        template = fx.GraphModule(gm, copy.deepcopy(gm.graph)) if keyed else None
        first = self._build_piece(gm, kinds, example_inputs, passes)
        self.inline.note_piece(first[0].index, first[1], module)
        variants = {self._variant_key(first[0], keyed): first}

        def invoke(*args: Any) -> Any:
            piece, run = first
            if keyed:
                key = self._variant_key(first[0], keyed)
                if key not in variants:
                    assert template is not None
                    fresh = fx.GraphModule(template, copy.deepcopy(template.graph))
                    # Named after the parameters it runs with here (another layer's).
                    variants[key] = self._build_piece(fresh, classify(args), example_inputs, passes)
                piece, run = variants[key]
            produced = self.produced
            sources: list[tuple[int, int] | None] = []
            for arg in args:
                hit = produced.get(id(arg)) if isinstance(arg, Tensor) else None
                sources.append(hit[1] if hit is not None and hit[0]() is arg else None)
            invocation = Invocation(piece, [id(a) for a in args], sources)
            index = len(self.trace)
            previous, self.current = self.current, invocation
            self.trace.append(invocation)
            try:
                out = run(*args)
            finally:
                self.current = previous
            for j, value in enumerate(out if isinstance(out, (list, tuple)) else (out,)):
                if isinstance(value, Tensor):
                    produced[id(value)] = (weakref.ref(value), (index, j))
                    self.varying.mark_output((index, j), value)
            return out

        return invoke

    def _build_piece(
        self,
        gm: fx.GraphModule,
        kinds: list[tuple[str, str]],
        example_inputs: Sequence[Any],
        passes: Sequence[GraphPass],
    ) -> tuple[Piece, Callable[..., Any]]:
        """A new :class:`Piece` of ``gm`` (as Dynamo gave it) and what runs it: ``gm``
        transformed by every pass, then compiled by the last one where it compiles."""
        original = copy.deepcopy(gm.graph)
        piece = Piece(index=len(self.pieces), graph=original, placeholders=list(kinds))
        piece.frame_module = _frame_module(gm.graph, kinds)
        self.pieces.append(piece)
        for graph_pass in passes:
            gm = graph_pass.transform(gm, piece, self)
        gm.recompile()
        run: Callable[..., Any] = gm.forward
        if passes:
            compiled = passes[-1].compile_graph(gm, example_inputs, piece)
            if compiled is not None:
                run = compiled
        return piece, run

    def _variant_key(self, piece: Piece, keyed: Sequence[GraphPass]) -> Hashable:
        return tuple(graph_pass.variant_key(piece, self) for graph_pass in keyed)

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        owner = self.owner_ref()
        for graph_pass in owner.passes if owner is not None else ():
            out = graph_pass.intercept_call(owner, self, args, kwargs)  # type: ignore[arg-type]
            if out is not NOT_INTERCEPTED:
                return out
        return self.dynamo_call(args, kwargs)

    def dynamo_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the module through Dynamo and the pass chain, recording the call trace."""
        self.calls += 1
        self.trace = []
        self.produced = {}
        import torch._dynamo

        args, kwargs, marked = self.varying.mark(args, kwargs)
        try:
            # Inside DistributedDataParallel, Dynamo's DDPOptimizer would split each captured
            # graph at the gradient buckets' boundaries and hand the passes the pieces: a
            # residual add whose stream enters a piece as an input is then no longer seen as
            # one (under unit_scale, a different model than in one process). The passes see
            # whole graphs; DDP's reducer hooks still all-reduce the gradients.
            with (
                dynamo_recompile_limit(_RECOMPILE_LIMIT, accumulated=True),
                torch._dynamo.config.patch(optimize_ddp=False),
                quiet_torch_logs(),
            ):
                out = self._compiled_for_state()(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            inner = error.inner_exception
            if isinstance(inner, UnitScaleError):  # a pass's own error says what to do
                raise inner from None
            raise CaptureError(
                f"unitscale could not transform a graph of {type(self.owner_module).__name__}: "
                f"{type(inner).__name__}: {inner}"
            ) from inner
        except torch._dynamo.exc.TorchDynamoException as error:
            self._raise_eager_error(args, kwargs)
            raise CaptureError(
                f"TorchDynamo could not capture {type(self.owner_module).__name__}.forward: "
                f"{str(error).splitlines()[0] if str(error) else type(error).__name__}. "
                "Run the module eagerly to check it works; if it does, please report this"
            ) from error
        owner = self.owner_ref()
        if owner is not None:
            for graph_pass in owner.passes:
                graph_pass.after_call(owner, self, out)
        if not any(getattr(p, "enabled", True) is False for p in self.owner_passes):
            self.last_trace = self.trace
        if not marked:
            self.inline.after_call(
                self.owner_module, self.trace, self.produced, (args, kwargs, out)
            )
        self.produced = {}
        return _VaryingSizes.unmark(out, marked) if marked else out

    def _raise_eager_error(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Run the forward eagerly after Dynamo failed, and raise what the user's own code
        raises there (a shape error, say), with its source line and without Dynamo's
        traceback. Returns where the eager forward runs: Dynamo itself failed."""
        try:
            self.owner_module(*args, **kwargs)  # as called (grad mode included), output unused
        except Exception as user_error:
            note = (
                f"(raised by {type(self.owner_module).__name__}.forward, run eagerly by "
                "unitscale after TorchDynamo failed to capture it; it fails without unitscale too)"
            )
            if hasattr(user_error, "add_note"):  # Python 3.11+
                user_error.add_note(note)
            raise user_error from None

    @property
    def owner_passes(self) -> tuple[GraphPass, ...]:
        owner = self.owner_ref()
        return owner.passes if owner is not None else ()

    @property
    def owner_module(self) -> nn.Module:
        owner = self.owner_ref()
        return owner.module if owner is not None else nn.Module()


class TransformedModule(_Wrapper):
    """A copy of a module whose forward runs through a chain of graph passes.

    Returned by ``track_scales``, ``unit_scale``, ``simulate_format`` and ``compile`` in
    :mod:`unitscale.transforms`.
    Behaves like the module it wraps: same ``state_dict()`` keys, same attributes (looked up on
    the wrapped module), deep-copyable and picklable. A method of the wrapped module that calls
    the module itself (``self(...)``, ``self.forward(...)``: ``generate()``) runs this forward.
    """

    def __init__(self, module: nn.Module, passes: Sequence[GraphPass]) -> None:
        super().__init__()
        self.module = module
        self.passes: tuple[GraphPass, ...] = tuple(passes)
        self._capture: Capture | None = None

    # -- running ---------------------------------------------------------------------------
    @signed_forward  # inspect.signature(self.forward) is the wrapped module's (_signature.py)
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced by a torch.compile: see _inline.py
            return compiled_forward(self, args, kwargs)
        return self._transformed_forward(args, kwargs)

    def _transformed_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from ._functorch import refuse_under_functorch

        refuse_under_functorch(type(self.module).__name__, self._transforms_text())
        for graph_pass in self.passes:
            graph_pass.before_call(self, args, kwargs)
        for graph_pass in self.passes:
            args, kwargs = graph_pass.prepare_inputs(self, args, kwargs)
        if self._capture is None:
            self._capture = Capture(self)
        out = self._capture.call(args, kwargs)
        for graph_pass in reversed(self.passes):
            out = graph_pass.finish_outputs(self, out)
        return out

    @property
    def capture(self) -> Capture | None:
        """Runtime capture state (None before the first call)."""
        return self._capture

    def scales_graph(self) -> fx.Graph:
        """The tracked graph of the last call (see :func:`~unitscale.transforms.track_scales`).

        Raises:
            UnitScaleError: the module is not tracked.
        """
        for graph_pass in self.passes:
            if graph_pass.stage is Stage.TRACK:
                return graph_pass.scales_graph(self)  # type: ignore[attr-defined]
        raise UnitScaleError(
            "scales_graph(): this module is not tracked; wrap it with "
            "unitscale.transforms.track_scales(module) first"
        )

    def _transforms_text(self) -> str:
        """The transforms of the chain, for messages (``unit_scale, simulate_format``)."""
        names = {
            Stage.REWRITE: "unit_scale",
            Stage.SIMULATE: "simulate_format",
            Stage.TRACK: "track_scales",
            Stage.COMPILE: "compile",
        }
        return ", ".join(dict.fromkeys(names.get(p.stage, type(p).__name__) for p in self.passes))

    def pass_of_type(self, cls: type[GraphPass]) -> GraphPass | None:
        """The first pass in the chain that is an instance of ``cls``."""
        return next((p for p in self.passes if isinstance(p, cls)), None)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_capture"] = None
        state["passes"] = tuple(p.without_state() for p in self.passes)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __deepcopy__(self, memo: dict[int, Any]) -> TransformedModule:
        clone = TransformedModule.__new__(type(self))
        memo[id(self)] = clone
        state = self.__getstate__()
        clone.__dict__.update(copy.deepcopy(state, memo))
        return clone

    def extra_repr(self) -> str:
        return "passes=[" + ", ".join(type(p).__name__ for p in self.passes) + "]"


def iter_tensors(tree: Any) -> Iterator[Tensor]:
    """Every tensor in a nested structure of args (lists, tuples, dicts, dataclasses)."""
    leaves = torch.utils._pytree.tree_leaves(tree)
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            yield leaf
