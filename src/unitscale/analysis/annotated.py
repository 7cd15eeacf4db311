"""Annotated code: a module's ``forward`` source with the scale of what each line computes.

Design constraints: the scales come from :func:`unitscale.transforms.track_scales` (the module
is tracked as a copy; the caller's module is not touched); graph nodes are mapped to source
lines through the ``stack_trace`` that TorchDynamo records on every node, taking the outermost
frame in ``forward`` (so ``x = x + self.attn(...)`` is annotated with the sum, not with an op
inside ``attn``).
"""

from __future__ import annotations

import inspect
import math
import re
import textwrap
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn
from torch.utils._pytree import tree_map

from ..errors import AnalysisError
from ..tracking.metrics import Metrics

__all__ = ["analyse_module"]

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def _call(module: nn.Module, inputs: Any) -> Any:
    # Tracking marks float inputs requires_grad and backward fills their .grad: give it
    # detached aliases (no copy) so that the caller's tensors are left as they were.
    if isinstance(inputs, Mapping):
        inputs = dict(inputs)
    inputs = tree_map(lambda v: v.detach() if isinstance(v, Tensor) else v, inputs)
    if isinstance(inputs, Tensor):
        return module(inputs)
    if isinstance(inputs, Mapping):
        return module(**inputs)
    if isinstance(inputs, (tuple, list)):
        return module(*inputs)
    raise AnalysisError(
        f"analyse_module: inputs must be a Tensor, a tuple/list of arguments or a mapping of "
        f"keyword arguments, got {type(inputs).__name__}"
    )


def _backward(output: Any, backward: Tensor | None) -> None:
    if not isinstance(output, Tensor):
        raise AnalysisError(
            f"analyse_module: the module returned {type(output).__name__}, not a Tensor; wrap "
            "it so that forward returns the tensor to differentiate"
        )
    if backward is not None:
        if backward.shape != output.shape:
            raise AnalysisError(
                f"analyse_module: backward has shape {tuple(backward.shape)} but the output has "
                f"shape {tuple(output.shape)}; pass a gradient shaped like the output"
            )
        output.backward(backward)
    elif output.requires_grad:
        (output if output.dim() == 0 else output.sum()).backward()


def _fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    if math.isfinite(value) and value != 0 and not 1e-3 <= abs(value) < 1e4:
        return f"{value:.2e}"
    return f"{value:.3g}"


def _scales(metrics: Metrics, metric: str) -> str:
    fwd = None if metrics.fwd is None else float(metrics.fwd.as_dict()[metric])
    bwd = None if metrics.bwd is None else float(metrics.bwd.as_dict()[metric])
    return f"(-> {_fmt(fwd)}, <- {_fmt(bwd)})"


def analyse_module(
    module: nn.Module,
    inputs: Any,
    backward: Tensor | None = None,
    metric: str = "mean_abs",
) -> str:
    """Return ``module``'s ``forward`` source, each line annotated with its scales.

    The module is tracked (:func:`unitscale.transforms.track_scales`), called on ``inputs``,
    and differentiated: with ``backward`` as the output's gradient, or else from the output
    itself (a scalar) or its sum. A line that computes a floating-point tensor ends with
    ``# (-> F, <- B)``: ``metric`` of the last value the line computes (F) and of the gradient
    with respect to it (B; ``n/a`` where none flowed). The ``def`` line lists the inputs'
    scales. Lines that call submodules are annotated with their result; the submodules'
    own lines are not shown. A line that runs several times (a loop) shows its last run.

    Args:
        module: the module to analyse (not modified).
        inputs: a Tensor, a tuple/list of positional arguments, or a mapping of keyword
            arguments.
        backward: gradient of the output, shaped like it (default: differentiate the output,
            or its sum when it is not a scalar).
        metric: which statistic to show (``"mean_abs"``, ``"rms"``, ``"std"``, ...).

    Returns:
        The annotated source, as one string.

    Raises:
        AnalysisError: for unsupported inputs, a non-tensor output, a gradient of the wrong
            shape, an unknown metric or a module whose source is unavailable.

    Example:
        >>> class Double(nn.Module):
        ...     def forward(self, x):
        ...         y = x * 2
        ...         return y
        >>> import torch
        >>> code = analyse_module(Double(), torch.full((4,), 0.5), backward=torch.ones(4))
        >>> print(code.splitlines()[2].strip())
        y = x * 2  # (-> 1, <- 1)
    """
    from ..transforms import track_scales

    if metric not in Metrics.Data.SCALAR_FIELDS:
        raise AnalysisError(
            f"analyse_module: metric={metric!r} is not a scalar metric; use one of "
            f"{list(Metrics.Data.SCALAR_FIELDS)}"
        )
    forward = type(module).forward
    try:
        lines, first = inspect.getsourcelines(forward)
        source_file = inspect.getsourcefile(forward)
    except (OSError, TypeError) as exc:
        raise AnalysisError(
            f"analyse_module: cannot read the source of {type(module).__name__}.forward "
            f"({exc}); define the module in a file"
        ) from exc
    if source_file is None:  # pragma: no cover - getsourcelines would have failed first
        raise AnalysisError(f"analyse_module: no source file for {type(module).__name__}")
    last = first + len(lines) - 1

    tracked = track_scales(module)
    _backward(_call(tracked, inputs), backward)
    graph = tracked.scales_graph()

    by_line: dict[int, list[Metrics]] = {}
    inputs_line: list[str] = []
    for node in graph.nodes:
        metrics = node.meta.get("metrics")
        if not isinstance(metrics, Metrics) or metrics.fwd is None:
            continue
        if node.op in ("placeholder", "get_attr"):
            if node.op == "placeholder" and not node.meta.get("requires_grad"):
                name = node.meta.get("clean_name", node.name)
                inputs_line.append(f"{name} {_scales(metrics, metric)}")
            continue
        for match in _FRAME.finditer(str(node.meta.get("stack_trace") or "")):
            line = int(match["line"])
            if match["file"] == source_file and first <= line <= last:
                by_line.setdefault(line, []).append(metrics)
                break  # the outermost frame inside forward is the line that computes it

    dedented = textwrap.dedent("".join(lines)).splitlines()
    def_index = next((i for i, s in enumerate(dedented) if s.lstrip().startswith("def ")), 0)
    annotated = [i for i in range(len(dedented)) if first + i in by_line]
    annotated += [def_index] if inputs_line else []
    width = max((len(dedented[i]) for i in annotated), default=0)
    out = [
        f"# {type(module).__name__}.forward: {metric} of each line's result "
        "(-> forward value, <- gradient)"
    ]
    for i, text in enumerate(dedented):
        note = ""
        found = by_line.get(first + i)
        if found:
            note = _scales(found[-1], metric)
        elif i == def_index and inputs_line:
            note = ", ".join(inputs_line)
        out.append(f"{text.ljust(width)}  # {note}" if note else text)
    return "\n".join(line.rstrip() for line in out)
