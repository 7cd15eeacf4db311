"""Out-of-place forms of the in-place arithmetic in a captured graph.

Dynamo records ``x += 1`` as ``x_1 = operator.iadd(x, 1)``: a node that changes the value of
``x`` for every later user, ``skip = x`` (the same tensor) included. A rewrite that inserts a
unit-scaled op between ``x`` and its users (the residual split of ``unit_scale``) would hand
the in-place op a view made by an autograd Function, which autograd refuses, and would change
what the later users see. Here each such op on a tensor the graph computed becomes its
out-of-place form (``x_1 = x + 1``) and every later use of the tensor reads ``x_1``: the
values plain PyTorch computes, in a graph without mutation.

Left in place (and so as written): a mutation of a graph input, parameter or buffer (the
caller sees it), of a view or of a tensor that a view was taken of before the mutation (the
view would see it), and one whose out-of-place form would change the dtype.
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx
from torch import Tensor

from ...capture import example_value

__all__ = ["functionalize_inplace"]

_FUNCTIONS: dict[Any, Any] = {
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
}
_METHODS = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div"}


def _out_of_place(node: fx.Node) -> Any:
    if node.op == "call_function":
        return _FUNCTIONS.get(node.target)
    if node.op == "call_method" and isinstance(node.target, str):
        return _METHODS.get(node.target)
    return None


def _same_dtype(value: Tensor, others: tuple[Any, ...]) -> bool:
    """Whether the out-of-place op keeps ``value``'s dtype: the other operand is a number or
    a tensor of that dtype."""
    for other in others:
        if isinstance(other, fx.Node):
            other_value = example_value(other)
            if not isinstance(other_value, Tensor) or other_value.dtype != value.dtype:
                return False
        elif not isinstance(other, (int, float)):
            return False
    return True


def _aliased(tensor: fx.Node, before: fx.Node, order: dict[fx.Node, int]) -> bool:
    """Whether a node ahead of ``before`` took a view of ``tensor`` (it would see the change)."""
    for user in tensor.users:
        if order[user] < order[before]:
            value = example_value(user)
            values = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(v, Tensor) and v._is_view() for v in values):
                return True
    return False


def functionalize_inplace(graph: fx.Graph) -> int:
    """Rewrite, in place, the in-place arithmetic of ``graph`` (see the module docstring).

    Returns:
        The number of ops rewritten.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    # The node that holds the current value of a tensor changed in place, per node of it.
    current: dict[fx.Node, fx.Node] = {}
    rewritten = 0
    for node in list(graph.nodes):
        if current:
            node.args = fx.map_arg(node.args, lambda n: current.get(n, n))
            node.kwargs = fx.map_arg(node.kwargs, lambda n: current.get(n, n))
        target = _out_of_place(node)
        if target is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        mutated = node.args[0]
        value = example_value(mutated)
        if (
            mutated.op not in ("call_function", "call_method", "call_module")
            or not isinstance(value, Tensor)
            or not value.is_floating_point()
            or value._is_view()
            or not _same_dtype(value, node.args[1:])
            or _aliased(mutated, node, order)
        ):
            continue
        node.target = target
        # Every name of the tensor (``x`` and ``x_1 = x``) now means this node's value.
        for name, latest in list(current.items()):
            if latest is mutated:
                current[name] = node
        current[mutated] = node
        rewritten += 1
    return rewritten
