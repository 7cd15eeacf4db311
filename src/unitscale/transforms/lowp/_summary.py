"""What an FP8 transform did to each matmul-like op: :class:`FP8Summary` and
:func:`fp8_summary`.

A pass that runs ops in FP8 (simulated or real) records, per captured graph, the ops it
converted and the matmul-like ops it left as they were, each with the reason
(:func:`record`); :func:`fp8_summary` joins them over the graphs of the model's last call.
The record is logged once per captured graph, at INFO on the ``"unitscale"`` logger, and an
op left out for a reason the user did not choose (one no table recognises) is also warned
about, so that nothing is skipped silently.

Design constraints: records are plain strings in ``piece.data["fp8_summary"]`` keyed by the
transform's name, so that they pickle with the model and several FP8 passes do not mix.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ...capture import Piece, TransformedModule, example_value, unwrap_compiled, warn_user
from ...errors import UnitScaleError
from ._fsdp import GATHER_KEY

__all__ = [
    "FP8Summary",
    "flop_share",
    "fp8_summary",
    "linear_flops",
    "record",
    "warn_if_not_unit_scaled",
]

logger = logging.getLogger("unitscale")

#: ``piece.data`` keys of the records and of the linear ops' FLOPs.
_KEY = "fp8_summary"
_FLOPS = "fp8_flops"
#: ``piece.data`` key of the count of unit-scaled ops each transform converted.
_UNIT_KEY = "fp8_unit_scaled"


@dataclasses.dataclass(frozen=True)
class FP8Summary:
    """Which matmul-like ops an FP8 transform converted, and which it did not and why.

    Attributes:
        transform: the transform (``"simulate_fp8"``, ``"simulate_format"``, ``"to_fp8"``).
        converted: the ops in FP8, as ``<module path>: <op> (<graph node>)`` (no path for
            an op of the top-level module, no node name where it is the op's), in graph
            order.
        not_converted: ``(op, reason)`` for every matmul-like op left in the model's own
            precision (outside the ``ops`` scope, in a module of ``skip=``, no
            floating-point operand, or not recognised).
        converted_flop_share: the share (0 to 1) of the linear ops' FLOPs, per forward at
            the shapes last seen, that ran in FP8, the ops kept by ``skip=`` left out
            (``to_fp8`` records it; None where the transform records no FLOPs, as the
            simulations).
        float8_all_gather: (``to_fp8`` under FSDP2) the weights of the FP8 ops that FSDP2
            all-gathers as float8 bytes, by parameter name.
        high_precision_gather: ``(weight, reason)`` for each weight of an FP8 op that
            arrives in its own precision instead (not sharded by FSDP2, tied, turned off).

    Example:
        >>> s = FP8Summary("simulate_fp8", ("fc: linear",), (("bmm", "outside ops='linear'"),))
        >>> print(s)
        simulate_fp8: 1 op(s) in FP8, 1 matmul-like op(s) not: bmm (outside ops='linear')
    """

    transform: str
    converted: tuple[str, ...]
    not_converted: tuple[tuple[str, str], ...]
    converted_flop_share: float | None = None
    float8_all_gather: tuple[str, ...] = ()
    high_precision_gather: tuple[tuple[str, str], ...] = ()

    def __str__(self) -> str:
        text = f"{self.transform}: {len(self.converted)} op(s) in FP8"
        if self.converted_flop_share is not None:
            text += f" ({self.converted_flop_share:.0%} of the linear ops' FLOPs)"
        if not self.not_converted:
            text += ", every matmul-like op"
        else:
            left = ", ".join(f"{op} ({reason})" for op, reason in self.not_converted)
            text += f", {len(self.not_converted)} matmul-like op(s) not: {left}"
        if self.float8_all_gather:
            text += f"; FSDP2 gathers {len(self.float8_all_gather)} weight(s) in float8"
            if self.high_precision_gather:
                plain = ", ".join(f"{w} ({why})" for w, why in self.high_precision_gather)
                text += f", {len(self.high_precision_gather)} in their precision: {plain}"
        return text


def _hint(size: Any) -> int:
    """A size as an int; a symbolic one's hint (its value when captured), no guard added."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    hint = getattr(node, "hint", None)
    return int(hint) if hint is not None else 0


def linear_flops(node: fx.Node, slots: Sequence[tuple[int, str]]) -> float:
    """FLOPs of one linear op ``node`` (``2 * rows * in * out``) from the example values of
    its first two operands (the input, the weight in either layout); 0 where unknown."""
    values = []
    for position, keyword in list(slots)[:2]:
        arg = node.kwargs.get(keyword) if keyword in node.kwargs else None
        if arg is None and position < len(node.args):
            arg = node.args[position]
        value = example_value(arg) if isinstance(arg, fx.Node) else None
        values.append(value if isinstance(value, torch.Tensor) else None)
    x, weight = [*values, None, None][:2]
    if x is None or weight is None or x.dim() == 0:
        return 0.0
    inner = max(_hint(x.shape[-1]), 1)
    return 2.0 * _hint(x.numel()) * _hint(weight.numel()) / inner


def flop_share(pieces: Sequence[Piece], transform: str) -> float | None:
    """The share of linear-op FLOPs ``transform`` ran in FP8 over ``pieces`` (each counted
    once; None if it recorded none; 0 for no linear op)."""
    converted = total = 0.0
    seen = False
    unique = {id(piece): piece for piece in pieces}
    for piece in unique.values():
        flops = piece.data.get(_FLOPS, {}).get(transform)
        if flops is not None:
            seen = True
            converted, total = converted + flops[0], total + flops[1]
    if not seen:
        return None
    return converted / total if total > 0 else 0.0


def record(
    piece: Piece,
    transform: str,
    converted: Sequence[str],
    not_converted: Sequence[tuple[str, str]],
    warn_reasons: Sequence[str] = (),
    *,
    unit_scaled: int = 0,
    flops: tuple[float, float] | None = None,
) -> None:
    """Store one graph's summary in ``piece`` and log it once (INFO); warn about the ops left
    out for a reason among ``warn_reasons`` (those the user did not choose). ``unit_scaled``
    counts the converted ops that are unit-scaled ops (for
    :func:`warn_if_not_unit_scaled`); ``flops``: the linear ops' FLOPs converted and in
    all, for ``converted_flop_share``."""
    counts = piece.data.setdefault(_UNIT_KEY, {})
    counts[transform] = counts.get(transform, 0) + unit_scaled
    converted_list, left_list = piece.data.setdefault(_KEY, {}).setdefault(transform, ([], []))
    converted_list.extend(converted)
    left_list.extend(not_converted)
    if flops is not None:
        before = piece.data.setdefault(_FLOPS, {}).get(transform, (0.0, 0.0))
        piece.data[_FLOPS][transform] = (before[0] + flops[0], before[1] + flops[1])
    summary = FP8Summary(transform, tuple(converted), tuple(not_converted))
    logger.info("%s (graph %d)", summary, piece.index)
    surprising = [(op, reason) for op, reason in not_converted if reason in warn_reasons]
    if surprising:
        ops = ", ".join(f"{op} ({reason})" for op, reason in surprising)
        warn_user(
            f"{transform}: {len(surprising)} matmul-like op(s) run in the model's own "
            f"precision, not in FP8: {ops}. unitscale.transforms.fp8_summary(model) lists "
            "every op and why."
        )


def warn_if_not_unit_scaled(
    transform: str, module: TransformedModule, trace: Sequence[Any]
) -> None:
    """Warn when ``transform`` runs ops in FP8 without scales (``scaling="none"``) in a model
    with no unit scaling: none of the ops it converted in the call ``trace`` describes (its
    :class:`~unitscale.capture.Invocation` list) is a unit-scaled op, i.e. the model is
    neither ``unit_scale``'d nor built from unitscale's modules or functions. Such a model's
    tensors are not near 1: FP8 without scales saturates the large ones and flushes small
    gradients to zero, silently (docs/guide/fp8.rst)."""
    converted = unit_scaled = 0
    for piece in {id(inv.piece): inv.piece for inv in trace}.values():
        converted += len(piece.data.get(_KEY, {}).get(transform, ((), ()))[0])
        unit_scaled += piece.data.get(_UNIT_KEY, {}).get(transform, 0)
    if not converted or unit_scaled:
        return
    warn_user(
        f"{transform}: {type(module.module).__name__} has no unit scaling (none of its "
        f"{converted} op(s) in FP8 is a unit-scaled op), and scaling='none' casts each tensor "
        "as it is: values beyond the format's range saturate and small ones (gradients "
        "above all) flush to zero. Unit-scale the model first "
        f"({transform}(unitscale.transforms.unit_scale(model))) or scale each tensor as "
        f"torchao does ({transform}(model, scaling='tensorwise'))."
    )


def fp8_summary(module: nn.Module, transform: str | None = None) -> FP8Summary:
    """Which matmul-like ops ``module``'s FP8 transform converted in its last call, and which not.

    Args:
        module: a model returned by :func:`~unitscale.transforms.simulate_fp8`,
            :func:`~unitscale.transforms.simulate_format` or
            :func:`~unitscale.transforms.to_fp8` (or a chain holding one), called
            at least once.
        transform: which FP8 transform's summary, where a chain holds several (default:
            the only one).

    Returns:
        The :class:`FP8Summary`, over the graphs that ran in the last call.

    Raises:
        UnitScaleError: ``module`` has no FP8 transform, has not been called, or holds
            several and ``transform`` does not say which.

    Example:
        >>> import torch
        >>> from unitscale.transforms import simulate_fp8
        >>> mlp = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        >>> model = simulate_fp8(mlp, ops="linear", scaling="tensorwise")
        >>> _ = model(torch.ones(3, 4))
        >>> fp8_summary(model).converted  # module path: op (graph node)
        ('0: linear (input_1)', '1: linear (input_2)')
    """
    module = unwrap_compiled(module)  # torch.compile's OptimizedModule: its _orig_mod
    if not isinstance(module, TransformedModule):
        raise UnitScaleError(
            f"fp8_summary: {type(module).__name__} is not a transformed model; pass a model "
            "returned by unitscale.transforms.simulate_fp8, simulate_format or to_fp8"
        )
    capture = module.capture
    if capture is None or not capture.last_trace:
        raise UnitScaleError(
            "fp8_summary: the model has not been called yet; call it once, since the summary "
            "comes from the graphs that ran"
        )
    pieces: list[Piece] = []
    for invocation in capture.last_trace:
        if invocation.piece not in pieces:
            pieces.append(invocation.piece)
    found: dict[str, tuple[list[str], list[tuple[str, str]]]] = {}
    gathers: tuple[dict[str, None], dict[str, str]] = ({}, {})
    for piece in pieces:
        float8, plain = piece.data.get(GATHER_KEY, ((), ()))
        gathers[0].update(dict.fromkeys(float8))
        gathers[1].update(plain)
        for name, (converted, left) in piece.data.get(_KEY, {}).items():
            into = found.setdefault(name, ([], []))
            into[0].extend(converted)
            into[1].extend(left)
    if not found:
        raise UnitScaleError(
            f"fp8_summary: {type(module.module).__name__} runs no FP8 transform; pass a model "
            "returned by unitscale.transforms.simulate_fp8, simulate_format or to_fp8"
        )
    if transform is None:
        if len(found) > 1:
            raise UnitScaleError(
                f"fp8_summary: the model holds several FP8 transforms ({', '.join(found)}); "
                "say which with transform="
            )
        transform = next(iter(found))
    if transform not in found:
        raise UnitScaleError(
            f"fp8_summary: transform={transform!r} did not run; choose from {', '.join(found)}"
        )
    converted, left = found[transform]
    share = flop_share(pieces, transform)
    if transform != "to_fp8":
        return FP8Summary(transform, tuple(converted), tuple(left), share)
    high = tuple((w, why) for w, why in gathers[1].items() if w not in gathers[0])
    return FP8Summary(
        transform,
        tuple(converted),
        tuple(left),
        share,
        float8_all_gather=tuple(gathers[0]),
        high_precision_gather=high,
    )
