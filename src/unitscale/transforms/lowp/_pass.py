"""The graph pass of ``simulate_format`` and ``simulate_fp8``: :class:`SimulateFormatPass`.

The pass rewrites each captured graph so that every floating-point operand of a matmul-like
op (:mod:`unitscale.transforms.lowp._operands`) goes through
:func:`~unitscale.transforms.lowp._quantise.quantise_operand` first: the operand is
rounded to ``fwd_format`` in the forward pass and, optionally, the gradient with respect to
it is rounded to ``bwd_format`` in the backward pass. Optionally, the gradient with respect
to the op's *output* is rounded too (``quantise_grad``, inserted after the op, with the bias
of a linear op moved after it).

Design constraints: an inserted node carries the ``example_value`` of the operand it
quantises, so that ``track_scales`` applied on top records it (as ``<operand>_quantised``);
the pass holds only its configuration (formats, scaling, scope), so it pickles and
deep-copies as configuration.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ...capture import (
    Capture,
    Piece,
    Stage,
    TransformedModule,
    example_value,
    is_float_node,
    module_path_at,
)
from ...formats import FPFormat
from .._rewrite import RewritePass, insert_call, parameter_nodes, placeholder_names
from . import _simulated_rowwise as rowwise
from ._operands import NO_FLOAT_OPERAND, UNRECOGNISED, fp8_candidates, is_unit_scaled
from ._ops import (
    OpsScope,
    add_bias,
    is_linear,
    target_name,
    unit_addmm_bias,
    unit_linear_bias,
    unit_readout_bias,
)
from ._quantise import format_spec, fp8_scale, quantise_grad, quantise_operand
from ._scaling import DEFAULT_HISTORY_LEN, ROWWISE_SCALINGS, Scaling, history_buffer
from ._summary import record, warn_if_not_unit_scaled

__all__ = ["SimulateFormatPass"]

NO_ROWWISE = "no rowwise counterpart"
"""Summary reason of a linear op that the rowwise recipes have no simulated form of."""


class _Sites:
    """While one graph is rewritten: the history node of each scaled rounding (delayed
    scaling only) and how many scaled roundings the forward and the backward do.

    A history is named after the op it serves, where the piece runs (the module path as
    :func:`~unitscale.capture.module_path_at` gives it, with the op's name unless it is a
    linear op) and the tensor's role (the operand's argument name, ``grad_<operand>``,
    ``grad_output``): ``fp8_amax_history_blocks_1_fc_input``. The names are kept per
    capture, keyed by that place, the role and the op's source line, so that a graph
    recaptured for new shapes finds its histories again and two ops of different graph
    pieces (around a graph break) never share one, whatever Dynamo named their nodes.
    """

    def __init__(
        self, gm: fx.GraphModule, piece: Piece, capture: Capture, history_len: int, delayed: bool
    ) -> None:
        self.gm = gm
        self.piece = piece
        self.root = capture.owner_module if delayed else None
        self.history_len = history_len
        self.counts = [0, 0]  # scaled roundings in the forward, in the backward
        if self.root is not None:
            self.names: dict[tuple[Any, ...], str] = capture.pass_state.setdefault(_SITES, {})
            self.module_names = {id(m): n for n, m in self.root.named_modules()}
            self.parameters = parameter_nodes(gm, piece)
            self.seen: dict[tuple[Any, ...], int] = {}

    def history(
        self, graph: fx.Graph, op: fx.Node, role: str, device: torch.device
    ) -> fx.Node | None:
        """A ``get_attr`` node for the history of ``op``'s tensor ``role``, or None without
        delayed scaling. The graph module holds the root's buffer itself, so the graph's
        updates are the buffer's."""
        if self.root is None:
            return None
        place = module_path_at(op, self.piece.frame_module, self.module_names)
        if not is_linear(op, self.parameters):
            place = f"{place}.{target_name(op.target).rsplit('::', 1)[-1]}".lstrip(".")
        key: tuple[Any, ...] = (place, role, op.meta.get("stack_trace"))
        occurrence = self.seen.get(key, 0)
        self.seen[key] = occurrence + 1
        key = (*key, occurrence)
        site = self.names.get(key)
        if site is None:
            base = re.sub(r"\W", "_", f"{place}.{role}" if place else role)
            taken = set(self.names.values())
            site, n = base, 0
            while site in taken:
                n += 1
                site = f"{base}_{n}"
            self.names[key] = site
        name = history_buffer(self.root, site, self.history_len, device)
        if name not in self.gm._buffers:
            self.gm.register_buffer(name, self.root._buffers[name])
        node = graph.get_attr(name)
        node.meta["example_value"] = torch.empty(self.history_len, device="meta")
        self.piece.data[_SITES] = True
        return node


_SITES = "fp8_history_sites"
"""Key of the history names in ``capture.pass_state`` and, in ``piece.data``, the mark of a
piece that reads histories (its variants: :func:`history_variant_key`)."""


def history_variant_key(scaling: str, piece: Piece, capture: Capture) -> Hashable:
    """The variant key of a piece with delayed scaling: its position in the running call.

    Dynamo reuses the graph of one layer's frame (a layer with a graph break inside) for
    every other layer; its history nodes name the first layer's histories. Keyed by its
    position, the piece is rewritten for each place it runs at, with that place's
    histories (named from its parameters' module, see :class:`_Sites`)."""
    if scaling != "delayed" or not piece.data.get(_SITES):
        return None
    return len(capture.trace)


class SimulateFormatPass(RewritePass):
    """Quantise the operands of matmul-like ops (forward values and their gradients).

    Reads: node targets and Dynamo's ``example_value`` meta (only floating-point operands
    are quantised). Writes: one :func:`quantise_operand` node per operand slot of each op
    (``x @ x`` gets two: each slot's gradient is rounded on its own), inserted just
    before the op, named ``<operand>_quantised``, with the operand's ``example_value``;
    with ``output_grad_format``, one :func:`quantise_grad` node after each op whose output
    is a floating-point tensor, named ``<op>_grad_quantised``, taking over the op's users
    (the bias of a linear op or an ``addmm`` is then added after it, by a node ``<op>_bias``
    calling :func:`~._fp8_ops.add_bias` or its unit-scaled variants, so that the bias
    gradient is not rounded, as in torchao, Transformer Engine and ``to_fp8``; an ``addmm``
    then runs as ``torch.mm``, a unit-scaled one as the unit-scaled ``linear`` of a ``t``
    node); with ``scaling``, one
    :func:`fp8_scale` node per operand (``<operand>_scale``, meta ``fp8_scaling``), and for
    ``"delayed"`` one ``fp8_amax_history`` call per scaled rounding returning its history;
    ``piece.data["simulate_format"]``: the names of the quantised ``(op, operand)`` pairs.

    Args:
        fwd_format: format of the operands in the forward pass.
        bwd_format: format of the gradients with respect to the operands (None: not rounded).
        output_grad_format: format of the gradient with respect to each op's output (None:
            not rounded).
        scaling: ``"none"``, ``"tensorwise"`` or ``"delayed"``.
        history_len: amax-history length for ``"delayed"``.
        ops: ``"matmuls"`` (every matmul-like op) or ``"linear"`` (only the ops with a
            weight parameter, see :mod:`unitscale.transforms.lowp._ops`); the matmul-like
            ops left out are recorded for :func:`~unitscale.transforms.fp8_summary`.
        transform: the transform's name in that summary and its log line.
        skip: qualified names of the modules whose ops are left as they are (``skip=``,
            :mod:`~._skip`), listed in that summary.
    """

    stage = Stage.SIMULATE
    scopable = True
    transform_name = "simulate_format"
    uncaptured_consequence = "their matmul-like ops run unquantised"
    applied = "already simulates a number format"
    order_fix = (
        "unit-scale first so that the formats see unit-scaled tensors, e.g. "
        "simulate_fp8(unit_scale(model)); the other order has no meaning, as {op} would "
        "replace the ops whose operands the format rounds"
    )

    def __init__(
        self,
        fwd_format: FPFormat,
        bwd_format: FPFormat | None,
        output_grad_format: FPFormat | None = None,
        scaling: Scaling = "none",
        history_len: int = DEFAULT_HISTORY_LEN,
        ops: OpsScope = "matmuls",
        transform: str = "simulate_format",
        skip: frozenset[str] = frozenset(),
    ) -> None:
        self.fwd_format = fwd_format
        self.skip = skip
        self.bwd_format = bwd_format
        self.output_grad_format = output_grad_format
        self.scaling = scaling
        self.history_len = history_len
        self.ops = ops
        self.label = transform

    def __repr__(self) -> str:
        return (
            f"SimulateFormatPass(fwd_format={self.fwd_format}, bwd_format={self.bwd_format}, "
            f"output_grad_format={self.output_grad_format}, scaling={self.scaling!r}, "
            f"ops={self.ops!r})"
        )

    def variant_key(self, piece: Piece, capture: Capture) -> Hashable:
        return history_variant_key(self.scaling, piece, capture)

    def inlinable(self, module: nn.Module) -> bool:
        """True: the roundings are ops of the graph, and so are the updates of delayed
        scaling's amax histories (buffers the graph updates in place); the call hooks warn."""
        return True

    def after_call(self, module: TransformedModule, capture: Capture, output: Any) -> None:
        super().after_call(module, capture, output)
        trace = capture.trace or capture.last_trace
        if getattr(self, "_checked", False) or not trace:
            return
        self._checked = True
        fmt = self.fwd_format
        eight_bits = fmt.exponent_bits + fmt.mantissa_bits < 8  # FP8 and narrower
        if self.label == "simulate_fp8" and self.scaling == "none" and eight_bits:
            warn_if_not_unit_scaled(self.label, module, trace)

    def without_state(self) -> SimulateFormatPass:
        clone = super().without_state()
        clone.__dict__.pop("_checked", None)
        clone.__dict__.pop("_warned", None)
        return clone  # type: ignore[return-value]

    def transform(self, gm: fx.GraphModule, piece: Piece, capture: Capture) -> fx.GraphModule:
        # Per-graph state, held by the pass only while this graph is rewritten (the pass
        # itself stays configuration: it pickles and deep-copies).
        self._sites = _Sites(gm, piece, capture, self.history_len, self.scaling == "delayed")
        try:
            # extend: a nested child's own pass may already have rounded its ops here.
            piece.data.setdefault("simulate_format", []).extend(self._rewrite(gm, piece, capture))
            piece.data["fp8_scaling"] = (self.scaling, *self._sites.counts)
        finally:
            del self._sites
        return gm

    def _rewrite(self, gm: fx.GraphModule, piece: Piece, capture: Capture) -> list[tuple[str, str]]:
        graph = gm.graph
        names = {node: name for node, (_, name) in placeholder_names(gm, piece).items()}
        quantised: list[tuple[str, str]] = []
        converted: list[str] = []
        left: list[tuple[str, str]] = []
        unit_scaled = 0
        for node, label, slots in fp8_candidates(self, gm, piece, capture, self.ops, left):
            if self.scaling in ROWWISE_SCALINGS:
                unit = is_unit_scaled(node)
                if not self._rowwise(node):
                    left.append((label, NO_ROWWISE))
                    continue
                converted.append(label)
                unit_scaled += unit
                continue
            before = len(quantised)
            if node.op == "call_function" and node.target is torch.einsum:
                self._quantise_einsum(graph, node, names, quantised)
                self._quantise_output_grad(graph, node)
            else:
                self._quantise_slots(graph, node, slots, names, quantised)
            if len(quantised) > before:
                converted.append(label)
                unit_scaled += is_unit_scaled(node)
            else:
                left.append((label, NO_FLOAT_OPERAND))
        record(piece, self.label, converted, left, (UNRECOGNISED,), unit_scaled=unit_scaled)
        return quantised

    def _rowwise(self, node: fx.Node) -> bool:
        """Make the linear op ``node`` run torchao's rowwise recipe (:mod:`~._simulated_rowwise`):
        two scaled casts in the forward, four in the backward (two with the weight
        gradient in high precision)."""
        if not rowwise.convert(node, self.scaling):
            return False
        self._sites.counts[0] += 2
        self._sites.counts[1] += 2 if self.scaling == "rowwise_with_gw_hp" else 4
        node.meta["fp8_scaling"] = {"forward": self.scaling, "gradient": self.scaling}
        return True

    def _quantise_slots(
        self,
        graph: fx.Graph,
        node: fx.Node,
        slots: list[tuple[int, str]],
        names: dict[fx.Node, str],
        quantised: list[tuple[str, str]],
    ) -> None:
        """Round each floating-point operand in ``slots`` of ``node``, then its output gradient."""
        operand: Any
        for position, keyword in slots:
            if position < len(node.args):
                operand = node.args[position]
            elif keyword:
                operand = node.kwargs.get(keyword)
            else:
                operand = None
            if not is_float_node(operand):
                continue
            # One node per operand slot, even for x @ x: each slot's gradient is a
            # separate output of the matmul's backward, rounded on its own.
            new = self._insert(graph, node, operand, keyword or f"operand{position}", names)
            quantised.append((node.name, operand.name))
            if position < len(node.args):
                args = list(node.args)
                args[position] = new
                node.args = tuple(args)
            else:
                node.kwargs = {**node.kwargs, keyword: new}
        if slots:
            self._quantise_output_grad(graph, node)

    def _quantise_output_grad(self, graph: fx.Graph, node: fx.Node) -> None:
        """Round the gradient arriving at ``node``'s output (what the matmul's backward reads)."""
        if self.output_grad_format is None or not is_float_node(node) or not node.users:
            return
        with graph.inserting_after(node):
            history = self._sites.history(graph, node, "grad_output", example_value(node).device)
        with graph.inserting_after(history or node):
            new = insert_call(
                graph,
                quantise_grad,
                (node, format_spec(self.output_grad_format), self.scaling, history),
                name=f"{node.name}_grad_quantised",
                value=example_value(node),
                meta_from=node,
            )
        if self.scaling != "none":
            self._sites.counts[1] += 1
            new.meta["fp8_scaling"] = {"gradient": self.scaling}
        node.replace_all_uses_with(
            new, delete_user_cb=lambda user: user is not new and user is not history
        )
        self._add_bias_after(graph, node, new)

    @staticmethod
    def _add_bias_after(graph: fx.Graph, node: fx.Node, rounded: fx.Node) -> None:
        """Move the bias of a linear op (``F.linear``, the unit-scaled linear and readout) or
        of an ``addmm`` (transformers' ``Conv1D``, unit-scaled or not) after the
        output-gradient rounding: the bias gradient is the sum of the unrounded output
        gradient, as in torchao's ``Float8Linear`` and Transformer Engine, and as in
        ``to_fp8`` (:func:`~._fp8_ops.add_bias`)."""
        split = _split_bias(graph, node)
        if split is None:
            return
        function, args = split
        with graph.inserting_after(rounded):
            added = insert_call(
                graph,
                function,
                (rounded, *args),
                name=f"{node.name}_bias",
                value=example_value(node),
                meta_from=node,
            )
        rounded.replace_all_uses_with(added, delete_user_cb=lambda user: user is not added)

    def _quantise_einsum(
        self,
        graph: fx.Graph,
        node: fx.Node,
        names: dict[fx.Node, str],
        quantised: list[tuple[str, str]],
    ) -> None:
        listed = len(node.args) == 2 and isinstance(node.args[1], (list, tuple))
        operands: list[Any] = list(node.args[1] if listed else node.args[1:])  # type: ignore[arg-type]
        for i, operand in enumerate(operands):
            if not is_float_node(operand):
                continue
            operands[i] = self._insert(graph, node, operand, f"operand{i}", names)
            quantised.append((node.name, operand.name))
        if listed:
            node.args = (node.args[0], list(operands))
        else:
            node.args = (node.args[0], *operands)

    def _insert(
        self,
        graph: fx.Graph,
        consumer: fx.Node,
        operand: fx.Node,
        role: str,
        names: dict[fx.Node, str],
    ) -> fx.Node:
        base = names.get(operand, operand.name)
        bwd = None if self.bwd_format is None else format_spec(self.bwd_format)
        scaled = self.scaling != "none"
        grad_scaling = self.scaling if bwd is not None else "none"
        sites = self._sites
        with graph.inserting_before(consumer):
            scale = None
            if scaled:
                device = example_value(operand).device
                history = sites.history(graph, consumer, role, device)
                scale = insert_call(
                    graph,
                    fp8_scale,
                    (operand, self.fwd_format.max_absolute_value, history),
                    name=f"{base}_scale",
                    value=torch.empty((), device="meta"),
                    meta_from=consumer,
                )
                sites.counts[0] += 1
                scale.meta["fp8_scaling"] = {"forward": self.scaling}
            grad_history = None
            if grad_scaling != "none":
                device = example_value(operand).device
                grad_history = sites.history(graph, consumer, f"grad_{role}", device)
            new = insert_call(
                graph,
                quantise_operand,
                (operand, format_spec(self.fwd_format), bwd, scale, grad_scaling, grad_history),
                name=f"{base}_quantised",
                value=example_value(operand),
                meta_from=consumer,
            )
        sites.counts[1] += grad_scaling != "none"
        if scaled:
            new.meta["fp8_scaling"] = {"forward": self.scaling, "gradient": grad_scaling}
        return new


def _argument(node: fx.Node, position: int, keyword: str, default: Any = None) -> Any:
    if position < len(node.args):
        return node.args[position]
    return node.kwargs.get(keyword, default)


def _split_bias(
    graph: fx.Graph, node: fx.Node
) -> tuple[Callable[..., Any], tuple[Any, ...]] | None:
    """Rewrite ``node`` (a linear op or an ``addmm`` with a floating-point bias) to compute
    its product without the bias; return the function that adds the bias to that product
    and its arguments after the product. None (``node`` untouched) for other ops."""
    from ... import functional as U

    unit_addmm = U.torch_map[torch.addmm]
    if node.op == "call_function" and node.target in (F.linear, U.linear, U.linear_readout):
        bias = _argument(node, 2, "bias")
        if not is_float_node(bias):
            return None
        if len(node.args) > 2:
            node.args = (*node.args[:2], None, *node.args[3:])
        else:
            node.kwargs = {**node.kwargs, "bias": None}
        if node.target is F.linear:
            return add_bias, (bias,)
        x, w = _argument(node, 0, "input"), _argument(node, 1, "weight")
        if node.target is U.linear:
            constraint = _argument(node, 3, "constraint", "to_output_scale")
            return unit_linear_bias, (bias, x, w, constraint)
        constraint = _argument(node, 3, "constraint", "to_grad_input_scale")
        return unit_readout_bias, (bias, x, w, constraint, node.kwargs.get("mup", True))
    is_addmm = (node.op == "call_function" and node.target in (torch.addmm, unit_addmm)) or (
        node.op == "call_method" and node.target == "addmm"
    )
    if not is_addmm or node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        return None
    bias, x, w = (_argument(node, i, k) for i, k in enumerate(("input", "mat1", "mat2")))
    if len(node.args) > 3 or not is_float_node(bias):
        return None
    if node.target is unit_addmm:
        constraint = node.kwargs.get("constraint", "to_output_scale")
        with graph.inserting_before(node):
            weight = graph.call_method("t", (w,))
        weight.meta["example_value"] = example_value(w).t()
        node.target, node.args, node.kwargs = U.linear, (x, weight, None, constraint), {}
        return unit_addmm_bias, (bias, x, w, constraint)
    node.op, node.target, node.args, node.kwargs = "call_function", torch.mm, (x, w), {}
    return add_bias, (bias,)
