"""unitscale.functional: unit scale, constraints, true (or documented) gradients, errors.

Scale checks feed i.i.d. N(0, 1) inputs and an N(0, 1) incoming gradient and compare the
standard deviation of the output and of each input's gradient with 1. Tolerances are
relative: ``TOL`` (±10%) where a rule rests on an approximation (attention, conv edges,
normalisation's O(1/n) terms, sampling noise of small tensors), ``TIGHT`` (±5%) where the
maths is exact and the tensors are large.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import unitscale.functional as U
from unitscale.constraints import UnknownConstraintError
from unitscale.errors import UnsupportedArgumentError
from unitscale.functional import _nonlinear, _torch_map
from unitscale.functional._nonlinear import _attention_moments, _softmax_moment_table

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 0.10
TIGHT = 0.05


def scale_stats(
    op: Callable[..., Tensor],
    make_inputs: Callable[[], Sequence[Tensor]],
    trials: int = 1,
) -> tuple[float, list[float]]:
    """Std of ``op``'s output and of each float input's gradient, pooled over ``trials``
    (the output's std is NaN for a scalar output, e.g. a reduced loss)."""
    outputs: list[Tensor] = []
    grads: list[list[Tensor]] | None = None
    for _ in range(trials):
        inputs = [t.requires_grad_() if t.is_floating_point() else t for t in make_inputs()]
        output = op(*inputs)
        floats = [t for t in inputs if t.is_floating_point()]
        upstream = torch.randn_like(output) if output.dim() else torch.ones_like(output)
        found = torch.autograd.grad(output, floats, upstream)
        outputs.append(output.detach().flatten())
        grads = [[] for _ in floats] if grads is None else grads
        for pool, grad in zip(grads, found, strict=True):
            pool.append(grad.flatten())
    assert grads is not None
    output_std = torch.cat(outputs).std().item() if outputs[0].numel() > 1 else math.nan
    return output_std, [torch.cat(pool).std().item() for pool in grads]


def randn(*shapes: Sequence[int]) -> Callable[[], list[Tensor]]:
    return lambda: [torch.randn(*shape) for shape in shapes]


def assert_unit(value: float, tol: float, what: str = "") -> None:
    assert abs(value - 1.0) <= tol, f"{what}: std {value:.4f} not within ±{tol} of 1"


# --------------------------------------------------------------------------------------------
# constants and softmax moments
# --------------------------------------------------------------------------------------------


def test_elementwise_constants_match_numerical_integration() -> None:
    z = np.linspace(-12.0, 12.0, 200001)
    density = np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi) * (z[1] - z[0])
    zt = torch.tensor(z, dtype=torch.float64, requires_grad=True)

    def moments(f: Callable[[Tensor], Tensor]) -> tuple[float, float, float]:
        y = f(zt)
        (d,) = torch.autograd.grad(y.sum(), zt)
        y_np, d_np = y.detach().numpy(), d.numpy()
        mean, second = (y_np * density).sum(), (y_np**2 * density).sum()
        return math.sqrt(second - mean**2), math.sqrt(second), math.sqrt((d_np**2 * density).sum())

    for approximate in ("none", "tanh"):
        std, _, grad_rms = moments(lambda t, a=approximate: F.gelu(t, approximate=a))
        assert std == pytest.approx(_nonlinear._GELU_STD[approximate], rel=1e-9)
        assert grad_rms == pytest.approx(_nonlinear._GELU_GRAD_RMS[approximate], rel=1e-9)
    std, rms, grad_rms = moments(F.silu)
    assert (std, rms, grad_rms) == pytest.approx(
        (_nonlinear._SILU_STD, _nonlinear._SILU_RMS, _nonlinear._SILU_GRAD_RMS), rel=1e-9
    )


@pytest.mark.parametrize("logit_var", [0.25, 1.0, 4.0])
def test_softmax_moments_match_monte_carlo(logit_var: float) -> None:
    lengths = [1, 2, 5, 32, 300]
    v, g = _softmax_moment_table(lengths, logit_var)
    for n, v_n, g_n in zip(lengths, v, g, strict=True):
        z = (torch.randn(40000, n, dtype=torch.float64) * math.sqrt(logit_var)).requires_grad_()
        p = z.softmax(-1)
        upstream = torch.randn_like(p)
        (grad,) = torch.autograd.grad(p, z, upstream)
        mc_v = (p**2).sum(-1).mean().item()
        mc_g = n * (grad**2).mean().item()
        assert v_n == pytest.approx(mc_v, rel=0.03, abs=1e-12)
        assert g_n == pytest.approx(mc_g, rel=0.05, abs=1e-9)


def test_softmax_moment_limits() -> None:
    v, g = _softmax_moment_table([1, 4, 100000], 1.0)
    assert v[0] == pytest.approx(1.0, abs=1e-9) and g[0] == pytest.approx(0.0, abs=1e-9)
    assert v[2] * 100000 == pytest.approx(math.e, rel=0.01)  # v(n) -> e/n
    v, g = _softmax_moment_table([8], 0.0)  # equal logits: p = 1/n exactly
    assert v[0] == pytest.approx(1 / 8, rel=1e-9)
    assert g[0] == pytest.approx(1 / 8 - 1 / 64, rel=1e-9)


def test_causal_moments_interpolate_accurately_for_long_sequences() -> None:
    exact_v, exact_g = _softmax_moment_table(np.arange(1, 1025), 1.0)
    mean_v, mean_g = _attention_moments(1024, 1024, True, 1.0)
    assert mean_v == pytest.approx(exact_v.mean(), rel=1e-4)
    assert mean_g == pytest.approx(exact_g.mean(), rel=1e-4)


# --------------------------------------------------------------------------------------------
# unit scale, unconstrained (constraint=None)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4096, 4), (256, 64), (8, 4096)])
@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu", "softmax", "dropout"])
def test_elementwise_unit_scale(name: str, shape: tuple[int, int]) -> None:
    ops: dict[str, Callable[[Tensor], Tensor]] = {
        "gelu": lambda x: U.gelu(x, constraint=None),
        "gelu_tanh": lambda x: U.gelu(x, approximate="tanh", constraint=None),
        "silu": lambda x: U.silu(x, constraint=None),
        "softmax": lambda x: U.softmax(x, dim=-1, constraint=None),
        "dropout": lambda x: U.dropout(x, 0.3),
    }
    out, (grad,) = scale_stats(ops[name], randn(shape))
    assert_unit(out, TIGHT, f"{name} output")
    assert_unit(grad, TIGHT, f"{name} grad")


@pytest.mark.parametrize("shape", [(4096, 4), (256, 64), (8, 4096)])
def test_scale_elementwise_unit_scale(shape: tuple[int, int]) -> None:
    # for x ~ N(0, 1): E[sin x] = 0, E[sin^2 x] = (1 - e^-2) / 2, E[cos^2 x] = (1 + e^-2) / 2
    sin_std, cos_rms = math.sqrt((1 - math.exp(-2)) / 2), math.sqrt((1 + math.exp(-2)) / 2)
    scaled_sin = U.scale_elementwise(torch.sin, 1 / sin_std, 1 / cos_rms, constraint=None)
    out, (grad,) = scale_stats(scaled_sin, randn(shape))
    assert_unit(out, TIGHT, "output")
    assert_unit(grad, TIGHT, "grad")


@pytest.mark.parametrize("shape", [(4096, 4), (256, 64), (8, 4096)])
def test_silu_glu_unit_scale(shape: tuple[int, int]) -> None:
    out, grads = scale_stats(lambda x, g: U.silu_glu(x, g, constraint=None), randn(shape, shape))
    assert_unit(out, TIGHT, "output")
    for grad in grads:
        assert_unit(grad, TIGHT, "grad")


def test_dropout_eval_and_zero_p_are_identity() -> None:
    x = torch.randn(10)
    assert U.dropout(x, 0.5, training=False) is x
    assert U.dropout(x, 0.0) is x


@pytest.mark.parametrize(
    ("left", "right"),
    [((256, 16), (16, 1024)), ((64, 1024), (1024, 16)), ((8, 32, 64), (8, 64, 48))],
)
def test_matmul_unit_scale(left: tuple[int, ...], right: tuple[int, ...]) -> None:
    out, grads = scale_stats(lambda a, b: U.matmul(a, b, constraint=None), randn(left, right), 2)
    assert_unit(out, TIGHT, "output")
    for grad in grads:
        assert_unit(grad, TIGHT, "grad")


@pytest.mark.parametrize(("left", "right"), [((8, 32, 64), (64, 16)), ((4, 1, 16, 32), (3, 32, 8))])
def test_matmul_unit_scale_with_broadcasting(left: tuple[int, ...], right: tuple[int, ...]) -> None:
    out, grads = scale_stats(lambda a, b: U.matmul(a, b, constraint=None), randn(left, right), 4)
    assert_unit(out, TOL, "output")
    for grad in grads:
        assert_unit(grad, TOL, "grad")


def _plain_readout(*args: Any, **kwargs: Any) -> Tensor:
    return U.linear_readout(*args, mup=False, **kwargs)


@pytest.mark.parametrize("op", [U.linear, _plain_readout])
@pytest.mark.parametrize(
    ("fan_in", "fan_out", "batch"), [(16, 512, (256,)), (512, 16, (256,)), (128, 128, (4, 64))]
)
def test_linear_unit_scale(
    op: Callable[..., Tensor], fan_in: int, fan_out: int, batch: tuple[int, ...]
) -> None:
    def make() -> list[Tensor]:
        return [torch.randn(*batch, fan_in), torch.randn(fan_out, fan_in), torch.zeros(fan_out)]

    out, (grad_x, grad_w, grad_b) = scale_stats(
        lambda x, w, b: op(x, w, b, constraint=None), make, trials=8
    )
    assert_unit(out, TIGHT, "output")
    assert_unit(grad_x, TIGHT, "grad input")
    assert_unit(grad_w, TIGHT, "grad weight")
    assert_unit(grad_b, TOL, "grad bias")


@pytest.mark.parametrize(
    ("c_in", "c_out", "kernel", "stride", "groups", "padding"),
    [(4, 64, 3, 1, 1, 0), (64, 8, 5, 2, 1, 2), (32, 32, 4, 4, 1, 0), (32, 64, 3, 1, 4, "same")],
)
def test_conv1d_unit_scale(
    c_in: int, c_out: int, kernel: int, stride: int, groups: int, padding: int | str
) -> None:
    def make() -> list[Tensor]:
        return [
            torch.randn(8, c_in, 256),
            torch.randn(c_out, c_in // groups, kernel),
            torch.zeros(c_out),
        ]

    out, grads = scale_stats(
        lambda x, w, b: U.conv1d(x, w, b, stride, padding, 1, groups, constraint=None), make, 4
    )
    assert_unit(out, TOL, "output")
    for what, grad in zip(("input", "weight", "bias"), grads, strict=True):
        assert_unit(grad, TOL, f"grad {what}")


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("width", [32, 256, 2048])
def test_norm_unit_scale(name: str, width: int) -> None:
    rows = 65536 // width

    def make() -> list[Tensor]:
        return [torch.randn(rows, width), torch.ones(width), torch.zeros(width)]

    ops = {
        "layer_norm": lambda x, w, b: U.layer_norm(x, (width,), w, b),
        "rms_norm": lambda x, w, b: U.rms_norm(x, width, w) + 0 * b,
    }
    out, (grad_x, grad_w, grad_b) = scale_stats(ops[name], make, trials=4)
    assert_unit(out, TIGHT, "output")
    assert_unit(grad_x, TOL, "grad input")
    assert_unit(grad_w, TOL, "grad weight")
    if name == "layer_norm":
        assert_unit(grad_b, TOL, "grad bias")


@pytest.mark.parametrize(
    ("left", "right", "alpha"),
    [((256, 64), (256, 64), 1.0), ((32, 8, 16), (16,), 1.0), ((64, 64), (64, 64), -3.0)],
)
def test_add_unit_scale(left: tuple[int, ...], right: tuple[int, ...], alpha: float) -> None:
    out, grads = scale_stats(
        lambda a, b: U.add(a, b, alpha=alpha, constraint=None), randn(left, right), 8
    )
    assert_unit(out, TIGHT, "output")
    for grad in grads:
        assert_unit(grad, TOL, "grad")


@pytest.mark.parametrize("tau", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("width", [16, 128, 512])
def test_residual_block_unit_scale(tau: float, width: int) -> None:
    def block(x: Tensor, w: Tensor) -> Tensor:
        residual, skip = U.residual_split(x, share=tau)
        return U.residual_add(U.linear(residual, w, constraint=None), skip, share=tau)

    out, (grad_x, grad_w) = scale_stats(block, randn((8192 // width, width), (width, width)), 4)
    assert_unit(out, TIGHT, "output")
    assert_unit(grad_x, TIGHT, "grad input")
    assert_unit(grad_w, TIGHT, "grad weight")


@pytest.mark.parametrize("tau", [0.1, 0.5, 0.9])
def test_residual_ops_are_unit_on_their_own(tau: float) -> None:
    out, grads = scale_stats(
        lambda r, s: U.residual_add(r, s, share=tau), randn((512, 64), (512, 64))
    )
    assert_unit(out, TIGHT, "residual_add output")
    for grad in grads:
        assert_unit(grad, TIGHT, "residual_add grad")
    out, (grad,) = scale_stats(
        lambda x: torch.cat(U.residual_split(x, share=tau)), randn((512, 64))
    )
    assert_unit(out, TIGHT, "residual_split outputs")
    assert_unit(grad, TIGHT, "residual_split grad")


@pytest.mark.parametrize(
    ("vocab", "width", "tokens"), [(1000, 64, (8, 512)), (64, 256, (4, 64)), (50, 16, (4096,))]
)
def test_embedding_unit_scale(vocab: int, width: int, tokens: tuple[int, ...]) -> None:
    def make() -> list[Tensor]:
        return [torch.randint(0, vocab, tokens), torch.randn(vocab, width)]

    out, (grad_w,) = scale_stats(U.embedding, make, trials=2)
    assert_unit(out, TIGHT, "output")
    assert_unit(grad_w, TOL, "grad weight")


@pytest.mark.parametrize(
    ("queries", "keys", "dim", "causal"),
    [
        (16, 16, 32, True),
        (256, 256, 64, True),
        (64, 64, 16, False),
        (32, 128, 32, False),
        (256, 64, 32, True),
    ],
)
def test_attention_unit_scale(queries: int, keys: int, dim: int, causal: bool) -> None:
    def op(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return U.scaled_dot_product_attention(q, k, v, is_causal=causal, constraint=None)

    shapes = (8, 4, queries, dim), (8, 4, keys, dim), (8, 4, keys, dim)
    out, grads = scale_stats(op, randn(*shapes))
    assert_unit(out, TOL, "output")
    for what, grad in zip("qkv", grads, strict=True):
        assert_unit(grad, TOL, f"grad {what}")


@pytest.mark.parametrize(
    "kwargs", [{"dropout_p": 0.3}, {"scale": 1 / 32}, {"scale": 0.25}, {"enable_gqa": True}]
)
def test_attention_unit_scale_options(kwargs: dict[str, object]) -> None:
    def op(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return U.scaled_dot_product_attention(q, k, v, is_causal=True, constraint=None, **kwargs)

    heads_kv = 2 if kwargs.get("enable_gqa") else 8
    shapes = (4, 8, 128, 32), (4, heads_kv, 128, 32), (4, heads_kv, 128, 32)
    out, grads = scale_stats(op, randn(*shapes))
    assert_unit(out, TOL, "output")
    for what, grad in zip("qkv", grads, strict=True):
        assert_unit(grad, TOL, f"grad {what}")


@pytest.mark.parametrize(("seq", "dim"), [(16, 8), (128, 64)])
def test_rotary_embedding_unit_scale(seq: int, dim: int) -> None:
    out, grads = scale_stats(U.rotary_embedding, randn((16, 4, seq, dim)))
    assert_unit(out, TOL, "output")
    assert_unit(grads[0], TOL, "grad")


def test_rotary_embedding_scores_depend_on_relative_position() -> None:
    # RoPE's defining property: <R_m q, R_n k> depends on m - n only. Shift both sequences
    # by 5 positions: every score between the same pair of vectors is unchanged.
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 24, 16, dtype=torch.float64).unbind(0)
    pad = torch.zeros(1, 5, 16, dtype=torch.float64)
    scores = U.rotary_embedding(q) @ U.rotary_embedding(k).mT
    shifted = (
        U.rotary_embedding(torch.cat([pad, q], 1)) @ U.rotary_embedding(torch.cat([pad, k], 1)).mT
    )
    torch.testing.assert_close(shifted[:, 5:, 5:], scores)
    plain = q @ k.mT  # without RoPE the scores are the same only on the diagonal
    torch.testing.assert_close(scores.diagonal(dim1=-2, dim2=-1), plain.diagonal(dim1=-2, dim2=-1))
    assert not torch.allclose(scores, plain)


def test_rotary_embedding_equals_llamas() -> None:
    # The reference: transformers' Llama RoPE (default base 10000, half-split layout).
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    torch.manual_seed(0)
    q, k = torch.randn(2, 2, 4, 24, 16).unbind(0)  # (batch, heads, seq, head size)
    cos, sin = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4))(
        q, torch.arange(24)[None]
    )
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(U.rotary_embedding(q), q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(U.rotary_embedding(k), k_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(("batch", "classes"), [(4096, 4), (512, 100), (32, 5000)])
def test_cross_entropy_unit_grad(reduction: str, batch: int, classes: int) -> None:
    def make() -> list[Tensor]:
        return [torch.randn(batch, classes), torch.randint(0, classes, (batch,))]

    _, (grad,) = scale_stats(lambda x, t: U.cross_entropy(x, t, reduction=reduction), make)
    assert_unit(grad, TIGHT, "grad logits")


def test_cross_entropy_label_smoothing_and_spatial_targets() -> None:
    def make() -> list[Tensor]:
        return [torch.randn(16, 50, 32), torch.randint(0, 50, (16, 32))]

    _, (grad,) = scale_stats(lambda x, t: U.cross_entropy(x, t, label_smoothing=0.2), make)
    assert_unit(grad, TIGHT, "grad logits")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(4096,), (64, 64), (4, 32, 128)])
def test_mse_loss_unit_grad(reduction: str, shape: tuple[int, ...]) -> None:
    _, grads = scale_stats(lambda x, t: U.mse_loss(x, t, reduction=reduction), randn(shape, shape))
    for grad in grads:
        assert_unit(grad, TIGHT, "grad")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("broadcast", ["target", "input"])
def test_mse_loss_unit_grad_of_a_broadcast_operand(reduction: str, broadcast: str) -> None:
    """An operand broadcast over the batch (a target shared by every example) sums the
    gradient of every row: unit after its own factor, like the full-size operand's."""
    shapes = [(512, 64), (64,)] if broadcast == "target" else [(64,), (512, 64)]
    with pytest.warns(UserWarning, match="target size"):  # torch's own note on broadcasting
        _, grads = scale_stats(
            lambda x, t: U.mse_loss(x, t, reduction=reduction), randn(*shapes), 8
        )
    for grad in grads:
        assert_unit(grad, TOL, "grad")


def test_losses_are_not_scaled() -> None:
    logits, target = torch.randn(64, 10), torch.randint(0, 10, (64,))
    target[::5] = -100
    assert torch.equal(U.cross_entropy(logits, target), F.cross_entropy(logits, target))
    x, y = torch.randn(100), torch.randn(100)
    assert torch.equal(U.mse_loss(x, y, reduction="sum"), F.mse_loss(x, y, reduction="sum"))


# --------------------------------------------------------------------------------------------
# constraints tie the scales as documented
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "constraint", ["to_output_scale", "to_grad_input_scale", "gmean", "hmean", "amean"]
)
@pytest.mark.parametrize(("fan_in", "fan_out"), [(64, 1024), (1024, 64)])
def test_linear_constraint_ties_scales(constraint: str, fan_in: int, fan_out: int) -> None:
    ideal_out, ideal_grad = fan_in**-0.5, fan_out**-0.5
    shared = {
        "to_output_scale": ideal_out,
        "to_grad_input_scale": ideal_grad,
        "gmean": math.sqrt(ideal_out * ideal_grad),
        "hmean": 2 / (1 / ideal_out + 1 / ideal_grad),
        "amean": (ideal_out + ideal_grad) / 2,
    }[constraint]
    out, (grad_x, grad_w) = scale_stats(
        lambda x, w: U.linear(x, w, constraint=constraint), randn((256, fan_in), (fan_out, fan_in))
    )
    assert out == pytest.approx(shared / ideal_out, rel=TIGHT)
    assert grad_x == pytest.approx(shared / ideal_grad, rel=TIGHT)
    assert_unit(grad_w, TIGHT, "weight gradients are never constrained")


def test_linear_readout_default_keeps_the_gradient_unit() -> None:
    # plain unit scaling: logits std sqrt(fan_in / fan_out)
    out, (grad_x, _) = scale_stats(_plain_readout, randn((512, 64), (1024, 64)))
    assert out == pytest.approx(math.sqrt(64 / 1024), rel=TIGHT)
    assert_unit(grad_x, TIGHT, "grad input")
    # u-muP's readout (the default): multiplier 1/fan_in, logits std 1/sqrt(fan_in)
    out, (grad_x, grad_w) = scale_stats(U.linear_readout, randn((512, 64), (1024, 64)))
    assert out == pytest.approx(1 / math.sqrt(64), rel=TIGHT)
    assert_unit(grad_x, TIGHT, "grad input")
    assert_unit(grad_w, TIGHT, "grad weight")


@pytest.mark.parametrize(
    ("name", "grad_std"),
    [
        ("gelu", _nonlinear._GELU_GRAD_RMS["none"] / _nonlinear._GELU_STD["none"]),
        ("silu", _nonlinear._SILU_GRAD_RMS / _nonlinear._SILU_STD),
    ],
)
def test_elementwise_default_constraint(name: str, grad_std: float) -> None:
    out, (grad,) = scale_stats(getattr(U, name), randn((1024, 256)))
    assert_unit(out, TIGHT, "output")
    assert grad == pytest.approx(grad_std, rel=TIGHT)
    out, (grad,) = scale_stats(
        lambda x: getattr(U, name)(x, constraint="to_grad_input_scale"), randn((1024, 256))
    )
    assert out == pytest.approx(1 / grad_std, rel=TIGHT)
    assert_unit(grad, TIGHT, "grad")


@pytest.mark.parametrize("n", [4, 64, 1024])
def test_softmax_default_constraint(n: int) -> None:
    v, g = _softmax_moment_table([n], 1.0)
    out, (grad,) = scale_stats(lambda x: U.softmax(x, -1), randn((262144 // n, n)))
    assert_unit(out, TIGHT, "output")
    assert grad == pytest.approx(math.sqrt(n * g[0] / (n * v[0] - 1)), rel=TIGHT)


@pytest.mark.parametrize(
    "constraint", ["to_output_scale", "to_left_grad_scale", "to_right_grad_scale"]
)
def test_matmul_constraints(constraint: str) -> None:
    m, k, n = 64, 256, 1024
    ideal = {"out": k**-0.5, "left": n**-0.5, "right": m**-0.5}
    shared = ideal[
        {"to_output_scale": "out", "to_left_grad_scale": "left"}.get(constraint, "right")
    ]
    out, (grad_l, grad_r) = scale_stats(
        lambda a, b: U.matmul(a, b, constraint=constraint), randn((m, k), (k, n))
    )
    assert out == pytest.approx(shared / ideal["out"], rel=TIGHT)
    assert grad_l == pytest.approx(shared / ideal["left"], rel=TIGHT)
    assert grad_r == pytest.approx(shared / ideal["right"], rel=TIGHT)


@pytest.mark.parametrize("constant_first", [True, False])
@pytest.mark.parametrize("alpha", [1.0, -2.0])
def test_add_of_a_one_element_operand_keeps_the_scale(constant_first: bool, alpha: float) -> None:
    """A constant (or one-element parameter) plus a tensor: a constant offset, so the output
    keeps the tensor's scale, the tensor's gradient is the incoming one, and the offset's is
    the sum over the output (unit after ``1/sqrt(numel)`` with ``constraint=None``)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=generator, requires_grad=True)
    c = torch.tensor(5.0, requires_grad=True)
    grad = torch.randn(256, 64, generator=generator)
    for constraint in ("to_output_scale", None):
        x.grad = c.grad = None
        operands = (c, x) if constant_first else (x, c)
        out = U.add(*operands, alpha=alpha, constraint=constraint)
        out.backward(grad)
        x_coefficient = alpha if constant_first else 1.0
        c_coefficient = 1.0 if constant_first else alpha
        # the offset moves every element alike: only x's coefficient is undone
        scale = 1 / abs(x_coefficient)
        torch.testing.assert_close(out, (c * c_coefficient + x * x_coefficient) * scale)
        assert out.std().item() == pytest.approx(x.std().item(), rel=1e-5)
        torch.testing.assert_close(x.grad, grad * x_coefficient * scale)
        expected = grad.sum() * c_coefficient * scale
        if constraint is None:
            expected = grad.sum() / math.sqrt(grad.numel()) * math.copysign(1, c_coefficient)
        torch.testing.assert_close(c.grad, expected)
    for shape in ((), (1,), (1, 1)):  # every one-element shape, the reference's std of 1
        out = U.add(torch.full(shape, 5.0), torch.randn(256, 64, generator=generator))
        assert out.std().item() == pytest.approx(1.0, rel=TIGHT)


def test_add_default_constraint_is_a_true_mean() -> None:
    out, grads = scale_stats(U.add, randn((256, 64), (256, 64)))
    assert_unit(out, TIGHT, "output")
    assert grads == pytest.approx([2**-0.5, 2**-0.5], rel=TIGHT)


def test_attention_default_constraint_keeps_gradients_near_unit() -> None:
    def op(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return U.scaled_dot_product_attention(q, k, v, is_causal=True)

    mean_v, mean_g = _attention_moments(128, 128, True, 1.0)
    out, (grad_q, grad_k, grad_v) = scale_stats(op, randn(*[(8, 4, 128, 32)] * 3))
    assert_unit(out, TOL, "output")
    assert_unit(grad_v, TOL, "grad v")  # same ideal scale as the output in self-attention
    ratio = math.sqrt(mean_g / mean_v)  # q and k gradients: sqrt(G / v) < 1
    assert grad_q == pytest.approx(ratio, rel=TOL)
    assert grad_k == pytest.approx(ratio, rel=TOL)


@pytest.mark.parametrize("bad", ["to_ouput_scale", "to_grad_input_scale"])
def test_constraint_errors_reach_the_caller(bad: str) -> None:
    with pytest.raises(UnknownConstraintError, match="constraint"):
        U.matmul(torch.randn(2, 3), torch.randn(3, 4), constraint=bad)


# --------------------------------------------------------------------------------------------
# gradients: true where the constraint ties the scales, documented factors elsewhere
# --------------------------------------------------------------------------------------------


def f64(*shape: int, grad: bool = True) -> Tensor:
    return torch.randn(*shape, dtype=torch.float64, requires_grad=grad)


def _seeded_dropout(x: Tensor) -> Tensor:
    torch.manual_seed(1)
    return U.dropout(x, 0.3)


GRADCHECK_CASES: dict[str, tuple[Callable[..., Tensor], Callable[[], tuple[Tensor, ...]]]] = {
    "gelu": (U.gelu, lambda: (f64(3, 5),)),
    "gelu_tanh": (lambda x: U.gelu(x, approximate="tanh"), lambda: (f64(3, 5),)),
    "silu": (U.silu, lambda: (f64(3, 5),)),
    "silu_glu": (U.silu_glu, lambda: (f64(3, 5), f64(3, 5))),
    "softmax": (lambda x: U.softmax(x, dim=-1), lambda: (f64(3, 5),)),
    "dropout": (_seeded_dropout, lambda: (f64(4, 6),)),
    "matmul": (U.matmul, lambda: (f64(2, 3, 4), f64(4, 5))),
    "linear": (U.linear, lambda: (f64(3, 4), f64(5, 4, grad=False))),
    "linear_readout": (_plain_readout, lambda: (f64(3, 4), f64(5, 4, grad=False))),
    "conv1d": (
        lambda x, w: U.conv1d(x, w, stride=2, padding=1),
        lambda: (f64(2, 3, 9), f64(4, 3, 3, grad=False)),
    ),
    "layer_norm": (lambda x: U.layer_norm(x, (6,)), lambda: (f64(3, 6),)),
    "rms_norm": (lambda x: U.rms_norm(x, (6,)), lambda: (f64(3, 6),)),
    "add": (U.add, lambda: (f64(3, 4), f64(4))),
    "attention": (
        lambda q, k, v: U.scaled_dot_product_attention(q, k, v, is_causal=True),
        lambda: (f64(2, 5, 4), f64(2, 5, 4), f64(2, 5, 3)),
    ),
}


@pytest.mark.parametrize("name", sorted(GRADCHECK_CASES))
def test_gradcheck_where_the_constraint_gives_true_gradients(name: str) -> None:
    op, make = GRADCHECK_CASES[name]
    assert torch.autograd.gradcheck(op, make())


@pytest.mark.parametrize("f", [torch.exp, torch.tanh, torch.sigmoid])
def test_scale_elementwise_leaves_outputs_that_autograd_reads_intact(
    f: Callable[[Tensor], Tensor],
) -> None:
    # these functions' backward reads their output: it must not be scaled in place
    assert torch.autograd.gradcheck(U.scale_elementwise(f, 0.5, 0.25), (f64(3, 4),))


def test_residual_split_and_add_together_give_true_gradients() -> None:
    w = f64(4, 4, grad=False)

    def block(x: Tensor) -> Tensor:
        residual, skip = U.residual_split(x, share=0.3)
        return U.residual_add(U.gelu(U.linear(residual, w)), skip, share=0.3)

    assert torch.autograd.gradcheck(block, (f64(3, 4),))


def _grads(
    fn: Callable[..., Tensor], inputs: Sequence[Tensor], upstream: Tensor
) -> tuple[Tensor, ...]:
    return torch.autograd.grad(fn(*inputs), inputs, upstream)


def test_unconstrained_gradient_is_the_true_one_times_the_scale_ratio() -> None:
    x = f64(6, 8)
    upstream = torch.randn(6, 8, dtype=torch.float64)
    (constrained,) = _grads(U.gelu, [x], upstream)  # true gradient of s_out * gelu
    (unconstrained,) = _grads(lambda t: U.gelu(t, constraint=None), [x], upstream)
    ratio = _nonlinear._GELU_STD["none"] / _nonlinear._GELU_GRAD_RMS["none"]  # s_grad / s_out
    assert torch.allclose(unconstrained, constrained * ratio)

    w = f64(16, 8)
    upstream = torch.randn(6, 16, dtype=torch.float64)
    true_x, _ = _grads(lambda a, b: F.linear(a, b) / math.sqrt(8), [x, w], upstream)
    got_x, _ = _grads(lambda a, b: U.linear(a, b, constraint=None), [x, w], upstream)
    assert torch.allclose(got_x, true_x * math.sqrt(8 / 16))


def test_weight_gradients_are_scaled_not_true() -> None:
    x, w, b = f64(2, 5, 8), f64(16, 8), f64(16)
    upstream = torch.randn(2, 5, 16, dtype=torch.float64)
    true = _grads(lambda *t: F.linear(t[0], t[1] / math.sqrt(8), t[2]), [x, w, b], upstream)
    got = _grads(U.linear, [x, w, b], upstream)
    batch = 10
    assert torch.allclose(got[0], true[0])  # input: true under to_output_scale
    assert torch.allclose(got[1], true[1] * math.sqrt(8) / math.sqrt(batch))
    assert torch.allclose(got[2], true[2] / math.sqrt(batch))

    x, w = f64(4, 6), f64(6, grad=True)
    upstream = torch.randn(4, 6, dtype=torch.float64)
    true = _grads(lambda a, b: F.layer_norm(a, (6,), b), [x, w], upstream)
    got = _grads(lambda a, b: U.layer_norm(a, (6,), b), [x, w], upstream)
    assert torch.allclose(got[0], true[0])
    assert torch.allclose(got[1], true[1] / 2)  # 1/sqrt(4 rows)

    ids, table = torch.randint(0, 10, (5, 8)), f64(10, 3)
    upstream = torch.randn(5, 8, 3, dtype=torch.float64)
    (true_w,) = torch.autograd.grad(F.embedding(ids, table), table, upstream)
    (got_w,) = torch.autograd.grad(U.embedding(ids, table), table, upstream)
    assert torch.allclose(got_w, true_w * math.sqrt(10 / 40))


def test_residual_add_alone_unscales_each_gradient() -> None:
    r, s = f64(5), f64(5)
    upstream = torch.randn(5, dtype=torch.float64)
    grad_r, grad_s = _grads(lambda a, b: U.residual_add(a, b, share=0.25), [r, s], upstream)
    assert torch.allclose(grad_r, upstream) and torch.allclose(grad_s, upstream)
    x = f64(5)
    g_r, g_s = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    residual, skip = U.residual_split(x, share=0.25)
    (grad_x,) = torch.autograd.grad([residual, skip], x, [g_r, g_s])
    assert torch.allclose(grad_x, 0.5 * g_r + math.sqrt(0.75) * g_s)


def test_loss_gradients_are_the_true_ones_times_the_documented_factor() -> None:
    logits, target = f64(32, 10), torch.randint(0, 10, (32,))
    (true,) = torch.autograd.grad(F.cross_entropy(logits, target), logits)
    (got,) = torch.autograd.grad(U.cross_entropy(logits, target), logits)
    v, _ = _attention_moments(1, 10, False, 1.0)
    factor = 32 * math.sqrt(10 / (v - 2 / 10 + 1))
    assert torch.allclose(got, true * factor)

    x, y = f64(7, 3), f64(7, 3)
    true = _grads(F.mse_loss, [x, y], torch.tensor(1.0, dtype=torch.float64))
    got = _grads(U.mse_loss, [x, y], torch.tensor(1.0, dtype=torch.float64))
    for t, g in zip(true, got, strict=True):
        assert torch.allclose(g, t * 21 / (2 * math.sqrt(2)))


# --------------------------------------------------------------------------------------------
# unsupported arguments
# --------------------------------------------------------------------------------------------

X = torch.randn(4, 8)
IDS = torch.randint(0, 4, (3,))
BAD_CALLS: list[tuple[str, Callable[[], object], str]] = [
    ("gelu approximate", lambda: U.gelu(X, approximate="exact"), "'approximate'"),
    ("silu inplace", lambda: U.silu(X, inplace=True), "'inplace'"),
    ("softmax dim", lambda: U.softmax(X), "'dim'=None"),
    ("dropout inplace", lambda: U.dropout(X, inplace=True), "'inplace'"),
    ("dropout p", lambda: U.dropout(X, 1.5), "'p'=1.5"),
    (
        "conv1d stride",
        lambda: U.conv1d(torch.randn(1, 2, 8), torch.randn(2, 2, 3), stride=(1, 2)),
        "'stride'",
    ),
    ("embedding max_norm", lambda: U.embedding(IDS, X, max_norm=1.0), "'max_norm'"),
    ("embedding norm_type", lambda: U.embedding(IDS, X, norm_type=1.0), "'norm_type'"),
    (
        "embedding freq",
        lambda: U.embedding(IDS, X, scale_grad_by_freq=True),
        "'scale_grad_by_freq'",
    ),
    ("embedding sparse", lambda: U.embedding(IDS, X, sparse=True), "'sparse'"),
    ("attention mask", lambda: U.scaled_dot_product_attention(X, X, X, attn_mask=X), "'attn_mask'"),
    (
        "attention dropout",
        lambda: U.scaled_dot_product_attention(X, X, X, dropout_p=1.0),
        "'dropout_p'",
    ),
    ("ce weight", lambda: U.cross_entropy(X, IDS.repeat(2)[:4], weight=torch.ones(8)), "'weight'"),
    (
        "ce size_average",
        lambda: U.cross_entropy(X, IDS.repeat(2)[:4], size_average=True),
        "'size_average'",
    ),
    ("ce reduce", lambda: U.cross_entropy(X, IDS.repeat(2)[:4], reduce=False), "'reduce'"),
    ("ce reduction", lambda: U.cross_entropy(X, IDS.repeat(2)[:4], reduction="max"), "'reduction'"),
    ("ce soft target", lambda: U.cross_entropy(X, X.softmax(-1)), "'target'"),
    ("mse weight", lambda: U.mse_loss(X, X, weight=X), "'weight'"),
    ("mse reduce", lambda: U.mse_loss(X, X, reduce=True), "'reduce'"),
    ("split tau", lambda: U.residual_split(X, 0.0), "'tau'=0.0"),
    ("add tau", lambda: U.residual_add(X, X, -1.0), "'tau'=-1.0"),
    ("add share", lambda: U.residual_add(X, X, share=1.5), "'share'=1.5"),
    ("split both", lambda: U.residual_split(X, 1.0, share=0.5), "not both"),
]


@pytest.mark.parametrize(("what", "call", "match"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_unsupported_arguments_are_named(what: str, call: Callable[[], object], match: str) -> None:
    with pytest.raises(UnsupportedArgumentError, match=match) as info:
        call()
    assert "unitscale.functional." in str(info.value)


def test_inputs_are_not_mutated() -> None:
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    x_before, w_before = x.clone(), w.clone()
    U.linear(x.requires_grad_(), w.requires_grad_()).sum().backward()
    U.dropout(x, 0.5)
    assert torch.equal(x.detach(), x_before) and torch.equal(w.detach(), w_before)


# --------------------------------------------------------------------------------------------
# U.add on non-tensors, torch_map against real Dynamo graphs
# --------------------------------------------------------------------------------------------


def test_add_is_the_plain_add_unless_both_operands_are_float_tensors() -> None:
    x = torch.randn(3)
    assert U.add(2, 3) == 5
    assert U.add((1,), (2,)) == (1, 2)
    assert torch.equal(U.add(x, 1.0), x + 1.0)
    assert torch.equal(U.add(1.0, x), 1.0 + x)
    assert torch.equal(U.add(torch.arange(3), torch.arange(3)), torch.arange(3) * 2)
    assert torch.equal(U.add(x, 2.0, alpha=3), x + 6.0)


class _Captured(torch.nn.Module):
    """A model using every op family the way users write them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.rms = torch.nn.RMSNorm(8)
        self.lin = torch.nn.Linear(8, 8)
        self.conv = torch.nn.Conv1d(8, 8, 3, padding=1)
        self.act = torch.nn.GELU()
        self.silu = torch.nn.SiLU()
        self.drop = torch.nn.Dropout(0.1)
        self.soft = torch.nn.Softmax(dim=-1)
        self.loss = torch.nn.CrossEntropyLoss()

    def forward(self, ids: Tensor, target: Tensor) -> Tensor:
        x = self.emb(ids)
        x = self.lin(self.norm(x)) + torch.add(x, 1.0)
        x = self.silu(self.rms(x)) + F.silu(x)
        x = self.drop(self.act(x)) + F.gelu(x, approximate="tanh")
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        scores = self.soft(x @ x.transpose(-1, -2)) + torch.softmax(x.matmul(x.mT), -1)
        x = torch.matmul(scores, x) + x.add(F.dropout(x, 0.1))
        q = x.unflatten(-1, (2, 4)).transpose(1, 2)
        x = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).flatten(2)
        return self.loss(x.flatten(0, 1), target.flatten()) + F.mse_loss(x, x.detach())


def _capture(model: torch.nn.Module, *args: Tensor) -> tuple[torch.fx.GraphModule, list[Tensor]]:
    """The Dynamo graph of ``model(*args)`` and the inputs it takes (parameters included)."""
    graphs: list[tuple[torch.fx.GraphModule, list[Tensor]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> torch.fx.GraphModule:
        graphs.append((gm, list(example_inputs)))
        return gm

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    (captured,) = graphs
    return captured


def test_torch_map_covers_what_dynamo_graphs_call() -> None:
    ids, target = torch.randint(0, 10, (2, 6)), torch.randint(0, 8, (2, 6))
    graph, _ = _capture(_Captured(), ids, target)
    called = {n.target for n in graph.graph.nodes if n.op == "call_function"}
    methods = {getattr(torch.Tensor, n.target) for n in graph.graph.nodes if n.op == "call_method"}
    scalable = {
        F.embedding, F.layer_norm, torch.rms_norm, F.linear, operator.add, torch.add, F.silu,
        F.gelu, F.dropout, torch.conv1d, operator.matmul, F.softmax, torch.softmax,
        torch.matmul, F.scaled_dot_product_attention, F.cross_entropy, F.mse_loss,
        torch.Tensor.add, torch.Tensor.matmul,
    }  # fmt: skip
    assert scalable <= called | methods  # the model really produces these targets
    assert scalable <= set(U.torch_map)
    assert set(U.torch_map.values()) <= {
        getattr(U, name) for name in U.__all__ if name != "torch_map"
    } | {_torch_map._torch_softmax, _torch_map._addmm}


def test_torch_map_replacements_accept_the_graphs_arguments() -> None:
    """Swap every mapped target in a captured graph: the graph still runs, unit-scaled."""
    ids, target = torch.randint(0, 10, (2, 6)), torch.randint(0, 8, (2, 6))
    graph, inputs = _capture(_Captured(), ids, target)
    replaced = 0
    for node in graph.graph.nodes:
        method = getattr(torch.Tensor, node.target) if node.op == "call_method" else None
        if node.op == "call_function" and node.target in U.torch_map:
            node.target = U.torch_map[node.target]
            replaced += 1
        elif method in U.torch_map:  # the tensor is the first argument either way
            node.op, node.target = "call_function", U.torch_map[method]
            replaced += 1
    graph.recompile()
    assert replaced >= 18
    (loss,) = graph(*inputs)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_compiles_one_graph_for_every_length(causal: bool, masked: bool) -> None:
    # Under torch.compile with dynamic shapes the scales come from the symbolic lengths
    # (tensors of the key counts), not from a specialised int: one graph serves every
    # length, with the eager scales (outputs and every input gradient).
    from torch._dynamo.testing import CompileCounterWithBackend

    from unitscale.functional._attention import masked_scaled_dot_product_attention

    def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        if masked:
            return masked_scaled_dot_product_attention(q, k, v, mask, is_causal=causal)
        return U.scaled_dot_product_attention(q, k, v, is_causal=causal)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(attend, backend=counter, fullgraph=True, dynamic=True)
    torch.manual_seed(0)
    compiled_after_first = None
    for length in (8, 16, 12, 32, 8):
        q, k, v = (torch.randn(2, 4, length, 16, requires_grad=True) for _ in range(3))
        mask = torch.rand(length, length) > 0.3 if masked else None
        if mask is not None:
            mask |= torch.eye(length, dtype=torch.bool)  # every row sees a key
        grad = torch.randn(2, 4, length, 16)
        expected = attend(q, k, v, mask)
        expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
        out = compiled(q, k, v, mask)
        grads = torch.autograd.grad(out, (q, k, v), grad)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        for actual, wanted in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(actual, wanted, rtol=1e-5, atol=1e-5)
        if compiled_after_first is None:
            compiled_after_first = counter.frame_count
    assert counter.frame_count == compiled_after_first  # no length compiled again
    torch._dynamo.reset()


def test_attention_moment_table_op_passes_opcheck() -> None:
    from unitscale.functional._attention import _moment_lists

    like = torch.randn(3, 5, requires_grad=True)
    args = (like, 6, 0.75, torch.float32)
    torch.library.opcheck(torch.ops.unitscale.softmax_moment_table.default, args)
    v, g = _moment_lists(6, 0.75)
    expected = torch.tensor([v, g], dtype=torch.float32)
    assert torch.equal(torch.ops.unitscale.softmax_moment_table(*args), expected)


@pytest.mark.parametrize(
    ("constraint", "mult"), [("to_output_scale", 1.0), (None, 1.0), ("gmean", 0.5)]
)
def test_softmax_compiles_one_graph_for_every_length(constraint: str | None, mult: float) -> None:
    # Under torch.compile with dynamic shapes the softmax scales come from an op taking the
    # symbolic length (0-dim tensors), not from a specialised int: one graph serves every
    # length, with the eager scales (output and input gradient), for every kind of
    # constraint (shared, separate, a mean of the two).
    from torch._dynamo.testing import CompileCounterWithBackend

    def scaled(x: Tensor) -> Tensor:
        return U.softmax(x, dim=-1, constraint=constraint, mult=mult)

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(scaled, backend=counter, fullgraph=True, dynamic=True)
    torch.manual_seed(0)
    compiled_after_first = None
    for length in (8, 16, 12, 32, 8):
        x = torch.randn(4, 3, length, requires_grad=True)
        grad = torch.randn(4, 3, length)
        expected = scaled(x)
        (expected_grad,) = torch.autograd.grad(expected, x, grad)
        out = compiled(x)
        (actual_grad,) = torch.autograd.grad(out, x, grad)
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(actual_grad, expected_grad, rtol=1e-6, atol=1e-6)
        if compiled_after_first is None:
            compiled_after_first = counter.frame_count
    assert counter.frame_count == compiled_after_first  # no length compiled again
    torch._dynamo.reset()


def test_softmax_scales_op_passes_opcheck_and_gives_the_eager_scales() -> None:
    from unitscale.functional._moments import _softmax_scales

    like = torch.randn(3, 5, requires_grad=True)
    for length, mult in ((1, 1.0), (7, 1.0), (64, 0.5)):
        args = (like, length, mult, torch.float64)
        torch.library.opcheck(torch.ops.unitscale.softmax_scales.default, args)
        expected = torch.tensor(_softmax_scales(length, mult), dtype=torch.float64)
        assert torch.equal(torch.ops.unitscale.softmax_scales(*args), expected)
