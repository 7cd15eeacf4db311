"""Unit-scaled attention: ``scaled_dot_product_attention`` (causal or no mask) and
``masked_scaled_dot_product_attention`` (``unit_scale`` maps masked SDPA calls there).

:func:`unitscale.functional.scaled_dot_product_attention` derives its scales from how many
keys each query sees, which it knows only for ``is_causal`` or no mask, so it refuses
``attn_mask``. Models written the ordinary way pass masks (a causal mask built with
``tril``, padding masks), so :func:`masked_scaled_dot_product_attention` applies the same
scaling rule with the key counts read from the mask itself: per query row ``i``, ``n_i``
visible keys, and the means ``mean v(n_i)``, ``mean G(n_i)`` of the softmax moments over
every row of the mask. The counts are tensors computed on the mask's device, so the scales
are 0-dim tensors: no host synchronisation, and the op still compiles.

Design constraints: the scaling rule and the moment tables are those of
:mod:`unitscale.functional` (one place for the maths); only the mask handling is here. A
boolean mask marks visible keys with True; a float (additive) mask hides entries at
``-inf`` or below half the dtype's lowest value (what Hugging Face models use) and treats
every other entry as a visible bias.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import custom_op

from ..constraints import apply_constraint
from ..errors import UnsupportedArgumentError
from ._base import Constraint, _finish, _prescale, _rsqrt, _scale_grad, _specialised_int
from ._moments import _attention_moments, _softmax_moments
from ._mult import check_mult

__all__ = [
    "masked_scaled_dot_product_attention",
    "rotary_embedding",
    "scaled_dot_product_attention",
]

# --------------------------------------------------------------------------------------------
# attention without a mask
# --------------------------------------------------------------------------------------------


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    constraint: Constraint = "to_output_scale",
    mult: float = 1.0,
) -> Tensor:
    """Unit-scaled attention (``F.scaled_dot_product_attention``).

    Scaling rule, for i.i.d. unit ``query (..., L, E)``, ``key (..., S, E)`` and
    ``value (..., S, Ev)`` and a unit incoming gradient. The scores ``scale * q.k`` are
    i.i.d. with variance ``σ² = scale² E`` (1 by default). Let query row ``i`` see ``n_i``
    keys (``S``, or ``min(i + 1, S)`` with ``is_causal``), and ``v(n)``, ``G(n)`` the softmax
    moments of :func:`softmax` (for logit variance ``σ²``; exact numerical integration);
    bars are means over the ``L`` rows. As ``value`` is independent of the weights:

    * output ``Σ_j p_ij v_j``: variance ``mean v``;
    * value gradient ``Σ_i p_ij g_i``: ``(L/S) mean v``;
    * query gradient ``scale Σ_j ds_ij k_j``: ``scale² Ev mean G``;
    * key gradient: ``(L/S) scale² Ev mean G``;

    all divided by ``1 - dropout_p`` and, with ``enable_gqa``, key/value ones multiplied by
    ``heads_q / heads_kv``. Ideal scales are the inverse square roots. For self-attention
    these four nearly coincide (``mean G < mean v`` for short rows), so the default
    ``to_output_scale`` (output factor for all; true gradients) keeps gradients near unit;
    ``None`` makes each unit. The query/key gradient rule assumes ``key`` independent of the
    score gradients, and all of it assumes Gaussian scores: both approximations are good
    (within 10%, as the tests check) for ``E >= 16``; with ``E = 8`` the query gradient runs
    about 10-20% high. One scale serves every position, so with ``is_causal`` early rows
    (which average few values) come out larger than late ones; the tensor as a whole is unit.

    With ``mult`` (u-μP's α_attn): the scores are ``mult * scale * q.k``, i.e. the score
    scale becomes ``mult * scale`` (``mult / sqrt(E)`` by default) and everything above
    holds with that scale (``σ² = mult² scale² E``, moments integrated exactly at it).

    u-μP's attention logits are ``α_attn q.k / d_head`` (μP's ``1/d_head``; the u-μP paper's
    rules, Section 4): pass ``scale=1 / E`` and ``mult=α_attn``, as :class:`unitscale.MHSA` does by
    default. ``scale=None`` keeps torch's ``1/sqrt(E)``, so that this op stays a drop-in for
    ``F.scaled_dot_product_attention`` (which :func:`unitscale.transforms.unit_scale` relies on).
    Where the paper fits the attention output's scale empirically, this op integrates the
    softmax moments exactly (Gaussian scores) at whatever logit scale is used, so one rule
    serves every ``scale`` and ``mult``: measured output std 1.013, 0.991, 0.989 for causal
    attention at ``scale=1/E`` with ``(E, seq)`` = (16, 64), (64, 256), (128, 1024).

    Args:
        query, key, value: as for ``F.scaled_dot_product_attention``, assumed unit-scaled.
        attn_mask: unsupported (the scale depends on how many keys each query sees); use
            ``is_causal``.
        dropout_p: attention dropout, applied whenever it is non-zero (as in PyTorch).
        is_causal: causal (top-left aligned) mask.
        scale: score scale; None means ``1/sqrt(E)``.
        enable_gqa: grouped-query attention, as in PyTorch.
        constraint: a constraint taking an output and three grad scales, or None.
        mult: positive multiplier of the attention scores.

    Returns:
        ``(..., L, Ev)``.

    Raises:
        UnsupportedArgumentError: ``attn_mask`` is given, or ``dropout_p`` is outside [0, 1).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> q, k, v = torch.randn(3, 8, 4, 256, 64)
        >>> round(scaled_dot_product_attention(q, k, v, is_causal=True).std().item(), 1)
        1.0
    """
    if attn_mask is not None:
        raise UnsupportedArgumentError(
            "scaled_dot_product_attention",
            "attn_mask",
            "<tensor>",
            "use is_causal=True (the scale depends on how many keys each query sees)",
        )
    if not 0.0 <= dropout_p < 1.0:
        raise UnsupportedArgumentError(
            "scaled_dot_product_attention", "dropout_p", dropout_p, "use 0 <= dropout_p < 1"
        )
    mult = check_mult("scaled_dot_product_attention", mult)
    head_dim, value_dim = _specialised_int(query.shape[-1]), value.shape[-1]
    score_scale = (1.0 / math.sqrt(head_dim) if scale is None else float(scale)) * mult
    if mult != 1.0:
        scale = score_scale
    if isinstance(query.shape[-2], torch.SymInt) or isinstance(key.shape[-2], torch.SymInt):
        # Lengths that vary under torch.compile: the same rule with tensor scales, one graph
        # for every length (specialising would compile a graph per length).
        return dynamic_length_attention(
            query, key, value, dropout_p, is_causal, score_scale, scale, enable_gqa, constraint
        )
    queries, keys = _specialised_int(query.shape[-2]), _specialised_int(key.shape[-2])
    logit_var = score_scale * score_scale * head_dim
    mean_v, mean_g = _attention_moments(queries, keys, bool(is_causal), logit_var)
    keep = 1.0 - dropout_p
    group = query.shape[-3] // key.shape[-3] if enable_gqa and query.dim() > 2 else 1
    ratio = queries / keys * group
    grad_q_var = score_scale * score_scale * value_dim * mean_g / keep
    out_scale, q_scale, k_scale, v_scale = apply_constraint(
        constraint,
        _rsqrt(mean_v / keep),
        _rsqrt(grad_q_var),
        _rsqrt(grad_q_var * ratio),
        _rsqrt(mean_v * ratio / keep),
    )
    output = F.scaled_dot_product_attention(
        _prescale(query, q_scale, out_scale),
        _prescale(key, k_scale, out_scale),
        _prescale(value, v_scale, out_scale),
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return _finish(output, out_scale, inplace=False)  # attention's backward reads its output


# --------------------------------------------------------------------------------------------
# attention with a mask
# --------------------------------------------------------------------------------------------

_TABLES: dict[tuple[int, float], tuple[list[float], list[float]]] = {}
_DEVICE_TABLES: dict[tuple[int, float, torch.device, torch.dtype], tuple[Tensor, Tensor]] = {}


def _moment_lists(keys: int, logit_var: float) -> tuple[list[float], list[float]]:
    """``v(n)`` and ``G(n)`` for ``n = 0..keys`` (entry 0 repeats entry 1)."""
    cache_key = (keys, logit_var)
    if cache_key not in _TABLES:
        import numpy as np

        v, g = _softmax_moments(np.arange(1, keys + 1), logit_var)
        _TABLES[cache_key] = ([float(v[0]), *map(float, v)], [float(g[0]), *map(float, g)])
    return _TABLES[cache_key]


@custom_op("unitscale::softmax_moment_table", mutates_args=())
def softmax_moment_table(like: Tensor, keys: int, logit_var: float, dtype: torch.dtype) -> Tensor:
    """``v(n)`` and ``G(n)`` for ``n = 0..keys`` (:func:`_moment_lists`) as one ``(2, keys + 1)``
    tensor on ``like``'s device: an op, so that under ``torch.compile`` ``keys`` can be a
    dynamic size (the tables are integrated numerically, for the concrete length, at run
    time) and one graph serves every length."""
    v, g = _moment_lists(int(keys), logit_var)
    return torch.tensor([v, g], device=like.device, dtype=dtype)


@softmax_moment_table.register_fake
def _softmax_moment_table_fake(
    like: Tensor, keys: int, logit_var: float, dtype: torch.dtype
) -> Tensor:
    return like.new_empty((2, keys + 1), dtype=dtype)


def _no_gradient(ctx: object, grad: Tensor) -> tuple[None, None, None, None]:
    """The tables depend on ``like``'s sizes, not its values."""
    return None, None, None, None


softmax_moment_table.register_autograd(_no_gradient)


def _moment_tables(
    keys: int, logit_var: float, like: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The moment tables as tensors on ``like``'s device: cached per device in eager mode;
    built from Python floats (constants of the graph) while being compiled or traced with
    fake tensors (a cached real tensor cannot be indexed by a fake one on torch < 2.8); from
    :func:`softmax_moment_table` for a symbolic ``keys`` (a dynamic length), and always
    under TorchDynamo, which shows a symbolic size to ``isinstance`` as an int."""
    if isinstance(keys, torch.SymInt) or torch.compiler.is_dynamo_compiling():
        # Detached: the scales carry no gradient (none would reach ``like`` anyway, but the
        # backward would reduce every scaled tensor to compute it).
        table = softmax_moment_table(like.detach(), keys, logit_var, dtype)
        return table[0], table[1]
    v, g = _moment_lists(keys, logit_var)
    device = like.device
    if torch.compiler.is_compiling() or type(like) not in (Tensor, torch.nn.Parameter):
        return torch.tensor(v, device=device, dtype=dtype), torch.tensor(
            g, device=device, dtype=dtype
        )
    cache_key = (keys, logit_var, device, dtype)
    if cache_key not in _DEVICE_TABLES:
        _DEVICE_TABLES[cache_key] = (
            torch.tensor(v, device=device, dtype=dtype),
            torch.tensor(g, device=device, dtype=dtype),
        )
    return _DEVICE_TABLES[cache_key]


def _visible(mask: Tensor) -> Tensor:
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def masked_scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    constraint: str | None = "to_output_scale",
) -> Tensor:
    """Unit-scaled ``F.scaled_dot_product_attention`` that also takes ``attn_mask``.

    Without a mask this is :func:`unitscale.functional.scaled_dot_product_attention`. With
    one, the same scaling rule (see there) with ``n_i``, the number of keys query row ``i``
    sees, counted from the mask: the output is scaled by ``1/sqrt(mean v(n_i) / keep)``, the
    query, key and value gradients by the rule's factors, combined by ``constraint``. With
    ``is_causal=True`` as well, a key is visible where both the mask and the causal rule
    allow it (as PyTorch's own kernels combine them), and counted so.

    Args:
        query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa: as for
            ``F.scaled_dot_product_attention``.
        constraint: a constraint taking an output and three grad scales, or None.

    Returns:
        ``(..., L, Ev)``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> q, k, v = torch.randn(3, 8, 4, 256, 64)
        >>> causal = torch.ones(256, 256, dtype=torch.bool).tril()
        >>> out = masked_scaled_dot_product_attention(q, k, v, attn_mask=causal)
        >>> round(out.std().item(), 1)
        1.0
    """
    if attn_mask is None:
        return scaled_dot_product_attention(
            query, key, value, None, dropout_p, is_causal, scale, enable_gqa, constraint
        )
    if not 0.0 <= dropout_p < 1.0:
        raise UnsupportedArgumentError(
            "scaled_dot_product_attention", "dropout_p", dropout_p, "use 0 <= dropout_p < 1"
        )
    queries, keys = _length(query.shape[-2]), _length(key.shape[-2])
    head_dim = _specialised_int(query.shape[-1])
    score_scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    visible = _visible(attn_mask)
    if is_causal:
        # PyTorch's kernels then show a key where both the mask and the causal rule allow it
        # (some backends refuse the pair instead): fold the rule into the mask, so that the
        # key counts, hence the scales, are those of the keys actually seen.
        causal = torch.ones(queries, keys, dtype=torch.bool, device=attn_mask.device).tril()
        visible = visible & causal
        if attn_mask.dtype == torch.bool:
            attn_mask = visible
        else:
            attn_mask = torch.where(causal, attn_mask, float("-inf"))
    visible = visible.expand(*visible.shape[:-2], queries, keys)
    counts = visible.sum(-1).clamp(max=keys)
    return _attend(
        query, key, value, attn_mask, False, counts, score_scale, scale, dropout_p, enable_gqa,
        constraint,
    )  # fmt: skip


def dynamic_length_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout_p: float,
    is_causal: bool,
    score_scale: float,
    scale: float | None,
    enable_gqa: bool,
    constraint: str | None,
) -> Tensor:
    """:func:`unitscale.functional.scaled_dot_product_attention` (no mask) for query or key
    lengths that are dynamic sizes under ``torch.compile``: the same rule, with the key count
    of each query row (``min(i + 1, keys)`` if ``is_causal``, else ``keys``) as a tensor and
    the scales as 0-dim tensors, so that one graph serves every length instead of one graph
    (and one compilation) per length. ``score_scale`` is the rule's score scale (the
    caller's, ``mult`` included); ``scale`` is what ``F.scaled_dot_product_attention`` gets."""
    queries, keys = query.shape[-2], key.shape[-2]
    if is_causal:
        rows = torch.arange(1, queries + 1, device=query.device)
        counts = rows.clamp(max=keys)
    else:
        counts = torch.full((1,), keys, device=query.device)
    return _attend(
        query, key, value, None, is_causal, counts, score_scale, scale, dropout_p, enable_gqa,
        constraint,
    )  # fmt: skip


def _length(size: int) -> int:
    """A sequence length as it is: an int, or a symbolic size under ``torch.compile``
    (``int()`` would specialise the graph to it: a recompile per length)."""
    return size if isinstance(size, torch.SymInt) else int(size)


def _attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    counts: Tensor,
    score_scale: float,
    scale: float | None,
    dropout_p: float,
    enable_gqa: bool,
    constraint: str | None,
) -> Tensor:
    """Attention scaled by the rule for the key ``counts`` of the query rows (a tensor):
    the moments averaged over the rows, the scales as 0-dim tensors (no host sync)."""
    queries, keys = _length(query.shape[-2]), _length(key.shape[-2])
    head_dim, value_dim = _specialised_int(query.shape[-1]), _specialised_int(value.shape[-1])
    logit_var = score_scale * score_scale * head_dim
    dtype = query.dtype if query.dtype == torch.float64 else torch.float32
    v_table, g_table = _moment_tables(keys, logit_var, query, dtype)
    mean_v = v_table[counts].mean()
    mean_g = g_table[counts].mean()
    keep = 1.0 - dropout_p
    group = query.shape[-3] // key.shape[-3] if enable_gqa and query.dim() > 2 else 1
    ratio = queries / keys * group
    grad_q_var = score_scale * score_scale * value_dim * mean_g / keep
    ideal = [
        torch.rsqrt(mean_v / keep),
        torch.rsqrt(grad_q_var),
        torch.rsqrt(grad_q_var * ratio),
        torch.rsqrt(mean_v * ratio / keep),
    ]
    out_scale, q_scale, k_scale, v_scale = _constrain(constraint, ideal)
    output = F.scaled_dot_product_attention(
        _scale_grad(query, q_scale / out_scale),
        _scale_grad(key, k_scale / out_scale),
        _scale_grad(value, v_scale / out_scale),
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return output * out_scale.to(output.dtype)


def _constrain(constraint: str | None, scales: list[Tensor]) -> list[Tensor]:
    """:func:`unitscale.constraints.apply_constraint` for 0-dim tensor scales (no host sync)."""
    if constraint is None:
        return scales
    apply_constraint(constraint, *([1.0] * len(scales)))  # validates the name and arity
    stacked = torch.stack(scales)
    if constraint == "gmean":
        shared = stacked.log().mean().exp()
    elif constraint == "hmean":
        shared = len(scales) / stacked.reciprocal().sum()
    elif constraint == "amean":
        shared = stacked.mean()
    else:  # to_output_scale: the only other constraint that takes four scales
        shared = scales[0]
    return [shared] * len(scales)


def rotary_embedding(x: Tensor, base: float = 10000.0) -> Tensor:
    """Rotary position embedding (RoPE; Su et al. 2021, as in Llama) of ``(..., seq, dim)``.

    Position ``t`` rotates the pairs ``(x[..., i], x[..., i + dim/2])`` by the angle
    ``t * base ** (-2i / dim)`` (the half-split layout of Llama's implementation). A rotation
    keeps each pair's norm, so unit-scaled inputs stay unit-scaled, in the forward and the
    backward pass: no scale factor is needed. Positions count from 0 along ``seq``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> q = torch.randn(2, 4, 16, 8)  # (batch, heads, seq, head dim)
        >>> r = rotary_embedding(q)
        >>> torch.allclose(r[..., 0, :], q[..., 0, :])  # position 0 is not rotated
        True
        >>> torch.allclose(r.norm(dim=-1), q.norm(dim=-1), atol=1e-5)  # rotations keep norms
        True
    """
    seq, dim = x.shape[-2], x.shape[-1]
    half = dim // 2
    angle_dtype = torch.promote_types(x.dtype, torch.float32)  # float32 at least, as Llama
    frequencies = base ** (-torch.arange(half, device=x.device, dtype=angle_dtype) / half)
    angles = torch.arange(seq, device=x.device, dtype=angle_dtype)[:, None] * frequencies
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)
