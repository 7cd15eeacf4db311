"""``compile``: the last step of a transform chain, compiling its graphs with Inductor.

:class:`CompilePass` is a :class:`~unitscale.capture.GraphPass` of stage ``COMPILE``: it
changes no graph, and its :meth:`~CompilePass.compile_graph` hands each captured piece, as the
earlier passes left it, to TorchInductor. So ``compile(simulate_fp8(unit_scale(m)))`` runs the
unit-scaled, FP8-simulating graph as fused kernels, with the same results as the eager chain
up to floating-point reassociation.

Design constraints: nothing can be applied after ``compile``, and ``compile`` refuses a chain
that records statistics (``track_scales``), whose Python side effects cannot run inside
compiled code; the capture core's stage order checks both.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch.fx as fx
from torch import Tensor, nn

from ..capture import Capture, GraphPass, Piece, Stage, TransformedModule, transformed
from ..errors import CaptureError
from ._rewrite import warn_uncaptured

__all__ = ["CompilePass", "compile"]


class CompilePass(GraphPass):
    """Compile each captured graph with TorchInductor (``compile_fx``).

    Reads: the graph the earlier passes produced. Writes: nothing.
    """

    stage = Stage.COMPILE
    applied = "is already compiled by unitscale.transforms.compile"
    order_fix = "apply compile last, e.g. compile(simulate_fp8(unit_scale(model)))"

    def __repr__(self) -> str:
        return "CompilePass()"

    def state_key(self) -> Hashable:
        """The data-parallel size and gradient accumulation: Inductor folds the gradient
        factors of unit-scaled ops (see :mod:`unitscale.data_parallel`) into the compiled
        backward, so a change of either compiles the graphs again."""
        from ..data_parallel import data_parallel_size, gradient_accumulation_steps

        return data_parallel_size(), gradient_accumulation_steps()

    def after_call(self, module: TransformedModule, capture: Capture, output: Any) -> None:
        if not getattr(self, "_warned", False):
            self._warned = warn_uncaptured(
                module, capture, output, "compile", "the ops computing them run eagerly"
            )

    def compile_graph(
        self, gm: fx.GraphModule, example_inputs: Sequence[Any], piece: Piece
    ) -> Callable[..., Any] | None:
        from torch._inductor.compile_fx import compile_fx

        gm, state = _lift_state(gm)
        compiled: Callable[..., Any] = compile_fx(gm, [*example_inputs, *state])  # type: ignore[assignment]
        if not state:
            return compiled
        return lambda *args: compiled(*args, *state)


def _lift_state(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[Tensor]]:
    """Turn the tensors an earlier pass gave the graph as attributes (``simulate_fp8``'s amax
    histories, which it updates in place) into trailing inputs: Inductor compiles a graph
    from Dynamo's inputs only, and writes an input's in-place updates back to it."""
    if not any(n.op == "get_attr" and n.target in gm._buffers for n in gm.graph.nodes):
        return gm, []
    # A copy: Dynamo reads the placeholders of the graph module it handed over afterwards.
    original = gm
    gm = copy.deepcopy(original)
    gm.meta = original.meta
    for attribute in ("_param_name_to_source", "_source_to_user_stacks"):
        if hasattr(original, attribute):
            setattr(gm, attribute, getattr(original, attribute))
    for mine, theirs in zip(
        gm.graph.find_nodes(op="placeholder"),
        original.graph.find_nodes(op="placeholder"),
        strict=True,
    ):
        if hasattr(theirs, "_dynamo_source"):
            mine._dynamo_source = theirs._dynamo_source
    state_nodes = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in gm._buffers]
    state: list[Tensor] = []
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    for node in state_nodes:
        with gm.graph.inserting_after(last):
            placeholder = gm.graph.placeholder(f"{node.name}_state")
        placeholder.meta.update(node.meta)
        placeholder._dynamo_source = None  # not a user input
        node.replace_all_uses_with(placeholder)
        gm.graph.erase_node(node)
        state.append(original._buffers[str(node.target)])  # type: ignore[arg-type]
        last = placeholder
    for node in state_nodes:
        gm._buffers.pop(str(node.target), None)
    gm.recompile()
    return gm, state


def compile(module: nn.Module) -> TransformedModule:
    """Return a copy of ``module`` (or of a transform chain) compiled with TorchInductor.

    Apply it last: ``compile(simulate_fp8(unit_scale(model)))``. Each graph TorchDynamo
    captures (one per graph break) is transformed by the earlier steps, then compiled.
    Compilation happens at the first call and again for new input shapes, dtypes or
    ``train()``/``eval()`` modes, as with ``torch.compile``.

    Args:
        module: a ``torch.nn.Module``, or a module returned by ``unit_scale`` or
            ``simulate_format``/``simulate_fp8``.

    Returns:
        The compiled copy (``module`` is not touched).

    Raises:
        CaptureError: ``module`` is not a module; is already compiled (by this function or
            by ``torch.compile``); or is tracked by ``track_scales``, whose statistics cannot
            be gathered from compiled code (compile the untracked module instead); or holds
            a submodule that is tracked or compiled (the error names it); or runs
            ``to_fp8`` on the CPU with a torch whose Inductor cannot compile float8 casts
            there (torch 2.8: run the ``to_fp8`` model eagerly, which works, or use a newer
            torch).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> fast = compile(model)  # doctest: +SKIP
        >>> torch.allclose(fast(torch.ones(1, 4)), model(torch.ones(1, 4)))  # doctest: +SKIP
        True
    """
    _check_fp8_compiles(module)
    return transformed(module, CompilePass(), "compile")


def _check_fp8_compiles(module: nn.Module) -> None:
    """Refuse compiling a ``to_fp8`` chain on the CPU where Inductor cannot compile its
    float8 casts (found by a tiny compiled trial), with the reason."""
    from .lowp._scaled_mm import float8_compile_error
    from .lowp._to_fp8 import ToFP8Pass

    if not isinstance(module, TransformedModule) or module.pass_of_type(ToFP8Pass) is None:
        return
    for device in {p.device for p in module.parameters()}:
        error = float8_compile_error(device)
        if error is not None:
            raise CaptureError(
                f"unitscale.transforms.compile: {error}; run the to_fp8 model without "
                "compile (eager float8 GEMMs work), or compile with a newer torch"
            )
