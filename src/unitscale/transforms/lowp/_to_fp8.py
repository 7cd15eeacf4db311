"""``to_fp8``: run every linear op of a model as real float8 GEMMs (``torch._scaled_mm``).

:class:`ToFP8Pass` rewrites each captured graph: every linear op, as
:mod:`unitscale.transforms.lowp._ops` defines them for ``simulate_fp8(ops="linear")`` too
(``F.linear``, :func:`unitscale.functional.linear` and ``linear_readout``, and ``addmm``
whose second matrix is a parameter, transformers' ``Conv1D``, or ``unit_scale``'s version of
it), calls its float8 counterpart in :mod:`unitscale.transforms.lowp._gemm` instead, with the
same arguments. Every other op runs as before, in the model's precision: the matmul-like ops
that are not linear ops (attention's batched matmuls, ``matmul`` of two activations,
convolutions, ``einsum``) and the linear ops that ``_scaled_mm`` cannot take (non-float
operands, a device without float8 GEMMs) are listed, with the reason, in
:func:`~unitscale.transforms.fp8_summary` (the summary ``simulate_fp8`` keeps, with the
same op names and reasons) and in one INFO log line per captured graph; the summary's
``converted_flop_share`` is the share of the linear ops' FLOPs that ran in FP8, and
``to_fp8`` warns when it is under 90%. Any weight shape converts (the GEMMs pad to CUDA's
alignment, :mod:`~._scaled_mm`).

The numerics are those of ``simulate_fp8`` restricted to the same ops (see
docs/guide/fp8-real.rst): operands rounded to nearest in E4M3, the output gradient in E5M2,
FP32 accumulation, the bias added after the GEMM.

Design constraints: the pass holds only its configuration (it pickles and deep-copies); what
it found is stored per graph by :func:`~._fp8_summary.record` (under the name ``"to_fp8"``)
and in ``piece.data["fp8_scaling"]`` (read by ``scaling_cost``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ... import functional as U
from ...capture import (
    Capture,
    Piece,
    Stage,
    TransformedModule,
    example_value,
    is_float_node,
    transformed,
)
from ...errors import CaptureError
from ...formats import FormatError
from .._rewrite import RewritePass, placeholder_names
from . import _fsdp
from . import _gemm as fp8
from ._blocks import is_block_request, real_block_gemm_refusal
from ._operands import NO_FLOAT_OPERAND, UNRECOGNISED, fp8_candidates, is_unit_scaled
from ._pass import SimulateFormatPass, _Sites, history_variant_key
from ._rowwise import ROWWISE
from ._scaling import DEFAULT_HISTORY_LEN, Scaling, keep_histories
from ._simulate import FP8_RECIPES, FP8Recipe, _check_scaling
from ._skip import Skip, resolve_skip
from ._summary import (  # noqa: F401 (fp8_summary: to_fp8's example)
    flop_share,
    fp8_summary,
    linear_flops,
    record,
    warn_if_not_unit_scaled,
)

__all__ = ["ToFP8Pass", "to_fp8"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Below this share of the linear ops' FLOPs in FP8, ``to_fp8`` warns.
MIN_FLOP_SHARE = 0.9
# scaled casts in the backward of one linear op, by scaling (the forward's: 2)
_BACKWARD_CASTS = {"none": 0, "tensorwise": 1, "delayed": 1, "rowwise": 4, "rowwise_with_gw_hp": 2}


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
        "addmm": _LinearOp("addmm", fp8.addmm, addmm, weight_transposed=True),  # bias.addmm
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
    arguments plus ``scaling``, ``fast_accum`` and, for ``"delayed"``, ``histories``:
    ``get_attr`` nodes of the amax-history buffers ``fp8_amax_history_<module>_input``,
    ``..._weight`` and ``..._grad_output``, named as ``simulate_fp8`` names them, one set
    per place the piece runs at: :func:`~._pass.history_variant_key`);
    the summary record (:mod:`~._fp8_summary`) of the graph's matmul-like ops;
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

    def __init__(
        self,
        scaling: Scaling = "none",
        history_len: int = DEFAULT_HISTORY_LEN,
        skip: frozenset[str] = frozenset(),
        fast_accum: bool = True,
    ) -> None:
        self.scaling = scaling
        self.history_len = history_len
        self.skip = skip  # modules kept in high precision (_skip.py)
        #: FSDP2 float8 all-gather: each linear weight by name, None where marked for it, else
        #: the reason (None: turned off); set by to_fp8 (see :mod:`~._fsdp`).
        self.fsdp_gather: dict[str, str | None] | None = None
        self.fast_accum = fast_accum

    def __repr__(self) -> str:
        return f"ToFP8Pass(scaling={self.scaling!r}, fast_accum={self.fast_accum!r})"

    def variant_key(self, piece: Piece, capture: Capture) -> Hashable:
        return history_variant_key(self.scaling, piece, capture)

    def inlinable(self, module: nn.Module) -> bool:
        """True, as for ``simulate_fp8``, except where the weights are on a device whose
        Inductor cannot compile the float8 casts (torch 2.8 on the CPU, see
        :func:`~._scaled_mm.float8_compile_error`): a user's torch.compile would hand them
        to Inductor (whose compiled backward crashed there), so the GEMMs stay behind the
        boundary. (Weights that FSDP2 shards are not plain parameters: no plan takes them.)"""
        from ._scaled_mm import float8_compile_error

        devices = {param.device for param in module.parameters()}
        return all(float8_compile_error(device) is None for device in devices)

    def transform(self, gm: fx.GraphModule, piece: Piece, capture: Capture) -> fx.GraphModule:
        sites = _Sites(gm, piece, capture, self.history_len, self.scaling == "delayed")
        converted: list[str] = []
        left: list[tuple[str, str]] = []
        unit_scaled = 0
        weights: dict[fx.Node, list[str]] = {}
        table = _linear_ops()
        names = {node: name for node, (_, name) in placeholder_names(gm, piece).items()}
        flops = [0.0, 0.0]  # converted, all (linear ops, per forward)
        # the ops of simulate_fp8(ops="linear"), under the same names and reasons
        for node, label, slots in fp8_candidates(self, gm, piece, capture, "linear", left):
            op = table.get(node.target)
            bound = _bind(node, op.params) if op is not None else {}
            reason = "no float8 counterpart" if op is None else self._refusal(op, bound)
            cost = linear_flops(node, slots)
            flops[1] += cost
            if reason is not None:
                left.append((label, reason))
                continue
            assert op is not None  # for mypy: reason is None only with an op
            unit_scaled += is_unit_scaled(node)
            self._convert(gm.graph, node, op, bound, sites)
            converted.append(label)
            weights.setdefault(bound[_operands(op)[1]], []).append(label)
            flops[0] += cost
        record(
            piece,
            self.transform_name,
            converted,
            left,
            (UNRECOGNISED,),
            unit_scaled=unit_scaled,
            flops=(flops[0], flops[1]),
        )
        marks = getattr(self, "fsdp_gather", None)
        _fsdp.record_gathers(piece, gm, names, weights, marks, capture.owner_ref())
        piece.data["fp8_scaling"] = (self.scaling, *sites.counts)
        gm.recompile()
        return gm

    def _refusal(self, op: _LinearOp, bound: dict[str, Any]) -> str | None:
        """Why this linear op cannot run as float8 GEMMs (None: it can)."""
        x_name, w_name = _operands(op)
        x, weight = bound.get(x_name), bound.get(w_name)
        if op.weight_transposed and (bound.get("beta", 1) != 1 or bound.get("alpha", 1) != 1):
            return "addmm with beta or alpha other than 1"
        if not (is_float_node(x) and is_float_node(weight)):
            return NO_FLOAT_OPERAND
        x_value, w_value = example_value(x), example_value(weight)
        if x_value.dtype not in _FLOAT_DTYPES or w_value.dtype not in _FLOAT_DTYPES:
            return (
                f"operands in {x_value.dtype} and {w_value.dtype}: float8 GEMMs cast from "
                "float32, bfloat16 or float16"
            )
        if w_value.dim() != 2 or x_value.dim() < 1:
            return f"operand shapes {tuple(x_value.shape)} and {tuple(w_value.shape)}"
        error = fp8.float8_device_error(x_value.device, rowwise=self.scaling in ROWWISE)
        if error is not None:
            return f"{error}; move the model to a device with float8 GEMMs"
        return None

    def _convert(
        self,
        graph: fx.Graph,
        node: fx.Node,
        op: _LinearOp,
        bound: dict[str, Any],
        sites: _Sites,
    ) -> None:
        kwargs: dict[str, Any] = {**bound, "scaling": self.scaling, "fast_accum": self.fast_accum}
        if self.scaling != "none":
            sites.counts[0] += 2
            sites.counts[1] += _BACKWARD_CASTS[self.scaling]
        if self.scaling == "delayed":
            histories = []
            with graph.inserting_before(node):
                for name in _operands(op):
                    device = example_value(bound[name]).device
                    histories.append(sites.history(graph, node, name, device))
                device = example_value(node).device
                histories.append(sites.history(graph, node, "grad_output", device))
            kwargs["histories"] = tuple(histories)
        node.op, node.target = "call_function", op.target
        node.args = ()
        node.kwargs = kwargs

    def after_call(self, module: TransformedModule, capture: Capture, output: Any) -> None:
        super().after_call(module, capture, output)
        trace = capture.trace or capture.last_trace
        if getattr(self, "_checked", False) or not trace:
            return
        self._checked = True
        if self.scaling == "none":
            warn_if_not_unit_scaled(self.transform_name, module, trace)
        records = [inv.piece.data.get("fp8_summary", {}).get("to_fp8") for inv in trace]
        name = type(module.module).__name__
        if not any(converted for converted, _ in filter(None, records)):
            warnings.warn(
                f"to_fp8: {name} has no linear op that can run as "
                "float8 GEMMs (nn.Linear, F.linear, unitscale's linear and readout, "
                "transformers' Conv1D); it runs as before, nothing in FP8",
                UserWarning,
                stacklevel=6,
            )
            return
        share = flop_share([inv.piece for inv in trace], "to_fp8")
        if share is not None and share < MIN_FLOP_SHARE:
            warnings.warn(
                f"to_fp8: only {share:.0%} of {name}'s linear-op FLOPs run in FP8 (under "
                f"{MIN_FLOP_SHARE:.0%}); unitscale.transforms.fp8_summary(model) lists the "
                "ops left in high precision and why",
                UserWarning,
                stacklevel=6,
            )

    def without_state(self) -> ToFP8Pass:
        clone = super().without_state()
        clone.__dict__.pop("_checked", None)
        clone.__dict__.pop("_warned", None)
        return clone  # type: ignore[return-value]


def _check_recipe(recipe: Any) -> None:
    if is_block_request(recipe):
        raise real_block_gemm_refusal("to_fp8", recipe)
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
    skip: Skip = None,
    fsdp_float8_all_gather: bool = True,
    fast_accum: bool = True,
) -> TransformedModule:
    """Return a copy of ``module`` whose linear ops run as real float8 GEMMs.

    Every linear op (an op with a weight: ``nn.Linear``/``F.linear``, unitscale's linear
    layers and readout, transformers' ``Conv1D``) runs through ``torch._scaled_mm``: forward
    ``x(E4M3) @ W(E4M3)``, backward ``grad_x = grad_y(E5M2) @ W(E4M3)`` and ``grad_W =
    grad_y(E5M2).T @ x(E4M3)``, accumulated in FP32, written in the input's dtype (under
    ``torch.autocast``, in autocast's, as torchao's ``Float8Linear``), the bias added
    afterwards; the backward keeps ``x`` and ``W`` as float8 tensors. Every GEMM meets
    CUDA's rules for ``_scaled_mm`` on every device, padding to multiples of 16 as needed,
    so any shape converts. This is the ``"hardware"`` recipe of :func:`simulate_fp8`, for
    real: on the CPU its outputs and gradients equal rounding the same operands and
    multiplying them as the CPU's kernel does, bit for bit (see docs/guide/fp8-real.rst,
    which also says where a GPU differs). Other ops run as before; :func:`fp8_summary`
    lists what runs in FP8 and what not, and the share of the linear ops' FLOPs in FP8.

    Args:
        module: any ``torch.nn.Module`` (or a transformed one, e.g. ``unit_scale(m)``) that
            TorchDynamo can capture.
        recipe: ``"hardware"`` (or the equal :class:`FP8Recipe`); others are refused.
        scaling: ``"none"`` (default: scale 1, no amax anywhere, what a unit-scaled model
            needs), ``"tensorwise"`` (torchao's dynamic recipe with its default config),
            ``"delayed"`` (amax histories, as in :func:`simulate_fp8`), or torchao's
            rowwise recipes ``"rowwise"`` and ``"rowwise_with_gw_hp"`` (see
            docs/guide/fp8-real.rst).
        history_len: amax-history length for ``scaling="delayed"``.
        skip: modules kept in high precision, as for :func:`simulate_fp8`.
        fsdp_float8_all_gather: where :func:`unitscale.data_parallel.fully_shard` (FSDP2)
            shards the weight of an ``nn.Linear`` (applied after ``to_fp8``), all-gather it
            as E4M3 bytes, cast on each rank with the GEMM's own scale, which the GEMM then
            uses as it arrives (``"none"`` and ``"tensorwise"`` scaling; the same numbers as
            gathering the weight in its precision, a quarter of FP32's bytes). ``False``
            gathers every weight in its own precision (see docs/guide/distributed.rst).
        fast_accum: the forward GEMM accumulates with cuBLAS's fast float8 accumulation
            (torchao's default, ``True``); the backward's never do. On CUDA it trades
            accumulation precision in the forward for speed; on the CPU it changes nothing.

    Returns:
        The transformed copy (``module`` is not touched).

    Raises:
        FormatError: this torch build or a parameter's device has no float8 GEMMs (use
            :func:`simulate_fp8` there); ``recipe`` cannot run as float8 GEMMs (other
            formats, stochastic rounding, rounded operand gradients), or names a block-scaled
            format (``"mxfp8_e4m3"``, a ``BlockFormat``: real block-scaled GEMMs need a
            Blackwell-class GPU, compute capability 10.x; simulate it with
            :func:`simulate_format`); ``scaling`` or ``history_len`` is not supported;
            ``skip`` names no module.
        CaptureError: as for :func:`simulate_format`; or ``module`` already simulates a
            number format or runs in FP8.

    Example:
        >>> model = to_fp8(nn.Linear(2, 1, bias=False), scaling="tensorwise")
        >>> with torch.no_grad():
        ...     _ = model.weight.copy_(torch.tensor([[1000.0, 0.3]]))
        >>> model(torch.ones(1, 2)).item()  # W * 0.448 -> E4M3 -> / 0.448, by _scaled_mm
        1000.31...
        >>> fp8_summary(model).converted
        ('linear',)
    """
    _check_recipe(recipe)
    _check_scaling("to_fp8", scaling, history_len)
    if not isinstance(fast_accum, bool):
        raise FormatError(
            f"unitscale.transforms.to_fp8: argument 'fast_accum'={fast_accum!r} must be a "
            "bool (True: the forward GEMM accumulates fast, as torchao's default)"
        )
    _fsdp.check_not_sharded(module)
    build = fp8.float8_build_error()
    if build is not None:
        raise FormatError(
            f"unitscale.transforms.to_fp8: {build}, which float8 GEMMs need (torch 2.1 or "
            "later with a float8 build); use unitscale.transforms.simulate_fp8 to simulate "
            "the same numerics"
        )
    if isinstance(module, nn.Module):
        for device in {p.device for p in module.parameters()}:
            fp8.check_float8(device, "to_fp8", rowwise=scaling in ROWWISE)
    if isinstance(module, TransformedModule) and module.pass_of_type(SimulateFormatPass):
        raise CaptureError(
            "unitscale.transforms.to_fp8: the module already simulates a number format "
            "(simulate_format/simulate_fp8); apply to_fp8 to the model without it"
        )
    skipped = resolve_skip("to_fp8", module, skip)
    graph_pass = ToFP8Pass(scaling, history_len, skipped, fast_accum)
    result = transformed(module, graph_pass, "to_fp8")
    if fsdp_float8_all_gather:
        for owned in result.passes:  # the chain's own copy of the pass
            if isinstance(owned, ToFP8Pass):
                owned.fsdp_gather = _fsdp.mark_weights(result.module, scaling)
    if scaling == "delayed":
        keep_histories(result.module)
    return result
