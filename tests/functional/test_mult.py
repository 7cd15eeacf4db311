"""u-μP multipliers (``mult=``) on ops and modules, and the residual scaling rule."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import unitscale as us
import unitscale.functional as U
from unitscale.errors import UnsupportedArgumentError
from unitscale.functional._mult import moments
from unitscale.functional._nonlinear import _softmax_scales

MULTS = [1 / 8, 0.5, 2.0, 8.0]
# Output and input-gradient std of each op, for N(0, 1) inputs and incoming gradient with
# constraint=None, must be 1 within TOL (sampling error of ~1e5-element tensors, and for
# attention the documented Gaussian-score approximation).
TOL = 0.06


def _grad_stds(y: Tensor, inputs: tuple[Tensor, ...]) -> list[float]:
    grads = torch.autograd.grad(y, inputs, torch.randn_like(y))
    return [g.std().item() for g in grads]


ELEMENTWISE: dict[str, tuple[Callable[..., Tensor], Callable[..., Tensor]]] = {
    # name: (unit-scaled op with mult, plain op)
    "gelu": (lambda x, m: U.gelu(x, constraint=None, mult=m), F.gelu),
    "gelu_tanh": (
        lambda x, m: U.gelu(x, "tanh", constraint=None, mult=m),
        lambda x: F.gelu(x, approximate="tanh"),
    ),
    "silu": (lambda x, m: U.silu(x, constraint=None, mult=m), F.silu),
    "softmax": (
        lambda x, m: U.softmax(x, -1, constraint=None, mult=m),
        lambda x: F.softmax(x, -1),
    ),
}


# Enough rows for softmax at mult 8, whose near one-hot rows make the sample std converge slowly.
@pytest.mark.parametrize("shape", [(2048, 256), (32, 64, 128)])
@pytest.mark.parametrize("mult", MULTS)
@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_mult_keeps_unit_scale(name: str, mult: float, shape: tuple[int, ...]) -> None:
    op, plain = ELEMENTWISE[name]
    x = torch.randn(*shape, requires_grad=True)
    y = op(x, mult)
    assert y.std().item() == pytest.approx(1.0, abs=TOL)
    assert _grad_stds(y, (x,))[0] == pytest.approx(1.0, abs=TOL)
    # the forward is the plain op of the mult-scaled input times one (static) scale
    reference = plain(mult * x.detach())
    torch.testing.assert_close(y.detach(), _fitted_scale(y, reference) * reference)
    # ... and that scale is the documented one (constraint=None: the ideal output scale)
    assert _fitted_scale(y, reference) == pytest.approx(DOCUMENTED[name](mult, shape), rel=1e-5)


# The documented output scale of each op: 1 / std(f(mult x)), by quadrature for GELU/SiLU;
# n / sqrt(n v - 1) with v integrated at logit variance mult^2 for softmax.
DOCUMENTED: dict[str, Callable[[float, tuple[int, ...]], float]] = {
    "gelu": lambda m, shape: 1 / moments("gelu", m)[0],
    "gelu_tanh": lambda m, shape: 1 / moments("gelu_tanh", m)[0],
    "silu": lambda m, shape: 1 / moments("silu", m)[0],
    "softmax": lambda m, shape: _softmax_scales(shape[-1], m)[0],
}


def _fitted_scale(y: Tensor, reference: Tensor) -> float:
    """The least-squares ``s`` in ``y = s * reference`` (robust to zeros in ``reference``)."""
    y = y.detach().double()
    reference = reference.double()
    return float((y * reference).sum() / (reference * reference).sum())


@pytest.mark.parametrize("mult", MULTS)
def test_silu_glu_mult(mult: float) -> None:
    x, gate = torch.randn(2, 256, 512).requires_grad_().unbind(0)
    x, gate = x.detach().requires_grad_(), gate.detach().requires_grad_()
    y = U.silu_glu(x, gate, constraint=None, mult=mult)
    assert y.std().item() == pytest.approx(1.0, abs=TOL)
    for std in _grad_stds(y, (x, gate)):
        assert std == pytest.approx(1.0, abs=TOL)
    reference = x.detach() * F.silu(mult * gate.detach())
    torch.testing.assert_close(y.detach(), reference / moments("silu", mult)[1])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mult", MULTS)
def test_attention_mult(mult: float, causal: bool) -> None:
    q, k, v = (torch.randn(4, 4, 128, 32, requires_grad=True) for _ in range(3))
    y = U.scaled_dot_product_attention(q, k, v, is_causal=causal, constraint=None, mult=mult)
    assert y.std().item() == pytest.approx(1.0, abs=0.1)
    for std in _grad_stds(y, (q, k, v)):
        assert std == pytest.approx(1.0, abs=0.1)
    reference = F.scaled_dot_product_attention(
        mult * q.detach(), k.detach(), v.detach(), is_causal=causal
    )
    torch.testing.assert_close(y.detach(), _fitted_scale(y, reference) * reference)


@pytest.mark.parametrize("classes", [64, 1000])
@pytest.mark.parametrize("mult", MULTS)
def test_cross_entropy_mult(mult: float, classes: int) -> None:
    logits = torch.randn(512, classes, requires_grad=True)
    target = torch.randint(0, classes, (512,))
    loss = U.cross_entropy(logits, target, mult=mult)
    loss.backward()
    assert logits.grad is not None
    assert logits.grad.std().item() == pytest.approx(1.0, abs=TOL)
    # the loss is the plain loss of the mult-scaled logits (never scaled)
    assert loss.item() == pytest.approx(F.cross_entropy(mult * logits, target).item(), rel=1e-5)


def test_mult_one_is_unchanged() -> None:
    x = torch.randn(64, 64)
    assert torch.equal(U.gelu(x, mult=1.0), U.gelu(x))
    assert torch.equal(U.softmax(x, -1, mult=1.0), U.softmax(x, -1))


def test_moments_quadrature_is_converged_and_meets_the_limits() -> None:
    for name in ("gelu", "gelu_tanh", "silu"):
        for mult in (1 / 16, 1.0, 16.0):
            coarse, fine = moments(name, mult), moments(name, mult, 48001)
            assert max(abs(a - b) for a, b in zip(coarse, fine, strict=True)) < 1e-9
    # large mult: both tend to ReLU, std(relu(m x)) = m sqrt(1/2 - 1/(2 pi))
    relu_std = 64 * math.sqrt(0.5 - 0.5 / math.pi)
    assert moments("gelu", 64.0)[0] == pytest.approx(relu_std, rel=2e-3)
    assert moments("silu", 64.0)[0] == pytest.approx(relu_std, rel=2e-3)
    # small mult: both tend to x/2 (std m/2, gradient rms m/2)
    assert moments("gelu", 1e-3)[0] == pytest.approx(5e-4, rel=1e-3)
    assert moments("silu", 1e-3)[2] == pytest.approx(5e-4, rel=1e-3)


def test_modules_pass_mult() -> None:
    x = torch.randn(64, 128)
    torch.testing.assert_close(us.GELU(mult=2.0)(x), U.gelu(x, mult=2.0))
    torch.testing.assert_close(us.SiLU(mult=0.5)(x), U.silu(x, mult=0.5))
    torch.testing.assert_close(us.Softmax(-1, mult=3.0)(x), U.softmax(x, -1, mult=3.0))
    target = torch.randint(0, 128, (64,))
    assert us.CrossEntropyLoss(mult=2.0)(x, target).item() == pytest.approx(
        F.cross_entropy(2.0 * x, target).item(), rel=1e-5
    )
    assert "mult=2" in repr(us.GELU(mult=2.0))
    mhsa = us.MHSA(32, 4, attn_mult=4.0)
    assert mhsa.attn_mult == 4.0 and "attn_mult=4" in repr(mhsa)
    assert us.MLP(32, activation_mult=2.0).act.mult == 2.0


@pytest.mark.parametrize("mult", [0.0, -1.0, float("inf"), "2"])
def test_bad_mult_is_rejected(mult: object) -> None:
    with pytest.raises(UnsupportedArgumentError, match="'mult'"):
        U.gelu(torch.randn(4), mult=mult)  # type: ignore[arg-type]
    with pytest.raises(UnsupportedArgumentError, match="'mult'"):
        us.Softmax(-1, mult=mult)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# residual scaling rule
# --------------------------------------------------------------------------------------------


def _paper_tau(
    index: int, layers: int, residual_mult: float, ratio: float, alpha: float = 0.5
) -> float:
    """The paper's rule (u-μP, Appendix G) in its own form: the std ratio of branch to skip,
    ``alpha_k / (layers/2)^alpha`` over the std of the stream before the add, with
    ``alpha_mlp = residual_mult sqrt(2 / (1 + ratio²))`` and ``alpha_attn = ratio alpha_mlp``
    (the reference's ``tau``). ``alpha`` is the depth exponent of the branch multiplier:
    1/2 for depth-μP, 1 for CompleteP (Dey et al. 2025, multipliers ``L^-alpha``)."""
    alpha_mlp = residual_mult * math.sqrt(2.0 / (1.0 + ratio**2))
    alpha_attn = ratio * alpha_mlp
    pairs = layers / 2
    attn_before, mlp_before = (index + 1) // 2, index // 2
    stream_var = 1.0 + (attn_before * alpha_attn**2 + mlp_before * alpha_mlp**2) / pairs ** (
        2 * alpha
    )
    branch = (alpha_attn if index % 2 == 0 else alpha_mlp) / pairs**alpha
    return branch / math.sqrt(stream_var)


@pytest.mark.parametrize(("residual_mult", "ratio"), [(1.0, 1.0), (2.0, 0.5), (0.3, 3.0)])
@pytest.mark.parametrize("layers", [2, 4, 12])
@pytest.mark.parametrize(("depth_rule", "alpha"), [("depth-mup", 0.5), ("completep", 1.0)])
def test_residual_rule_is_the_papers(
    residual_mult: float, ratio: float, layers: int, depth_rule: str, alpha: float
) -> None:
    tau = U.transformer_residual_scaling_rule(residual_mult, ratio, depth_rule)
    assert [tau(k, layers) for k in range(layers)] == pytest.approx(
        [_paper_tau(k, layers, residual_mult, ratio, alpha) for k in range(layers)], rel=1e-12
    )


def test_residual_rule_errors() -> None:
    tau = U.transformer_residual_scaling_rule()
    with pytest.raises(UnsupportedArgumentError, match="'index'"):
        tau(4, 4)
    with pytest.raises(UnsupportedArgumentError, match="'residual_mult'"):
        U.transformer_residual_scaling_rule(residual_mult=0.0)


def _stream(
    depth: int, residual_mult: float, ratio: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Run a stack of ``2 depth`` independent unit branches through the rule's residual adds;
    return the final stream and the embedding's, attention's and MLP's parts of it."""
    tau = U.transformer_residual_scaling_rule(residual_mult, ratio)
    layers = 2 * depth
    x = torch.randn(4096, 64)
    parts = {"embedding": x.clone(), "attention": torch.zeros_like(x), "mlp": torch.zeros_like(x)}
    for k in range(layers):
        t = tau(k, layers) ** 2 / (1 + tau(k, layers) ** 2)  # the share of the variance
        _residual, skip = U.residual_split(x, tau(k, layers))
        branch = torch.randn_like(x)  # a unit-scaled branch output
        x = U.residual_add(branch, skip, tau(k, layers))
        for name in parts:
            parts[name] = parts[name] * math.sqrt(1 - t)
        kind = "attention" if k % 2 == 0 else "mlp"
        parts[kind] = parts[kind] + math.sqrt(t) * branch
    return x, parts["embedding"], parts["attention"], parts["mlp"]


@pytest.mark.parametrize("depth", [2, 8, 32])
@pytest.mark.parametrize(("residual_mult", "ratio"), [(1.0, 1.0), (2.0, 0.5), (0.5, 3.0)])
def test_residual_rule_keeps_unit_scale_and_ratio(
    depth: int, residual_mult: float, ratio: float
) -> None:
    x, embedding, attention, mlp = _stream(depth, residual_mult, ratio)
    assert x.std().item() == pytest.approx(1.0, abs=0.02)
    torch.testing.assert_close(x, embedding + attention + mlp)
    # attention vs MLP contributions (std) follow the ratio; the mean of the attention and
    # MLP contributions (variance) vs the embedding's is the mult squared
    assert attention.std().item() / mlp.std().item() == pytest.approx(ratio, rel=0.05)
    mean_branch_var = (attention.var().item() + mlp.var().item()) / 2
    assert mean_branch_var / embedding.var().item() == pytest.approx(residual_mult**2, rel=0.1)


@pytest.mark.parametrize("depth", [1, 4, 16])
def test_default_residual_rule_gives_equal_thirds(depth: int) -> None:
    # The paper's defaults: embedding, attention and MLP each a third of the final stream.
    x, embedding, attention, mlp = _stream(depth, 1.0, 1.0)
    shares = [part.var().item() / x.var().item() for part in (embedding, attention, mlp)]
    assert shares == pytest.approx([1 / 3] * 3, abs=0.02)


def test_decoder_uses_the_residual_rule() -> None:
    tau = U.transformer_residual_scaling_rule(2.0, 1.0)
    for mup in (True, False):  # without u-muP too, when a residual mult is given
        model = us.TransformerDecoder(32, 3, 4, 10, residual_mult=2.0, mup=mup)
        taus = [t for layer in model.layers for t in (layer.attn_tau, layer.mlp_tau)]
        assert taus == pytest.approx([tau(k, 6) for k in range(6)])
        assert model.readout.mup is mup
    default = U.transformer_residual_scaling_rule()
    model = us.TransformerDecoder(32, 3, 4, 10)  # u-muP by default: the default rule
    taus = [t for layer in model.layers for t in (layer.attn_tau, layer.mlp_tau)]
    assert taus == pytest.approx([default(k, 6) for k in range(6)])


@pytest.mark.parametrize("depth", [2, 8])
def test_mup_decoder_stream_is_unit(depth: int) -> None:
    model = us.TransformerDecoder(64, depth=depth, heads=4, vocab_size=128, mup=True)
    streams: list[float] = []
    for layer in model.layers:
        layer.register_forward_hook(lambda _m, _i, out: streams.append(out.std().item()))
    with torch.no_grad():
        model(torch.randint(0, 128, (4, 64)))
    # Near-unit, but growing with depth: μP's 1/d_head logits make attention nearly uniform
    # at initialisation, so tokens share a growing common component (measured: 1.0 to 1.7
    # over 8 layers at seq 64; 1.0 to 1.37 with torch's 1/sqrt(d_head) logits).
    assert all(0.75 < s < 2.0 for s in streams), streams
