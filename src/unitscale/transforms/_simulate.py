"""``simulate_format`` and ``simulate_fp8``: run matmul-like ops on low-precision operands.

:class:`SimulateFormatPass` rewrites each captured graph so that every floating-point
operand of a matmul-like op goes through :func:`quantise_operand` first: the operand is
rounded to ``fwd_format`` in the forward pass and, optionally, the gradient with respect to
it is rounded to ``bwd_format`` in the backward pass. Optionally, the gradient with respect
to the op's *output* is rounded too (:func:`quantise_grad`, inserted after the op).

Which tensors an FP8 run rounds is an :class:`FP8Recipe`. The default, ``"hardware"``, is
what FP8 training recipes on current accelerators do: the matmul's inputs (weights included)
in E4M3 and the gradient arriving at its output in E5M2, so the gradients it produces for
its inputs, and the weight gradient in particular, come out of a higher-precision
accumulation and are not rounded. ``"all-operands"`` rounds the gradient with respect to
every operand (weights included) to E5M2 instead: an earlier, harsher simulation.

Matmul-like ops (:data:`MATMUL_OPERANDS`): ``F.linear`` (input and weight, not bias),
``matmul``/``mm``/``bmm``/``@``, ``addmm``/``baddbmm``/``addbmm`` (the two matrices),
``einsum`` (every tensor operand), ``conv1d/2d/3d`` and their transposes (input and weight),
``F.scaled_dot_product_attention`` (query, key and value, not the mask), the grouped
matmuls of mixture-of-experts layers (tokens and stacked expert weights, see
:mod:`unitscale.transforms._fp8_ops`), and their unit-scaled equivalents in
:mod:`unitscale.functional` (transformers' ``Conv1D`` ``addmm`` included), so that
``simulate_fp8(unit_scale(m))`` quantises the same tensors as ``simulate_fp8(m)``. With
``ops="linear"`` only the ops with a weight parameter are rounded. Every other op runs in the
model's own precision; the matmul-like ones left out are recorded for
:func:`~unitscale.transforms.fp8_summary` (and logged at capture).

Design constraints: an inserted node carries the ``example_value`` of the operand it
quantises, so that ``track_scales`` applied on top records it (as ``<operand>_quantised``);
the pass holds only its two formats, so it pickles and deep-copies as configuration.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

from ..capture import (
    Capture,
    Invocation,
    Piece,
    Stage,
    TransformedModule,
    example_value,
    identifier,
    is_float_node,
    module_path_of,
    transformed,
)
from ..errors import UnitScaleError
from ..formats import E4M3, E5M2, PRESETS, FormatError, FPFormat, get_format
from ._fp8_ops import (
    OPS_SCOPES,
    OpsScope,
    add_bias,
    grouped_operands,
    is_linear,
    looks_matmul_like,
    target_name,
    unit_addmm_bias,
    unit_linear_bias,
    unit_readout_bias,
)
from ._fp8_summary import record
from ._rewrite import (
    RewritePass,
    insert_call,
    parameter_nodes,
    placeholder_names,
)
from ._scaling import (
    DEFAULT_HISTORY_LEN,
    SCALINGS,
    Scaling,
    amax_scale,
    delayed_scale,
    history_buffer,
    keep_histories,
    scaled_round,
    tensor_amax,
)

__all__ = [
    "FP8_RECIPES",
    "MATMUL_OPERANDS",
    "FP8Recipe",
    "FormatSpec",
    "ScalingCost",
    "SimulateFormatPass",
    "format_spec",
    "fp8_scale",
    "quantise_grad",
    "quantise_operand",
    "scaling_cost",
    "simulate_format",
    "simulate_fp8",
]

# (position, keyword) of each operand that a matmul unit reads.
_Operands = tuple[tuple[int, str], ...]
_LINEAR: _Operands = ((0, "input"), (1, "weight"))
_MATMUL: _Operands = ((0, "input"), (1, "other"))
_MM: _Operands = ((0, "input"), (1, "mat2"))
_ADDMM: _Operands = ((1, "mat1"), (2, "mat2"))
_BADDBMM: _Operands = ((1, "batch1"), (2, "batch2"))
_ATTENTION: _Operands = ((0, "query"), (1, "key"), (2, "value"))

MATMUL_OPERANDS: dict[Callable[..., Any], _Operands] = {
    F.linear: _LINEAR,
    torch.matmul: _MATMUL,
    operator.matmul: _MATMUL,
    operator.imatmul: _MATMUL,
    torch.mm: _MM,
    torch.bmm: _MM,
    torch.addmm: _ADDMM,
    torch.baddbmm: _BADDBMM,
    torch.addbmm: _BADDBMM,
    F.conv1d: _LINEAR,
    F.conv2d: _LINEAR,
    F.conv3d: _LINEAR,
    F.conv_transpose1d: _LINEAR,
    F.conv_transpose2d: _LINEAR,
    F.conv_transpose3d: _LINEAR,
    F.scaled_dot_product_attention: _ATTENTION,
}
"""Matmul-like torch functions and the ``(position, keyword)`` of the operands quantised."""

# Tensor methods (``x.matmul(y)``: ``self`` is argument 0) that are matmul-like.
_METHOD_OPERANDS: dict[str, _Operands] = {
    "matmul": _MATMUL,
    "__matmul__": _MATMUL,
    "mm": _MM,
    "bmm": _MM,
    "addmm": _ADDMM,
    "baddbmm": _BADDBMM,
}

# unitscale.functional ops that are matmul-like, and how many leading operands they quantise.
_UNIT_SCALED_OPERANDS = {
    "linear": 2,
    "linear_readout": 2,
    "matmul": 2,
    "conv1d": 2,
    "scaled_dot_product_attention": 3,
}
_unit_scaled_cache: dict[Callable[..., Any], _Operands] | None = None


def _unit_scaled_operands() -> dict[Callable[..., Any], _Operands]:
    """The matmul-like ops of :mod:`unitscale.functional` (imported lazily: it is heavier)."""
    global _unit_scaled_cache
    if _unit_scaled_cache is None:
        table: dict[Callable[..., Any], _Operands] = {}
        try:
            from .. import functional as U
        except ImportError:  # pragma: no cover - functional ships with the package
            U = None  # type: ignore[assignment]
        for name, count in _UNIT_SCALED_OPERANDS.items():
            fn = getattr(U, name, None)
            if fn is None:
                continue
            params = list(inspect.signature(fn).parameters)[:count]
            table[fn] = tuple((i, p) for i, p in enumerate(params))
        from ..functional import masked_scaled_dot_product_attention, torch_map

        table[masked_scaled_dot_product_attention] = _ATTENTION
        # transformers' Conv1D (``addmm(bias, x, weight)``) once unit_scale replaced it.
        table[torch_map[torch.addmm]] = _ADDMM
        _unit_scaled_cache = table
    return _unit_scaled_cache


def matmul_operands(node: fx.Node) -> list[tuple[int, str]]:
    """The ``(position, keyword)`` slots of ``node``'s matmul operands ([] if not matmul-like)."""
    if node.op == "call_method":
        return list(_METHOD_OPERANDS.get(str(node.target), ()))
    if node.op != "call_function":
        return []
    target = node.target
    if target is torch.einsum:
        if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)):
            return []  # list form: handled by the caller
        return [(i, "") for i in range(1, len(node.args))]
    try:
        operands = MATMUL_OPERANDS.get(target) or _unit_scaled_operands().get(target)  # type: ignore[arg-type]
    except TypeError:  # unhashable target
        return []
    return list(operands or ()) or grouped_operands(node)


FormatSpec = tuple[int, int, str, str] | tuple[int, int, str, str, str]
"""An :class:`FPFormat` as plain data, ``(exponent_bits, mantissa_bits, rounding,
special_values)``, with ``overflow`` appended where it is not the default ``"saturate"``:
what an inserted graph node holds, since generated graph code can only embed Python
literals."""


def format_spec(fmt: FPFormat) -> FormatSpec:
    """The :data:`FormatSpec` of ``fmt``."""
    spec = (fmt.exponent_bits, fmt.mantissa_bits, fmt.rounding, fmt.special_values)
    return spec if fmt.overflow == "saturate" else (*spec, fmt.overflow)


@functools.lru_cache(maxsize=64)
def _format_of(spec: FormatSpec) -> FPFormat:
    return FPFormat(*spec)


def _as_format(spec: FPFormat | FormatSpec) -> FPFormat:
    return spec if isinstance(spec, FPFormat) else _format_of(tuple(spec))


class _ScaledQuantise(torch.autograd.Function):
    """``y = fwd(x)`` (rounded, optionally scaled; a fresh tensor either way), ``grad_x =
    bwd(grad_y)``: the one place where simulated FP8 rounds a value and its gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        fwd_format: FPFormat | None,
        scale: Tensor | None,
        bwd_format: FPFormat | None,
        grad_scaling: str,
        grad_history: Tensor | None,
    ) -> Tensor:
        ctx.bwd = (bwd_format, grad_scaling, grad_history)
        if fwd_format is None:
            # A copy, not a view: the caller may modify the result in place
            # (``y = linear(x); y += x``), which autograd forbids on a custom Function's view.
            return x.clone()
        if scale is None:
            return fwd_format.quantise(x)
        return scaled_round(x, scale, fwd_format.quantise)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        bwd_format, grad_scaling, grad_history = ctx.bwd
        if bwd_format is not None:
            grad = _round_gradient(grad, bwd_format, grad_scaling, grad_history)
        return grad, None, None, None, None, None


def _round_gradient(grad: Tensor, fmt: FPFormat, scaling: str, history: Tensor | None) -> Tensor:
    if scaling == "none":
        return fmt.quantise(grad)
    if scaling == "delayed" and history is not None:
        scale = delayed_scale(grad, history, fmt.max_absolute_value, record=True)
    else:
        scale = amax_scale(tensor_amax(grad), fmt.max_absolute_value)
    return scaled_round(grad, scale, fmt.quantise)


def fp8_scale(x: Tensor, format_max: float, history: Tensor | None = None) -> Tensor:
    """The scale ``format_max / amax`` that a scaled cast of ``x`` multiplies it by.

    Inserted by ``scaling="tensorwise"`` (``history`` None: the amax of ``x``) and
    ``"delayed"`` (the max of ``history``, which is then updated while autograd records;
    see :mod:`unitscale.transforms._scaling` for the rules and their sources).

    Example:
        >>> fp8_scale(torch.tensor([0.5, -2.0]), 448.0).item()  # E4M3's max / amax
        224.0
    """
    if history is None:
        return amax_scale(tensor_amax(x), format_max)
    return delayed_scale(x, history, format_max, record=torch.is_grad_enabled())


def quantise_operand(
    x: Tensor,
    fwd_format: FPFormat | FormatSpec,
    bwd_format: FPFormat | FormatSpec | None,
    scale: Tensor | None = None,
    grad_scaling: Scaling = "none",
    grad_history: Tensor | None = None,
) -> Tensor:
    """Round ``x`` to ``fwd_format``, and the gradient with respect to ``x`` to ``bwd_format``.

    Args:
        x: a floating-point tensor (an operand of a matmul-like op).
        fwd_format: the format of the forward value (an ``FPFormat`` or its
            :data:`FormatSpec`).
        bwd_format: the format of the gradient, likewise; None passes the gradient through
            unrounded.
        scale: if given, ``x`` is multiplied by it before rounding and divided after (a
            scaled cast, see :func:`fp8_scale`).
        grad_scaling: how the gradient is scaled before rounding: ``"none"``,
            ``"tensorwise"`` (by ``format_max / amax(gradient)``) or ``"delayed"`` (from
            ``grad_history``, which is updated).
        grad_history: the gradient's amax history, for ``grad_scaling="delayed"``.

    Returns:
        ``fwd_format.quantise(x)`` (scaled if asked), whose backward rounds the incoming
        gradient to ``bwd_format`` (straight through otherwise).

    Example:
        >>> import dataclasses
        >>> from unitscale.formats import E4M3, E5M2
        >>> e4m3, e5m2 = (dataclasses.replace(f, rounding="nearest") for f in (E4M3, E5M2))
        >>> x = torch.tensor([0.3, 1000.0], requires_grad=True)
        >>> y = quantise_operand(x, e4m3, e5m2)
        >>> y.backward(torch.tensor([0.3, 1e6]))
        >>> y.tolist(), x.grad.tolist()
        ([0.3125, 448.0], [0.3125, 57344.0])
    """
    bwd = None if bwd_format is None else _as_format(bwd_format)
    return _ScaledQuantise.apply(x, _as_format(fwd_format), scale, bwd, grad_scaling, grad_history)


def quantise_grad(
    y: Tensor,
    bwd_format: FPFormat | FormatSpec,
    scaling: Scaling = "none",
    history: Tensor | None = None,
) -> Tensor:
    """A copy of ``y``; the gradient with respect to it is rounded to ``bwd_format``.

    Inserted after a matmul-like op: its output gradient is what an FP8 matmul's backward
    reads (in E5M2), while the gradients it computes are accumulated in higher precision.
    The result is a new tensor (not a view), so the caller may modify it in place.

    Args:
        y: the op's output.
        bwd_format: the gradient's format.
        scaling: ``"none"``, ``"tensorwise"`` or ``"delayed"`` (see :func:`quantise_operand`).
        history: the gradient's amax history, for ``scaling="delayed"``.

    Example:
        >>> import dataclasses
        >>> from unitscale.formats import E5M2
        >>> y = torch.tensor([0.3, 1e6], requires_grad=True)
        >>> out = quantise_grad(y, dataclasses.replace(E5M2, rounding="nearest"))
        >>> out.backward(torch.tensor([0.3, 1e6]))
        >>> out.tolist(), y.grad.tolist()
        ([0.30000001192092896, 1000000.0], [0.3125, 57344.0])
    """
    return _ScaledQuantise.apply(y, None, None, _as_format(bwd_format), scaling, history)


class _Sites:
    """While one graph is rewritten: the history node of each scaled rounding (delayed
    scaling only) and how many scaled roundings the forward and the backward do."""

    def __init__(self, gm: fx.GraphModule, root: nn.Module | None, history_len: int) -> None:
        self.gm = gm
        self.root = root
        self.history_len = history_len
        self.counts = [0, 0]  # scaled roundings in the forward, in the backward
        self.sites: set[str] = set()

    def history(self, graph: fx.Graph, site: str, device: torch.device) -> fx.Node | None:
        """A ``get_attr`` node for the history of ``site`` (made unique), or None without
        delayed scaling. The graph module holds the root's buffer itself, so the graph's
        updates are the buffer's."""
        if self.root is None:
            return None
        site = identifier(site)
        unique, n = site, 0
        while unique in self.sites:
            n += 1
            unique = f"{site}_{n}"
        self.sites.add(unique)
        name = history_buffer(self.root, unique, self.history_len, device)
        if name not in self.gm._buffers:
            self.gm.register_buffer(name, self.root._buffers[name])
        node = graph.get_attr(name)
        node.meta["example_value"] = torch.empty(self.history_len, device="meta")
        return node


UNRECOGNISED = "not recognised as a matmul-like op: runs unrounded"
"""Summary reason of an op named like a matmul that no table holds (also warned about)."""
OUTSIDE_LINEAR = "outside ops='linear'"
"""Summary reason of a matmul-like op that is not a linear op (no weight parameter)."""
NO_FLOAT_OPERAND = "no floating-point operand"
"""Summary reason of a matmul-like op without a floating-point operand to round or cast."""


def fp8_candidates(
    graph_pass: RewritePass,
    gm: fx.GraphModule,
    piece: Piece,
    capture: Capture,
    ops: OpsScope,
    left: list[tuple[str, str]],
) -> Iterator[tuple[fx.Node, str, list[tuple[int, str]]]]:
    """The matmul-like ops of ``gm`` that an FP8 pass converts: those in the pass's module
    scope and in ``ops`` (:func:`~._fp8_ops.is_linear` for ``"linear"``), each with its
    summary label and operand slots (see :func:`matmul_operands`). Appends to ``left`` the
    matmul-like ops it does not yield, with the reason: the one classification of
    ``simulate_fp8`` and ``to_fp8``, so that ``ops="linear"`` and ``to_fp8`` cover the same
    ops under the same names."""
    in_scope = graph_pass.scope_filter(capture, piece)
    parameters = parameter_nodes(gm, piece)
    module_names = {id(m): name for name, m in capture.owner_module.named_modules()}
    for node in list(gm.graph.nodes):
        if not in_scope(node):
            continue
        einsum = node.op == "call_function" and node.target is torch.einsum
        slots = matmul_operands(node)
        if not (einsum or slots):
            if looks_matmul_like(node):
                left.append((_op_label(node, module_names), UNRECOGNISED))
            continue
        label = _op_label(node, module_names)
        if ops == "linear" and not is_linear(node, parameters):
            left.append((label, OUTSIDE_LINEAR))
            continue
        yield node, label, slots


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
            weight parameter, see :mod:`unitscale.transforms._fp8_ops`); the matmul-like
            ops left out are recorded for :func:`~unitscale.transforms.fp8_summary`.
        transform: the transform's name in that summary and its log line.
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
    ) -> None:
        self.fwd_format = fwd_format
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

    def transform(self, gm: fx.GraphModule, piece: Piece, capture: Capture) -> fx.GraphModule:
        root = capture.owner_module if self.scaling == "delayed" else None
        # Per-graph state, held by the pass only while this graph is rewritten (the pass
        # itself stays configuration: it pickles and deep-copies).
        self._sites = _Sites(gm, root, self.history_len)
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
        for node, label, slots in fp8_candidates(self, gm, piece, capture, self.ops, left):
            before = len(quantised)
            if node.op == "call_function" and node.target is torch.einsum:
                self._quantise_einsum(graph, node, names, quantised)
                self._quantise_output_grad(graph, node)
            else:
                self._quantise_slots(graph, node, slots, names, quantised)
            if len(quantised) > before:
                converted.append(label)
            else:
                left.append((label, NO_FLOAT_OPERAND))
        record(piece, self.label, converted, left, warn_reasons=(UNRECOGNISED,))
        return quantised

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
            new = self._insert(graph, node, operand, names)
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
            site = f"{node.name}_grad_quantised"
            history = self._sites.history(graph, site, example_value(node).device)
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
            operands[i] = self._insert(graph, node, operand, names)
            quantised.append((node.name, operand.name))
        if listed:
            node.args = (node.args[0], list(operands))
        else:
            node.args = (node.args[0], *operands)

    def _insert(
        self, graph: fx.Graph, consumer: fx.Node, operand: fx.Node, names: dict[fx.Node, str]
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
                history = sites.history(graph, f"{base}_scale", device)
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
                site = f"{base}_quantised_grad"
                grad_history = sites.history(graph, site, example_value(operand).device)
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
    from .. import functional as U

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


def _op_label(node: fx.Node, module_names: dict[int, str]) -> str:
    """``<module path>: <op> (<node>)`` as summaries name ops: the module path left out at
    the top level, the graph node's name where it is not the op's (``0: linear (input_1)``)."""
    path = module_path_of(node, module_names)
    op = target_name(node.target).rsplit("::", 1)[-1]
    label = op if node.name.startswith(op) else f"{op} ({node.name})"
    return f"{path}: {label}" if path else label


def _check_format(argument: str, value: Any) -> FPFormat:
    if isinstance(value, FPFormat):
        return value
    try:
        # A name means its preset, which rounds to nearest as hardware casts do.
        return get_format(value)
    except FormatError as error:
        raise FormatError(
            f"unitscale.transforms.simulate_format: argument {argument!r}={value!r} is not a "
            "format; pass a unitscale.formats.FPFormat (e.g. unitscale.formats.E4M3, or "
            "FPFormat(exponent_bits, mantissa_bits)) or a preset key such as 'e4m3'"
        ) from error


def _check_ops(op: str, ops: Any) -> None:
    if not isinstance(ops, str) or ops not in OPS_SCOPES:
        raise FormatError(
            f"unitscale.transforms.{op}: argument 'ops'={ops!r} is not supported; use "
            "'linear' (ops with a weight parameter: the scope of real FP8 training) or "
            "'matmuls' (every matmul-like op, attention's included)"
        )


def _check_scaling(op: str, scaling: Any, history_len: Any) -> None:
    if not isinstance(scaling, str) or scaling not in SCALINGS:
        raise FormatError(
            f"unitscale.transforms.{op}: argument 'scaling'={scaling!r} is not supported; "
            f"use one of {SCALINGS}"
        )
    if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
        raise FormatError(
            f"unitscale.transforms.{op}: argument 'history_len'={history_len!r} must be a "
            f"positive int (the number of earlier steps scaling='delayed' keeps; default "
            f"{DEFAULT_HISTORY_LEN})"
        )


def _transformed(op: str, module: nn.Module, graph_pass: SimulateFormatPass) -> TransformedModule:
    result = transformed(module, graph_pass, op)
    if graph_pass.scaling == "delayed":
        keep_histories(result.module)
    return result


def simulate_format(
    module: nn.Module,
    fwd_format: FPFormat | str,
    bwd_format: FPFormat | str,
    scaling: Scaling = "none",
    history_len: int = DEFAULT_HISTORY_LEN,
    ops: OpsScope = "matmuls",
) -> TransformedModule:
    """Return a copy of ``module`` whose matmul-like ops see operands in low precision.

    Every floating-point operand of a matmul-like op (``F.linear`` input and weight,
    ``matmul``/``bmm``/``@``, ``addmm``, ``einsum``, convolutions, the query, key and value
    of ``F.scaled_dot_product_attention``, and their :mod:`unitscale.functional`
    equivalents) is rounded to ``fwd_format`` in the forward pass, and the gradient with
    respect to it is rounded to ``bwd_format`` in the backward pass. Nothing else changes:
    the arithmetic inside each op, and every other op, runs in the model's own dtype.

    A format rounds to nearest, as PyTorch's casts do (bit-identical to them), whether it is
    given by name (``"e4m3"``) or as a preset (``unitscale.formats.E4M3``): that is every
    :class:`~unitscale.formats.FPFormat`'s default. Pass one with
    ``rounding="stochastic"`` for stochastic rounding.

    Args:
        module: any ``torch.nn.Module`` (or an already transformed one, e.g.
            ``unit_scale(m)``) that TorchDynamo can capture.
        fwd_format: format of forward operands: an :class:`~unitscale.formats.FPFormat`
            or a preset key (``"e4m3"``, ``"e5m2"``, ``"fp16"``, ``"bf16"``), which rounds
            to nearest.
        bwd_format: format of the gradients, likewise.
        scaling: ``"none"`` (default), ``"tensorwise"`` or ``"delayed"``: how each rounded
            tensor is scaled (see :func:`simulate_fp8`).
        history_len: amax-history length for ``scaling="delayed"``.
        ops: which ops are rounded: ``"matmuls"`` (default: every matmul-like op) or
            ``"linear"`` (ops with a weight parameter), as for :func:`simulate_fp8`.

    Returns:
        The transformed copy (``module`` is not touched).

    Raises:
        FormatError: a format argument is neither an ``FPFormat`` nor a preset key, or
            ``scaling``/``history_len``/``ops`` is not supported.
        CaptureError: ``module`` is not a module, is already compiled (see
            :func:`~unitscale.transforms.compile`) or tracked (apply ``track_scales``
            last), or holds a submodule that is (the error names it); or TorchDynamo
            cannot capture it (at the first call).

    Example:
        >>> from unitscale.formats import FPFormat
        >>> tiny = FPFormat(2, 1, rounding="nearest")  # values 0, 0.5, 1, 1.5, 2, 3
        >>> model = simulate_format(nn.Linear(4, 1, bias=False), tiny, tiny)
        >>> with torch.no_grad():
        ...     _ = model.weight.copy_(torch.tensor([[0.3, 1.1, 1.6, 5.0]]))
        >>> model(torch.ones(1, 4)).item()  # weights round to 0.5, 1, 1.5, 3
        6.0
    """
    fwd = _check_format("fwd_format", fwd_format)
    bwd = _check_format("bwd_format", bwd_format)
    _check_scaling("simulate_format", scaling, history_len)
    _check_ops("simulate_format", ops)
    graph_pass = SimulateFormatPass(
        fwd, bwd, scaling=scaling, history_len=history_len, ops=ops, transform="simulate_format"
    )
    return _transformed("simulate_format", module, graph_pass)


def _short(fmt: FPFormat | None) -> str:
    """``e4m3/nearest`` for a preset with any rounding; the full repr otherwise."""
    if fmt is None:
        return "None"
    for key, preset in PRESETS.items():
        if dataclasses.replace(preset, rounding=fmt.rounding) == fmt:
            return f"{key}/{fmt.rounding}"
    return repr(fmt)


@dataclasses.dataclass(frozen=True)
class FP8Recipe:
    """Which tensors around each matmul-like op :func:`simulate_fp8` rounds, and to what.

    Every operand of a matmul-like op (weights included) is rounded to ``operands`` in the
    forward pass. In the backward pass, ``output_grad`` rounds the gradient arriving at the
    op's output (what an FP8 matmul's backward reads), and ``operand_grads`` rounds the
    gradients the op produces for its operands (the weight gradient included). Named presets
    are in :data:`FP8_RECIPES`: ``"hardware"`` (the default of :func:`simulate_fp8`) and
    ``"all-operands"``. ``ops`` says which ops the recipe covers.

    Attributes:
        operands: format of the operands in the forward pass.
        output_grad: format of the gradient with respect to the op's output, or None.
        operand_grads: format of the gradients with respect to the operands, or None.
        ops: ``"matmuls"`` (default: every matmul-like op, attention's batched matmuls,
            convolutions and mixture-of-experts grouped matmuls included) or ``"linear"``
            (only ops with a weight parameter: ``nn.Linear``/``F.linear``, the unit-scaled
            linears and readout, transformers' ``Conv1D``; the scope of real FP8 training).

    Raises:
        FormatError: a field is not an :class:`~unitscale.formats.FPFormat` (or None where
            allowed), neither gradient is rounded, or ``ops`` is unknown.

    Example:
        >>> FP8_RECIPES["hardware"]  # doctest: +NORMALIZE_WHITESPACE
        FP8Recipe(operands=e4m3/nearest, output_grad=e5m2/nearest, operand_grads=None,
                  ops='matmuls')
        >>> dataclasses.replace(FP8_RECIPES["hardware"], ops="linear").ops
        'linear'
    """

    operands: FPFormat
    output_grad: FPFormat | None
    operand_grads: FPFormat | None = None
    ops: OpsScope = "matmuls"

    def __post_init__(self) -> None:
        if not isinstance(self.operands, FPFormat):
            raise FormatError(
                f"FP8Recipe: operands={self.operands!r} is not an FPFormat; pass e.g. "
                "dataclasses.replace(unitscale.formats.E4M3, rounding='nearest')"
            )
        for name in ("output_grad", "operand_grads"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, FPFormat):
                raise FormatError(f"FP8Recipe: {name}={value!r} is neither an FPFormat nor None")
        if self.output_grad is None and self.operand_grads is None:
            raise FormatError(
                "FP8Recipe: neither output_grad nor operand_grads is set, so no gradient "
                "would be rounded; set one (FP8 recipes round the output gradient to E5M2)"
            )
        if not isinstance(self.ops, str) or self.ops not in OPS_SCOPES:
            raise FormatError(
                f"FP8Recipe: ops={self.ops!r}; use 'linear' (ops with a weight parameter) or "
                "'matmuls' (every matmul-like op)"
            )

    def __repr__(self) -> str:
        return (
            f"FP8Recipe(operands={_short(self.operands)}, "
            f"output_grad={_short(self.output_grad)}, "
            f"operand_grads={_short(self.operand_grads)}, ops={self.ops!r})"
        )


_E4M3_NEAREST = dataclasses.replace(E4M3, rounding="nearest")
_E5M2_NEAREST = dataclasses.replace(E5M2, rounding="nearest")

FP8_RECIPES: MappingProxyType[str, FP8Recipe] = MappingProxyType(
    {
        "hardware": FP8Recipe(operands=_E4M3_NEAREST, output_grad=_E5M2_NEAREST),
        "all-operands": FP8Recipe(
            operands=_E4M3_NEAREST, output_grad=None, operand_grads=_E5M2_NEAREST
        ),
    }
)
"""Named :class:`FP8Recipe` presets, all rounding to nearest (as hardware casts do).

- ``"hardware"``: matmul inputs (weights included) in E4M3, the gradient of the matmul's
  output in E5M2; the input and weight gradients the matmul computes are not rounded (they
  are accumulated in higher precision, as FP8 training recipes on current hardware do).
- ``"all-operands"``: matmul inputs in E4M3, and the gradient with respect to every input,
  the weight's included, in E5M2 (this library's behaviour before the hardware recipe).
"""


def _check_recipe(recipe: Any) -> FP8Recipe:
    if isinstance(recipe, FP8Recipe):
        return recipe
    if isinstance(recipe, str) and recipe in FP8_RECIPES:
        return FP8_RECIPES[recipe]
    raise FormatError(
        f"unitscale.transforms.simulate_fp8: recipe={recipe!r} is not an FP8 recipe; pass an "
        f"FP8Recipe or one of {sorted(FP8_RECIPES)}"
    )


def simulate_fp8(
    module: nn.Module,
    recipe: FP8Recipe | str = "hardware",
    scaling: Scaling = "none",
    history_len: int = DEFAULT_HISTORY_LEN,
    ops: OpsScope | None = None,
) -> TransformedModule:
    """Return a copy of ``module`` whose matmul-like ops run on FP8 operands.

    With the default ``recipe="hardware"``: every operand of a matmul-like op (weights
    included) is rounded to OCP FP8 E4M3 in the forward pass and the gradient arriving at
    the op's output to OCP FP8 E5M2 in the backward pass, both round-to-nearest-even as
    hardware casts do; the gradients the op computes for its operands (the weight gradient
    included) are not rounded, as in FP8 recipes where the matmul accumulates in higher
    precision. ``recipe="all-operands"`` rounds the gradient with respect to every operand
    to E5M2 instead (what ``simulate_format(module, "e4m3", "e5m2")`` does).
    Values beyond a format's range saturate to its largest value (an ``FPFormat`` with
    ``overflow="inf"`` in a custom recipe makes them ``±inf`` instead). For stochastic
    rounding or other formats, pass an :class:`FP8Recipe` or call :func:`simulate_format`.

    ``scaling`` says how each tensor the recipe rounds is scaled (rules and their sources in
    :mod:`unitscale.transforms._scaling`):

    - ``"none"`` (default): not at all, what a unit-scaled model needs;
    - ``"tensorwise"``: multiplied by ``format_max / amax(tensor)`` before rounding and
      divided after, forward and backward, the amax taken when the tensor is rounded: the
      numerics of torchao's float8 training with its default config (tested against
      ``torchao.float8.convert_to_float8_training``); amax is not reduced over
      data-parallel ranks, as in torchao's default;
    - ``"delayed"``: the same with ``amax`` the maximum of the tensor's amax history over the
      ``history_len`` earlier training steps (the first step uses the current amax); the
      histories are buffers of the returned module (``fp8_amax_history_<site>`` in
      ``state_dict()``, created at the first call).

    ``ops`` says which ops are rounded:

    - ``"matmuls"`` (the default): every matmul-like op: linear layers, attention's
      ``scaled_dot_product_attention`` and batched matmuls, ``einsum``, convolutions and the
      grouped matmuls of mixture-of-experts layers (``torch.nn.functional.grouped_mm``,
      ``torch._grouped_mm``, transformers' ``grouped_mm_fallback``);
    - ``"linear"``: only the ops with a weight parameter (``nn.Linear``/``F.linear``, the
      unit-scaled linears and readout, transformers' ``Conv1D``): the scope of real FP8
      training (torchao's ``convert_to_float8_training``, Transformer Engine's FP8 linears),
      where attention runs in the input's precision. ``simulate_fp8(model, ops="linear",
      scaling="tensorwise")`` is torchao's recipe (tested against it on the built-in GPT).

    The default is ``"matmuls"``, the stricter test: a model that trains with every matmul
    in FP8 trains with its linear layers alone in FP8, and FP8 attention kernels exist; it is
    also what this function did before ``ops`` existed, so results recorded without it keep
    their meaning. To predict a real FP8 run of linear layers, pass ``ops="linear"``.
    :func:`fp8_summary` lists the ops rounded and the matmul-like ops that were not (and
    why), also logged once per captured graph at INFO on the ``"unitscale"`` logger; an op
    named like a matmul that no table recognises is warned about.

    :func:`scaling_cost` counts the amax reductions and scale computations of a step.

    Args:
        module: any ``torch.nn.Module`` (or a transformed one) that TorchDynamo can capture.
        recipe: an :class:`FP8Recipe` or the key of a preset in :data:`FP8_RECIPES`.
        scaling: ``"none"``, ``"tensorwise"`` or ``"delayed"``.
        history_len: amax-history length for ``scaling="delayed"`` (default 16, torchao's
            former delayed-scaling default).
        ops: ``"matmuls"`` or ``"linear"``; None (default) takes the recipe's
            (:attr:`FP8Recipe.ops`, ``"matmuls"`` for the presets).

    Returns:
        The transformed copy (``module`` is not touched).

    Raises:
        FormatError: ``recipe`` is neither an ``FP8Recipe`` nor a preset key, or
            ``scaling``/``history_len``/``ops`` is not supported.
        CaptureError: as for :func:`simulate_format`.

    Example:
        >>> model = simulate_fp8(nn.Linear(2, 1, bias=False))
        >>> with torch.no_grad():
        ...     _ = model.weight.copy_(torch.tensor([[1000.0, 0.3]]))
        >>> model(torch.ones(1, 2)).item()  # 448 (E4M3's max) + 0.3125
        448.3125
        >>> scaled = simulate_fp8(model.module, scaling="tensorwise")  # 1000 -> 448 -> 1000
        >>> scaled(torch.ones(1, 2)).item()  # 0.3 * 0.448 rounds to 0.140625, / 0.448
        1000.3138427734375
    """
    chosen = _check_recipe(recipe)
    _check_scaling("simulate_fp8", scaling, history_len)
    scope = chosen.ops if ops is None else ops
    _check_ops("simulate_fp8", scope)
    graph_pass = SimulateFormatPass(
        chosen.operands,
        chosen.operand_grads,
        chosen.output_grad,
        scaling=scaling,
        history_len=history_len,
        ops=scope,
        transform="simulate_fp8",
    )
    return _transformed("simulate_fp8", module, graph_pass)


@dataclasses.dataclass(frozen=True)
class ScalingCost:
    """What the per-tensor scales of a simulated-FP8 model cost in one training step.

    Counted from the rewritten graphs that ran in the last call (one count per scaled
    rounding), not estimated: each scaled rounding reduces its tensor to an amax (the
    forward ones when the forward runs, the gradient ones in the backward) and computes one
    scale from it (``"delayed"`` also reduces and updates a history of ``history_len``
    values per rounding, not counted as a tensor reduction).

    Attributes:
        scaling: the module's ``scaling``.
        forward: scaled roundings in the forward pass (operands, weights included).
        backward: scaled roundings in the backward pass (gradients).
    """

    scaling: str
    forward: int
    backward: int

    @property
    def amax_reductions(self) -> int:
        """Full-tensor ``max(abs(x))`` reductions per training step."""
        return self.forward + self.backward

    @property
    def scale_computations(self) -> int:
        """Scales computed per training step (one per amax)."""
        return self.forward + self.backward


def scaling_cost(module: nn.Module) -> ScalingCost:
    """Count the amax reductions and scale computations of one training step of ``module``.

    Args:
        module: a model returned by :func:`simulate_fp8` or :func:`simulate_format` (or a
            chain containing one), called at least once.

    Returns:
        The counts of the last call (forward, and the backward that follows it).

    Raises:
        UnitScaleError: ``module`` does not simulate a format, or has not been called.

    Example:
        >>> model = simulate_fp8(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
        ...                      scaling="tensorwise")
        >>> _ = model(torch.ones(3, 4))
        >>> cost = scaling_cost(model)  # 2 linears: 2 operands each, 1 output gradient each
        >>> cost.forward, cost.backward, cost.amax_reductions
        (4, 2, 6)
    """
    graph_pass = None
    if isinstance(module, TransformedModule):
        # simulate_fp8's pass, or to_fp8's (which counts its scales the same way)
        graph_pass = next(
            (
                p
                for p in module.passes
                if isinstance(p, SimulateFormatPass) or getattr(p, "counts_fp8_scaling", False)
            ),
            None,
        )
    if not isinstance(module, TransformedModule) or graph_pass is None:
        raise UnitScaleError(
            f"scaling_cost: {type(module).__name__} does not simulate a number format; pass "
            "a model returned by unitscale.transforms.simulate_fp8, simulate_format or to_fp8"
        )
    capture = module.capture
    trace: list[Invocation] = capture.last_trace if capture is not None else []
    if not trace:
        raise UnitScaleError(
            "scaling_cost: the model has not been called yet; call it once (a training "
            "step's forward) first, since the counts come from the graphs that ran"
        )
    forward = backward = 0
    for invocation in trace:
        _, fwd, bwd = invocation.piece.data.get("fp8_scaling", ("none", 0, 0))
        forward += fwd
        backward += bwd
    return ScalingCost(graph_pass.scaling, forward, backward)  # type: ignore[attr-defined]
