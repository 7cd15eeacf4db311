"""``simulate_format`` with block-scaled formats (MX, NVFP4): each GEMM's operands blocked
along that GEMM's reduction dimension, forward and both backward GEMMs.

A block-scaled GEMM shares a scale between the elements of a block *along the reduction
dimension* (each dot product multiplies blocks pairwise, then scales them), so one tensor
is blocked differently in each GEMM it enters. For a linear op ``y = x @ W.T`` (``x`` of
shape ``(M, K)``, ``W`` of ``(N, K)``), as Transformer Engine's MXFP8/NVFP4 recipes and
torchao's MX training do:

- forward ``y = Q(x, along K) @ Q(W, along K).T``;
- input gradient ``grad_x = Q(grad_y, along N) @ Q(W, along N)``;
- weight gradient ``grad_W = Q(grad_y, along M).T @ Q(x, along M)`` (``M``: the tokens,
  every leading dimension of ``x`` flattened),

``Q`` rounding with ``fwd_format`` (``x``, ``W``) or ``bwd_format`` (``grad_y``), each
time from the unrounded tensor (the backward keeps ``x`` and ``W`` in the model's
precision), the products in the model's precision. A bias is added after the GEMM, its
gradient the sum of the unrounded ``grad_y``. Two-operand matmuls (``matmul``, ``mm``,
``bmm``, ``@``, with ``ops="matmuls"``) are blocked the same way, ``a`` of ``(..., M, K)``
and ``b`` of ``(..., K, N)``, ``M`` per batch element. Not simulated: Transformer Engine's
16x16 two-dimensional weight blocks and random Hadamard transforms of its NVFP4 recipe.

Which ops are converted is the FP8 simulation's classification
(:func:`~unitscale.transforms.lowp._operands.fp8_candidates`, the same ``ops`` scopes and
summary names); the matmul-like ops left out (no block-scaled counterpart here, or a GEMM
dimension that is not a multiple of the block size) are recorded with the reason for
:func:`~unitscale.transforms.fp8_summary`.

Design constraints: formats travel in the graph as plain tuples (:data:`BlockSpec`); the
pass holds only configuration.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from ... import functional as U
from ...capture import Capture, Piece, TransformedModule, example_value, is_float_node
from ...formats import BlockFormat, FormatError
from ...scale import scale_bwd
from .._rewrite import RewritePass
from ._operands import NO_FLOAT_OPERAND, UNRECOGNISED, fp8_candidates
from ._ops import OpsScope, add_bias
from ._pass import SimulateFormatPass
from ._quantise import FormatSpec, format_spec
from ._summary import record

__all__ = [
    "BlockFormatPass",
    "BlockSpec",
    "block_linear",
    "block_matmul",
    "block_spec",
    "check_block_formats",
    "is_block_request",
    "real_block_gemm_refusal",
]

BlockSpec = tuple[FormatSpec, int, str, str, bool]
"""A :class:`~unitscale.formats.BlockFormat` as plain data (its element's
:data:`~._quantise.FormatSpec`, block size, scale format, scale mode, tensor scale)."""


def block_spec(fmt: BlockFormat) -> BlockSpec:
    """The :data:`BlockSpec` of ``fmt``."""
    element = format_spec(fmt.element)
    return (element, fmt.block_size, fmt.scale_format, fmt.scale_mode, fmt.tensor_scale)


# The block formats of the specs seen (a dict, not functools.lru_cache: see _quantise.py).
_BLOCKS: dict[BlockSpec, BlockFormat] = {}


def _block_of(spec: BlockSpec) -> BlockFormat:
    from ._quantise import _format_of

    block = _BLOCKS.get(spec)
    if block is None:
        element, size, scale_format, mode, tensor_scale = spec
        block = BlockFormat(_format_of(tuple(element)), size, scale_format, mode, tensor_scale)  # type: ignore[arg-type]
        _BLOCKS[spec] = block
    return block


def _as_block(spec: BlockFormat | BlockSpec) -> BlockFormat:
    return spec if isinstance(spec, BlockFormat) else _block_of(spec)


class BlockLinear(torch.autograd.Function):
    """``y = output_factor * Q(x) @ Q(W).T`` with the blockings of the module docstring;
    ``grad_x`` carries ``output_factor`` too, ``grad_W`` ``weight_grad_factor`` (the factors
    of a unit-scaled op, where ``to_fp8``'s float8 GEMMs put them)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        fwd: BlockFormat,
        bwd: BlockFormat,
        output_factor: float,
        weight_grad_factor: float,
    ) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = fwd.quantise(rows, dim=-1) @ fwd.quantise(weight, dim=-1).t()
        if not isinstance(output_factor, float) or output_factor != 1.0:
            out = out * output_factor
        ctx.save_for_backward(rows, weight)
        ctx.config = (x.shape, fwd, bwd, output_factor, weight_grad_factor)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows, weight = ctx.saved_tensors
        x_shape, fwd, bwd, output_factor, weight_grad_factor = ctx.config
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = bwd.quantise(g, dim=-1) @ fwd.quantise(weight, dim=0)
            if not isinstance(output_factor, float) or output_factor != 1.0:
                grad_x = grad_x * output_factor
            grad_x = grad_x.reshape(x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = bwd.quantise(g, dim=0).t() @ fwd.quantise(rows, dim=0)
            if not isinstance(weight_grad_factor, float) or weight_grad_factor != 1.0:
                grad_w = grad_w * weight_grad_factor
        return grad_x, grad_w, None, None, None, None


class BlockMatmul(torch.autograd.Function):
    """``a @ b`` (both at least 2-D, broadcasting batch dimensions) with ``a`` blocked along
    ``K`` (its last dimension) and ``b`` along ``K`` (its second last) in the forward;
    backward as in the module docstring, ``M`` and ``N`` per batch element."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, fwd: BlockFormat, bwd: BlockFormat) -> Tensor:
        ctx.save_for_backward(a, b)
        ctx.formats = (fwd, bwd)
        return torch.matmul(fwd.quantise(a, dim=-1), fwd.quantise(b, dim=-2))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        a, b = ctx.saved_tensors
        fwd, bwd = ctx.formats
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = torch.matmul(bwd.quantise(grad, dim=-1), fwd.quantise(b, dim=-1).mT)
            grad_a = grad_a.sum_to_size(a.shape)
        if ctx.needs_input_grad[1]:
            grad_b = torch.matmul(fwd.quantise(a, dim=-2).mT, bwd.quantise(grad, dim=-2))
            grad_b = grad_b.sum_to_size(b.shape)
        return grad_a, grad_b, None, None


def _apply_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    fwd: BlockFormat | BlockSpec,
    bwd: BlockFormat | BlockSpec,
    factors: U.LinearFactors | None,
) -> Tensor:
    """``x @ weight.T + bias`` as block-scaled GEMMs; with a unit-scaled op's ``factors``,
    applied where ``to_fp8``'s float8 linear applies them."""
    f, b = _as_block(fwd), _as_block(bwd)
    if factors is None:
        out: Tensor = BlockLinear.apply(x, weight, f, b, 1.0, 1.0)
        return add_bias(out, bias)
    x = scale_bwd(x, factors.input_grad)
    out = BlockLinear.apply(x, weight, f, b, factors.output, factors.weight_grad)
    return add_bias(out, bias, factors.weight_grad)


def block_linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    fwd: BlockFormat | BlockSpec,
    bwd: BlockFormat | BlockSpec,
) -> Tensor:
    """``F.linear`` as block-scaled GEMMs (what ``simulate_format`` puts in its place).

    Example:
        >>> from unitscale.formats import get_format
        >>> mx = get_format("mxfp4_e2m1")
        >>> x, w = torch.full((1, 32), 0.3), torch.ones(2, 32)
        >>> block_linear(x, w, fwd=mx, bwd=mx).tolist()  # 0.3 at scale 2**-4: 4.8 -> 4
        [[8.0, 8.0]]
    """
    return _apply_linear(input, weight, bias, fwd, bwd, None)


def block_addmm(
    input: Tensor,
    mat1: Tensor,
    mat2: Tensor,
    *,
    fwd: BlockFormat | BlockSpec,
    bwd: BlockFormat | BlockSpec,
) -> Tensor:
    """``torch.addmm(bias, x, weight)`` (transformers' ``Conv1D``) as block-scaled GEMMs."""
    return _apply_linear(mat1, mat2.t(), input, fwd, bwd, None)


def block_unit_linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    constraint: U.Constraint = "to_output_scale",
    *,
    fwd: BlockFormat | BlockSpec,
    bwd: BlockFormat | BlockSpec,
) -> Tensor:
    """:func:`unitscale.functional.linear` as block-scaled GEMMs."""
    factors = U.linear_factors(input, weight, constraint)
    return _apply_linear(input, weight, bias, fwd, bwd, factors)


def block_unit_linear_readout(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    constraint: U.Constraint = "to_grad_input_scale",
    *,
    mup: bool = True,
    fwd: BlockFormat | BlockSpec,
    bwd: BlockFormat | BlockSpec,
) -> Tensor:
    """:func:`unitscale.functional.linear_readout` as block-scaled GEMMs."""
    factors = U.linear_readout_factors(input, weight, constraint, mup=mup)
    return _apply_linear(input, weight, bias, fwd, bwd, factors)


def block_unit_addmm(
    input: Tensor,
    mat1: Tensor,
    mat2: Tensor,
    constraint: U.Constraint = "to_output_scale",
    *,
    fwd: BlockFormat | BlockSpec,
    bwd: BlockFormat | BlockSpec,
) -> Tensor:
    """``unit_scale``'s ``addmm`` (:func:`block_unit_linear` of ``(mat1, mat2.t(), input)``)."""
    return block_unit_linear(mat1, mat2.t(), input, constraint, fwd=fwd, bwd=bwd)


def block_matmul(
    input: Tensor, other: Tensor, *, fwd: BlockFormat | BlockSpec, bwd: BlockFormat | BlockSpec
) -> Tensor:
    """``input @ other`` (both at least 2-D) as a block-scaled GEMM."""
    out: Tensor = BlockMatmul.apply(input, other, _as_block(fwd), _as_block(bwd))
    return out


# Each converted op: (its block-scaled counterpart, the names of its leading parameters,
# whether the weight is stored transposed (addmm's (in, out) matrix)).
_Op = tuple[Callable[..., Any], tuple[str, ...], bool]
_LINEAR = ("input", "weight", "bias")
_ADDMM = ("input", "mat1", "mat2")
_MATMUL = ("input", "other")


def _table() -> dict[Any, _Op]:
    return {
        F.linear: (block_linear, _LINEAR, False),
        U.linear: (block_unit_linear, (*_LINEAR, "constraint"), False),
        U.linear_readout: (block_unit_linear_readout, (*_LINEAR, "constraint"), False),
        torch.addmm: (block_addmm, _ADDMM, True),
        "addmm": (block_addmm, _ADDMM, True),
        U.torch_map[torch.addmm]: (block_unit_addmm, (*_ADDMM, "constraint"), True),
        torch.matmul: (block_matmul, _MATMUL, False),
        torch.mm: (block_matmul, _MATMUL, False),
        torch.bmm: (block_matmul, _MATMUL, False),
        "matmul": (block_matmul, _MATMUL, False),
        "__matmul__": (block_matmul, _MATMUL, False),
        "mm": (block_matmul, _MATMUL, False),
        "bmm": (block_matmul, _MATMUL, False),
        operator.matmul: (block_matmul, _MATMUL, False),
    }


NO_BLOCK_COUNTERPART = (
    "no block-scaled simulation of this op (linear ops and two-operand matmul/mm/bmm/@ only)"
)
"""Summary reason of a matmul-like op the block-scaled simulation leaves unrounded."""


class BlockFormatPass(SimulateFormatPass):
    """Replace each linear op (and, with ``ops="matmuls"``, each two-operand matmul) by its
    block-scaled counterpart in this module.

    Reads: node targets, ``example_value`` shapes (to check every GEMM dimension against
    the block sizes), which placeholders are parameters (through the shared
    classification). Writes: the target and arguments of each converted node (the same
    arguments plus ``fwd``/``bwd`` as :data:`BlockSpec`); the summary record;
    ``piece.data["simulate_format"]``: the ``(op, operand)`` pairs rounded.

    A subclass of :class:`~._pass.SimulateFormatPass` so that every rule about a model that
    simulates a number format (``to_fp8`` refuses it, ``scaling_cost`` reads it) holds.
    """

    def __init__(
        self,
        fwd_block: BlockFormat,
        bwd_block: BlockFormat,
        ops: OpsScope = "matmuls",
        transform: str = "simulate_format",
        skip: frozenset[str] = frozenset(),
    ) -> None:
        self.fwd_block = fwd_block
        self.bwd_block = bwd_block
        self.ops = ops
        self.skip = skip
        self.label = transform
        self.scaling = "none"
        self.history_len = 1

    def __repr__(self) -> str:
        return f"BlockFormatPass(fwd={self.fwd_block!r}, bwd={self.bwd_block!r}, ops={self.ops!r})"

    def after_call(self, module: TransformedModule, capture: Capture, output: Any) -> None:
        # Per-block scales need no unit scaling to stay in range: no warning about scales.
        RewritePass.after_call(self, module, capture, output)

    def transform(self, gm: fx.GraphModule, piece: Piece, capture: Capture) -> fx.GraphModule:
        converted: list[str] = []
        left: list[tuple[str, str]] = []
        quantised: list[tuple[str, str]] = []
        table = _table()
        for node, label, _ in fp8_candidates(self, gm, piece, capture, self.ops, left):
            try:
                op = table.get(node.target)
            except TypeError:  # an unhashable target
                op = None
            if op is None:
                left.append((label, NO_BLOCK_COUNTERPART))
                continue
            bound = dict(zip(op[1], node.args, strict=False))
            bound.update(node.kwargs)
            if op[0] is block_matmul and "mat2" in bound:  # torch.mm(input, mat2=...)
                bound["other"] = bound.pop("mat2")
            reason = self._refusal(node, op, bound)
            if reason is not None:
                left.append((label, reason))
                continue
            bound.pop("beta", None)  # 1 where the op is converted (see _refusal)
            bound.pop("alpha", None)
            operands = [
                bound[n] for n in op[1] if n in ("input", "weight", "mat1", "mat2", "other")
            ]
            quantised.extend((node.name, o.name) for o in operands if isinstance(o, fx.Node))
            node.op, node.target = "call_function", op[0]
            node.args = ()
            node.kwargs = {
                **bound,
                "fwd": block_spec(self.fwd_block),
                "bwd": block_spec(self.bwd_block),
            }
            converted.append(label)
        record(piece, self.label, converted, left, warn_reasons=(UNRECOGNISED,))
        piece.data.setdefault("simulate_format", []).extend(quantised)
        piece.data["fp8_scaling"] = ("none", 0, 0)
        gm.recompile()
        return gm

    def _refusal(self, node: fx.Node, op: _Op, bound: dict[str, Any]) -> str | None:
        """Why ``node`` cannot run as block-scaled GEMMs here (None: it can)."""
        function, _, transposed = op
        if function is block_matmul:
            a, b = bound.get("input"), bound.get("other")
        elif transposed:
            if bound.get("beta", 1) != 1 or bound.get("alpha", 1) != 1:
                return "addmm with beta or alpha other than 1"
            a, b = bound.get("mat1"), bound.get("mat2")
        else:
            a, b = bound.get("input"), bound.get("weight")
        if not (is_float_node(a) and is_float_node(b)):
            return NO_FLOAT_OPERAND
        x, w = example_value(a), example_value(b)
        if function is block_matmul:
            if x.dim() < 2 or w.dim() < 2:
                return f"a matrix-vector product (shapes {tuple(x.shape)}, {tuple(w.shape)})"
            m, k, n = x.shape[-2], x.shape[-1], w.shape[-1]
        else:
            if w.dim() != 2:
                return f"weight of shape {tuple(w.shape)}"
            n, k = (w.shape[1], w.shape[0]) if transposed else (w.shape[0], w.shape[1])
            m = math.prod(x.shape[:-1])
        sizes = {self.fwd_block.block_size, self.bwd_block.block_size}
        block = math.lcm(*sizes)
        dims = {"M": int(m), "K": int(k), "N": int(n)}
        if any(size % block for size in dims.values()):
            shown = ", ".join(f"{name}={size}" for name, size in dims.items())
            return (
                f"GEMM dimensions {shown}: each must be a multiple of the block size {block} "
                "(no padding)"
            )
        return None


def real_block_gemm_refusal(op: str, what: Any) -> FormatError:
    """The error for a request of a real block-scaled GEMM (``op`` was asked for ``what``)."""
    return FormatError(
        f"unitscale.transforms.{op}: {what!r} asks for real block-scaled GEMMs, which "
        "torch._scaled_mm runs only on Blackwell-class NVIDIA GPUs (compute capability 10.x, "
        "e.g. B200) and this library does not issue; simulate the format instead with "
        f"unitscale.transforms.simulate_format(model, {_name(what)!r}, {_name(what)!r})"
    )


def _name(what: Any) -> str:
    """The preset name of a block format (or the name given), for the error's example."""
    from ...formats import BLOCK_PRESETS

    for name, preset in BLOCK_PRESETS.items():
        if what == name or (
            isinstance(what, BlockFormat) and what.with_rounding("nearest") == preset
        ):
            return name
    return "mxfp8_e4m3"


def is_block_request(value: Any) -> bool:
    """Whether ``value`` is a block-scaled format or the name of one."""
    from ...formats import BLOCK_PRESETS

    return isinstance(value, BlockFormat) or (
        isinstance(value, str) and value.lower() in BLOCK_PRESETS
    )


def check_block_formats(fwd: Any, bwd: Any, scaling: Any) -> tuple[BlockFormat, BlockFormat]:
    """``simulate_format``'s check of a block-scaled pair: both block formats, no scaling."""
    if not (isinstance(fwd, BlockFormat) and isinstance(bwd, BlockFormat)):
        raise FormatError(
            f"unitscale.transforms.simulate_format: fwd_format={fwd!r} and bwd_format="
            f"{bwd!r} mix a block-scaled format with a per-tensor one; pass two block-scaled "
            "formats (e.g. 'mxfp8_e4m3' and 'mxfp8_e5m2') or two per-tensor ones"
        )
    if scaling != "none":
        raise FormatError(
            f"unitscale.transforms.simulate_format: scaling={scaling!r} with block-scaled "
            "formats, whose per-block scales are their scaling; use scaling='none'"
        )
    return fwd, bwd
