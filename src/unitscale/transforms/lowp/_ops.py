"""Which captured ops FP8 covers: the matmul-like ops, the linear ones among them, and the
matmul-like ops a transform does not recognise.

Two scopes (``ops=`` of :func:`~unitscale.transforms.simulate_fp8`):

- ``"linear"``: ops with a weight parameter, the scope of real FP8 training (the library's
  ``to_fp8``, torchao's ``convert_to_float8_training`` and Transformer Engine): ``F.linear``
  (``nn.Linear``), the unit-scaled ``linear`` and ``linear_readout``, and ``addmm`` whose
  second matrix is a parameter (transformers' ``Conv1D``, also once ``unit_scale`` has
  replaced it);
- ``"matmuls"``: every matmul-like op, attention's batched matmuls and
  ``scaled_dot_product_attention``, convolutions, ``einsum`` and the grouped matmuls of
  mixture-of-experts layers (``torch.nn.functional.grouped_mm``, ``torch._grouped_mm``,
  transformers' ``grouped_mm_fallback``) included.

Design constraints: classification reads only node targets and which nodes hold parameters
(the capture core's placeholder kinds), so it is the same for every pass that asks; an op
whose name says it multiplies matrices (``..._mm``, ``matmul``, ``gemm``) but that no table
holds is reported by the transforms as not recognised, never skipped silently.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from ...formats import FormatError
from ...scale import scale_bwd

__all__ = [
    "OPS_SCOPES",
    "OpsScope",
    "add_bias",
    "addmm_weight",
    "grouped_operands",
    "is_linear",
    "looks_matmul_like",
    "target_name",
    "unit_addmm_bias",
    "unit_linear_bias",
    "unit_readout_bias",
]

OpsScope = Literal["linear", "matmuls"]
"""Which ops FP8 covers: ``"linear"`` (ops with a weight parameter) or ``"matmuls"``."""

OPS_SCOPES: tuple[str, ...] = ("linear", "matmuls")

# (position, keyword) of each operand that a grouped matmul reads: the tokens (sorted by
# expert) and the experts' stacked weights; ``offs`` (integer group ends) is not an operand.
_GROUPED: tuple[tuple[int, str], ...] = ((0, "mat_a"), (1, "mat_b"))
_GROUPED_BY_NAME: dict[str, tuple[tuple[int, str], ...]] = {
    "aten::_grouped_mm": ((0, "self"), (1, "mat2")),
    "transformers::grouped_mm_fallback": ((0, "input"), (1, "weight")),
}


def target_name(target: Any) -> str:
    """A readable name of a node target: ``aten::_grouped_mm`` for a torch op, the function's
    ``__name__`` otherwise, the method name for ``call_method``."""
    if isinstance(target, str):
        return target
    qualified = getattr(target, "_qualified_op_name", None)  # an OpOverloadPacket
    if qualified is None and isinstance(target, torch._ops.OpOverload):
        qualified = target._overloadpacket._qualified_op_name
    if qualified is not None:
        return str(qualified)
    return str(getattr(target, "__name__", target))


def grouped_operands(node: fx.Node) -> list[tuple[int, str]]:
    """The operand slots of a grouped matmul node ([] if ``node`` is not one)."""
    if node.op != "call_function":
        return []
    grouped_mm = getattr(F, "grouped_mm", None)
    if grouped_mm is not None and node.target is grouped_mm:
        return list(_GROUPED)
    if node.target is getattr(torch, "_grouped_mm", object()):
        return list(_GROUPED_BY_NAME["aten::_grouped_mm"])
    return list(_GROUPED_BY_NAME.get(target_name(node.target), ()))


_linear_cache: tuple[Callable[..., Any], ...] | None = None


def _linear_functions() -> tuple[Callable[..., Any], ...]:
    """``F.linear`` and the unit-scaled linear ops (imported lazily: functional is heavier)."""
    global _linear_cache
    if _linear_cache is None:
        from ... import functional as U

        _linear_cache = (F.linear, U.linear, U.linear_readout)
    return _linear_cache


_addmm_cache: tuple[Callable[..., Any], ...] | None = None


def _addmm_functions() -> tuple[Callable[..., Any], ...]:
    """``torch.addmm`` and the unit-scaled op ``unit_scale`` replaces it with (``Conv1D``)."""
    global _addmm_cache
    if _addmm_cache is None:
        from ... import functional as U

        _addmm_cache = (torch.addmm, U.torch_map[torch.addmm])
    return _addmm_cache


def is_linear(node: fx.Node, parameters: set[fx.Node]) -> bool:
    """Whether ``node`` is a linear op: ``F.linear`` or a unit-scaled linear/readout, or an
    ``addmm`` (function or method) whose second matrix is one of ``parameters`` (the
    ``(in, out)`` weight of transformers' ``Conv1D``)."""
    if node.op == "call_function" and node.target in _linear_functions():
        return True
    is_addmm = (node.op == "call_function" and node.target in _addmm_functions()) or (
        node.op == "call_method" and node.target == "addmm"
    )
    if not is_addmm:
        return False
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("mat2")
    return isinstance(weight, fx.Node) and weight in parameters


_MATMUL_NAME = re.compile(r"(mm|matmul|gemm|einsum)$")


def looks_matmul_like(node: fx.Node) -> bool:
    """Whether ``node``'s target is named like a matrix multiply (``addmm``, ``_scaled_mm``,
    ``grouped_mm``, ``matmul``, ``gemm``, ``einsum``): for reporting the ones no table holds."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = target_name(node.target).rsplit("::", 1)[-1].rsplit(".", 1)[-1]
    return bool(_MATMUL_NAME.search(name.lower()))


# The bias of a linear op under FP8 (simulated or real) is added after the GEMM, in the
# output's precision, as torchao's ``Float8Linear`` does (and Transformer Engine, which
# fuses the bias gradient with the cast in high precision): its gradient is the sum of the
# output gradient before that gradient is rounded to E5M2. ``simulate_fp8`` inserts these
# after its output-gradient rounding; ``to_fp8``'s float8 linear ops end with them.


def add_bias(out: Tensor, bias: Tensor | None, weight_grad_factor: float = 1.0) -> Tensor:
    """``out + bias`` in ``out``'s dtype; the bias gradient times ``weight_grad_factor`` (a
    unit-scaled op's, as :func:`unitscale.functional.linear` scales it).

    Example:
        >>> add_bias(torch.zeros(2, 3), torch.ones(3)).tolist()
        [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    """
    if bias is None:
        return out
    if not isinstance(weight_grad_factor, float) or weight_grad_factor != 1.0:
        bias = scale_bwd(bias, weight_grad_factor)
    return out + bias.to(out.dtype)


def unit_linear_bias(
    out: Tensor,
    bias: Tensor | None,
    input: Tensor,
    weight: Tensor,
    constraint: Any = "to_output_scale",
) -> Tensor:
    """The bias of :func:`unitscale.functional.linear` (``input``, ``weight`` and
    ``constraint`` as it was called), added to its bias-free ``out``."""
    from ... import functional as U

    return add_bias(out, bias, U.linear_factors(input, weight, constraint).weight_grad)


def unit_readout_bias(
    out: Tensor,
    bias: Tensor | None,
    input: Tensor,
    weight: Tensor,
    constraint: Any = "to_grad_input_scale",
    mup: bool = True,
) -> Tensor:
    """As :func:`unit_linear_bias`, for :func:`unitscale.functional.linear_readout`."""
    from ... import functional as U

    factors = U.linear_readout_factors(input, weight, constraint, mup=mup)
    return add_bias(out, bias, factors.weight_grad)


def unit_addmm_bias(
    out: Tensor,
    bias: Tensor | None,
    mat1: Tensor,
    mat2: Tensor,
    constraint: Any = "to_output_scale",
) -> Tensor:
    """As :func:`unit_linear_bias`, for ``unit_scale``'s ``addmm`` (``linear(mat1, mat2.t(),
    bias)``, transformers' ``Conv1D``)."""
    return unit_linear_bias(out, bias, mat1, mat2.t(), constraint)


def addmm_weight(where: str, mat2: Tensor, beta: float, alpha: float) -> Tensor:
    """``addmm``'s second matrix as a linear op's weight (``mat2.t()``), for the linear-op
    counterparts that take ``addmm`` (transformers' ``Conv1D``); ``beta`` and ``alpha``
    other than 1 are refused, naming ``where`` (e.g. ``"to_fp8: addmm"``)."""
    if beta != 1 or alpha != 1:
        raise FormatError(
            f"unitscale.transforms.{where}: beta={beta!r}, alpha={alpha!r} are not supported "
            "(only 1); scale the operands, or call torch.addmm"
        )
    return mat2.t()
