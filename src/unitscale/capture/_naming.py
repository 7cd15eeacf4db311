"""Readable names for the ops of inlined functions (docs/design.rst, "Contracts", Tracking).

Dynamo names a node after the variable it is assigned to in the frame being traced
(``q_embed``) or, for a sub-expression, after its op (``mul_5``); it does not say which
function the variable belongs to. For an op that runs inside a function the module's
``forward`` calls (``apply_rotary_pos_emb``, ``rotate_half``, a user helper), the name reads
as ``function.variable``, from the innermost frame of the node's ``stack_trace`` that is the
user's code (not torch's and not unitscale's):

- a node Dynamo named after a variable keeps it: ``apply_rotary_pos_emb.q_embed``;
- a node Dynamo named after its op (its name is the one ``source_fn_stack`` records) inside an
  assignment takes the assigned variable and the op: ``apply_rotary_pos_emb.q_embed.mul``
  for ``q * cos`` in ``q_embed = (q * cos) + (rotate_half(q) * sin)``.

Ops written directly in a ``forward`` keep Dynamo's name as it is (the contract for
top-level code). Design constraint: the name comes from node meta alone (no source files
are read), so it costs nothing per call.
"""

from __future__ import annotations

import os
import re

import torch
import torch.fx as fx

__all__ = ["function_name", "readable_name"]

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line \d+, in (?P<function>\S+)\s*$')
_ASSIGNMENT = re.compile(r"^\s*(?P<target>[A-Za-z_]\w*)\s*(:[^=]+)?=(?!=)")
_LIBRARY_DIRS = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)


def _user_frame(stack_trace: str) -> tuple[str, str] | None:
    """``(function, source line)`` of the innermost frame outside torch and unitscale."""
    lines = stack_trace.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        match = _FRAME.match(lines[index])
        if match is None:
            continue
        if os.path.abspath(match["file"]).startswith(_LIBRARY_DIRS):
            continue
        source = lines[index + 1] if index + 1 < len(lines) else ""
        return match["function"], source
    return None


def function_name(node: fx.Node) -> str | None:
    """The function, other than a ``forward``, whose code produced ``node``; None for code
    written in a module's ``forward`` (or at top level) and where Dynamo kept no stack."""
    stack_trace = node.meta.get("stack_trace")
    if not isinstance(stack_trace, str):
        return None
    frame = _user_frame(stack_trace)
    if frame is None:
        return None
    function = frame[0]
    if function == "forward" or function.startswith("<"):  # <lambda>, <genexpr>...
        return None
    return function


def readable_name(node: fx.Node, name: str) -> str:
    """The clean name of op node ``node``, whose name in the joined graph is ``name``.

    Examples:
        >>> graph = fx.Graph()
        >>> node = graph.create_node("call_function", torch.mul, name="mul_5")
        >>> node.meta["stack_trace"] = (
        ...     '  File "model.py", line 9, in apply_rotary_pos_emb\\n'
        ...     "    q_embed = (q * cos) + (rotate_half(q) * sin)\\n"
        ... )
        >>> node.meta["source_fn_stack"] = [("mul_5", torch.mul)]
        >>> readable_name(node, "mul_5")
        'apply_rotary_pos_emb.q_embed.mul'
        >>> node.meta["source_fn_stack"] = [("add_2", torch.add)]  # named q_embed by Dynamo
        >>> readable_name(node, "q_embed")
        'apply_rotary_pos_emb.q_embed'
    """
    function = function_name(node)
    if function is None:
        return name
    sources = node.meta.get("source_fn_stack") or []
    if sources and sources[-1][0] == node.name:  # named after its op, not a variable
        frame = _user_frame(node.meta["stack_trace"])
        assignment = _ASSIGNMENT.match(frame[1]) if frame is not None else None
        if assignment is not None:
            op = re.sub(r"_\d+$", "", sources[-1][0])
            return f"{function}.{assignment['target']}.{op}"
    return f"{function}.{name}"
