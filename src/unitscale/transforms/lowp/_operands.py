"""Which ops are matmul-like, which of their operands an FP8 transform rounds, and the one
classification of a graph's matmul-like ops shared by ``simulate_fp8`` and ``to_fp8``.

Matmul-like ops (:data:`MATMUL_OPERANDS`): ``F.linear`` (input and weight, not bias),
``matmul``/``mm``/``bmm``/``@``, ``addmm``/``baddbmm``/``addbmm`` (the two matrices),
``einsum`` (every tensor operand), ``conv1d/2d/3d`` and their transposes (input and weight),
``F.scaled_dot_product_attention`` (query, key and value, not the mask), the grouped
matmuls of mixture-of-experts layers (tokens and stacked expert weights, see
:mod:`unitscale.transforms.lowp._ops`), and their unit-scaled equivalents in
:mod:`unitscale.functional` (transformers' ``Conv1D`` ``addmm`` included), so that
``simulate_fp8(unit_scale(m))`` quantises the same tensors as ``simulate_fp8(m)``. With
``ops="linear"`` only the ops with a weight parameter are rounded; the matmul-like ones left
out are recorded with a reason for :func:`~unitscale.transforms.fp8_summary`.
"""

from __future__ import annotations

import inspect
import operator
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...capture import Capture, Piece, module_path_at, module_path_of
from .._rewrite import RewritePass, parameter_nodes
from ._ops import OpsScope, grouped_operands, is_linear, looks_matmul_like, target_name
from ._skip import SKIPPED, is_skipped

__all__ = [
    "MATMUL_OPERANDS",
    "NO_FLOAT_OPERAND",
    "OUTSIDE_LINEAR",
    "UNRECOGNISED",
    "fp8_candidates",
    "is_unit_scaled",
    "matmul_operands",
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
            from ... import functional as U
        except ImportError:  # pragma: no cover - functional ships with the package
            U = None  # type: ignore[assignment]
        for name, count in _UNIT_SCALED_OPERANDS.items():
            fn = getattr(U, name, None)
            if fn is None:
                continue
            params = list(inspect.signature(fn).parameters)[:count]
            table[fn] = tuple((i, p) for i, p in enumerate(params))
        from ...functional import masked_scaled_dot_product_attention, torch_map

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


def is_unit_scaled(node: fx.Node) -> bool:
    """Whether ``node`` is a matmul-like op of :mod:`unitscale.functional` (what
    ``unit_scale`` puts in place of torch's, and what unitscale's modules call)."""
    if node.op != "call_function":
        return False
    try:
        return node.target in _unit_scaled_operands()
    except TypeError:  # unhashable target
        return False


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
    scope and in ``ops`` (:func:`~._fp8_ops.is_linear` for ``"linear"``) and not in a module
    of the pass's ``skip`` (:mod:`~._skip`), each with its
    summary label and operand slots (see :func:`matmul_operands`). Appends to ``left`` the
    matmul-like ops it does not yield, with the reason: the one classification of
    ``simulate_fp8`` and ``to_fp8``, so that ``ops="linear"`` and ``to_fp8`` cover the same
    ops under the same names."""
    in_scope = graph_pass.scope_filter(capture, piece)
    skip: frozenset[str] = getattr(graph_pass, "skip", frozenset())
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
        if skip and is_skipped(
            module_path_at(node, piece.frame_module, module_names), skip, graph_pass.scope
        ):
            left.append((label, SKIPPED))
            continue
        yield node, label, slots


def _op_label(node: fx.Node, module_names: dict[int, str]) -> str:
    """``<module path>: <op> (<node>)`` as summaries name ops: the module path left out at
    the top level, the graph node's name where it is not the op's (``0: linear (input_1)``)."""
    path = module_path_of(node, module_names)
    op = target_name(node.target).rsplit("::", 1)[-1]
    label = op if node.name.startswith(op) else f"{op} ({node.name})"
    return f"{path}: {label}" if path else label
