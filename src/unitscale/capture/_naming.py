"""Names in captured graphs: readable names for the ops of inlined functions
(docs/design.rst, "Contracts", Tracking), Python identifiers, module paths and the names of
a graph's inputs (the naming of the whole package lives here).

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

import inspect
import os
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

__all__ = ["function_name", "identifier", "module_path_of", "readable_name"]

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


# -- names of graph values: identifiers, module paths, inputs --------------------------------
def identifier(name: str) -> str:
    """A valid Python identifier derived from ``name`` (``emb.weight`` -> ``emb_weight``)."""
    name = re.sub(r"\W", "_", name)
    return name if name and not name[0].isdigit() else f"_{name}"


def module_path_of(node: fx.Node, module_names: dict[int, str]) -> str:
    """Qualified name of the innermost module that produced ``node`` ("" at top level)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    for key, (path, _cls) in reversed(list(stack.items())):
        try:
            name = module_names.get(int(key))
        except (TypeError, ValueError):
            name = None
        if name is not None:
            return name
        # A module reached through a global (``G['__import_...'].apply_rotary_pos_emb``:
        # transformers wraps some functions in a module of its own) is not one of the model's
        # modules: the op belongs to the innermost module of the model that called it.
        if not str(path).startswith("G["):
            break
    else:
        return ""
    return _clean_module_path(str(path))


def module_path_at(node: fx.Node, frame_module: str | None, module_names: dict[int, str]) -> str:
    """Qualified name of the innermost module of ``node`` where its graph runs now: the
    module path relative to the captured frame's ``self`` (Dynamo's ``nn_module_stack``),
    under ``frame_module`` (a piece's :attr:`~._core.Piece.frame_module`). Dynamo reuses the
    graph of one layer's frame for every other layer, so :func:`module_path_of` (read off
    the module objects Dynamo saw) names the first layer there; this names the layer the
    piece runs for. :func:`module_path_of` where the frame is unknown."""
    stack = node.meta.get("nn_module_stack")
    if frame_module is None or not stack:
        return module_path_of(node, module_names) if frame_module is None else frame_module
    _key, (path, _cls) = list(stack.items())[-1]
    if not str(path).startswith("L['self']"):
        return module_path_of(node, module_names)
    relative = _clean_module_path(str(path))
    return ".".join(part for part in (frame_module, relative) if part)


def _clean_module_path(path: str) -> str:
    """A qualified module name from Dynamo's source path (``L['self'].blocks[0]`` ->
    ``blocks.0``)."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    return path.lstrip(".")


def _frame_module(graph: fx.Graph, kinds: Sequence[tuple[str, str]]) -> str | None:
    """Qualified name of the module bound to ``self`` in the frame ``graph`` was captured
    from, read off a parameter or buffer input: its qualified name less its path from
    ``self`` (``blocks.1.norm.weight`` from ``L['self']._modules['norm']...`` is
    ``blocks.1``). None where no input says (a frame without parameters)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, (kind, name) in zip(placeholders, kinds, strict=False):
        if kind not in ("param", "buffer"):
            continue
        source = getattr(node.meta.get("grapharg"), "source", None)
        text = getattr(source, "name", None)
        text = text() if callable(text) else text
        if not isinstance(text, str) or not text.startswith("L['self']"):
            continue
        relative = re.sub(
            r"\._(?:modules|parameters|buffers)\['([^']+)'\]", r".\1", text[len("L['self']") :]
        )
        if not re.fullmatch(r"(\.\w+)+", relative):
            continue
        relative = relative[1:]
        if name == relative:
            return ""
        if name.endswith("." + relative):
            return name[: -len(relative) - 1]
    return None


def _source_name(source: Any, arg_names: Sequence[str]) -> str | None:
    """A readable name for a Dynamo input source: ``x``, ``batch.input_ids``, ``args[0]``."""
    base = getattr(source, "base", None)
    local = getattr(source, "local_name", None)
    if isinstance(local, str) and base is None:
        return local
    index = getattr(source, "index", getattr(source, "member", None))
    if base is None or index is None:
        return None
    base_local = getattr(base, "local_name", None)
    if base_local == "args" and isinstance(index, int) and getattr(base, "base", None) is None:
        # torch.compile of a built-in module traces fn(*args, **kwargs): use forward's names.
        return arg_names[index] if index < len(arg_names) else f"args_{index}"
    if base_local == "kwargs" and getattr(base, "base", None) is None:
        return str(index)
    parent = _source_name(base, arg_names)
    return None if parent is None else f"{parent}.{index}"


def _placeholder_kind(
    node: fx.Node,
    value: Any,
    params: dict[int, str],
    buffers: dict[int, str],
    arg_names: Sequence[str],
) -> tuple[str, str]:
    if isinstance(value, Tensor):
        if id(value) in params:
            return ("param", params[id(value)])
        if id(value) in buffers:
            return ("buffer", buffers[id(value)])
    grapharg = node.meta.get("grapharg")
    name = _source_name(getattr(grapharg, "source", None), arg_names)
    if name is None:
        target = node.target if isinstance(node.target, str) else node.name
        name = re.sub(r"^L_|_$", "", target)
    return ("input", name)


def _positional_names(module: nn.Module) -> list[str]:
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in parameters if p.kind in kinds]
