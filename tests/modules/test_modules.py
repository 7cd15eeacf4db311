"""unitscale modules: initialisation, unit scale, argument errors, compilation, training.

The scaling maths is tested op by op in test_functional.py; here each module is checked as
a user sees it: N(0, 1) input, N(0, 1) incoming gradient, output and gradient std within
``TOL`` (±10%) or ``TIGHT`` (±5%) of the value its docstring states (1 unless stated).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

import unitscale as us
from unitscale.constraints import UnknownConstraintError
from unitscale.errors import UnsupportedArgumentError

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = 0.10
TIGHT = 0.05
# A unit-std GELU output keeps mean 0.2821/0.5879; the next linear layer sees its rms.
GELU_RMS = math.sqrt(1 + (0.28209479177 / 0.5879149692) ** 2)


def module_stats(
    module: nn.Module, make_input: Callable[[], Tensor], *extra: Tensor, trials: int = 1
) -> dict[str, float]:
    """Std of the output, the input's gradient and each parameter's gradient (pooled; NaN
    for a scalar, e.g. a reduced loss)."""
    pools: dict[str, list[Tensor]] = {}
    for _ in range(trials):
        module.zero_grad()
        x = make_input()
        if x.is_floating_point():
            x.requires_grad_()
        y = module(x, *extra)
        upstream = torch.randn_like(y) if y.dim() else torch.ones_like(y)
        y.backward(upstream)
        found = {"output": y.detach(), **({"input": x.grad} if x.is_floating_point() else {})}
        found |= {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
        for name, value in found.items():
            pools.setdefault(name, []).append(value.flatten())
    return {
        name: torch.cat(values).std().item() if values[0].numel() > 1 else math.nan
        for name, values in pools.items()
    }


def check(stats: dict[str, float], tol: float, **expected: float) -> None:
    for name, value in stats.items():
        want = expected.get(name.replace(".", "_"), 1.0)
        if math.isnan(want):
            continue
        assert abs(value / want - 1) <= tol, (
            f"{name}: std {value:.4f}, expected {want:.4f}±{tol:.0%}"
        )


# --------------------------------------------------------------------------------------------
# initialisation and torch.nn compatibility
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (lambda: us.Linear(64, 128), lambda: nn.Linear(64, 128)),
        (lambda: us.LinearReadout(64, 128), lambda: nn.Linear(64, 128)),
        (lambda: us.Conv1d(16, 32, 3), lambda: nn.Conv1d(16, 32, 3)),
        (lambda: us.LayerNorm(64), lambda: nn.LayerNorm(64)),
        (lambda: us.RMSNorm(64), lambda: nn.RMSNorm(64)),
        (
            lambda: us.Embedding(100, 64, padding_idx=0),
            lambda: nn.Embedding(100, 64, padding_idx=0),
        ),
    ],
)
def test_same_parameters_as_torch_with_unit_init(
    ours: Callable[[], nn.Module], theirs: Callable[[], nn.Module]
) -> None:
    module, twin = ours(), theirs()
    assert isinstance(module, type(twin))
    assert {k: v.shape for k, v in module.state_dict().items()} == {
        k: v.shape for k, v in twin.state_dict().items()
    }
    for name, param in module.named_parameters():
        if name == "bias":
            assert torch.equal(param, torch.zeros_like(param))
        elif isinstance(module, nn.LayerNorm | nn.RMSNorm):
            assert torch.equal(param, torch.ones_like(param))
        else:
            weights = param[1:] if isinstance(module, nn.Embedding) else param
            assert weights.std().item() == pytest.approx(1.0, rel=TIGHT)
    if isinstance(module, nn.Embedding):
        assert torch.equal(module.weight[0], torch.zeros(64))


def test_blocks_initialise_every_weight_to_unit_variance() -> None:
    model = us.TransformerDecoder(64, depth=2, heads=4, vocab_size=256, bias=True)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            assert torch.equal(param, torch.zeros_like(param)), name
        elif "norm" in name:
            assert torch.equal(param, torch.ones_like(param)), name
        else:
            assert param.std().item() == pytest.approx(1.0, rel=TIGHT), name


def test_repr_shows_the_constraint() -> None:
    assert "constraint='gmean'" in repr(us.Linear(2, 3, constraint="gmean"))
    assert "constraint=None" in repr(us.GELU(constraint=None))
    assert "constraint='to_grad_input_scale'" in repr(us.LinearReadout(2, 3))


# --------------------------------------------------------------------------------------------
# unit scale, three shapes each
# --------------------------------------------------------------------------------------------

SHAPES = ["small", "wide", "deep"]


def _case(name: str, shape: str) -> tuple[nn.Module, Callable[[], Tensor], tuple[Tensor, ...], int]:
    """(module, input factory, extra forward arguments, trials) for a module and a shape."""
    fan = {"small": (16, 512, 256), "wide": (512, 16, 256), "deep": (128, 128, 512)}[shape]
    fan_in, fan_out, batch = fan
    if name in ("Linear", "LinearReadout"):
        plain = {"mup": False} if name == "LinearReadout" else {}  # u-muP's: test_decoder_scales
        module = getattr(us, name)(fan_in, fan_out, constraint=None, **plain)
        trials = 32 if fan_out < 64 else 8  # enough bias-gradient samples
        return module, lambda: torch.randn(batch, fan_in), (), trials
    if name == "Conv1d":
        c_in, c_out, kernel, stride = {
            "small": (4, 64, 3, 1),
            "wide": (64, 8, 5, 2),
            "deep": (32, 32, 4, 4),
        }[shape]
        module = us.Conv1d(c_in, c_out, kernel, stride, padding=1, constraint=None)
        return module, lambda: torch.randn(8, c_in, 256), (), 4
    width = {"small": 32, "wide": 2048, "deep": 256}[shape]
    rows = 65536 // width
    if name in ("LayerNorm", "RMSNorm"):
        return getattr(us, name)(width), lambda: torch.randn(rows, width), (), 4
    if name == "Embedding":
        vocab, dim, tokens = {
            "small": (50, 16, 4096),
            "wide": (1000, 64, 4096),
            "deep": (64, 256, 256),
        }[shape]
        return us.Embedding(vocab, dim), lambda: torch.randint(0, vocab, (tokens,)), (), 2
    if name == "Dropout":
        p = {"small": 0.1, "wide": 0.5, "deep": 0.8}[shape]
        return us.Dropout(p), lambda: torch.randn(rows, width), (), 1
    if name in ("GELU", "SiLU"):
        return getattr(us, name)(constraint=None), lambda: torch.randn(rows, width), (), 1
    if name == "Softmax":
        return us.Softmax(-1, constraint=None), lambda: torch.randn(rows, width), (), 1
    if name == "CrossEntropyLoss":
        classes = {"small": 4, "wide": 5000, "deep": 100}[shape]
        target = torch.randint(0, classes, (256,))
        return us.CrossEntropyLoss(), lambda: torch.randn(256, classes), (target,), 1
    # head_dim >= 16: see MHSA's docstring for smaller heads
    hidden, heads, seq = {"small": (32, 2, 16), "wide": (256, 4, 32), "deep": (128, 4, 128)}[shape]
    make = lambda: torch.randn(4, seq, hidden)  # noqa: E731
    if name == "MLP":
        return us.MLP(hidden, constraint=None), make, (), 4
    # torch's 1/sqrt(d_head) logits (mup=False): the attention rule's Gaussian-score
    # approximations are checked at logit std 1; u-muP's 1/d_head: test_decoder_scales.
    if name == "MHSA":
        return us.MHSA(hidden, heads, constraint=None, mup=False), make, (), 4
    assert name in ("TransformerLayer", "TransformerLayer-gpt")
    block = "gpt" if name.endswith("-gpt") else "llama"  # "llama": the default block
    return (
        us.TransformerLayer(
            hidden, heads, attn_tau=0.3, mlp_tau=0.3, constraint=None, mup=False, block=block
        ),
        make,
        (),
        4,
    )


# Documented departures from 1 (see the modules' docstrings); NaN: not checked.
EXPECTED: dict[str, dict[str, float]] = {
    "CrossEntropyLoss": {"output": math.nan},  # the loss value is not scaled
    "MLP": {"output": GELU_RMS, "down_weight": GELU_RMS},
    # The default (Llama-style) layer: RMSNorm without parameters, a SwiGLU MLP whose
    # gated output has mean ~0, so every scale is 1.
    # The GPT-style layer: branch output GELU_RMS with share tau = 0.3 of the variance.
    # Attention mixes rows, so the row sums behind the norms' weight and bias gradients do
    # not cancel as their rule assumes (see layer_norm's docstring): not checked here.
    "TransformerLayer-gpt": {
        "output": math.sqrt(0.3 * GELU_RMS**2 + 0.7),
        "mlp_down_weight": GELU_RMS,
        **{f"{norm}_norm_{p}": math.nan for norm in ("attn", "mlp") for p in ("weight", "bias")},
    },
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "name",
    [
        "Linear", "LinearReadout", "Conv1d", "LayerNorm", "RMSNorm", "Embedding", "Dropout",
        "GELU", "SiLU", "Softmax", "CrossEntropyLoss", "MLP", "MHSA", "TransformerLayer",
        "TransformerLayer-gpt",
    ],
)  # fmt: skip
def test_module_unit_scale(name: str, shape: str) -> None:
    module, make, extra, trials = _case(name, shape)
    stats = module_stats(module, make, *extra, trials=trials)
    assert "input" in stats or name == "Embedding"
    check(stats, TOL, **EXPECTED.get(name, {}))


@pytest.mark.parametrize("mup", [True, False])
@pytest.mark.parametrize(("hidden", "vocab", "seq"), [(32, 64, 16), (64, 1024, 32), (128, 256, 64)])
def test_decoder_scales(hidden: int, vocab: int, seq: int, mup: bool) -> None:
    model = us.TransformerDecoder(
        hidden, depth=2, heads=4, vocab_size=vocab, constraint=None, mup=mup
    )
    stats = module_stats(model, lambda: torch.randint(0, vocab, (8, seq)), trials=2)
    # u-muP's readout: logits std 1/sqrt(hidden) (multiplier 1/fan_in on a unit product of
    # std sqrt(fan_in)). Plain unit scaling keeps the readout's default
    # (to_grad_input_scale): logits std sqrt(hidden / vocab). Either way the gradient
    # entering the network is unit.
    logits_std = 1 / math.sqrt(hidden) if mup else math.sqrt(hidden / vocab)
    assert stats.pop("output") == pytest.approx(logits_std, rel=TOL)
    assert stats.pop("readout.weight") == pytest.approx(1.0, rel=TOL)
    assert stats.pop("embedding.weight") == pytest.approx(1.0, rel=0.2)  # through the stack
    weights = {k: v for k, v in stats.items() if "norm" not in k}
    # Through a deep stack, single-scale causal attention makes position-dependent scales
    # (early rows larger) that correlate activations and gradients: the weight gradients
    # are unit on the whole (median within 10%) and each within a factor 1.5 of 1 (1.75
    # with u-muP's 1/d_head logits, whose near-uniform attention at initialisation
    # correlates the tokens more: 1.56 measured for hidden 128, seq 64; the same
    # correlation puts the default Llama-style block's median at 0.89 there, 0.94 with the
    # GPT-style block, so the median is held within 15% with u-muP).
    median_tol = 0.15 if mup else TOL
    assert sorted(weights.values())[len(weights) // 2] == pytest.approx(1.0, rel=median_tol)
    bound = 1.75 if mup else 1.5
    for name, value in weights.items():
        assert 1 / bound < value < bound, (name, value)


# --------------------------------------------------------------------------------------------
# argument errors at construction
# --------------------------------------------------------------------------------------------

UNSUPPORTED = UnsupportedArgumentError
BAD_MODULES: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("conv", lambda: us.Conv1d(2, 2, 3, padding_mode="reflect"), UNSUPPORTED, "'padding_mode'"),
    ("embedding max_norm", lambda: us.Embedding(4, 2, max_norm=1.0), UNSUPPORTED, "'max_norm'"),
    ("embedding sparse", lambda: us.Embedding(4, 2, sparse=True), UNSUPPORTED, "'sparse'"),
    ("dropout inplace", lambda: us.Dropout(inplace=True), UNSUPPORTED, "'inplace'"),
    ("silu inplace", lambda: us.SiLU(inplace=True), UNSUPPORTED, "'inplace'"),
    ("softmax dim", lambda: us.Softmax(), UNSUPPORTED, "'dim'=None"),
    ("ce weight", lambda: us.CrossEntropyLoss(weight=torch.ones(3)), UNSUPPORTED, "'weight'"),
    ("mhsa heads", lambda: us.MHSA(64, 5), UNSUPPORTED, "'heads'=5.*hidden_size=64"),
    ("mhsa rope odd head", lambda: us.MHSA(12, 4, rope=True), UNSUPPORTED, "'rope'.*=3 must"),
    ("decoder rope odd head", lambda: us.TransformerDecoder(12, 1, 4, 10), UNSUPPORTED, "'rope'"),
    ("layer tau", lambda: us.TransformerLayer(64, 4, mlp_tau=0.0), UNSUPPORTED, "'mlp_tau'=0.0"),
    (
        "layer share",
        lambda: us.TransformerLayer(64, 4, mlp_share=1.0),
        UNSUPPORTED,
        "'mlp_share'=1.0",
    ),
    (
        "decoder tau",
        lambda: us.TransformerDecoder(64, 1, 4, 10, attn_tau=0.0),
        UNSUPPORTED,
        "'attn",
    ),
    ("constraint", lambda: us.Linear(2, 2, constraint="gmeen"), UnknownConstraintError, "'gmeen'"),
    (
        "arity",
        lambda: us.MHSA(8, 2, constraint="to_grad_input_scale"),
        UnknownConstraintError,
        "3 in",
    ),
]


@pytest.mark.parametrize(
    ("what", "build", "error", "match"), BAD_MODULES, ids=[b[0] for b in BAD_MODULES]
)
def test_bad_arguments_fail_at_construction(
    what: str, build: Callable[[], object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        build()


# --------------------------------------------------------------------------------------------
# torch.compile: one graph, same numbers
# --------------------------------------------------------------------------------------------


def _compile_case(name: str) -> tuple[nn.Module, tuple[Tensor, ...]]:
    x = torch.randn(2, 8, 16)
    ids = torch.randint(0, 32, (2, 8))
    cases: dict[str, Callable[[], tuple[nn.Module, tuple[Tensor, ...]]]] = {
        "Linear": lambda: (us.Linear(16, 24), (x,)),
        "LinearReadout": lambda: (us.LinearReadout(16, 24), (x,)),
        "Conv1d": lambda: (us.Conv1d(8, 12, 3, padding="same"), (x,)),
        "LayerNorm": lambda: (us.LayerNorm(16), (x,)),
        "RMSNorm": lambda: (us.RMSNorm(16), (x,)),
        "Embedding": lambda: (us.Embedding(32, 16), (ids,)),
        "Dropout": lambda: (us.Dropout(0.25).eval(), (x,)),
        "GELU": lambda: (us.GELU(approximate="tanh"), (x,)),
        "SiLU": lambda: (us.SiLU(), (x,)),
        "Softmax": lambda: (us.Softmax(-1), (x,)),
        "CrossEntropyLoss": lambda: (us.CrossEntropyLoss(), (x[0], ids[0] % 16)),
        "MLP": lambda: (us.MLP(16), (x,)),
        "MHSA": lambda: (us.MHSA(16, 4), (x,)),
        "TransformerLayer": lambda: (us.TransformerLayer(16, 4), (x,)),
        "TransformerDecoder": lambda: (us.TransformerDecoder(16, 2, 4, 32), (ids, ids.roll(-1, 1))),
        "DepthSequential": lambda: (us.DepthSequential(us.Linear(16, 16), us.GELU()), (x,)),
    }
    return cases[name]()


@pytest.mark.parametrize(
    "name",
    [n for n in us.modules.__all__ if n != "DepthModuleList"],  # a list: no forward
)
def test_module_compiles_to_one_graph_and_matches_eager(name: str) -> None:
    module, args = _compile_case(name)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=counter, fullgraph=True)
    floats = [a for a in args if a.is_floating_point()]
    for a in floats:
        a.requires_grad_()
    eager_out = module(*args)
    eager_grads = torch.autograd.grad(eager_out.sum(), [*floats, *module.parameters()])
    compiled_out = compiled(*args)
    compiled_grads = torch.autograd.grad(compiled_out.sum(), [*floats, *module.parameters()])
    assert counter.frame_count == 1
    assert torch.allclose(compiled_out, eager_out, atol=1e-5, rtol=1e-5)
    for c, e in zip(compiled_grads, eager_grads, strict=True):
        assert torch.allclose(c, e, atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()


def test_mhsa_compiles_with_inductor() -> None:
    layer = us.MHSA(32, 4)
    x = torch.randn(2, 16, 32, requires_grad=True)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    y = compiled(x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    (eager_grad,) = torch.autograd.grad(layer(x).sum(), x)
    assert counter.frame_count == 1
    assert torch.allclose(y, layer(x), atol=1e-4, rtol=1e-4)
    assert torch.allclose(grad, eager_grad, atol=1e-4, rtol=1e-3)
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------
# TransformerDecoder as a model
# --------------------------------------------------------------------------------------------


def test_decoder_loss_follows_the_labels_convention() -> None:
    model = us.TransformerDecoder(32, depth=1, heads=4, vocab_size=50)
    tokens = torch.randint(0, 50, (3, 13))
    input_ids, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :4] = -100
    logits = model(input_ids)
    loss = model(input_ids, labels)
    assert logits.shape == (3, 12, 50)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_decoder_dropout_only_in_training() -> None:
    model = us.TransformerDecoder(32, depth=1, heads=4, vocab_size=50, dropout_p=0.5)
    ids = torch.randint(0, 50, (2, 8))
    model.eval()
    assert torch.equal(model(ids), model(ids))
    model.train()
    assert not torch.equal(model(ids), model(ids))


def test_decoder_running_mean_tau_schedule() -> None:
    model = us.TransformerDecoder(32, depth=3, heads=4, vocab_size=10, mup=False)
    shares = [t for layer in model.layers for t in (layer.attn_share, layer.mlp_share)]
    assert shares == pytest.approx([1 / (k + 1) for k in range(1, 7)])
    fixed = us.TransformerDecoder(
        32, depth=2, heads=4, vocab_size=10, attn_tau=0.75, mlp_share=0.4, mup=False
    )
    assert [(layer.attn_tau, layer.mlp_share) for layer in fixed.layers] == [(0.75, 0.4)] * 2
    assert fixed.layers[0].attn_share == pytest.approx(0.36)  # 0.75² / (1 + 0.75²)


@pytest.mark.parametrize("optimiser", ["adam", "sgd"])
def test_decoder_trains(optimiser: str) -> None:
    model = us.TransformerDecoder(32, depth=2, heads=4, vocab_size=64)
    tokens = torch.randint(0, 64, (8, 33))
    input_ids, labels = tokens[:, :-1], tokens[:, 1:]
    opt: torch.optim.Optimizer = (
        torch.optim.Adam(model.parameters(), lr=0.02)
        if optimiser == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.05)
    )
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = model(input_ids, labels)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(math.log(64), rel=0.1)  # near-uniform at init
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize(
    ("mup", "attn_mult", "rope"),
    [(True, 1.0, False), (True, 3.0, False), (False, 2.0, False), (True, 1.0, True)],
)
def test_mhsa_logit_scale(mup: bool, attn_mult: float, rope: bool) -> None:
    # u-muP (default): softmax(attn_mult * q.k / d_head), muP's 1/d_head; mup=False: torch's
    # 1/sqrt(d_head). The unit-scaled attention multiplies the result by one constant.
    # rope=True: the same on queries and keys rotated by their position (RoPE).
    torch.manual_seed(0)
    hidden, heads, seq = 64, 4, 16
    head_dim = hidden // heads
    mhsa = us.MHSA(hidden, heads, attn_mult=attn_mult, mup=mup, rope=rope)
    seen: dict[str, Tensor] = {}
    mhsa.qkv.register_forward_hook(lambda _m, _i, out: seen.__setitem__("qkv", out))
    mhsa.out.register_forward_pre_hook(lambda _m, args: seen.__setitem__("attended", args[0]))
    with torch.no_grad():
        mhsa(torch.randn(2, seq, hidden))
    q, k, v = seen["qkv"].unflatten(-1, (3, heads, head_dim)).movedim(-3, 0).transpose(-2, -3)
    if rope:  # Llama's half-split rotation, written out: position t, pair i, angle t/1e4^(i/h)
        half = head_dim // 2
        angle = torch.arange(seq)[:, None] / 10000.0 ** (torch.arange(half) / half)
        cos, sin = angle.cos(), angle.sin()

        def rotate(x: Tensor) -> Tensor:
            first, second = x[..., :half], x[..., half:]
            return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

        q, k = rotate(q), rotate(k)
    scale = attn_mult / head_dim if mup else attn_mult / math.sqrt(head_dim)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(
        ~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf")
    )
    reference = (scores.softmax(-1) @ v).transpose(-2, -3).flatten(-2)
    attended = seen["attended"]
    constant = (attended * reference).sum() / reference.pow(2).sum()
    torch.testing.assert_close(attended, constant * reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rope", [True, False])
def test_decoder_positions_come_from_rope(rope: bool) -> None:
    # The default decoder knows positions through RoPE: swapping two earlier tokens changes
    # the last position's logits. Without it (rope=False, a NoPE decoder) causal attention
    # sees the prefix as a set: with one layer, whose keys and values come from the tokens
    # alone, the last logits do not change.
    torch.manual_seed(0)
    model = us.TransformerDecoder(32, depth=1, heads=4, vocab_size=50, rope=rope).eval()
    ids = torch.arange(12).unsqueeze(0) * 3  # distinct tokens
    swapped = ids.clone()
    swapped[0, [2, 5]] = ids[0, [5, 2]]
    with torch.no_grad():
        last, last_swapped = model(ids)[0, -1], model(swapped)[0, -1]
    moved = (last - last_swapped).abs().max().item()
    if rope:
        assert moved > 1e-3 * last.abs().max().item()
    else:
        torch.testing.assert_close(last, last_swapped, rtol=1e-5, atol=1e-6)


# PyTorch's own notice that its CPU attention kernel has no batching rule (it loops).
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_per_sample_gradients_with_torch_func_match_a_loop() -> None:
    """``vmap(grad(...))`` over a u-muP decoder (``functional_call``): every scaling and
    rounding op supports torch.func, and each example's gradients are those of its own
    backward pass."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = us.TransformerDecoder(32, depth=2, heads=4, vocab_size=50)
    params = {name: p.detach() for name, p in model.named_parameters()}
    ids = torch.randint(0, 50, (3, 9))

    def loss(p: dict[str, torch.Tensor], seq: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (seq[None, :-1], seq[None, 1:]))

    per_sample = vmap(grad(loss), in_dims=(None, 0), randomness="different")(params, ids)
    for i in range(3):
        model.zero_grad()
        model(ids[i : i + 1, :-1], ids[i : i + 1, 1:]).backward()
        for name, p in model.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(per_sample[name][i], p.grad, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------------------------
# the Llama-style block of the u-muP paper's experiments (block="llama")
# --------------------------------------------------------------------------------------------


def test_default_block_is_llama_rmsnorm_swiglu_without_biases_or_norm_parameters() -> None:
    model = us.TransformerDecoder(48, depth=2, heads=4, vocab_size=64)  # block="llama"
    assert isinstance(us.TransformerLayer(48, 4).mlp_norm, us.RMSNorm)  # the layer's too
    assert not isinstance(model.final_norm, us.LayerNorm)
    assert model.state_dict().keys() == dict(model.named_parameters()).keys()  # no norm buffers
    layer = model.layers[0]
    assert isinstance(layer.attn_norm, us.RMSNorm) and isinstance(model.final_norm, us.RMSNorm)
    assert layer.mlp.gated
    inner = 2 * 4 * 48 // 3  # Llama's rule: 2/3 of the GELU MLP's 4 x width
    assert layer.mlp.up.weight.shape == (2 * inner, 48)
    assert layer.mlp.down.weight.shape == (48, inner)
    assert layer.attn.rope
    assert sorted({p.mup_type for p in model.parameters()}) == ["output", "weight"]  # type: ignore[attr-defined]
    trainable = us.TransformerDecoder(48, 2, 4, 64, block="llama", trainable_norms=True)
    assert trainable.final_norm.weight.mup_type == "norm"  # type: ignore[union-attr]
    gpt = us.TransformerDecoder(48, 2, 4, 64, block="gpt")  # the GPT-style block stays
    assert isinstance(gpt.final_norm, us.LayerNorm) and not gpt.layers[0].mlp.gated
    with pytest.raises(UnsupportedArgumentError, match="'block'"):
        us.TransformerDecoder(48, 2, 4, 64, block="bert")


@pytest.mark.parametrize("mup", [True, False])
def test_llama_decoder_scales(mup: bool) -> None:
    hidden, vocab, seq = 64, 256, 32
    model = us.TransformerDecoder(
        hidden, depth=2, heads=4, vocab_size=vocab, constraint=None, mup=mup, block="llama"
    )
    stats = module_stats(model, lambda: torch.randint(0, vocab, (8, seq)), trials=2)
    logits_std = 1 / math.sqrt(hidden) if mup else math.sqrt(hidden / vocab)
    assert stats.pop("output") == pytest.approx(logits_std, rel=TOL)
    assert stats.pop("readout.weight") == pytest.approx(1.0, rel=TOL)
    assert stats.pop("embedding.weight") == pytest.approx(1.0, rel=0.2)
    weights = {k: v for k, v in stats.items() if "norm" not in k}
    assert sorted(weights.values())[len(weights) // 2] == pytest.approx(1.0, rel=TOL)
    for name, value in weights.items():
        assert 1 / 1.75 < value < 1.75, (name, value)


def test_llama_decoder_compiles_to_one_graph() -> None:
    model = us.TransformerDecoder(16, 2, 4, 32, block="llama")
    ids = torch.randint(0, 32, (2, 8))
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    eager = model(ids, ids.roll(-1, 1))
    torch.testing.assert_close(compiled(ids, ids.roll(-1, 1)), eager, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1
    torch._dynamo.reset()
