"""What ``unit_scale`` reads off a captured graph: residual adds and the kind of their branch,
additions of independent operands, matmuls by a weight, masked attention, and the values that
carry the data-parallel batch (with the hints that tell the unit-scaled ops about the rest).

The rules are stated in the docstring of :mod:`unitscale.transforms.unit_scaling._transform`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from ...capture import Piece, example_value, is_float_node
from .._rewrite import ancestors, descendants, placeholder_names

# Additions a residual add can be written with (x + f(x), x += f(x), torch.add(x, f(x))).
_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)
_ADD_METHODS = ("add", "__add__")
# Ops that make a branch an attention branch.
_ATTENTION_FUNCTIONS = (F.scaled_dot_product_attention, F.softmax, torch.softmax)
_ATTENTION_METHODS = ("softmax",)
_MATMUL_FUNCTIONS = (operator.matmul, torch.matmul)
_MATMUL_METHODS = ("matmul", "__matmul__")


@dataclass
class _ResidualAdd:
    node: fx.Node
    skip: fx.Node
    branch: fx.Node
    kind: str


def _batch_nodes(gm: fx.GraphModule, piece: Piece) -> set[fx.Node]:
    """Nodes whose tensor value is computed from a tensor input of the piece: the values the
    data-parallel batch runs through. Sizes (``x.size(1)``) do not carry it, so
    ``torch.arange(x.size(1))`` is not one; an input of a later piece (after a graph break)
    counts as one."""
    kinds = placeholder_names(gm, piece)
    carrying: set[fx.Node] = set()
    for node in gm.graph.nodes:
        value = example_value(node)
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
            continue
        if node.op == "placeholder":
            if kinds.get(node, ("input", ""))[0] == "input" and isinstance(value, torch.Tensor):
                carrying.add(node)
        elif any(arg in carrying for arg in node.all_input_nodes):
            carrying.add(node)
    return carrying


def _hint_batch(graph: fx.Graph, batch: set[fx.Node]) -> None:
    """Tell ``U.embedding`` and ``U.add`` what their shapes cannot (see
    ``unitscale.functional.batch_hinted_add``): ids computed without the model's inputs are
    position ids shared by every example; an operand computed without them, added to a value
    computed with them, is shared by every example (counted over the whole batch)."""
    from ... import functional as U

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is U.embedding and node.args and node.args[0] not in batch:
            node.target = U.batch_hinted_embedding
        elif node.target is U.add and node in batch and len(node.args) >= 2:
            shared = tuple(isinstance(arg, fx.Node) and arg not in batch for arg in node.args[:2])
            if any(shared):
                node.target = U.batch_hinted_add
                node.kwargs = {**node.kwargs, "shared": shared}


def _is_matmul(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _MATMUL_FUNCTIONS
    return node.op == "call_method" and node.target in _MATMUL_METHODS


def _has_mask(node: fx.Node) -> bool:
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    return mask is not None


def _is_add(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _ADD_FUNCTIONS and "alpha" not in node.kwargs
    if node.op == "call_method":
        return node.target in _ADD_METHODS and "alpha" not in node.kwargs
    return False


def _independent_add(node: fx.Node) -> bool:
    """Whether ``node`` adds two float tensors neither of which is computed from the other.

    ``U.add`` assumes independent operands: ``x + 1`` (a constant), sizes and integers keep
    their plain addition, and so does ``x + 0.04 * x**3`` (inside a hand-written GELU),
    whose operands are far from independent.
    """
    operands = node.args[:2]
    if len(operands) != 2 or not all(is_float_node(a) for a in operands):
        return False
    left, right = operands
    assert isinstance(left, fx.Node) and isinstance(right, fx.Node)
    return left is not right and left not in ancestors(right) and right not in ancestors(left)


def _is_attention(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _ATTENTION_FUNCTIONS
    return node.op == "call_method" and node.target in _ATTENTION_METHODS


def _as_residual_add(node: fx.Node, params: set[fx.Node]) -> _ResidualAdd | None:
    """``node`` as a residual add ``skip + branch``, or None (see the module docstring)."""
    if not _is_add(node) or len(node.args) != 2:
        return None
    left, right = node.args
    if not (is_float_node(left) and is_float_node(right) and is_float_node(node)):
        return None
    out_shape = example_value(node).shape
    for skip, branch in ((left, right), (right, left)):
        assert isinstance(skip, fx.Node) and isinstance(branch, fx.Node)
        if example_value(skip).shape != out_shape:
            continue  # the stream keeps its shape through a residual block
        above_branch = ancestors(branch)
        if skip not in above_branch:
            continue
        # The branch: nodes on a path from skip to branch (skip excluded).
        inside = descendants(skip) & (above_branch | {branch})
        if not any(params.intersection(n.all_input_nodes) for n in inside):
            continue
        kind = "attention" if any(_is_attention(n) for n in inside) else "mlp"
        return _ResidualAdd(node, skip, branch, kind)
    return None
