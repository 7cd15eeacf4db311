"""What the recording pass reads off a captured graph: which values have a static shape, which
are equal on every data-parallel rank, and which merely rearrange another value (so that
their statistics are the other's).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...capture import Piece, example_value, is_float_node


def _static_shape(value: Tensor) -> bool:
    return all(isinstance(size, int) for size in value.shape)


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
