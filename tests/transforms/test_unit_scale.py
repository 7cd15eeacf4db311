"""unit_scale: op replacement, residual adds, unconstrained head, init, logging, scales."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import unitscale as us
import unitscale.functional as U
from unitscale import transforms
from unitscale.errors import CaptureError, UnsupportedArgumentError
from unitscale.functional import masked_scaled_dot_product_attention
from unitscale.models import GPTConfig, plain_gpt
from unitscale.transforms import (
    ResidualTau,
    UnknownOpError,
    simulate_fp8,
    track_scales,
    unit_scale,
)


class Block(nn.Module):
    """Pre-norm transformer block written the ordinary way."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def attend(self, x: Tensor) -> Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(b, s, w))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attend(self.attn_norm(x))
        x = x + self.down(F.gelu(self.up(self.mlp_norm(x))))
        return x


class Net(nn.Module):
    """Embeddings, two blocks, final norm, head and loss."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(16, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def unit_scaled_by_hand(net: Net, ids: Tensor, labels: Tensor, taus: list[float]) -> Tensor:
    """Net's forward written with unitscale.functional: what unit_scale must produce."""
    x = U.add(U.embedding(ids, net.emb.weight), U.embedding(torch.arange(16), net.pos.weight))
    tau = iter(taus)
    for block in net.blocks:
        assert isinstance(block, Block)
        t = next(tau)
        residual, skip = U.residual_split(x, share=t)
        h = U.layer_norm(residual, (32,), block.attn_norm.weight, block.attn_norm.bias)
        b, s, w = h.shape
        qkv = U.linear(h, block.qkv.weight, block.qkv.bias)
        q, k, v = qkv.view(b, s, 3, block.heads, -1).permute(2, 0, 3, 1, 4)
        a = U.scaled_dot_product_attention(q, k, v, is_causal=True)
        a = U.linear(a.transpose(1, 2).reshape(b, s, w), block.out.weight, block.out.bias)
        x = U.residual_add(a, skip, share=t)
        t = next(tau)
        residual, skip = U.residual_split(x, share=t)
        h = U.layer_norm(residual, (32,), block.mlp_norm.weight, block.mlp_norm.bias)
        h = U.linear(U.gelu(U.linear(h, block.up.weight, block.up.bias)), *_wb(block.down))
        x = U.residual_add(h, skip, share=t)
    # After the last residual add: unconstrained.
    x = U.layer_norm(x, (32,), net.norm.weight, net.norm.bias)
    logits = U.linear(x, net.head.weight, None, constraint=None)
    return U.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _wb(linear: nn.Linear) -> tuple[Tensor, Tensor]:
    return linear.weight, linear.bias


def residual_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [m for m in unitscale_messages(caplog) if "residual-add" in m]


def unitscale_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    """unitscale's own log lines: pytest >= 9 also captures torch's non-propagating loggers."""
    return [r.getMessage() for r in caplog.records if r.name == "unitscale"]


@pytest.fixture
def ids() -> Tensor:
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))


def test_log_lines_name_every_replacement_and_residual_add(
    caplog: pytest.LogCaptureFixture, ids: Tensor
) -> None:
    model = unit_scale(Net())
    with caplog.at_level(logging.INFO, logger="unitscale"):
        model(ids, ids)
    lines = unitscale_messages(caplog)
    block = [
        "layer_norm", "linear", "a", "linear_1",
        "x_1 (residual-add, tau=0.7071, share=0.3333)",
        "layer_norm_1", "linear_2", "gelu", "linear_3",
        "x_2 (residual-add, tau=0.5774, share=0.25)",
        "layer_norm_2", "linear_4", "a_1", "linear_5",
        "x_3 (residual-add, tau=0.5, share=0.2)",
        "layer_norm_3", "linear_6", "gelu_1", "linear_7",
        "x_4 (residual-add, tau=0.4472, share=0.1667)",
    ]  # fmt: skip
    expected = ["embedding", "embedding_1", "x", *block, "layer_norm_4", "logits", "cross_entropy"]
    assert lines == [f"unit scaling function: {name}" for name in expected]
    # Captured once: a second call logs nothing.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="unitscale"):
        model(ids, ids)
    assert not unitscale_messages(caplog)


def test_result_equals_the_model_written_with_unit_scaled_ops(ids: Tensor) -> None:
    # u-muP's residual rule at 2 layers (4 branches, beta^2 = 1/2 each): 1/3, 1/4, 1/5, 1/6
    model = unit_scale(Net(), trainable_norms=True)
    loss = model(ids, ids)
    loss.backward()
    by_hand = Net()
    by_hand.load_state_dict(model.state_dict())
    expected = unit_scaled_by_hand(by_hand, ids, ids, [1 / 3, 1 / 4, 1 / 5, 1 / 6])
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for (name, param), (_, reference) in zip(
        model.module.named_parameters(), by_hand.named_parameters(), strict=True
    ):
        assert param.grad is not None and reference.grad is not None
        torch.testing.assert_close(param.grad, reference.grad, rtol=1e-5, atol=1e-5, msg=name)


def test_residual_tau_per_kind_of_branch(caplog: pytest.LogCaptureFixture, ids: Tensor) -> None:
    model = unit_scale(Net(), residual_tau=ResidualTau(attention=0.2, mlp=0.6))
    with caplog.at_level(logging.INFO, logger="unitscale"):
        model(ids, ids)
    assert residual_lines(caplog) == [
        f"unit scaling function: x_{i} (residual-add, tau={tau}, share={share})"
        for i, tau, share in [(1, 0.5, 0.2), (2, 1.225, 0.6), (3, 0.5, 0.2), (4, 1.225, 0.6)]
    ]
    with pytest.raises(Exception, match=r"ResidualTau\(mlp=1.5\) is outside \(0, 1\)"):
        ResidualTau(mlp=1.5)


class Variants(nn.Module):
    """Residual adds written in other ways, and additions that are not residual adds."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(8, 8)
        self.g = nn.Linear(8, 8)
        self.h = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        x = self.f(x).relu() + x  # skip on the right
        x += self.g(x)  # in place
        x = torch.add(x, self.h(x))  # torch.add
        y = x + 0.044715 * x**3  # x feeds the other operand, but no parameter: not residual
        z = y + y  # the same tensor twice: not residual
        return z + self.f(y)  # operands share y, but neither feeds the other: U.add


def test_residual_adds_are_found_by_dependency_not_by_syntax(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="unitscale"):
        unit_scale(Variants(), residual_tau=ResidualTau(rule="equal_shares"))(torch.randn(4, 8))
    assert unitscale_messages(caplog) == [
        "unit scaling function: linear",
        "unit scaling function: x (residual-add, tau=1, share=0.5)",
        "unit scaling function: linear_1",
        "unit scaling function: x_1 (residual-add, tau=0.7071, share=0.3333)",
        "unit scaling function: linear_2",
        "unit scaling function: x_2 (residual-add, tau=0.5774, share=0.25)",
        "unit scaling function: linear_3",
        "unit scaling function: add_4",  # z + f(y); y and z stay plain additions
    ]


class TwoStages(Net):
    """A graph break between the blocks: two captured graphs."""

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
        x = self.blocks[0](x)
        print("", end="")
        x = self.blocks[1](x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class BreakInLoop(Net):
    """A graph break inside the loop: Dynamo runs the rest of the forward eagerly."""

    def forward(self, ids: Tensor, labels: Tensor) -> Tensor:
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
            print("", end="")
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def test_graph_breaks_continue_the_depth_rule_or_warn(
    caplog: pytest.LogCaptureFixture, ids: Tensor
) -> None:
    with caplog.at_level(logging.INFO, logger="unitscale"):
        unit_scale(TwoStages())(ids, ids)
    taus = [line.split("share=")[1] for line in residual_lines(caplog)]
    assert taus == ["0.3333)", "0.25)", "0.2)", "0.1667)"]  # u-muP's rule over 4 branches
    model = unit_scale(BreakInLoop())
    with pytest.warns(
        UserWarning, match=r"unit_scale: 1 floating-point output\(s\) of BreakInLoop"
    ):
        model(ids, ids)


class BrokenLayer(nn.Module):
    """Two residual adds with a graph break between them (optional): Dynamo compiles the
    code before the break and the resume function after it once, then runs both for every
    layer (modules are inputs to its graphs, not constants)."""

    def __init__(self, width: int, graph_break: bool) -> None:
        super().__init__()
        self.graph_break = graph_break
        self.attn_norm, self.mix = nn.LayerNorm(width), nn.Linear(width, width)
        self.mlp_norm, self.up = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.mix(F.softmax(self.attn_norm(x), dim=-1))
        if self.graph_break:
            torch._dynamo.graph_break()
        return x + self.up(F.gelu(self.mlp_norm(x)))


def repeated_layers(graph_break: bool, layers: int = 4) -> nn.Module:
    return nn.Sequential(*(BrokenLayer(16, graph_break) for _ in range(layers)))


def taus_that_ran(model: nn.Module) -> list[float]:
    """The tau of every residual add the last call ran, in execution order."""
    capture = model.capture
    assert capture is not None
    return [
        tau
        for invocation in capture.last_trace
        for _, _, tau in invocation.piece.data["unit_scale"]["residual_adds"]
    ]


@pytest.mark.parametrize("then", ["eager", "compile"])
def test_a_graph_break_inside_repeated_layers_gives_each_layer_its_own_tau(then: str) -> None:
    # Each layer's residual adds must get the depth rule's tau for their place in the call,
    # exactly as without the break: same taus, same outputs and gradients.
    whole = unit_scale(repeated_layers(graph_break=False), trainable_norms=True)
    broken = unit_scale(repeated_layers(graph_break=True), trainable_norms=True)
    broken.load_state_dict(whole.state_dict())
    if then == "compile":
        whole, broken = transforms.compile(whole), transforms.compile(broken)
    x = torch.randn(8, 16)
    results = []
    for model in (whole, broken):
        for _ in range(2):  # the second call reuses the compiled pieces
            x_in = x.clone().requires_grad_()
            model(x_in).square().sum().backward()
            results.append((x_in.grad, *[p.grad.clone() for p in model.parameters()]))
            model.zero_grad()
    expected = [
        ResidualTau().share("attention" if k % 2 else "mlp", k, layers=8) for k in range(1, 9)
    ]
    assert len(set(expected)) == 8  # the rule differs per layer: the test can tell them apart
    assert taus_that_ran(whole) == pytest.approx(expected)
    assert taus_that_ran(broken) == pytest.approx(expected)
    torch.testing.assert_close(whole(x), broken(x), rtol=1e-5, atol=1e-6)
    for a, b in zip(results[1], results[3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_reused_graph_is_named_after_the_parameters_it_runs_with() -> None:
    # The layers' graphs carry each layer's parameter names, and the warning about ops
    # TorchDynamo ran eagerly (the head, after the loop it skipped) lists only those.
    model = unit_scale(
        nn.Sequential(*repeated_layers(graph_break=True, layers=3), nn.Linear(16, 4))
    )
    with pytest.warns(UserWarning, match=r"not transformed: the ops using 3\.weight, 3\.bias \("):
        model(torch.randn(8, 16))
    capture = model.capture
    assert capture is not None
    names = {name for p in capture.pieces for kind, name in p.placeholders if kind == "param"}
    assert names == {name for name, _ in model.named_parameters() if not name.startswith("3.")}


def test_ops_after_the_last_residual_add_are_unconstrained(ids: Tensor) -> None:
    model = track_scales(unit_scale(Net()))
    model(ids, ids).backward()
    nodes = {n.name: n for n in model.scales_graph().nodes}
    assert nodes["logits"].target is U.linear
    assert nodes["logits"].kwargs == {"constraint": None}
    for name in ("linear", "linear_7", "a", "gelu_1"):
        assert "constraint" not in nodes[name].kwargs, name
    assert nodes["x_4"].target is U.residual_add
    # Unconstrained: the head's input gradient is unit, not sqrt(vocab / width) = sqrt(2).
    grad = nodes["layer_norm_4"].meta["metrics"].bwd.rms
    assert 0.7 < grad < 1.3


def test_weights_are_reinitialised_in_the_copy_only() -> None:
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    model = unit_scale(net)
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key]), key
    state = model.state_dict()
    assert state.keys() == before.keys()
    for key, value in state.items():
        if key.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), key
        elif key.endswith("bias"):
            assert torch.equal(value, torch.zeros_like(value)), key
        else:  # Linear and Embedding weights: N(0, 1)
            assert abs(value.std().item() - 1) < 0.15 and abs(value.mean().item()) < 0.15, key
    padded = unit_scale(nn.Embedding(10, 4, padding_idx=3))
    assert torch.equal(padded.weight[3], torch.zeros(4))


def test_replace_overrides_and_extends_torch_map(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[tuple[int, ...]] = []

    def my_gelu(input: Tensor, approximate: str = "none") -> Tensor:
        calls.append(tuple(input.shape))
        return U.gelu(input, approximate)

    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 8)
    unit_scale(mlp, replace={F.gelu: my_gelu})(x)
    assert calls == [(4, 32)]
    with caplog.at_level(logging.INFO, logger="unitscale"):
        kept = unit_scale(mlp, replace={F.gelu: F.gelu})
        kept(x)
    assert unitscale_messages(caplog) == [
        "unit scaling function: input_1",
        "unit scaling function: input_3",
    ]


def hand_written_gelu(x: Tensor) -> Tensor:
    """GELU's tanh approximation written out: Dynamo would trace into it."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


class HandGelu(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return hand_written_gelu(x) * 1.0


def test_replace_maps_a_users_own_function_to_a_unit_scaled_op() -> None:
    """``replace={my_gelu: U.gelu}``: each call of the user's function is one op of the graph,
    replaced whole (values and gradients are U.gelu's, output std ~1, where the function
    left as it is gives ~0.6); other captures of the function still trace into it."""
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    grad = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))
    model = unit_scale(HandGelu(), replace={hand_written_gelu: U.gelu})
    out = model(x)
    expected = U.gelu(x) * 1.0
    torch.testing.assert_close(out, expected)
    assert out.std().item() == pytest.approx(1.0, rel=0.1)
    assert HandGelu()(x).std().item() < 0.7  # as written: not unit-scaled
    (got,) = torch.autograd.grad(out, x, grad)
    (want,) = torch.autograd.grad(expected, x, grad)
    torch.testing.assert_close(got, want)
    replaced = model.capture.pieces[0].data["unit_scale"]["replaced"]  # type: ignore[union-attr]
    assert len(replaced) == 1
    # Only while the unit-scaled model runs: a tracked plain copy still sees its ops.
    tracked = track_scales(HandGelu())
    tracked(x)
    targets = {n.target for n in tracked.scales_graph().nodes if n.op == "call_function"}
    assert hand_written_gelu not in targets and torch.tanh in targets


def test_replace_errors_name_the_op() -> None:
    mlp = nn.Sequential(nn.Linear(8, 8))
    with pytest.raises(UnknownOpError, match=r"replace key torch\.sin is not an op"):
        unit_scale(mlp, replace={torch.sin: torch.sin})
    with pytest.raises(
        UnknownOpError, match=r"replace\[torch\.nn\.functional\.gelu\]=3 is not callable"
    ):
        unit_scale(mlp, replace={F.gelu: 3})  # type: ignore[dict-item]
    with pytest.raises(UnknownOpError, match="replace must be a dict"):
        unit_scale(mlp, replace=[F.gelu])  # type: ignore[arg-type]


class BadShapes(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x @ x


class MaxNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=1.0)

    def forward(self, ids: Tensor) -> Tensor:
        return self.emb(ids)


def test_capture_and_unsupported_argument_errors_say_what_and_why() -> None:
    # The model's own error, as the model raises it without unitscale (not a CaptureError).
    with pytest.raises(RuntimeError, match=r"cannot be multiplied") as caught:
        unit_scale(BadShapes())(torch.randn(2, 3))
    assert not isinstance(caught.value, CaptureError)
    with pytest.raises(UnsupportedArgumentError, match=r"embedding: argument 'max_norm'=1\.0"):
        unit_scale(MaxNorm())(torch.arange(4))
    with pytest.raises(CaptureError, match=r"unit-scale first.*simulate_fp8\(unit_scale"):
        unit_scale(simulate_fp8(nn.Linear(2, 2)))
    with pytest.raises(CaptureError, match="already unit-scaled"):
        unit_scale(unit_scale(nn.Linear(2, 2)))
    with pytest.raises(CaptureError, match="apply track_scales last"):
        unit_scale(track_scales(nn.Linear(2, 2)))


@pytest.mark.parametrize("constraint", ["to_output_scale", None])
def test_masked_attention_scales_like_the_causal_op(constraint: str | None) -> None:
    q, k, v = torch.randn(3, 2, 4, 64, 16).unbind(0)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    grad = torch.randn(2, 4, 64, 16)
    results = []
    for mask, is_causal in ((causal, False), (None, True)):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = masked_scaled_dot_product_attention(
            inputs[0], inputs[1], inputs[2], mask, is_causal=is_causal, constraint=constraint
        )
        out.backward(grad)
        results.append([out, *(t.grad for t in inputs)])
    for masked, reference in zip(*results, strict=True):
        torch.testing.assert_close(masked, reference, rtol=1e-5, atol=1e-5)
    # A key-padding mask: every query sees the 40 unpadded keys, as attention over 40 keys.
    padding = torch.arange(64) < 40
    out = masked_scaled_dot_product_attention(q, k, v, attn_mask=padding[None, None, None])
    expected = U.scaled_dot_product_attention(q, k[..., :40, :], v[..., :40, :])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# Scale band of the unit-scaled GPT (measured at seeds 0-4 with these settings: forward rms
# 0.96-1.6, activation-gradient rms 0.43-2.2, parameter-gradient rms 0.47-5.7).
ACTIVATION_BAND = (1 / 4, 4.0)
# Weight and bias gradients sum over batch * seq tokens and are scaled by 1/sqrt(tokens),
# which is exact only for independent per-token gradients; the norms' biases collect the
# correlated part, so parameter gradients get a wider band.
PARAMETER_GRAD_BAND = (1 / 8, 8.0)


def gpt_scales(model: nn.Module, ids: Tensor) -> tuple[list[tuple[float, str]], ...]:
    tracked = track_scales(model)
    tracked(ids, labels=ids.roll(-1, dims=1)).backward()
    fwd: list[tuple[float, str]] = []
    bwd: list[tuple[float, str]] = []
    param_bwd: list[tuple[float, str]] = []
    for node in tracked.scales_graph().nodes:
        metrics = node.meta.get("metrics")
        # Documented exceptions: non-float tensors (ids, masks) carry no metrics; the
        # scalar loss is not scaled; zero-initialised biases are exactly 0 forward.
        if metrics is None or node.target is U.cross_entropy or node.target is F.cross_entropy:
            continue
        if metrics.fwd is not None and metrics.fwd.abs_max > 0:
            fwd.append((metrics.fwd.rms, node.name))
        if metrics.bwd is not None:
            target = param_bwd if node.meta["requires_grad"] else bwd
            target.append((metrics.bwd.rms, node.name))
    return fwd, bwd, param_bwd


@pytest.mark.slow
def test_unit_scaled_gpt_has_scales_near_one_where_the_plain_one_does_not() -> None:
    plain = plain_gpt(GPTConfig(hidden_size=64, depth=2, seq_len=64, aligned_labels=True), seed=0)
    ids = torch.randint(0, 256, (4, 64))
    fwd, bwd, param_bwd = gpt_scales(unit_scale(plain, trainable_norms=True), ids)
    assert len(fwd) > 50 and len(bwd) > 40 and len(param_bwd) == len(list(plain.parameters()))
    low, high = ACTIVATION_BAND
    for rms, name in fwd + bwd:
        assert low <= rms <= high, (name, rms)
    low, high = PARAMETER_GRAD_BAND
    for rms, name in param_bwd:
        assert low <= rms <= high, (name, rms)

    fwd, bwd, param_bwd = gpt_scales(plain, ids)
    assert min(fwd)[0] < 1 / 16  # e.g. attention output, about 0.004
    assert max(bwd + param_bwd)[0] < 1 / 16  # every gradient is small


def test_gpt_with_an_attention_mask_is_unit_scaled_too() -> None:
    plain = plain_gpt(GPTConfig(hidden_size=32, depth=1, seq_len=32), seed=0)
    ids = torch.randint(0, 256, (2, 32))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, 24:] = 0  # padding
    model = track_scales(unit_scale(plain))
    model(ids, attention_mask=mask).square().mean().backward()
    nodes = {n.name: n for n in model.scales_graph().nodes}
    attention = [n for n in nodes.values() if n.target is masked_scaled_dot_product_attention]
    assert len(attention) == 1
    assert 0.5 < attention[0].meta["metrics"].fwd.rms < 2.0
    assert math.isfinite(attention[0].meta["metrics"].bwd.rms)


@pytest.mark.slow
def test_unit_scale_hf_gpt2_forward_scales_near_one() -> None:
    """HF GPT-2's Conv1D layers (addmm) are unit-scaled and re-initialised too."""
    transformers = pytest.importorskip("transformers")
    from unitscale.transforms import track_scales, unit_scale

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (4, 32))

    def forward_rms(module: torch.nn.Module) -> list[float]:
        tracked = track_scales(module)
        tracked(input_ids=ids, labels=ids).loss.backward()
        return [
            n.meta["metrics"].fwd.rms
            for n in tracked.scales_graph().nodes
            if n.op == "call_function" and n.meta.get("metrics") and n.meta["metrics"].fwd.numel > 1
        ]

    plain, scaled = forward_rms(model), forward_rms(unit_scale(model))
    assert min(plain) < 1 / 64  # the plain model has activations far below unit scale
    # the smallest: the logits of u-muP's readout, std 1/sqrt(n_embd) = 1/8 by design
    assert 1 / 10 <= min(scaled) and max(scaled) <= 8


# --------------------------------------------------------------------------------------------
# u-muP: the readout, tied embeddings, fan-in of (in, out) weights
# --------------------------------------------------------------------------------------------


class TiedLM(nn.Module):
    """A tiny language model with the transformers convention: ``get_output_embeddings`` and
    a head weight tied to the input embedding."""

    def __init__(self, width: int = 256, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width, elementwise_affine=False)
        self.up = nn.Linear(width, width, bias=False)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.up(self.norm(x))
        return self.head(self.norm(x))


def test_unit_scale_makes_the_head_a_mup_readout_and_unties_it() -> None:
    from unitscale.transforms import unit_scale

    torch.manual_seed(0)
    original = TiedLM()
    model = unit_scale(original)
    ids = torch.randint(0, 64, (8, 64))
    logits = model(ids)
    # u-muP's readout: multiplier 1/fan_in on a unit product of std sqrt(fan_in)
    assert logits.std().item() * math.sqrt(256) == pytest.approx(1.0, rel=0.1)
    inner = model.module
    assert inner.head.weight is not inner.embed.weight  # untied: two roles, two tensors
    assert inner.head.weight.std().item() == pytest.approx(1.0, rel=0.05)  # unit init
    assert inner.head.weight.mup_type == "output" and inner.embed.weight.mup_type == "weight"
    assert original.head.weight is original.embed.weight  # the user's model is untouched
    assert model.state_dict().keys() == original.state_dict().keys()
    opt = us.optim.AdamW(model.parameters(), lr=1.0)
    lr_of = {id(p): g["lr"] * g["lr_scale"] for g in opt.param_groups for p in g["params"]}
    assert lr_of[id(inner.head.weight)] == 1.0
    assert lr_of[id(inner.embed.weight)] == pytest.approx(1 / 16)


def test_unit_scale_without_mup_is_plain_unit_scaling() -> None:
    from unitscale.transforms import unit_scale

    torch.manual_seed(0)
    model = unit_scale(TiedLM(), mup=False)
    logits = model(torch.randint(0, 64, (8, 64)))
    # a unit-scaled linear (1/sqrt(fan_in)), not u-muP's 1/fan_in: unit logits
    assert logits.std().item() == pytest.approx(1.0, rel=0.2)
    inner = model.module
    # untied as under u-muP: tied, each token's own embedding row would score ~sqrt(width)
    assert inner.head.weight is not inner.embed.weight
    assert inner.head.weight.mup_type == "weight"  # applied as a hidden weight is


def _tiny_gemma(family: str, vocab: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config_class, model_class = {
        "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[family]
    config = config_class(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=vocab, use_cache=False,
    )  # fmt: skip
    assert config.tie_word_embeddings  # the family's default: input and output tied
    return model_class(config)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma", "gemma2", "gemma3"])
def test_unit_scale_without_mup_gives_a_tied_gemma_the_initial_loss_of_unit_logits(
    family: str,
) -> None:
    """Plain unit scaling: unit-variance logits, whose cross-entropy is ln(vocab) + 1/2 in
    expectation (E[logsumexp] of V i.i.d. N(0, 1) logits is ln(V) + 1/2)."""
    from unitscale.transforms import unit_scale

    vocab = 512
    torch.manual_seed(0)
    model = _tiny_gemma(family, vocab)
    ids = torch.randint(0, vocab, (4, 32))
    scaled = unit_scale(model, mup=False)
    loss = scaled(input_ids=ids, labels=ids).loss.item()
    # tied, the head scored each token's own row at up to sqrt(64) = 8: a loss near 8
    assert loss == pytest.approx(math.log(vocab) + 0.5, abs=0.3), family
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_unit_scale_gives_hf_conv1d_its_fan_in() -> None:
    transformers = pytest.importorskip("transformers")
    from unitscale.transforms import unit_scale

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = unit_scale(transformers.GPT2LMHeadModel(config))
    inner = model.module
    c_fc, c_proj = inner.transformer.h[0].mlp.c_fc.weight, inner.transformer.h[0].mlp.c_proj.weight
    assert tuple(c_fc.shape) == (32, 128)  # stored (in, out)
    opt = us.optim.AdamW(model.parameters(), lr=1.0)
    lr_of = {id(p): g["lr"] * g["lr_scale"] for g in opt.param_groups for p in g["params"]}
    depth = 2
    assert lr_of[id(c_fc)] == pytest.approx(1 / math.sqrt(32 * depth))
    assert lr_of[id(c_proj)] == pytest.approx(1 / math.sqrt(128 * depth))
    assert inner.lm_head.weight is not inner.transformer.wte.weight
    assert inner.lm_head.weight.mup_type == "output"
    assert not inner.config.tie_word_embeddings
