"""Unit-scaled ops: drop-in counterparts of ``torch.nn.functional``, imported as ``U``.

Each op multiplies its output and its inputs' gradients by factors chosen so that, when the
inputs are i.i.d. N(0, 1) and the incoming gradient is i.i.d. N(0, 1), the output and every
input gradient have unit standard deviation at initialisation. Each docstring states the
assumptions, the ideal factors, and what the default constraint does with them.

How the factors are applied (the same recipe everywhere; scale maths lives in
:mod:`unitscale.scale` and :mod:`unitscale.constraints`): given the constrained output scale
``s`` and input-gradient scales ``g_i``, an op computes

    ``y = scale_fwd_bwd(f(scale_bwd(x_1, g_1 / s), ...), s, s)``

so the forward value is ``s * f(x)`` and the gradient of ``x_i`` is
``(g_i / s) * df/dx_i^T (s * grad_y) = g_i * df/dx_i^T grad_y``. When a constraint makes every
``g_i`` equal to ``s``, the pre-scales are free no-ops and the op is a plain multiplication
by ``s`` whose gradient is the true gradient. Weights are never constrained: their gradient
factor is applied with :func:`~unitscale.scale.scale_fwd_bwd` on the weight itself (folding
the output scale into the weight, which is cheaper than scaling the larger output).

Design constraints: every scale is a Python number computed from static shapes (never from
data), so ops compile to a single graph with ``torch.compile(fullgraph=True)``. Scales that
need the moments of a softmax (``softmax``, ``scaled_dot_product_attention``,
``cross_entropy``) are computed by numerical integration once per shape and cached; under
``torch.compile`` those ops specialise on the softmax length (a recompile per length).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._lazy_dynamo import assume_constant_result
from ..constraints import apply_constraint
from ..errors import UnitScaleError, UnsupportedArgumentError
from ..scale import scale_bwd, scale_fwd_bwd
from ._mult import check_mult, gelu_moments, silu_moments

Constraint = str | None

# Moments of elementwise nonlinearities at x ~ N(0, 1), by numerical integration (trapezoid
# rule on [-40, 40], 8e5 points; tests/functional/test_functional.py recomputes them).
# std(f(x)), rms(f(x)) = sqrt(E[f(x)^2]) and rms(f'(x)).
_GELU_STD = {"none": 0.5879149692201956, "tanh": 0.5879183156497649}
_GELU_GRAD_RMS = {"none": 0.6751672871699427, "tanh": 0.6751428337604438}
_SILU_STD = 0.5595384678495278
_SILU_RMS = 0.5964692111326139
_SILU_GRAD_RMS = 0.6160213889512496


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _prescale(x: Tensor, grad_scale: float, output_scale: float) -> Tensor:
    """Scale ``x``'s gradient so that, after the output's ``scale_fwd_bwd(., s, s)``, the
    gradient of ``x`` carries ``grad_scale`` in total (a no-op when the two are equal)."""
    return scale_bwd(x, grad_scale / output_scale)


def _finish(y: Tensor, output_scale: float, inplace: bool = True) -> Tensor:
    """Multiply the op's output by ``output_scale`` with a true gradient. In place unless the
    op's backward needs its output (softmax, attention): the output is the op's own."""
    return scale_fwd_bwd(y, output_scale, output_scale, inplace=inplace)


def _rsqrt(n: float) -> float:
    """``1 / sqrt(n)``, with 1 for an empty fan (nothing is summed, nothing to correct).

    A scale is never silently dropped: a NaN, infinite or negative ``n`` (a variance that
    went wrong) raises instead of leaving the tensor unscaled. A symbolic ``n`` (a count from
    a dynamic size under ``torch.compile``, at least 2) gives a symbolic scale, unchecked:
    a check would specialise the graph to one size.
    """
    if isinstance(n, torch.SymInt | torch.SymFloat):
        return 1.0 / torch.sym_sqrt(n)
    if not math.isfinite(n) or n < 0:
        raise UnitScaleError(
            f"unitscale.functional: a scale was computed from the variance {n!r}, which is "
            "not a finite non-negative number; this is a bug in unitscale, please report it"
        )
    return 1.0 / math.sqrt(n) if n > 0 else 1.0


def _is_float_tensor(x: object) -> bool:
    return isinstance(x, Tensor) and x.is_floating_point()


def _specialised_int(n: int) -> int:
    """Return ``n`` as a plain ``int``. Under ``torch.compile`` with dynamic shapes ``len`` of
    a ``range`` makes Dynamo specialise on the size (a guard and a recompile per value),
    which the softmax-moment scales need: they are computed numerically, not traced."""
    return len(range(n))


def _single(value: Any, op: str, argument: str) -> Any:
    """Accept ``v`` or a one-element tuple/list ``(v,)`` (what ``nn.Conv1d`` passes)."""
    if isinstance(value, tuple | list):
        if len(value) != 1:
            raise UnsupportedArgumentError(
                op, argument, value, "conv1d takes one value (or a 1-tuple) per argument"
            )
        return value[0]
    return value


def _reject(op: str, argument: str, value: object, default: object, fix: str) -> None:
    """Raise :class:`UnsupportedArgumentError` when ``value`` is not the default."""
    if value is None if default is None else value == default:
        return
    shown = f"<tensor of shape {tuple(value.shape)}>" if isinstance(value, Tensor) else value
    raise UnsupportedArgumentError(op, argument, shown, fix)


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


# --------------------------------------------------------------------------------------------
# elementwise ops
# --------------------------------------------------------------------------------------------


def scale_elementwise(
    f: Callable[..., Tensor],
    output_scale: float,
    grad_input_scale: float,
    constraint: Constraint = "to_output_scale",
) -> Callable[..., Tensor]:
    """Wrap an elementwise function ``f`` so its output and input gradient are scaled.

    Scaling rule: ``output_scale`` should be ``1 / std(f(x))`` and ``grad_input_scale``
    ``1 / rms(f'(x))`` for ``x ~ N(0, 1)``; then, for a unit input and a unit incoming
    gradient, the output and the input gradient have unit std. The two differ in general, so
    the gradient is the true gradient only if they are tied: the default ``to_output_scale``
    uses ``output_scale`` for both (output unit, gradient off by
    ``output_scale / grad_input_scale``); ``to_grad_input_scale`` uses ``grad_input_scale``
    for both; ``None`` keeps them separate (both unit, gradient scaled).

    Args:
        f: the elementwise function; extra arguments of the returned function are passed on.
        output_scale: ideal forward factor.
        grad_input_scale: ideal factor for the input's gradient.
        constraint: name of a two-scale constraint (see :mod:`unitscale.constraints`), or None.

    Returns:
        A function ``(input, *args, **kwargs) -> Tensor``.

    Raises:
        UnknownConstraintError: ``constraint`` is not a known name or needs other scales.

    Example:
        >>> double = scale_elementwise(lambda x: 2 * x, 0.5, 0.5)
        >>> double(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    return _elementwise(f, output_scale, grad_input_scale, constraint, inplace=False)


def _elementwise(
    f: Callable[..., Tensor],
    output_scale: float,
    grad_input_scale: float,
    constraint: Constraint,
    inplace: bool,
) -> Callable[..., Tensor]:
    """:func:`scale_elementwise`; ``inplace`` scales ``f``'s output in place, which is only
    right for an ``f`` whose backward does not read its output (not ``exp``, ``tanh``...)."""
    out_scale, in_scale = apply_constraint(constraint, output_scale, grad_input_scale)

    def scaled_f(input: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        output = f(_prescale(input, in_scale, out_scale), *args, **kwargs)
        return _finish(output, out_scale, inplace)

    return scaled_f


def gelu(
    input: Tensor,
    approximate: str = "none",
    constraint: Constraint = "to_output_scale",
    mult: float = 1.0,
) -> Tensor:
    """Unit-scaled GELU (``F.gelu``).

    Scaling rule, for ``x ~ N(0, 1)``: std(gelu(x)) = 0.58791 and rms(gelu'(x)) = 0.67517
    (numerical integration; the tanh approximation differs in the 5th digit), so the ideal
    output scale is 1/0.58791 = 1.7009 and the ideal grad-input scale 1/0.67517 = 1.4811.
    Default ``to_output_scale``: both use 1.7009, the output is unit and the gradient (a true
    gradient) has std 1.148. ``None``: both unit, gradient scaled by 1.4811/1.7009.

    With ``mult`` (u-μP's α): ``y = s * gelu(mult * input)``, ideal scales
    ``1 / std(gelu(mult x))`` and ``1 / rms(mult gelu'(mult x))``, computed by quadrature
    (``functional/_mult.py``; no closed form; error below 1e-9 for mult in [1/16, 16]).

    Args:
        input: the input, assumed unit-scaled.
        approximate: ``"none"`` or ``"tanh"``, as for ``F.gelu``.
        constraint: see :func:`scale_elementwise`.
        mult: positive multiplier applied to the input before the nonlinearity.

    Returns:
        ``gelu(mult * input)`` times the output scale.

    Raises:
        UnsupportedArgumentError: ``approximate`` is not ``"none"`` or ``"tanh"``, or
            ``mult`` is not positive.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(gelu(torch.randn(1000, 1000)).std().item(), 2)
        1.0
    """
    if approximate not in _GELU_STD:
        raise UnsupportedArgumentError("gelu", "approximate", approximate, 'use "none" or "tanh"')
    mult = check_mult("gelu", mult)
    if mult == 1.0:
        std, grad_rms = _GELU_STD[approximate], _GELU_GRAD_RMS[approximate]
    else:
        std, grad_rms = gelu_moments(mult, approximate)
        input = scale_fwd_bwd(input, mult, mult)  # a true gradient: d/dx f(m x) = m f'(m x)
    # gelu's backward reads its input only, so its output can be scaled in place
    return _elementwise(F.gelu, 1.0 / std, 1.0 / grad_rms, constraint, True)(
        input, approximate=approximate
    )


def silu(
    input: Tensor,
    inplace: bool = False,
    constraint: Constraint = "to_output_scale",
    mult: float = 1.0,
) -> Tensor:
    """Unit-scaled SiLU (``F.silu``).

    Scaling rule, for ``x ~ N(0, 1)``: std(silu(x)) = 0.55954 and rms(silu'(x)) = 0.61602
    (numerical integration): ideal output scale 1.7872, grad-input scale 1.6233. Default
    ``to_output_scale``: both 1.7872 (true gradient with std 1.101); ``None``: both unit.

    With ``mult`` (u-μP's α): ``y = s * silu(mult * input)``, ideal scales
    ``1 / std(silu(mult x))`` and ``1 / rms(mult silu'(mult x))`` by quadrature
    (``functional/_mult.py``; no closed form; error below 1e-9 for mult in [1/16, 16]).

    Args:
        input: the input, assumed unit-scaled.
        inplace: must be False (unit scaling returns a new tensor).
        constraint: see :func:`scale_elementwise`.
        mult: positive multiplier applied to the input before the nonlinearity.

    Returns:
        ``silu(mult * input)`` times the output scale.

    Raises:
        UnsupportedArgumentError: ``inplace=True`` or ``mult`` not positive.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(silu(torch.randn(1000, 1000)).std().item(), 2)
        1.0
    """
    _reject("silu", "inplace", inplace, False, "use inplace=False")
    mult = check_mult("silu", mult)
    if mult == 1.0:
        std, grad_rms = _SILU_STD, _SILU_GRAD_RMS
    else:
        std, _, grad_rms = silu_moments(mult)
        input = scale_fwd_bwd(input, mult, mult)  # a true gradient: d/dx f(m x) = m f'(m x)
    return _elementwise(F.silu, 1.0 / std, 1.0 / grad_rms, constraint, True)(input)


def silu_glu(
    input: Tensor, gate: Tensor, constraint: Constraint = "to_output_scale", mult: float = 1.0
) -> Tensor:
    """Unit-scaled SiLU-gated linear unit: ``input * silu(gate)`` (SwiGLU's nonlinearity).

    Scaling rule, for independent ``input, gate ~ N(0, 1)``: the output has zero mean and
    variance ``E[input^2] E[silu(gate)^2] = 0.59647^2``; the input's gradient is
    ``grad * silu(gate)`` (rms 0.59647) and the gate's ``grad * input * silu'(gate)`` (rms
    0.61602). Ideal scales: output and input 1/0.59647 = 1.6765, gate 1/0.61602 = 1.6233.
    Default ``to_output_scale``: all three 1.6765 (true gradients, gate gradient std 1.033);
    ``None``: all unit.

    With ``mult`` (u-μP's α, on the gate): ``y = s * input * silu(mult * gate)``; the same
    rule with ``rms(silu(mult g))`` (output and input) and ``rms(mult silu'(mult g))`` (gate),
    by quadrature (``functional/_mult.py``).

    Args:
        input: the linear half, assumed unit-scaled.
        gate: the gate half, assumed unit-scaled, same shape as ``input`` (or broadcastable).
        constraint: a constraint taking an output and two grad scales, or None.
        mult: positive multiplier applied to the gate before the SiLU.

    Returns:
        ``input * silu(mult * gate)`` times the output scale.

    Raises:
        UnsupportedArgumentError: ``mult`` is not positive.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> x, g = torch.randn(2, 1000, 1000)
        >>> round(silu_glu(x, g).std().item(), 2)
        1.0
    """
    mult = check_mult("silu_glu", mult)
    if mult == 1.0:
        rms, grad_rms = _SILU_RMS, _SILU_GRAD_RMS
    else:
        _, rms, grad_rms = silu_moments(mult)
        gate = scale_fwd_bwd(gate, mult, mult)  # a true gradient: d/dg silu(m g) = m silu'(m g)
    out_scale, input_scale, gate_scale = apply_constraint(
        constraint, 1.0 / rms, 1.0 / rms, 1.0 / grad_rms
    )
    input = _prescale(input, input_scale, out_scale)
    gate = _prescale(gate, gate_scale, out_scale)
    return _finish(input * F.silu(gate), out_scale)


def softmax(
    input: Tensor,
    dim: int | None = None,
    _stacklevel: int = 3,
    dtype: torch.dtype | None = None,
    constraint: Constraint = "to_output_scale",
    mult: float = 1.0,
) -> Tensor:
    """Unit-scaled softmax (``F.softmax``).

    Scaling rule, for ``n`` i.i.d. N(0, 1) logits along ``dim``: ``p = softmax(x)`` has mean
    ``1/n`` and variance ``(n v(n) - 1) / n^2`` with ``v(n) = E[sum_j p_j^2]``; the gradient
    ``p * (g - <p, g>)`` has mean square ``G(n) / n`` with
    ``G(n) = E[sum p^2 - 2 sum p^3 + (sum p^2)^2]``. ``v`` and ``G`` are computed exactly by
    numerical integration (``v(n) -> e/n`` for large ``n``, so the output scale tends to
    ``n / sqrt(e - 1)`` and the gradient scale to ``sqrt(n / e)``). Ideal scales:
    output ``n / sqrt(n v - 1)``, grad-input ``sqrt(n / G)``. Default ``to_output_scale``:
    both use the output scale (output unit; true gradient, whose std is then
    ``n / sqrt(n v - 1) * sqrt(G / n) = sqrt(n G / (n v - 1))``: above 1, e.g. 1.21 for
    n = 64, tending to ``sqrt(e / (e - 1)) ≈ 1.26`` for large ``n``); ``None``: both unit.
    The output keeps its mean: a unit-scaled softmax sums to ``n / sqrt(n v - 1)``, not 1.
    ``n = 1`` is left unscaled.

    With ``mult`` (u-μP's α): ``y = s * softmax(mult * input)``. The logits ``mult x`` are
    i.i.d. N(0, mult²), so the same rule holds with ``v`` and ``G`` integrated at logit
    variance ``mult²`` (exact, as above) and the gradient ``mult`` times larger: ideal
    scales ``n / sqrt(n v - 1)`` and ``sqrt(n / G) / mult``.

    Args:
        input: the logits, assumed i.i.d. N(0, 1) along ``dim``.
        dim: the dimension to normalise over; required.
        _stacklevel: accepted for compatibility with ``F.softmax`` and ignored.
        dtype: as for ``F.softmax``.
        constraint: see :func:`scale_elementwise`.
        mult: positive multiplier applied to the logits.

    Returns:
        ``softmax(mult * input, dim)`` times the output scale.

    Raises:
        UnsupportedArgumentError: ``dim`` is None or ``mult`` not positive.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(softmax(torch.randn(1000, 256), dim=-1).std().item(), 1)
        1.0
    """
    if dim is None:
        raise UnsupportedArgumentError(
            "softmax", "dim", None, "pass the dimension to normalise over, e.g. dim=-1"
        )
    mult = check_mult("softmax", mult)
    out_scale, in_scale = apply_constraint(constraint, *_softmax_scales(input.shape[dim], mult))
    if mult != 1.0:
        input = scale_fwd_bwd(input, mult, mult)  # a true gradient; in_scale includes 1/mult
    output = F.softmax(_prescale(input, in_scale, out_scale), dim, dtype=dtype)
    return _finish(output, out_scale, inplace=False)  # softmax's backward reads its output


def dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:
    """Unit-scaled dropout (``F.dropout``).

    Scaling rule: ``F.dropout`` keeps an element with probability ``1 - p`` and divides it by
    ``1 - p``, so the output's mean square is ``E[x^2] / (1 - p)``; the gradient (same mask,
    same factor) likewise. Multiplying by ``sqrt(1 - p)`` makes both unit, with one shared
    factor, so no constraint is needed and the gradient is the true gradient. In eval mode
    (``training=False``) or with ``p = 0`` it is the identity.

    Args:
        input: the input, assumed unit-scaled.
        p: drop probability, ``0 <= p <= 1``.
        training: apply dropout only when True.
        inplace: must be False.

    Returns:
        ``dropout(input) * sqrt(1 - p)``.

    Raises:
        UnsupportedArgumentError: ``inplace=True`` or ``p`` outside [0, 1].

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(dropout(torch.randn(1000, 1000), p=0.2).std().item(), 2)
        1.0
    """
    _reject("dropout", "inplace", inplace, False, "use inplace=False")
    if not 0.0 <= p <= 1.0:
        raise UnsupportedArgumentError("dropout", "p", p, "use a probability 0 <= p <= 1")
    if not training or p == 0.0:
        return input
    return _finish(F.dropout(input, p, training), math.sqrt(1.0 - p))


# --------------------------------------------------------------------------------------------
# embedding and attention
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
        from ._attention import dynamic_length_attention

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
# losses
# --------------------------------------------------------------------------------------------


def _check_reduction(op: str, reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise UnsupportedArgumentError(op, "reduction", reduction, 'use "mean", "sum" or "none"')


def cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    mult: float = 1.0,
) -> Tensor:
    """Cross-entropy loss (``F.cross_entropy``) with a unit-scaled gradient.

    The loss value is never scaled (it is what you report and compare). Scaling rule for
    the gradient, for ``C`` classes, ``batch`` rows, unit logits and targets independent of
    them: row gradient ``p - y`` (``y`` the smoothed one-hot) has zero mean and mean square
    ``(v(C) - 2/C + Σ y²) / C`` per element, ``v`` as in :func:`softmax` (about ``1/C``);
    ``reduction="mean"`` divides it by ``batch``. So the input gradient is scaled by
    ``sqrt(C / (v - 2/C + Σ y²))``, times ``batch`` for ``"mean"``: unit std for a loss
    whose gradient is 1 (``loss.backward()``), or, with ``"none"``, for a unit incoming
    gradient. There is no constraint: the gradient is the true one times that factor.
    ``batch`` counts every row, so with ignored targets the remaining rows' gradients are
    ``batch / kept`` times larger than unit (a static scale cannot know ``kept``).

    With ``mult`` (u-μP's α_loss): the loss is ``cross_entropy(mult * input)`` (a softmax
    temperature of ``1 / mult``). Its gradient is ``mult (p - y)`` with ``p`` the softmax of
    logits of variance ``mult²``, so ``v`` is integrated at that variance and the scale
    divided by ``mult``: ``sqrt(C / (v - 2/C + Σ y²)) / mult``.

    Args:
        input: logits ``(batch, C)``, ``(C,)`` or ``(batch, C, d1, ...)``.
        target: class indices (``int64``), as for ``F.cross_entropy``.
        weight: unsupported; must be None.
        size_average: deprecated in PyTorch; must be None.
        ignore_index: target value that contributes no loss and no gradient.
        reduce: deprecated in PyTorch; must be None.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        label_smoothing: as for ``F.cross_entropy``.
        mult: positive multiplier of the logits.

    Returns:
        The (unscaled) loss of ``mult * input``.

    Raises:
        UnsupportedArgumentError: an unsupported argument, probability targets, or ``mult``
            not positive.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> logits = torch.randn(512, 1000, requires_grad=True)
        >>> cross_entropy(logits, torch.randint(0, 1000, (512,))).backward()
        >>> round(logits.grad.std().item(), 1)
        1.0
    """
    op = "cross_entropy"
    _reject(op, "weight", weight, None, "class weights are not supported")
    _reject(op, "size_average", size_average, None, "use reduction=")
    _reject(op, "reduce", reduce, None, "use reduction=")
    _check_reduction(op, reduction)
    if target.is_floating_point():
        raise UnsupportedArgumentError(
            op,
            "target",
            f"<{target.dtype} tensor>",
            "pass class indices (int64), not probabilities",
        )
    classes = _specialised_int(input.shape[1] if input.dim() >= 2 else input.shape[0])
    batch = input.numel() // max(classes, 1)
    mult = check_mult(op, mult)
    v, _ = _attention_moments(1, classes, False, mult * mult)
    eps = float(label_smoothing)
    target_sq = (1.0 - eps) ** 2 + 2.0 * eps * (1.0 - eps) / classes + eps * eps / classes
    grad_scale = math.sqrt(classes / max(v - 2.0 / classes + target_sq, 1e-12)) / mult
    if reduction == "mean" and isinstance(batch, torch.SymInt):
        # A dynamic size (torch.compile): kept an integer factor of its own, which Inductor
        # treats as a size; a float product with it would be specialised to one size.
        input = scale_bwd(input, batch)
    elif reduction == "mean":
        grad_scale *= batch
    if mult != 1.0:
        input = scale_fwd_bwd(input, mult, mult)  # a true gradient; grad_scale has 1/mult
    return F.cross_entropy(
        scale_bwd(input, grad_scale),
        target,
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
    )


def mse_loss(
    input: Tensor,
    target: Tensor,
    size_average: bool | None = None,
    reduce: bool | None = None,
    reduction: str = "mean",
    weight: Tensor | None = None,
) -> Tensor:
    """Mean squared error (``F.mse_loss``) with unit-scaled gradients.

    The loss value is never scaled. Scaling rule for the gradients, for independent unit
    ``input`` and ``target``: ``d/dinput (input - target)^2 = 2 (input - target)`` has std
    ``2 sqrt(2)``, divided by ``N = numel`` for ``"mean"``; so both gradients are scaled by
    ``1/(2 sqrt(2))``, times ``N`` for ``"mean"``. No constraint (the gradients are the
    true ones times that factor).

    Args:
        input: predictions, assumed unit-scaled.
        target: targets, assumed unit-scaled; gets a gradient if it requires one.
        size_average: deprecated in PyTorch; must be None.
        reduce: deprecated in PyTorch; must be None.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        weight: unsupported; must be None.

    Returns:
        The (unscaled) loss.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(1000, 1000, requires_grad=True)
        >>> mse_loss(x, torch.randn(1000, 1000)).backward()
        >>> round(x.grad.std().item(), 2)
        1.0
    """
    op = "mse_loss"
    _reject(op, "size_average", size_average, None, "use reduction=")
    _reject(op, "reduce", reduce, None, "use reduction=")
    _reject(op, "weight", weight, None, "elementwise weights are not supported")
    _check_reduction(op, reduction)
    grad_scale = 1.0 / (2.0 * math.sqrt(2.0))
    if reduction == "mean":
        grad_scale *= math.prod(torch.broadcast_shapes(input.shape, target.shape))
    return F.mse_loss(
        scale_bwd(input, grad_scale), scale_bwd(target, grad_scale), reduction=reduction
    )
