"""``to_fp8``: run every linear op of a model as real float8 GEMMs (``torch._scaled_mm``).

:class:`ToFP8Pass` rewrites each captured graph: every linear op (an op with a weight:
``F.linear``, :func:`unitscale.functional.linear` and ``linear_readout``, and ``torch.addmm``
whose second matrix is a parameter, transformers' ``Conv1D``, or ``unit_scale``'s version of
it) calls its float8 counterpart in :mod:`unitscale.transforms._fp8_gemm` instead, with the
same arguments. Every other op runs as before, in the model's precision: the matmul-like ops
that are not linear ops (attention's batched matmuls, ``matmul`` of two activations,
convolutions, ``einsum``) and the linear ops that ``_scaled_mm`` cannot take (non-float or
mixed-dtype operands, weight shapes the device rejects) are listed, with the reason, in
:func:`fp8_summary` and in one INFO log line per captured graph.

The numerics are those of ``simulate_fp8`` restricted to the same ops (see
docs/guide/fp8-real.rst): operands rounded to nearest in E4M3, the output gradient in E5M2,
FP32 accumulation, the bias added after the GEMM.

Design constraints: the pass holds only its configuration (it pickles and deep-copies); what
it found is stored per graph under ``piece.data["to_fp8"]`` (a list of :class:`FP8Op`) and
``piece.data["fp8_scaling"]`` (read by ``scaling_cost``).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .. import functional as U
from ..capture import (
    Capture,
    Piece,
    Stage,
    TransformedModule,
    example_value,
    is_float_node,
    module_path_of,
    transformed,
)
from ..errors import CaptureError, UnitScaleError
from ..formats import FormatError
from . import _fp8_gemm as fp8
from ._rewrite import RewritePass, parameter_nodes, placeholder_names
from ._scaling import DEFAULT_HISTORY_LEN, SCALINGS, Scaling, keep_histories
from ._simulate import FP8_RECIPES, FP8Recipe, SimulateFormatPass, _Sites, matmul_operands

__all__ = ["FP8Op", "FP8Summary", "ToFP8Pass", "fp8_summary", "to_fp8"]

logger = logging.getLogger("unitscale")

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class FP8Op:
    """One matmul-like op of a captured graph, and whether ``to_fp8`` runs it in FP8.

    Attributes:
        name: the op's node name in the captured graph (``"linear_1"``, ``"logits"``).
        module: the qualified name of the module that called it ("" at top level).
        kind: what it is: ``"linear"``, ``"linear_readout"``, ``"addmm"`` or the name of
            another matmul-like op (``"scaled_dot_product_attention"``, ``"matmul"``).
        reason: None when it runs as float8 GEMMs; otherwise why it does not.
    """

    name: str
    module: str
    kind: str
    reason: str | None = None

    def __str__(self) -> str:
        where = f"{self.module}: " if self.module else ""
        return f"{where}{self.name} ({self.kind})"


@dataclasses.dataclass(frozen=True)
class FP8Summary:
    """Which ops of a ``to_fp8`` model ran as float8 GEMMs in its last call, and which not.

    Attributes:
        in_fp8: the linear ops that ran as float8 GEMMs.
        not_in_fp8: the other matmul-like ops, and the linear ops that could not, each with
            its :attr:`FP8Op.reason`; they ran in the model's own precision.
    """

    in_fp8: tuple[FP8Op, ...]
    not_in_fp8: tuple[FP8Op, ...]

    def __str__(self) -> str:
        lines = [f"{len(self.in_fp8)} op(s) in float8 GEMMs:"]
        lines += [f"  {op}" for op in self.in_fp8]
        lines.append(f"{len(self.not_in_fp8)} matmul-like op(s) not in FP8:")
        lines += [f"  {op}: {op.reason}" for op in self.not_in_fp8]
        return "\n".join(lines)


# Each linear op: what the summary calls it, its float8 counterpart, the names of its
# leading parameters (to read positional arguments), and whether the weight is stored
# transposed (addmm's second matrix, ``(in, out)``).
@dataclasses.dataclass(frozen=True)
class _LinearOp:
    kind: str
    target: Callable[..., Any]
    params: tuple[str, ...]
    weight_transposed: bool = False


def _linear_ops() -> dict[Any, _LinearOp]:
    linear = ("input", "weight", "bias")
    addmm = ("input", "mat1", "mat2")
    return {
        F.linear: _LinearOp("linear", fp8.linear, linear),
        U.linear: _LinearOp("linear", fp8.unit_linear, (*linear, "constraint")),
        U.linear_readout: _LinearOp(
            "linear_readout", fp8.unit_linear_readout, (*linear, "constraint")
        ),
        torch.addmm: _LinearOp("addmm", fp8.addmm, addmm, weight_transposed=True),
        U.torch_map[torch.addmm]: _LinearOp("addmm", fp8.unit_addmm, addmm, weight_transposed=True),
    }


def _bind(node: fx.Node, params: tuple[str, ...]) -> dict[str, Any]:
    bound = dict(zip(params, node.args, strict=False))
    bound.update(node.kwargs)
    return bound


def _operands(op: _LinearOp) -> tuple[str, str]:
    return ("mat1", "mat2") if op.weight_transposed else ("input", "weight")


class ToFP8Pass(RewritePass):
    """Replace each linear op by its float8 counterpart (:mod:`~._fp8_gemm`).

    Reads: node targets, Dynamo's ``example_value`` meta (dtypes, shapes, devices) and which
    placeholders are parameters (``addmm`` is a linear op only with a parameter as its
    second matrix). Writes: the target and arguments of each converted node (the same
    arguments plus ``scaling`` and, for ``"delayed"``, ``histories``: ``get_attr`` nodes of
    the amax-history buffers ``fp8_amax_history_<operand>_scale`` and
    ``..._<op>_grad_quantised``, named as ``simulate_fp8`` names them);
    ``piece.data["to_fp8"]``: an :class:`FP8Op` per matmul-like op;
    ``piece.data["fp8_scaling"]``: ``(scaling, forward scales, backward scales)``.
    """

    stage = Stage.SIMULATE
    repeatable = False
    scopable = True
    counts_fp8_scaling = True  # read by scaling_cost
    transform_name = "to_fp8"
    uncaptured_consequence = "their linear ops run in the model's precision, not in FP8"
    applied = "already runs its linear ops in FP8 (to_fp8)"
    order_fix = "unit-scale first, e.g. to_fp8(unit_scale(model))"

    def __init__(self, scaling: Scaling = "none", history_len: int = DEFAULT_HISTORY_LEN) -> None:
        self.scaling = scaling
        self.history_len = history_len

    def __repr__(self) -> str:
        return f"ToFP8Pass(scaling={self.scaling!r})"

    def transform(self, gm: fx.GraphModule, piece: Piece, capture: Capture) -> fx.GraphModule:
        root = capture.owner_module if self.scaling == "delayed" else None
        sites = _Sites(gm, root, self.history_len)
        ops = self._rewrite(gm, piece, capture, sites)
        piece.data.setdefault("to_fp8", []).extend(ops)
        piece.data["fp8_scaling"] = (self.scaling, *sites.counts)
        gm.recompile()
        converted = [str(op) for op in ops if op.reason is None]
        others = [f"{op} ({op.reason})" for op in ops if op.reason is not None]
        logger.info(
            "to_fp8: %d linear op(s) in float8 GEMMs: %s; not in FP8: %s",
            len(converted),
            ", ".join(converted) or "none",
            "; ".join(others) or "none",
        )
        return gm

    def _rewrite(
        self, gm: fx.GraphModule, piece: Piece, capture: Capture, sites: _Sites
    ) -> list[FP8Op]:
        table = _linear_ops()
        params = parameter_nodes(gm, piece)
        names = {node: name for node, (_, name) in placeholder_names(gm, piece).items()}
        modules = {id(m): n for n, m in capture.owner_module.named_modules()}
        in_scope = self.scope_filter(capture, piece)
        found: list[FP8Op] = []
        for node in list(gm.graph.nodes):
            if node.op not in ("call_function", "call_method") or not in_scope(node):
                continue
            target = node.target if node.op == "call_function" else None
            try:
                op = table.get(target)
            except TypeError:  # unhashable target
                op = None
            if op is None:
                if matmul_operands(node) or node.target is torch.einsum:
                    found.append(_record(node, modules, self._other_reason(node)))
                continue
            bound = _bind(node, op.params)
            reason = self._refusal(op, bound, params)
            record = _record(node, modules, reason, op.kind)
            found.append(record)
            if reason is None:
                self._convert(gm.graph, node, op, bound, names, sites)
        return found

    @staticmethod
    def _other_reason(node: fx.Node) -> str:
        value = example_value(node)
        dtype = getattr(value, "dtype", None)
        precision = str(dtype).replace("torch.", "") if dtype is not None else "its precision"
        return f"not a linear op (no weight parameter): runs in {precision}"

    def _refusal(self, op: _LinearOp, bound: dict[str, Any], params: set[fx.Node]) -> str | None:
        """Why this linear op cannot run as float8 GEMMs (None: it can)."""
        x_name, w_name = _operands(op)
        x, weight = bound.get(x_name), bound.get(w_name)
        if op.weight_transposed:
            if weight not in params:
                return "not a linear op: its second matrix is not a parameter"
            if bound.get("beta", 1) != 1 or bound.get("alpha", 1) != 1:
                return "addmm with beta or alpha other than 1"
        if not (is_float_node(x) and is_float_node(weight)):
            return "an operand is not a floating-point tensor"
        x_value, w_value = example_value(x), example_value(weight)
        if x_value.dtype not in _FLOAT_DTYPES or w_value.dtype != x_value.dtype:
            return (
                f"operands in {x_value.dtype} and {w_value.dtype}: float8 GEMMs take one "
                "dtype of float32, bfloat16 or float16"
            )
        if w_value.dim() != 2 or x_value.dim() < 1:
            return f"operand shapes {tuple(x_value.shape)} and {tuple(w_value.shape)}"
        fp8.check_float8(x_value.device, "to_fp8")
        fan_out, fan_in = w_value.shape[::-1] if op.weight_transposed else w_value.shape
        return fp8.float8_shape_error(int(fan_in), int(fan_out), x_value.device)

    def _convert(
        self,
        graph: fx.Graph,
        node: fx.Node,
        op: _LinearOp,
        bound: dict[str, Any],
        names: dict[fx.Node, str],
        sites: _Sites,
    ) -> None:
        kwargs: dict[str, Any] = {**bound, "scaling": self.scaling}
        if self.scaling != "none":
            sites.counts[0] += 2
            sites.counts[1] += 1
        if self.scaling == "delayed":
            histories = []
            with graph.inserting_before(node):
                for name in _operands(op):
                    operand = bound[name]
                    base = names.get(operand, operand.name)
                    device = example_value(operand).device
                    histories.append(sites.history(graph, f"{base}_scale", device))
                device = example_value(node).device
                histories.append(sites.history(graph, f"{node.name}_grad_quantised", device))
            kwargs["histories"] = tuple(histories)
        node.target = op.target
        node.args = ()
        node.kwargs = kwargs

    def after_call(self, module: TransformedModule, capture: Capture, output: Any) -> None:
        super().after_call(module, capture, output)
        trace = capture.trace or capture.last_trace
        if getattr(self, "_checked", False) or not trace:
            return
        self._checked = True
        ops = [op for inv in trace for op in inv.piece.data.get("to_fp8", ())]
        if not any(op.reason is None for op in ops):
            warnings.warn(
                f"to_fp8: {type(module.module).__name__} has no linear op that can run as "
                "float8 GEMMs (nn.Linear, F.linear, unitscale's linear and readout, "
                "transformers' Conv1D); it runs as before, nothing in FP8",
                UserWarning,
                stacklevel=6,
            )

    def without_state(self) -> ToFP8Pass:
        clone = super().without_state()
        clone.__dict__.pop("_checked", None)
        clone.__dict__.pop("_warned", None)
        return clone  # type: ignore[return-value]


def _record(
    node: fx.Node, modules: dict[int, str], reason: str | None, kind: str | None = None
) -> FP8Op:
    name = getattr(node.target, "__name__", None) or str(node.target)
    return FP8Op(node.name, module_path_of(node, modules), kind or str(name), reason)


def _check_recipe(recipe: Any) -> None:
    chosen = recipe
    if isinstance(recipe, str):
        if recipe not in FP8_RECIPES:
            raise FormatError(
                f"unitscale.transforms.to_fp8: recipe={recipe!r} is not an FP8 recipe; pass "
                f"'hardware' (the one to_fp8 runs) or an FP8Recipe"
            )
        chosen = FP8_RECIPES[recipe]
    if not isinstance(chosen, FP8Recipe):
        raise FormatError(
            f"unitscale.transforms.to_fp8: recipe={recipe!r} is not an FP8 recipe; pass "
            "'hardware' or an FP8Recipe"
        )
    hardware = FP8_RECIPES["hardware"]
    if chosen == hardware:
        return
    reasons = []
    for name, fmt, wanted in (
        ("operands", chosen.operands, hardware.operands),
        ("output_grad", chosen.output_grad, hardware.output_grad),
    ):
        if fmt is not None and fmt.rounding == "stochastic":
            reasons.append(f"{name} rounds stochastically (float8 casts round to nearest)")
        elif fmt != wanted:
            reasons.append(f"{name} is {fmt}, not {wanted} (the formats of float8 GEMMs)")
    if chosen.operand_grads is not None:
        reasons.append(
            "operand_grads rounds the GEMMs' own results (a float8 GEMM accumulates and "
            "writes them in higher precision)"
        )
    raise FormatError(
        f"unitscale.transforms.to_fp8: recipe {chosen!r} cannot run as float8 GEMMs: "
        f"{'; '.join(reasons)}; use recipe='hardware', or simulate this recipe with "
        "unitscale.transforms.simulate_fp8"
    )


def to_fp8(
    module: nn.Module,
    recipe: FP8Recipe | str = "hardware",
    scaling: Scaling = "none",
    history_len: int = DEFAULT_HISTORY_LEN,
) -> TransformedModule:
    """Return a copy of ``module`` whose linear ops run as real float8 GEMMs.

    Every linear op (an op with a weight: ``nn.Linear``/``F.linear``, unitscale's linear
    layers and readout, transformers' ``Conv1D``) runs through ``torch._scaled_mm``: forward
    ``x(E4M3) @ W(E4M3)``, backward ``grad_x = grad_y(E5M2) @ W(E4M3)`` and ``grad_W =
    grad_y(E5M2).T @ x(E4M3)``, accumulated in FP32, written in the input's dtype, the bias
    added afterwards; the backward keeps ``x`` and ``W`` as float8 tensors. This is the
    ``"hardware"`` recipe of :func:`simulate_fp8`, for real: on the CPU its outputs and
    gradients equal rounding the same operands and multiplying in FP32, bit for bit (see
    docs/guide/fp8-real.rst, which also says where a GPU differs). Other ops run as before;
    :func:`fp8_summary` lists what runs in FP8 and what not.

    Args:
        module: any ``torch.nn.Module`` (or a transformed one, e.g. ``unit_scale(m)``) that
            TorchDynamo can capture.
        recipe: ``"hardware"`` (or the equal :class:`FP8Recipe`); others are refused.
        scaling: ``"none"`` (default: scale 1, no amax anywhere, what a unit-scaled model
            needs), ``"tensorwise"`` (torchao's dynamic recipe with its default config) or
            ``"delayed"`` (amax histories, as in :func:`simulate_fp8`).
        history_len: amax-history length for ``scaling="delayed"``.

    Returns:
        The transformed copy (``module`` is not touched).

    Raises:
        FormatError: this torch build or a parameter's device has no float8 GEMMs (use
            :func:`simulate_fp8` there); ``recipe`` cannot run as float8 GEMMs (other
            formats, stochastic rounding, rounded operand gradients); ``scaling`` or
            ``history_len`` is not supported.
        CaptureError: as for :func:`simulate_format`; or ``module`` already simulates a
            number format or runs in FP8.

    Example:
        >>> model = to_fp8(nn.Linear(2, 1, bias=False))
        >>> with torch.no_grad():
        ...     _ = model.weight.copy_(torch.tensor([[1000.0, 0.3]]))
        >>> model(torch.ones(1, 2)).item()  # 448 (E4M3's max) + 0.3125, from _scaled_mm
        448.3125
        >>> [str(op) for op in fp8_summary(model).in_fp8]
        ['linear (linear)']
    """
    _check_recipe(recipe)
    if not isinstance(scaling, str) or scaling not in SCALINGS:
        raise FormatError(
            f"unitscale.transforms.to_fp8: argument 'scaling'={scaling!r} is not supported; "
            f"use one of {SCALINGS}"
        )
    if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
        raise FormatError(
            f"unitscale.transforms.to_fp8: argument 'history_len'={history_len!r} must be a "
            "positive int"
        )
    build = fp8.float8_build_error()
    if build is not None:
        raise FormatError(
            f"unitscale.transforms.to_fp8: {build}, which float8 GEMMs need (torch 2.1 or "
            "later with a float8 build); use unitscale.transforms.simulate_fp8 to simulate "
            "the same numerics"
        )
    if isinstance(module, nn.Module):
        for device in {p.device for p in module.parameters()}:
            fp8.check_float8(device, "to_fp8")
    if isinstance(module, TransformedModule) and module.pass_of_type(SimulateFormatPass):
        raise CaptureError(
            "unitscale.transforms.to_fp8: the module already simulates a number format "
            "(simulate_format/simulate_fp8); apply to_fp8 to the model without it"
        )
    result = transformed(module, ToFP8Pass(scaling, history_len), "to_fp8")
    if scaling == "delayed":
        keep_histories(result.module)
    return result


def fp8_summary(module: nn.Module) -> FP8Summary:
    """Which matmul-like ops of a :func:`to_fp8` model ran as float8 GEMMs in its last call.

    Args:
        module: a model returned by :func:`to_fp8` (or a chain containing it), called once.

    Returns:
        The :class:`FP8Summary` of the graphs that ran in the last call.

    Raises:
        UnitScaleError: ``module`` was not made by ``to_fp8``, or has not been called.

    Example:
        >>> model = to_fp8(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)))
        >>> _ = model(torch.ones(2, 16))
        >>> summary = fp8_summary(model)
        >>> len(summary.in_fp8), len(summary.not_in_fp8)
        (2, 0)
    """
    if not isinstance(module, TransformedModule) or module.pass_of_type(ToFP8Pass) is None:
        raise UnitScaleError(
            f"fp8_summary: {type(module).__name__} does not run in FP8; pass a model "
            "returned by unitscale.transforms.to_fp8"
        )
    capture = module.capture
    trace = capture.last_trace if capture is not None else []
    if not trace:
        raise UnitScaleError(
            "fp8_summary: the model has not been called yet; call it once, since the ops "
            "are found in the graphs TorchDynamo captures"
        )
    pieces = list({id(inv.piece): inv.piece for inv in trace}.values())
    ops = [op for piece in pieces for op in piece.data.get("to_fp8", ())]
    return FP8Summary(
        tuple(op for op in ops if op.reason is None),
        tuple(op for op in ops if op.reason is not None),
    )
