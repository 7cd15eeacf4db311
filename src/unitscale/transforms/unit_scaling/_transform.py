"""``unit_scale``: turn an ordinary PyTorch model into a unit-scaled one, graph by graph.

:class:`UnitScalePass` rewrites each graph TorchDynamo captures, in three steps:

1. **Residual adds.** An addition ``skip + branch`` is a residual add when ``skip`` also feeds
   the computation of ``branch`` (``skip`` is an ancestor of ``branch`` in the graph) and that
   computation uses a parameter (so ``x + 0.04 * x**3`` inside a GELU is not one). The
   branch's uses of ``skip`` are redirected to the first output of
   :func:`~unitscale.functional.residual_split`, and the add becomes
   :func:`~unitscale.functional.residual_add`. A branch that contains an attention op
   (``scaled_dot_product_attention`` or a softmax) is an *attention* branch; any other is an
   *MLP* branch. Each gets its own weight, a share of the variance (see
   :class:`ResidualTau`: by default u-μP's rule,
   Appendix G of the paper, over ``n`` branches, ``n`` twice the length of the model's
   residual stack, found as ``transforms/unit_scaling/_residual_tau.py`` says, or else the number of
   residual adds captured; with ``mup=False``, equal shares). Adds are counted in
   execution order over the whole call, across graph breaks; where Dynamo runs one captured
   graph at several depths (a layer with a graph break inside: the code before the break and
   its resume function are compiled once and reused for every layer), each depth runs a
   variant of the graph rewritten with its own taus (:meth:`UnitScalePass.variant_key`).
2. **Op replacement.** Every call of a function in ``unitscale.functional.torch_map``
   (updated with ``replace``; a user's own function among its keys is kept as one op by
   Dynamo, see ``_user_ops.py``) whose result is a floating-point tensor is replaced by its
   unit-scaled equivalent; ``Tensor`` methods are looked up as ``getattr(torch.Tensor, name)``.
   An addition that is not a residual add becomes ``U.add`` only if its operands are two
   float tensors neither of which is computed from the other (``U.add`` assumes independent
   operands); ``x + 1``, size arithmetic and ``x + 0.04 * x**3`` stay plain additions.
   A matmul ``x @ W`` whose right operand is a 2-D parameter becomes ``linear(x, W.t())``:
   ``W`` is a weight (weight-gradient rule, re-initialised to N(0, 1) at its first capture
   unless written since ``unit_scale`` returned), not a second activation.
   Attention with an explicit ``attn_mask`` uses
   :func:`~unitscale.functional.masked_scaled_dot_product_attention`, which reads
   the number of visible keys from the mask.
3. **Unconstrained head.** Ops downstream of the graph's last residual add get
   ``constraint=None`` (where they take one): there the graph is a chain, so a gradient scale
   that is off by a constant factor only rescales every upstream gradient by the same
   factor, which Adam-style optimisers ignore; in exchange the head's output and gradients
   are all unit.
4. **Data-parallel hints.** Values computed from the model's tensor inputs carry the batch;
   an embedding of ids computed without them (position ids, even of shape ``(1, T)``) and an
   operand computed without them in an add with one computed with them are shared by every
   example, which their shapes cannot show at a local batch of 1
   (:mod:`unitscale.data_parallel`).

Each replacement is logged at INFO on the ``"unitscale"`` logger as ``unit scaling function:
<node>``, each residual add as ``unit scaling function: <node> (residual-add, tau=<tau>,
share=<share>)`` (``tau`` the branch's std over the skip's, as the reference's
``residual_add`` takes it, ``share`` its share of the variance; 4 significant digits), in
graph order, when the graph is captured.

Design constraints: the pass holds only configuration (``replace``, taus) and pickles as such;
new and rewritten nodes keep Dynamo's ``example_value`` and source meta, so ``track_scales``
applied on top records and names them; ``unit_scale`` itself re-initialises the copy's
weights (never the user's module) so that they have unit scale.

This module holds the pass and ``unit_scale``; what the pass recognises in a graph is in
``_unit_scale_graph.py``, how the copy's weights are initialised in ``_unit_scale_init.py``,
the checks of ``replace`` in ``_unit_scale_replace.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
import operator
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ...capture import (
    Capture,
    Invocation,
    Piece,
    Stage,
    TransformedModule,
    example_value,
    is_float_node,
    transformed,
)
from ...functional import masked_scaled_dot_product_attention, share_to_tau
from ...parameter import tag_model
from .._rewrite import (
    RewritePass,
    insert_call,
    parameter_nodes,
    placeholder_names,
)
from ._graph import (
    _batch_nodes,
    _has_mask,
    _hint_batch,
    _independent_add,
    _is_matmul,
    _ResidualAdd,
)
from ._initialise import (
    _init_unit_scale,
    _mark_conv1d_fan_in,
    _readout_name,
    _unowned_versions,
    _untie_readout,
)
from ._inplace import functionalize_inplace
from ._norms import freeze_norms
from ._replace import _check_replace, _op_name, _torch_map
from ._residual_rewrite import rewrite_residual_adds
from ._residual_tau import ResidualTau, mark_depth_rule, residual_stack_length
from ._summary import classify, log_left_as_is, op_label
from ._user_ops import KeptWhole, is_user_function

__all__ = [
    "ResidualTau",
    "UnitScalePass",
    "unit_scale",
]

logger = logging.getLogger("unitscale")


def _accepts_constraint(fn: Callable[..., Any]) -> bool:
    try:
        return "constraint" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class UnitScalePass(RewritePass):
    """Make every captured graph unit-scaled (see the module docstring for the three steps).

    Reads: node targets, Dynamo's ``example_value`` meta, which placeholders are parameters.
    Writes: rewritten graphs; ``piece.data["unit_scale"]`` (:attr:`data_key`), a dict with
    ``"replaced"`` (node names) and ``"residual_adds"`` (``(node name, kind, tau)``) in graph
    order. Scoped to a submodule (a unit-scaled child absorbed by a transform of its parent),
    it rewrites that submodule's ops only, as ``unit_scale`` of the child alone would.

    Args:
        replace: extra or overriding entries for ``unitscale.functional.torch_map``.
        residual_tau: the ``tau`` of each kind of residual branch.
        readout_weight: qualified name of the output head's weight, whose linear becomes
            u-μP's readout (:func:`~unitscale.functional.linear_readout`, ``mup=True``), or
            None (no u-μP readout: plain unit scaling).
    """

    stage = Stage.REWRITE
    scopable = True
    transform_name = "unit_scale"
    uncaptured_consequence = (
        "the ops computing them are not unit-scaled (move the graph break, e.g. a "
        "print or .item(), out of loops and nested modules)"
    )
    repeatable = False
    applied = "is already unit-scaled"

    def __init__(
        self,
        replace: Mapping[Callable[..., Any], Callable[..., Any]] | None = None,
        residual_tau: ResidualTau | None = None,
        readout_weight: str | None = None,
    ) -> None:
        self.replace = _check_replace(replace)
        # The user's own functions among the keys: one op each in the graph while we run.
        self._kept = KeptWhole(k for k in self.replace if is_user_function(k))
        self.residual_tau = residual_tau if residual_tau is not None else ResidualTau()
        self.readout_weight = readout_weight
        #: Qualified names of the parameters ``unit_scale`` re-initialised (for warnings).
        self.reinitialised: list[str] = []
        # Parameter name -> version when unit_scale returned, for parameters that may turn
        # out to be matmul weights (re-initialised at their first capture if unchanged).
        self._versions: dict[str, int] | None = None
        #: The number of residual branches the paper's rule divides by (None: counted).
        self.residual_layers: int | None = None
        # (the running call's trace, invocations counted, residual adds and attention
        # branches among them).
        self._counted: tuple[list[Invocation], int, int, int] | None = None

    def without_state(self) -> UnitScalePass:
        clone = copy.copy(self)
        clone._counted = None
        clone._kept = KeptWhole(self._kept.functions)
        return clone

    def inlinable(self, module: nn.Module) -> bool:
        """True: the rewrite is all in the graph (the residual weights of its one piece are
        fixed); the call hooks keep the user's functions whole while Dynamo captures, and warn."""
        return True

    def before_call(self, module: TransformedModule, args: tuple[Any, ...], kwargs: dict) -> None:
        super().before_call(module, args, kwargs)
        self._kept.enter()  # the user's functions of replace: kept whole by Dynamo

    def after_call(self, module: TransformedModule, capture: Capture, output: Any) -> None:
        self._kept.exit()
        super().after_call(module, capture, output)
        log_left_as_is(capture, self.data_key)  # once per model and op, when first run

    def scoped(self, prefix: str) -> UnitScalePass:
        """This pass for the submodule ``prefix`` only: its parameter names gain the prefix."""
        clone = super().scoped(prefix)
        assert isinstance(clone, UnitScalePass)
        clone.reinitialised = [f"{prefix}.{name}" for name in self.reinitialised]
        if self._versions is not None:
            clone._versions = {f"{prefix}.{k}": v for k, v in self._versions.items()}
        return clone

    @property
    def data_key(self) -> str:
        """Where this pass writes in ``piece.data``: ``"unit_scale"``, or
        ``"unit_scale[<scope>]"`` for a pass scoped to a submodule."""
        return f"unit_scale[{self.scope}]" if self.scope else "unit_scale"

    def __repr__(self) -> str:
        names = ", ".join(_op_name(k) for k in self.replace)
        extra = f", replace={{{names}}}" if self.replace else ""
        return f"UnitScalePass(residual_tau={self.residual_tau}{extra})"

    def mapping(self) -> dict[Callable[..., Any], Callable[..., Any]]:
        """``unitscale.functional.torch_map`` updated with ``replace``."""
        mapping = _torch_map()
        mapping.update(self.replace)
        return mapping

    # -- the place of a piece in the call ----------------------------------------------------
    def _residual_adds_before(self, capture: Capture) -> tuple[int, int]:
        """How many residual adds, and attention branches among them, the running call has
        run so far (in the pieces of ``capture.trace``), counted incrementally: O(1) per
        piece over a call."""
        trace = capture.trace
        counted = self._counted
        if counted is None or counted[0] is not trace or counted[1] > len(trace):
            counted = (trace, 0, 0, 0)
        _, done, total, attention = counted
        for invocation in trace[done:]:
            adds = invocation.piece.data.get(self.data_key, {}).get("residual_adds", ())
            total += len(adds)
            attention += sum(1 for _, kind, _ in adds if kind == "attention")
        self._counted = (trace, len(trace), total, attention)
        return total, attention

    def variant_key(self, piece: Piece, capture: Capture) -> Hashable:
        """The number of residual adds (and attention branches among them) that ran before
        ``piece`` in this call, where ``piece`` has residual adds: their taus follow the
        rule from there, so a
        piece Dynamo reuses at another depth (a layer with a graph break inside, run for
        every layer) is rewritten again with that depth's taus."""
        if not piece.data.get(self.data_key, {}).get("residual_adds"):
            return None
        return self._residual_adds_before(capture)

    # -- the rewrite ------------------------------------------------------------------------
    def transform(self, gm: fx.GraphModule, piece: Piece, capture: Capture) -> fx.GraphModule:
        graph = gm.graph
        functionalize_inplace(graph)  # x += 1 on a residual stream: see _inplace
        params = parameter_nodes(gm, piece)
        # Residual adds are counted in execution order across graph breaks: the pieces that
        # already ran in this call come first.
        before = self._residual_adds_before(capture)
        in_scope = self.scope_filter(capture, piece)
        residual_adds = rewrite_residual_adds(
            graph, params, before, in_scope, self.residual_tau, self.residual_layers
        )
        was = {n: op_label(n) for n in graph.nodes if n.op in ("call_function", "call_method")}
        weights = self._matmul_weights_to_linear(graph, gm, piece, params, capture, in_scope)
        replaced = self._replace_ops(graph, in_scope)
        replaced.extend(self._mup_readout(graph, gm, piece, replaced))
        if residual_adds:
            self._unconstrain_after(residual_adds[-1], in_scope)
        _hint_batch(graph, _batch_nodes(gm, piece))
        graph.lint()
        # One line per rewritten node, in graph (execution) order.
        shares: dict[fx.Node, float] = {
            r.node: float(r.node.kwargs["share"])  # type: ignore[arg-type]
            for r in residual_adds
        }
        rewritten = set(replaced) | set(shares)
        for node in graph.nodes:
            if node in shares:
                logger.info(
                    "unit scaling function: %s (residual-add, tau=%.4g, share=%.4g)",
                    node.name,
                    share_to_tau(shares[node]),
                    shares[node],
                )
            elif node in rewritten:
                logger.info("unit scaling function: %s", node.name)
        piece.data[self.data_key] = {
            "replaced": [n.name for n in replaced],
            "replacements": [(n.name, was.get(n, op_label(n)), op_label(n)) for n in replaced],
            "matmul_weights": weights,
            "residual_adds": [(r.node.name, r.kind, r.node.kwargs["share"]) for r in residual_adds],
            # the other float ops: left as they are, or scale-neutral (see unit_scale_summary)
            **classify(graph, rewritten, in_scope),
        }
        return gm

    def _matmul_weights_to_linear(
        self,
        graph: fx.Graph,
        gm: fx.GraphModule,
        piece: Piece,
        params: set[fx.Node],
        capture: Capture,
        in_scope: Callable[[fx.Node], bool],
    ) -> list[str]:
        """``x @ W`` with a 2-D parameter ``W`` becomes ``linear(x, W.t())``: a weight, scaled
        and re-initialised as ``nn.Linear``'s is (not as a second activation). Returns the
        parameters' qualified names."""
        if self.mapping().get(F.linear) is F.linear:
            return []  # linear is not unit-scaled: leave matmuls as they are
        names = {n: name for n, (kind, name) in placeholder_names(gm, piece).items()}
        found: list[str] = []
        for node in list(graph.nodes):
            if not _is_matmul(node) or len(node.args) != 2 or node.kwargs:
                continue
            if not in_scope(node):
                continue
            left, right = node.args
            value = example_value(right)
            if right not in params or not is_float_node(left) or value.dim() != 2:
                continue
            assert isinstance(right, fx.Node)
            with graph.inserting_before(node):
                transposed = insert_call(
                    graph, torch.t, (right,), name=f"{right.name}_t", value=value.t(),
                    meta_from=node,
                )  # fmt: skip
            node.op = "call_function"
            node.target = F.linear
            node.args = (left, transposed)
            name = names.get(right)
            if name is not None:
                found.append(name)
                self._init_matmul_weight(capture, name)
        return found

    def _init_matmul_weight(self, capture: Capture, name: str) -> None:
        """Re-initialise a parameter used as a matmul weight to N(0, 1), as ``unit_scale``
        does for ``nn.Linear``: at its first capture, unless it was written since
        ``unit_scale`` returned (a loaded checkpoint or a training step is kept)."""
        versions = getattr(self, "_versions", None)
        if versions is None or name not in versions:
            return
        try:
            parameter = capture.owner_module.get_parameter(name)
        except AttributeError:
            return
        if parameter._version == versions.pop(name):
            with torch.no_grad():
                parameter.normal_(0.0, 1.0)

    def _replace_ops(self, graph: fx.Graph, in_scope: Callable[[fx.Node], bool]) -> list[fx.Node]:
        from ... import functional as U

        mapping = self.mapping()
        replaced: list[fx.Node] = []
        for node in list(graph.nodes):
            if not in_scope(node):
                continue
            if node.op == "call_function":
                key: Any = node.target
            elif node.op == "call_method":
                key = getattr(torch.Tensor, str(node.target), None)
            else:
                continue
            try:
                fn = mapping.get(key)
            except TypeError:  # unhashable target
                continue
            if fn is None or fn is key or not is_float_node(node):
                continue
            if key in (operator.add, torch.add, torch.Tensor.add) and not _independent_add(node):
                continue
            if fn is U.scaled_dot_product_attention and _has_mask(node):
                fn = masked_scaled_dot_product_attention
            node.op = "call_function"
            node.target = fn
            replaced.append(node)
        return replaced

    def _mup_readout(
        self, graph: fx.Graph, gm: fx.GraphModule, piece: Piece, replaced: list[fx.Node]
    ) -> list[fx.Node]:
        """The unit-scaled linear whose weight is the output head's becomes u-μP's readout
        (``linear_readout(..., mup=True)``: output multiplier ``1/fan_in``)."""
        from ... import functional as U

        if getattr(self, "readout_weight", None) is None:
            return []
        names = {n: name for n, (kind, name) in placeholder_names(gm, piece).items()}
        found = []
        for node in graph.nodes:
            if node.op != "call_function" or node.target is not U.linear or node not in replaced:
                continue
            weight = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
            if isinstance(weight, fx.Node) and names.get(weight) == self.readout_weight:
                node.target = U.linear_readout
                node.kwargs = {**node.kwargs, "mup": True}
                found.append(node)
        return [n for n in found if n not in replaced]

    def _unconstrain_after(self, last: _ResidualAdd, in_scope: Callable[[fx.Node], bool]) -> None:
        seen: set[fx.Node] = set()
        stack = list(last.node.users)
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            stack.extend(node.users)
            if not in_scope(node):
                continue
            if node.op == "call_function" and callable(node.target):
                if _accepts_constraint(node.target):
                    node.kwargs = {**node.kwargs, "constraint": None}


def unit_scale(
    module: nn.Module,
    replace: Mapping[Callable[..., Any], Callable[..., Any]] | None = None,
    mup: bool = True,
    *,
    residual_tau: ResidualTau | None = None,
    residual_mult: float | None = None,
    residual_attn_ratio: float | None = None,
    trainable_norms: bool = False,
    depth_rule: str | None = None,
) -> TransformedModule:
    """Return a unit-scaled, u-μP copy of ``module``: same code, unit-scaled ops and weights.

    The copy's ``torch``/``F`` calls are replaced by their :mod:`unitscale.functional`
    equivalents (``unitscale.functional.torch_map``, updated with ``replace``), its residual
    adds become ``residual_split``/``residual_add`` (attention and MLP branches weighted by
    ``residual_tau``), ops after the last residual add are unconstrained, and its
    ``nn.Linear``, ``nn.Conv1d`` and ``nn.Embedding`` weights are re-initialised to N(0, 1)
    (LayerNorm/RMSNorm weights to 1), biases to 0, wherever their op is unit-scaled. Its
    parameters are tagged for u-μP (:func:`unitscale.parameter.tag_model`), so
    :mod:`unitscale.optim` can train it. The graph is captured, and logged, at the first
    call (again on recompilation). See the module docstring for the residual-add rule.

    u-μP (``mup=True``, default; Blake et al., ICLR 2025): the output head, the module
    ``module.get_output_embeddings()`` returns (transformers' ``lm_head``), becomes u-μP's
    readout (:func:`~unitscale.functional.linear_readout` with ``mup=True``: multiplier
    ``1/fan_in``) and its weight is tagged ``"output"``; an input embedding tied to it is
    *untied* (the head gets its own copy, ``config.tie_word_embeddings`` is set False),
    since u-μP gives the two different multipliers and learning rates; weights stored
    ``(in, out)`` (transformers' ``Conv1D``, GPT-2) carry ``fan_in_dim = 0`` so that
    :mod:`unitscale.optim` reads their fan-in from the right dimension; every other
    parameter has its role (:func:`unitscale.parameter.tag_model`). A model without
    ``get_output_embeddings`` has no readout to find: its head stays a unit-scaled linear,
    tagged ``"weight"`` (its true role). The attention's logit scale is the model's own
    (``1/sqrt(d_head)`` in transformers models): a constant when, as usual, the head size
    stays fixed as the width grows. ``mup=False``: plain unit scaling (the head a
    unit-scaled linear tagged ``"weight"``), its head untied from the input embedding too:
    where the residual stream still holds a token's own embedding row (gemma multiplies its
    embedding by ``sqrt(width)``), a tied head gives that row a logit of up to
    ``sqrt(width)`` against unit-scale others, so the initial loss is not ``ln(vocab)``.

    Args:
        module: any ``torch.nn.Module`` TorchDynamo can capture (plain, not yet tracked,
            format-simulated or compiled).
        replace: ``{torch function: replacement}`` entries that override or extend
            ``torch_map``; each key must be a key of ``torch_map`` or a Python function of
            your own (a hand-written GELU: while the model runs, TorchDynamo keeps each
            call of it as one op, rather than tracing into it, so that the call is
            replaced whole), and each value a callable taking the same arguments (map a
            function to itself to leave it as it is; a torch op as a value means its unit-scaled
            op: ``{f: F.gelu}`` gives ``U.gelu``). Use module-level functions to pickle it.
        mup: u-μP (default, above); False for plain unit scaling.
        residual_tau: residual weights per kind of branch (default: u-μP's rule, Appendix
            G of the paper, see :class:`ResidualTau`; with ``mup=False`` and no mult given,
            ``ResidualTau(rule="equal_shares")``, equal shares of every branch, as
            ``TransformerDecoder(mup=False)``).
        residual_mult: α_res of u-μP's residual rule (None: ``residual_tau``'s, 1.0).
        residual_attn_ratio: α_ratio of u-μP's residual rule (None: ``residual_tau``'s, 1.0).
        trainable_norms: with ``mup=True``, keep the norms' scales and biases trainable.
            Default False, the paper's recommended scheme: every normalisation module's
            parameters are fixed (``requires_grad=False``; torch's norms at scale 1 and
            bias 0, others at the values they hold, their identity initialisation), because
            at u-μP's learning rates (a norm scale steps at ``lr / sqrt(depth)``) they move
            too fast. Linear biases keep training (``lr / sqrt(depth)``, the reference's
            bias rule). With ``mup=False`` norms are left trainable.
        depth_rule: ``"depth-mup"`` (u-μP's) or ``"completep"`` (CompleteP, Dey et al.
            2025, arXiv 2505.01618: residual multipliers ``1/L`` and no depth factor on the
            Adam learning rates of the stack's parameters, which carry
            ``mup_depth_rule``; see :class:`~unitscale.TransformerDecoder`); None:
            ``residual_tau``'s (``"depth-mup"``).

    Returns:
        The unit-scaled copy (``module`` is not touched; a checkpoint of ``module`` loads
        into it, though unit-scaled ops expect unit-scaled weights).

    Raises:
        UnknownOpError: a ``replace`` key is neither in ``torch_map`` nor a Python function
            of the user's (e.g. a torch op ``unit_scale`` does not know), or a value is not
            callable.
        CaptureError: ``module`` is not a module, is compiled, tracked, already unit-scaled
            or format-simulated, or holds a submodule that is (the error names it); or
            TorchDynamo cannot capture it (at the first call).

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> class Block(nn.Module):
        ...     def __init__(self) -> None:
        ...         super().__init__()
        ...         self.norm, self.up = nn.LayerNorm(256), nn.Linear(256, 256)
        ...     def forward(self, x):
        ...         return x + self.up(self.norm(x))
        >>> model = unit_scale(Block())
        >>> round(model(torch.randn(64, 256)).std().item(), 1)
        1.0
    """
    checked = _check_replace(replace)
    if residual_tau is None:
        # plain unit scaling keeps equal shares, as TransformerDecoder(mup=False) does,
        # unless a mult of u-muP's rule is given
        plain = not mup and residual_mult is None and residual_attn_ratio is None
        residual_tau = ResidualTau(rule="equal_shares" if plain else "paper")
    residual_tau = dataclasses.replace(
        residual_tau,
        residual_mult=residual_tau.residual_mult if residual_mult is None else residual_mult,
        residual_attn_ratio=(
            residual_tau.residual_attn_ratio if residual_attn_ratio is None else residual_attn_ratio
        ),
        depth_rule=residual_tau.depth_rule if depth_rule is None else depth_rule,
    )
    graph_pass = UnitScalePass(checked, residual_tau)
    result = transformed(module, graph_pass, "unit_scale")
    head = _readout_name(result.module)
    if head is not None:
        # Untied with or without u-muP: a tied head gives each token's own embedding row a
        # logit of up to sqrt(width), which dominates the unit-scale others (see unit_scale).
        _untie_readout(result.module, head)
    readout = head if mup else None
    graph_pass.readout_weight = readout
    graph_pass.reinitialised = _init_unit_scale(result.module, graph_pass.mapping())
    # Parameters not owned by a module re-initialised above may turn out, at capture, to be
    # matmul weights (x @ self.W): remember their versions to re-initialise them then.
    graph_pass._versions = _unowned_versions(result.module)
    # so that unitscale.optim's u-muP optimisers can train it
    tag_model(result.module, output=result.module.get_parameter(readout) if readout else None)
    _mark_conv1d_fan_in(result.module)
    # the paper's rule divides by the number of residual branches: two per layer of the
    # residual stack (else counted from the captured adds)
    stack = residual_stack_length(result.module)
    graph_pass.residual_layers = 2 * stack if stack else None
    mark_depth_rule(result.module, residual_tau.depth_rule)
    if mup and not trainable_norms:
        freeze_norms(result.module)
    return result
