"""Softmax moments by numerical integration: the scales of softmax, attention and cross-entropy
rest on them (computed once per shape and cached)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.library import custom_op

from .._lazy_dynamo import assume_constant_result
from ..errors import UnitScaleError
from ._base import (
    _specialised_int,
)

# --------------------------------------------------------------------------------------------
# softmax moments
# --------------------------------------------------------------------------------------------

_MOMENT_CACHE: dict[tuple[int, int, bool, float], tuple[float, float]] = {}


def _softmax_moment_table(lengths: Any, logit_var: float) -> tuple[Any, Any]:
    """``v(n) = E[sum_j p_j^2]`` and ``G(n) = E[sum_j p_j^2 - 2 sum_j p_j^3 + (sum_j p_j^2)^2]``
    for ``p = softmax(z)``, ``z`` of length ``n`` i.i.d. N(0, ``logit_var``).

    With ``w_j = exp(z_j)`` and ``S = sum_j w_j``, every term is a moment ``E[f(w) / S^k]``;
    writing ``S^-k = Γ(k)^-1 ∫ t^(k-1) exp(-t S) dt`` factorises it over the independent
    ``w_j``: ``E[w_1^k / S^k] = Γ(k)^-1 ∫ t^(k-1) ψ_k(t) φ(t)^(n-1) dt`` with
    ``ψ_k(t) = E[w^k exp(-t w)]`` and ``φ = ψ_0``. Both inner expectations and the outer
    integral (over ``u = log t``) use the trapezoid rule, which is spectrally accurate here.

    Every term is evaluated as ``t^k ψ_k(t) = E[exp(k s - e^s)]`` with ``s = u + log w``,
    which is bounded (by ``(k/e)^k``) for any logit variance, so nothing overflows; the
    grid over ``u`` is sized from the variance: it covers ``-log w`` for every ``z`` on the
    Gaussian grid plus the tails of ``exp(k s - e^s)`` (``e^(k s)`` below, ``exp(-e^s)``
    above), at a step small enough to resolve both.
    """
    import numpy as np

    n = np.asarray(lengths, dtype=np.float64)[:, None]
    sigma = math.sqrt(logit_var)
    z_max = 12.0
    # log w = sigma z: a step of at most 0.25 in log w keeps the z-sum spectrally accurate.
    z = np.linspace(-z_max, z_max, max(1201, int(2 * z_max * sigma / 0.25) + 1))
    density = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi) * (z[1] - z[0])
    # For each z, s = u + sigma z must span [-40, 7]: e^(k s) < 1e-17 below (k >= 1) and
    # exp(-e^s) < 1e-400 above. The integrand is entire in s, so a step of 0.1 is ample.
    u = np.arange(-sigma * z_max - 40.0, sigma * z_max + 7.0, 0.1)
    s = np.minimum(u[:, None] + sigma * z[None, :], 700.0)  # (u, z); e^700 is still finite
    exp_s = np.exp(s)
    du = u[1] - u[0]

    def t_psi(k: int) -> Any:  # t^k ψ_k(t) on the u grid
        return np.exp(k * s - exp_s) @ density

    log_phi = np.log(np.maximum(np.exp(-exp_s) @ density, 1e-300))
    power_1 = np.exp((n - 1.0) * log_phi)
    power_2 = np.exp(np.maximum(n - 2.0, 0.0) * log_phi)

    def integral(t_psi_k: Any) -> Any:  # ∫ t^(k-1) f dt = ∫ t^k f du
        return t_psi_k.sum(axis=-1) * du

    n = n[:, 0]
    psi_2 = t_psi(2)
    sum_p2 = n * integral(psi_2 * power_1)
    sum_p3 = n * integral(t_psi(3) * power_1) / 2.0
    # t^4 ψ_2(t)^2 = (t^2 ψ_2(t))^2
    sum_p2_squared = (
        n * integral(t_psi(4) * power_1) + n * (n - 1.0) * integral(psi_2**2 * power_2)
    ) / 6.0
    v, g = sum_p2, sum_p2 - 2.0 * sum_p3 + sum_p2_squared
    if not (np.all(np.isfinite(v)) and np.all(np.isfinite(g))):
        raise UnitScaleError(
            f"unitscale.functional: the softmax moments for logit variance {logit_var} are not "
            "finite; this is a bug in unitscale, please report it with the shapes used"
        )
    return v, g


def _softmax_moments(lengths: Any, logit_var: float) -> tuple[Any, Any]:
    """:func:`_softmax_moment_table` for increasing ``lengths`` (numpy arrays), affordable
    for long ones: exact for up to 512 lengths; otherwise integrated exactly up to 256 and
    on a geometric grid beyond, where ``n v(n)`` and ``n G(n)`` are smooth in ``log n`` and
    are interpolated. Used by every attention scale (with or without a mask)."""
    import numpy as np

    if len(lengths) <= 512:
        return _softmax_moment_table(lengths, logit_var)
    longest = int(lengths[-1])
    grid = np.unique(np.concatenate([np.arange(1, 257), np.geomspace(256, longest, 96)]))
    v_grid, g_grid = _softmax_moment_table(grid, logit_var)
    log_n, log_grid = np.log(lengths), np.log(grid)
    v = np.interp(log_n, log_grid, v_grid * grid) / lengths
    g = np.interp(log_n, log_grid, g_grid * grid) / lengths
    return v, g


@assume_constant_result
def _attention_moments(
    queries: int, keys: int, causal: bool, logit_var: float
) -> tuple[float, float]:
    """Mean over query rows of ``v(n_i)`` and ``G(n_i)`` (see :func:`_softmax_moment_table`),
    where row ``i`` attends to ``n_i = min(i + 1, keys)`` keys if ``causal`` (PyTorch's
    top-left-aligned mask) and to all ``keys`` otherwise. Cached; a constant under Dynamo."""
    key = (queries, keys, causal, logit_var)
    if queries < 1 or keys < 1:
        return 1.0, 1.0  # nothing attends: nothing to scale
    if key not in _MOMENT_CACHE:
        import numpy as np

        longest = min(queries, keys) if causal else keys
        lengths = np.arange(1, longest + 1) if causal else np.array([keys])
        v, g = _softmax_moments(lengths, logit_var)
        if causal:
            # rows 0..longest-1 see 1..longest keys; with queries > keys the rest see all keys.
            extra = max(queries - keys, 0)
            mean_v = (float(v.sum()) + extra * float(v[-1])) / queries
            mean_g = (float(g.sum()) + extra * float(g[-1])) / queries
        else:
            mean_v, mean_g = float(v[0]), float(g[0])
        _MOMENT_CACHE[key] = (mean_v, mean_g)
    return _MOMENT_CACHE[key]


def _softmax_scales(length: int, mult: float = 1.0) -> tuple[float, float]:
    """Ideal (output, grad-input) scales of ``softmax(mult * x)`` over ``length`` unit logits."""
    n = _specialised_int(length)
    if n <= 1:
        return 1.0, 1.0  # softmax of one element is the constant 1, its gradient is zero
    v, g = _attention_moments(1, n, False, mult * mult)
    # Var(p_j) = E[p_j^2] - E[p_j]^2 = v/n - 1/n^2; E[grad_j^2] = mult^2 G/n.
    return n / math.sqrt(n * v - 1.0), math.sqrt(n / g) / mult


@custom_op("unitscale::softmax_scales", mutates_args=())
def softmax_scales(like: Tensor, length: int, mult: float, dtype: torch.dtype) -> Tensor:
    """:func:`_softmax_scales` of ``(length, mult)`` as a ``(2,)`` tensor (output scale,
    grad-input scale) on ``like``'s device: an op, so that under ``torch.compile`` ``length``
    can be a dynamic size (the moments are integrated, for the concrete length, at run time)
    and one graph serves every length. ``like`` gives only the device.

    Example:
        >>> scales = softmax_scales(torch.empty(0), 64, 1.0, torch.float64)
        >>> scales.tolist() == list(_softmax_scales(64))
        True
    """
    return torch.tensor(_softmax_scales(int(length), mult), device=like.device, dtype=dtype)


@softmax_scales.register_fake
def _softmax_scales_fake(like: Tensor, length: int, mult: float, dtype: torch.dtype) -> Tensor:
    return like.new_empty((2,), dtype=dtype)


def _no_gradient(ctx: object, grad: Tensor) -> tuple[None, None, None, None]:
    """The scales depend on ``like``'s sizes, not its values."""
    return None, None, None, None


softmax_scales.register_autograd(_no_gradient)
