"""Unit-scaled matmul-like ops: matmul, linear, linear_readout, conv1d, embedding."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..constraints import apply_constraint
from ..scale import scale_bwd, scale_fwd_bwd
from ._base import Constraint, _finish, _prescale, _reject, _rsqrt, _single
from ._shared import broadcast_along_batch, shared_counts, shared_rsqrt

# --------------------------------------------------------------------------------------------
# matmul-like ops
# --------------------------------------------------------------------------------------------


def _matmul_fans(left: Tensor, right: Tensor) -> tuple[int, int, int]:
    """(terms per output, per left-gradient, per right-gradient element) of ``left @ right``.

    Every output element sums ``k`` products; there are ``numel(out) * k`` products in all
    and each input element (broadcast or not) takes part in ``numel(out) * k / numel(input)``
    of them, each adding one term to its gradient.
    """
    k = left.shape[-1]
    left_shape = tuple(left.shape) if left.dim() > 1 else (1, left.shape[0])
    right_shape = tuple(right.shape) if right.dim() > 1 else (right.shape[0], 1)
    batch = torch.broadcast_shapes(left_shape[:-2], right_shape[:-2])
    products = math.prod(batch) * left_shape[-2] * right_shape[-1] * k
    return k, products // max(left.numel(), 1), products // max(right.numel(), 1)


def _matmul_shared(left: Tensor, right: Tensor) -> tuple[bool, bool]:
    """Whether each operand's gradient sums over the sharded (data-parallel) dimension:
    dimension 0 of a batched output, or the rows of a 2-D left operand (one row included)."""
    if left.dim() > 2 or right.dim() > 2:
        batch = tuple(torch.broadcast_shapes(left.shape[:-2], right.shape[:-2]))
        if not batch:
            return False, False
        out = (*batch, 1, 1)
        return (
            broadcast_along_batch((*left.shape[:-2], 1, 1), out),
            broadcast_along_batch((*right.shape[:-2], 1, 1), out),
        )
    return False, left.dim() == 2


def matmul(input: Tensor, other: Tensor, constraint: Constraint = "to_output_scale") -> Tensor:
    """Unit-scaled ``torch.matmul`` of two activations (neither is treated as a weight).

    Scaling rule, for i.i.d. N(0, 1) operands ``input (..., m, k)`` (the left one) and
    ``other (..., k, n)`` (the right one):
    each output sums ``k`` unit products (std ``sqrt(k)``); each left-gradient element sums
    ``n`` (times any broadcast batch) and each right-gradient element ``m`` (times any
    broadcast batch, e.g. the whole batch for a 2-D ``other``). Ideal scales:
    ``1/sqrt(k)``, ``1/sqrt(fan_left)``, ``1/sqrt(fan_right)``. Default
    ``to_output_scale``: all three ``1/sqrt(k)`` (true gradients, std
    ``sqrt(fan / k)``); ``to_left_grad_scale``/``to_right_grad_scale`` keep one gradient
    unit; ``None``: all unit. Under data parallelism an operand broadcast along the batch
    (dimension 0 of a batched output, or the rows of a 2-D left operand) counts the global
    batch and its gradient is multiplied by the data-parallel size
    (:mod:`unitscale.data_parallel`).

    Args:
        input: left operand, assumed unit-scaled.
        other: right operand, assumed unit-scaled.
        constraint: a constraint taking an output and two grad scales, or None.

    Returns:
        ``input @ other`` times the output scale.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(matmul(torch.randn(64, 512), torch.randn(512, 64)).std().item(), 1)
        1.0
    """
    k, fan_left, fan_right = _matmul_fans(input, other)
    left_shared, right_shared = _matmul_shared(input, other)
    (left_shards, left_size), (right_shards, right_size) = (
        shared_counts(left_shared),
        shared_counts(right_shared),
    )
    out_scale, left_scale, right_scale = apply_constraint(
        constraint, _rsqrt(k), _rsqrt(fan_left * left_shards), _rsqrt(fan_right * right_shards)
    )
    left = _prescale(input, left_scale * left_size, out_scale)
    right = _prescale(other, right_scale * right_size, out_scale)
    return _finish(torch.matmul(left, right), out_scale)


class LinearFactors(NamedTuple):
    """The factors of a unit-scaled linear op, ``y = output * input @ weight.T + bias``.

    The op is ``F.linear(scale_bwd(input, input_grad), scale_fwd_bwd(weight, output,
    weight_grad), scale_bwd(bias, weight_grad))``: ``output`` multiplies the product (it
    rides on the weight, so it also multiplies the input's gradient), ``input_grad``
    multiplies the input's gradient on top of it, ``weight_grad`` the weight's and bias's
    gradients. For code that runs the product elsewhere (a float8 GEMM applies ``output``
    to its accumulator) and must scale exactly as :func:`linear` does.
    """

    output: float
    input_grad: float
    weight_grad: float


def linear_factors(
    input: Tensor, weight: Tensor, constraint: Constraint = "to_output_scale"
) -> LinearFactors:
    """The :class:`LinearFactors` of :func:`linear` for these operands (see its scaling rule).

    Example:
        >>> linear_factors(torch.ones(8, 64), torch.ones(16, 64))
        LinearFactors(output=0.125, input_grad=1.0, weight_grad=0.35355339059327373)
    """
    fan_out, fan_in = weight.shape[0], weight.shape[-1]
    batch = input.numel() // max(fan_in, 1)
    out_scale, in_scale = apply_constraint(constraint, _rsqrt(fan_in), _rsqrt(fan_out))
    weight_grad_scale = shared_rsqrt(batch, input.dim() >= 2)
    # F.linear(x, s * W) = s * (x W^T): the output scale rides on the (smaller) weight, whose
    # own gradient factor is set independently (weights are never constrained).
    # grad_x = (in/out) * grad_y (s W) = in * grad_y W: a no-op under to_output_scale.
    return LinearFactors(out_scale, in_scale / out_scale, weight_grad_scale)


def _apply_factors(
    input: Tensor, weight: Tensor, bias: Tensor | None, factors: LinearFactors
) -> Tensor:
    weight = scale_fwd_bwd(weight, factors.output, factors.weight_grad)
    if bias is not None:
        bias = scale_bwd(bias, factors.weight_grad)
    return F.linear(scale_bwd(input, factors.input_grad), weight, bias)


def _linear(input: Tensor, weight: Tensor, bias: Tensor | None, constraint: Constraint) -> Tensor:
    return _apply_factors(input, weight, bias, linear_factors(input, weight, constraint))


def linear(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    constraint: Constraint = "to_output_scale",
) -> Tensor:
    """Unit-scaled linear layer (``F.linear``): ``y = s * input @ weight.T + bias``.

    Scaling rule, for unit ``input (..., fan_in)`` and ``weight (fan_out, fan_in)`` and a
    unit incoming gradient, with ``batch = input.numel() / fan_in``: the output sums
    ``fan_in`` unit products (ideal scale ``1/sqrt(fan_in)``), the input's gradient sums
    ``fan_out`` (``1/sqrt(fan_out)``), the weight's and bias's gradients sum ``batch``
    (``1/sqrt(batch)``). Default ``to_output_scale``: the input gradient also uses
    ``1/sqrt(fan_in)`` (true gradient, std ``sqrt(fan_out / fan_in)``);
    ``to_grad_input_scale`` makes the input gradient unit and the output std
    ``sqrt(fan_in / fan_out)``; ``None``: both unit. Weight and bias gradients are never
    constrained: they are always ``1/sqrt(batch)`` times the true ``grad_y^T x`` (so they
    are not the true gradient unless ``batch`` is 1, a deliberate unit-scaling choice). The
    bias is added unscaled (it starts at zero). Under data parallelism and gradient
    accumulation ``batch`` is the whole step's batch and the factor is multiplied by the
    data-parallel size, so that averaged and accumulated gradients equal one process's on
    the whole batch (:mod:`unitscale.data_parallel`).

    Args:
        input: ``(..., fan_in)``, assumed unit-scaled.
        weight: ``(fan_out, fan_in)``, assumed unit variance.
        bias: optional ``(fan_out,)``.
        constraint: a two-scale constraint, or None.

    Returns:
        ``(..., fan_out)``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> y = linear(torch.randn(256, 1024), torch.randn(512, 1024))
        >>> y.shape, round(y.std().item(), 1)
        (torch.Size([256, 512]), 1.0)
    """
    return _linear(input, weight, bias, constraint)


def linear_readout(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    constraint: Constraint = "to_grad_input_scale",
    *,
    mup: bool = True,
) -> Tensor:
    """Readout (final) linear layer, e.g. a language model's head: u-μP's by default.

    ``mup=True`` (default) is u-μP's readout (the paper's rules, Section 4: μP's ``1/fan_in``
    output multiplier, the rest unit-scaled), described below. ``mup=False`` is plain unit
    scaling: the same op and ideal scales as :func:`linear`; only the default constraint
    differs. The backward pass of the whole network starts here, so
    ``to_grad_input_scale`` keeps the gradient that enters the network unit
    (``1/sqrt(fan_out)`` for both directions, a true gradient), and lets the output (the
    logits) take std ``sqrt(fan_in / fan_out)``: below 1 when the vocabulary is larger than
    the hidden size, so the initial predictions are close to uniform. Weight and bias
    gradients are scaled by ``1/sqrt(batch)`` as in :func:`linear`.

    u-μP (``mup=True``): output multiplier ``1/fan_in`` (μP's, not unit scaling's
    ``1/sqrt(fan_in)``) and input-gradient scale ``1/sqrt(fan_out)``, untied
    (``constraint`` is not used). The readout's input is correlated with its weight after
    a few steps (the body learns along ``W^T``), so ``W x`` grows like ``fan_in``, not
    ``sqrt(fan_in)``: only a ``1/fan_in`` multiplier keeps the logits' *change* independent
    of width; the logits start at std ``1/sqrt(fan_in)``. The input gradient is
    ``fan_in / sqrt(fan_out)`` times the true one: a constant factor on every
    upstream gradient, which Adam ignores and unit scaling wants (it is unit).

    Args:
        input: ``(..., fan_in)``, assumed unit-scaled.
        weight: ``(fan_out, fan_in)``, assumed unit variance.
        bias: optional ``(fan_out,)``.
        constraint: a two-scale constraint, or None (both directions unit); used only with
            ``mup=False``.
        mup: u-μP's readout scaling (above); False for plain unit scaling.

    Returns:
        ``(..., fan_out)``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> y = linear_readout(torch.randn(256, 64), torch.randn(1024, 64))
        >>> round(y.std().item() * 8, 1)  # u-μP: std 1 / sqrt(64)
        1.0
        >>> y = linear_readout(torch.randn(256, 64), torch.randn(1024, 64), mup=False)
        >>> round(y.std().item(), 2)  # plain unit scaling: sqrt(64 / 1024)
        0.25
    """
    return _apply_factors(
        input, weight, bias, linear_readout_factors(input, weight, constraint, mup=mup)
    )


def linear_readout_factors(
    input: Tensor,
    weight: Tensor,
    constraint: Constraint = "to_grad_input_scale",
    *,
    mup: bool = True,
) -> LinearFactors:
    """The :class:`LinearFactors` of :func:`linear_readout` (see its scaling rule).

    Example:
        >>> linear_readout_factors(torch.ones(8, 64), torch.ones(16, 64))
        LinearFactors(output=0.015625, input_grad=16.0, weight_grad=0.35355339059327373)
    """
    if not mup:
        return linear_factors(input, weight, constraint)
    fan_out, fan_in = weight.shape[0], weight.shape[-1]
    batch = input.numel() // max(fan_in, 1)
    weight_grad_scale = shared_rsqrt(batch, input.dim() >= 2)
    # grad_x = g (W / fan_in) * fan_in / sqrt(fan_out) = g W / sqrt(fan_out): unit.
    return LinearFactors(1.0 / max(fan_in, 1), max(fan_in, 1) * _rsqrt(fan_out), weight_grad_scale)


def conv1d(
    input: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: int | tuple[int, ...] = 1,
    padding: int | str | tuple[int, ...] = 0,
    dilation: int | tuple[int, ...] = 1,
    groups: int = 1,
    constraint: Constraint = "to_output_scale",
) -> Tensor:
    """Unit-scaled 1-D convolution (``F.conv1d``).

    Scaling rule, for unit ``input (N, C_in, L)`` and ``weight (C_out, C_in/groups, K)``: each
    output sums ``fan_in = C_in/groups * K`` products; each input element receives gradient
    from ``C_out/groups`` channels times about ``K / stride`` taps, so
    ``fan_out = C_out/groups * K / stride`` (exact away from the edges; assumes
    ``stride <= K`` and ``L >> K``); weight and bias gradients sum ``N * L_out`` terms.
    Factors and constraints as in :func:`linear` (default ``to_output_scale``; weight and
    bias gradients ``1/sqrt(N * L_out)``, never constrained).

    Args:
        input: ``(N, C_in, L)`` or ``(C_in, L)``, assumed unit-scaled.
        weight: ``(C_out, C_in/groups, K)``, assumed unit variance.
        bias: optional ``(C_out,)``.
        stride, padding, dilation, groups: as for ``F.conv1d`` (ints or 1-tuples;
            ``padding`` may be ``"same"`` or ``"valid"``).
        constraint: a two-scale constraint, or None.

    Returns:
        ``(N, C_out, L_out)``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> y = conv1d(torch.randn(8, 64, 256), torch.randn(32, 64, 3))
        >>> y.shape, round(y.std().item(), 1)
        (torch.Size([8, 32, 254]), 1.0)
    """
    step: int = _single(stride, "conv1d", "stride")
    spread: int = _single(dilation, "conv1d", "dilation")
    pad: int | str = _single(padding, "conv1d", "padding")
    out_channels, in_per_group, kernel = weight.shape
    length = input.shape[-1]
    if pad == "same":
        out_length = length
    else:
        pad_total = 0 if pad == "valid" else 2 * int(pad)
        out_length = (length + pad_total - spread * (kernel - 1) - 1) // step + 1
    batch = input.numel() // max(input.shape[-2] * length, 1) * out_length
    fan_in = in_per_group * kernel
    fan_out = out_channels // groups * kernel / step
    out_scale, in_scale = apply_constraint(constraint, _rsqrt(fan_in), _rsqrt(fan_out))
    weight_grad_scale = shared_rsqrt(batch, input.dim() == 3)
    weight = scale_fwd_bwd(weight, out_scale, weight_grad_scale)
    if bias is not None:
        bias = scale_bwd(bias, weight_grad_scale)
    input = scale_bwd(input, in_scale / out_scale)
    return F.conv1d(input, weight, bias, step, pad, spread, groups)


def embedding(
    input: Tensor,
    weight: Tensor,
    padding_idx: int | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> Tensor:
    """Unit-scaled embedding lookup (``F.embedding``).

    Scaling rule: the output is rows of a unit-variance weight, so no forward factor. The
    weight's gradient adds the incoming gradients of every occurrence of a token; with
    ``tokens = input.numel()`` spread uniformly over ``num_embeddings`` rows, an element's
    gradient variance is ``tokens / num_embeddings`` on average, so it is scaled by
    ``sqrt(num_embeddings / tokens)`` (rows of frequent tokens stay above 1, unused rows 0).
    Never constrained (a weight). Under data parallelism and gradient accumulation, token
    ids of 2 or more dimensions (one row included) count the whole batch's tokens and the
    factor is multiplied by the data-parallel size; 1-D ids (``torch.arange(T)`` positions)
    are shared by every example (:mod:`unitscale.data_parallel`).

    Args:
        input: integer token ids.
        weight: ``(num_embeddings, embedding_dim)``, assumed unit variance.
        padding_idx: as for ``F.embedding``.
        max_norm: unsupported (it rescales the weight in place); must be None.
        norm_type: only used with ``max_norm``; must be 2.0.
        scale_grad_by_freq: unsupported (unit scaling sets the gradient scale); must be False.
        sparse: unsupported; must be False.

    Returns:
        ``(*input.shape, embedding_dim)``.

    Raises:
        UnsupportedArgumentError: one of the unsupported arguments is given.

    Example:
        >>> w = torch.ones(10, 4, requires_grad=True)
        >>> embedding(torch.arange(10).repeat(4), w).sum().backward()
        >>> w.grad[0].tolist()  # 4 occurrences, scaled by sqrt(10 / 40)
        [2.0, 2.0, 2.0, 2.0]
    """
    check_embedding_args(max_norm, norm_type, scale_grad_by_freq, sparse)
    return scaled_embedding(input, weight, padding_idx, input.dim() >= 2)


def check_embedding_args(
    max_norm: float | None, norm_type: float, scale_grad_by_freq: bool, sparse: bool
) -> None:
    """Reject the ``F.embedding`` arguments :func:`embedding` does not support."""
    _reject("embedding", "max_norm", max_norm, None, "renormalise the weight yourself")
    _reject("embedding", "norm_type", norm_type, 2.0, "norm_type only applies with max_norm")
    _reject("embedding", "scale_grad_by_freq", scale_grad_by_freq, False, "unit scaling sets it")
    _reject("embedding", "sparse", sparse, False, "use dense gradients (sparse=False)")


def scaled_embedding(
    input: Tensor, weight: Tensor, padding_idx: int | None, batched: bool
) -> Tensor:
    """:func:`embedding`'s scaling, told whether dimension 0 of ``input`` is the sharded
    batch (token ids) or not (position ids shared by every example)."""
    shards, size = shared_counts(batched)
    # sym_sqrt/sym_max: plain math for ints, symbolic for a dynamic size under torch.compile.
    rows = torch.sym_max(input.numel() * shards, 1)
    weight = scale_bwd(weight, size * torch.sym_sqrt(weight.shape[0] / rows))
    return F.embedding(input, weight, padding_idx)
