"""The two meanings of a residual weight: ``tau`` (the reference library's ratio of standard
deviations, branch over skip) and ``share`` (the branch's share of the variance)."""

from __future__ import annotations

import math

import pytest
import torch

import unitscale as us
import unitscale.functional as U
from unitscale.errors import UnsupportedArgumentError


@pytest.mark.parametrize("tau", [0.2, 0.5, 1.0, 3.0])
def test_a_reference_style_call_gets_the_references_weights(tau: float) -> None:
    # Ported from unit_scaling: residual_split(x, tau) / residual_add(r, s, tau), tau positional.
    # The reference's weights: branch tau / sqrt(1 + tau²), skip 1 / sqrt(1 + tau²).
    branch_weight, skip_weight = tau / math.sqrt(1 + tau**2), 1 / math.sqrt(1 + tau**2)
    r, s = torch.randn(64, dtype=torch.float64), torch.randn(64, dtype=torch.float64)
    torch.testing.assert_close(U.residual_add(r, s, tau), branch_weight * r + skip_weight * s)
    x = torch.randn(64, dtype=torch.float64, requires_grad=True)
    g_r, g_s = torch.randn_like(r), torch.randn_like(s)
    residual, skip = U.residual_split(x, tau)
    (grad,) = torch.autograd.grad([residual, skip], x, [g_r, g_s])
    torch.testing.assert_close(grad, branch_weight * g_r + skip_weight * g_s)
    # the branch's share of the variance: tau² / (1 + tau²), the same add spelled share=
    share = tau**2 / (1 + tau**2)
    torch.testing.assert_close(U.residual_add(r, s, share=share), U.residual_add(r, s, tau))


def test_the_rules_taus_are_the_papers_std_ratios_for_residual_add() -> None:
    # A ported loop: tau = rule(k, n); x = residual_add(f(x), x, tau). Its final stream holds
    # the paper's weights: beta_k^2 = 1/2 each at 2 layers (4 branches), embedding 1, so each
    # branch's share of the final (normalised) stream is beta_k^2 / (1 + sum beta^2) = 1/6.
    rule = U.transformer_residual_scaling_rule()
    n = 4
    weights = [1.0]  # the embedding's coefficient in the stream, then each branch's
    for k in range(n):
        tau = rule(k, n)
        branch, skip = tau / math.sqrt(1 + tau**2), 1 / math.sqrt(1 + tau**2)
        weights = [w * skip for w in weights] + [branch]
    shares = [w * w for w in weights]
    assert shares == pytest.approx([1 / 3, 1 / 6, 1 / 6, 1 / 6, 1 / 6], rel=1e-12)


def test_both_spellings_or_a_bad_value_are_refused_naming_the_other() -> None:
    x = torch.ones(3)
    with pytest.raises(UnsupportedArgumentError, match="not both"):
        U.residual_add(x, x, 1.0, share=0.5)
    with pytest.raises(UnsupportedArgumentError, match="share="):
        U.residual_add(x, x, 0.0)
    with pytest.raises(UnsupportedArgumentError, match="tau="):
        U.residual_split(x, share=1.0)
    # neither: share 1/2, the reference's default tau = 1
    assert torch.equal(U.residual_add(x, 2 * x), U.residual_add(x, 2 * x, 1.0))


def _decoder_by_hand(model: us.TransformerDecoder, ids: torch.Tensor) -> torch.Tensor:
    """The decoder's forward with the residual adds written out as before the two names:
    the rule's shares ``beta_k^2 / (1 + sum_{j<=k} beta_j^2)`` (beta_k^2 = 2 / (2 depth / 2)
    at the default mults), each add ``sqrt(share) branch + sqrt(1 - share) skip``."""
    depth = len(model.layers)
    beta_sq = [2.0 * 1.0 / (1.0 + 1.0) / (2 * depth / 2.0)] * (2 * depth)
    shares = [beta_sq[k] / (1.0 + sum(beta_sq[: k + 1])) for k in range(2 * depth)]
    x = model.embedding(ids)
    for i, layer in enumerate(model.layers):
        for k, (norm, branch) in enumerate(
            [(layer.attn_norm, layer.attn), (layer.mlp_norm, layer.mlp)]
        ):
            share = shares[2 * i + k]
            x = branch(norm(x)) * math.sqrt(share) + x * math.sqrt(1.0 - share)
    return model.readout(model.final_norm(x))


@pytest.mark.parametrize("depth", [1, 3])
def test_the_library_models_numerics_are_unchanged(depth: int) -> None:
    torch.manual_seed(0)
    model = us.TransformerDecoder(32, depth=depth, heads=4, vocab_size=50)
    ids = torch.randint(0, 50, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(ids), _decoder_by_hand(model, ids))
