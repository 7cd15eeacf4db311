"""Softmax-moment scales at large logit variance (attention with ``scale=1.0``, wide heads).

The moment integral once used a fixed grid: at logit variance 64 it was 0.2% off and at 256
numpy overflowed, the gradient scale became NaN and ``_rsqrt`` turned it into 1.0 (a
silently unscaled gradient). These tests compare the moments with Monte Carlo estimates
over logit variances 1 to 256 and check that a non-finite scale is an error.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from unitscale import UnitScaleError
from unitscale import functional as U
from unitscale.functional._nonlinear import _attention_moments, _rsqrt, _softmax_moment_table

LENGTHS = [2, 8, 64, 300]


@pytest.mark.parametrize("logit_var", [1.0, 4.0, 16.0, 64.0, 256.0])
def test_softmax_moments_match_monte_carlo_up_to_logit_variance_256(logit_var: float) -> None:
    """Tolerance: 4 standard errors of the Monte Carlo mean (2e6 logits per length) plus
    0.1% of the value (the integral itself is accurate to about 1e-12)."""
    v, g = _softmax_moment_table(LENGTHS, logit_var)
    assert np.all(np.isfinite(v)) and np.all(np.isfinite(g))
    generator = torch.Generator().manual_seed(int(logit_var))
    for n, v_n, g_n in zip(LENGTHS, v, g, strict=True):
        rows = 2_000_000 // n
        z = torch.randn(rows, n, dtype=torch.float64, generator=generator) * math.sqrt(logit_var)
        p = z.softmax(-1)
        sum_p2, sum_p3 = (p**2).sum(-1), (p**3).sum(-1)
        for exact, samples in ((v_n, sum_p2), (g_n, sum_p2 - 2 * sum_p3 + sum_p2**2)):
            mean = samples.mean().item()
            standard_error = samples.std().item() / math.sqrt(rows)
            assert abs(exact - mean) <= 4 * standard_error + 1e-3 * abs(mean), (n, exact, mean)


def test_attention_with_unscaled_scores_on_wide_heads_has_unit_gradients() -> None:
    """``scale=1.0`` with head_dim 256: scores of variance 256. The old code returned a NaN
    moment here and left the gradients unscaled. Few keys dominate each row, so the
    sample std is noisy: 10% tolerance."""
    mean_v, mean_g = _attention_moments(128, 128, False, 256.0)
    assert math.isfinite(mean_v) and math.isfinite(mean_g)
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 4, 128, 256, requires_grad=True) for _ in range(3))
    for causal in (False, True):
        out = U.scaled_dot_product_attention(q, k, v, scale=1.0, is_causal=causal, constraint=None)
        out.backward(torch.randn_like(out))
        assert out.std().item() == pytest.approx(1.0, abs=0.05)
        for tensor in (q, k, v):
            assert tensor.grad is not None
            assert tensor.grad.std().item() == pytest.approx(1.0, abs=0.1)
            tensor.grad = None


def test_a_non_finite_scale_is_an_error_not_silently_one() -> None:
    assert _rsqrt(4.0) == 0.5 and _rsqrt(0.0) == 1.0  # an empty fan: nothing to correct
    for bad in (math.nan, math.inf, -1.0):
        with pytest.raises(UnitScaleError, match="not a finite non-negative number"):
            _rsqrt(bad)


def test_softmax_default_constraint_gradient_std_is_as_documented() -> None:
    """The docstring states ``sqrt(n G / (n v - 1))``, 1.21 for n = 64."""
    v, g = _softmax_moment_table([64], 1.0)
    documented = math.sqrt(64 * g[0] / (64 * v[0] - 1))
    assert documented == pytest.approx(1.21, abs=0.005)
    assert "1.21 for\n    n = 64" in (U.softmax.__doc__ or "")
    torch.manual_seed(0)
    x = torch.randn(8192, 64, requires_grad=True)
    y = U.softmax(x, dim=-1)
    y.backward(torch.randn_like(y))
    assert x.grad is not None
    assert x.grad.std().item() == pytest.approx(documented, rel=0.02)
