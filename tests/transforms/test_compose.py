"""Composition of transforms, compile, and what every transformed module must do."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import unitscale.functional as U
from unitscale.capture import Stage, TransformedModule
from unitscale.errors import CaptureError
from unitscale.formats import E4M3, E5M2
from unitscale.models import GPTConfig, plain_gpt
from unitscale.transforms import compile, simulate_format, simulate_fp8, track_scales, unit_scale
from unitscale.transforms.lowp._quantise import quantise_operand

# FP8 mechanics on plain models without scales, on purpose: the warning that says so
# (tested in test_simulate_scaling.py) is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.* has no unit scaling:UserWarning")

E4M3_NEAREST = dataclasses.replace(E4M3, rounding="nearest")
E5M2_NEAREST = dataclasses.replace(E5M2, rounding="nearest")


# unit_scale's residual rule (u-muP's, Appendix G) for a model of one residual branch:
# beta^2 = 2 (the branches together weigh 2 residual_mult^2 against the embedding's 1),
# tau = beta^2 / (1 + beta^2)
ONE_BRANCH_SHARE = 2 / 3


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 128)
        self.down = nn.Linear(128, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return self.head(x)


def by_hand(model: ResidualMLP, x: Tensor) -> Tensor:
    """simulate_fp8(unit_scale(ResidualMLP)) written out: unit-scaled ops, FP8 operands."""

    def q(t: Tensor) -> Tensor:
        return quantise_operand(t, E4M3_NEAREST, E5M2_NEAREST)

    residual, skip = U.residual_split(x, share=ONE_BRANCH_SHARE)
    h = U.layer_norm(residual, (32,), model.norm.weight, model.norm.bias)
    h = U.gelu(U.linear(q(h), q(model.up.weight), model.up.bias))
    h = U.linear(q(h), q(model.down.weight), model.down.bias)
    x = U.residual_add(h, skip, share=ONE_BRANCH_SHARE)
    return U.linear(q(x), q(model.head.weight), model.head.bias, constraint=None)


def outputs_and_grads(model: nn.Module, x: Tensor) -> list[Tensor]:
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(torch.linspace(-2, 2, out.numel()).view_as(out))
    inner = model.module if isinstance(model, TransformedModule) else model
    return [out.detach(), x.grad, *(p.grad for p in inner.parameters() if p.requires_grad)]


def test_chain_equals_the_steps_applied_by_hand() -> None:
    chained = simulate_fp8(unit_scale(ResidualMLP(), trainable_norms=True), recipe="all-operands")
    reference = ResidualMLP()
    reference.load_state_dict(chained.state_dict())
    x = torch.randn(16, 32)
    got = outputs_and_grads(chained, x)
    x_ref = x.clone().requires_grad_()
    out = by_hand(reference, x_ref)
    out.backward(torch.linspace(-2, 2, out.numel()).view_as(out))
    expected = [out.detach(), x_ref.grad, *(p.grad for p in reference.parameters())]
    for a, b in zip(got, expected, strict=True):
        assert a is not None and b is not None
        assert torch.equal(a, b)


def test_tracking_a_transformed_module_changes_nothing_and_shows_its_graph() -> None:
    x = torch.randn(16, 32)
    for transform in (unit_scale, simulate_fp8, lambda m: simulate_fp8(unit_scale(m))):
        model = transform(ResidualMLP())
        tracked = track_scales(model)
        tracked.load_state_dict(model.state_dict())
        for a, b in zip(outputs_and_grads(tracked, x), outputs_and_grads(model, x), strict=True):
            assert torch.equal(a, b)
    targets = {n.target for n in tracked.scales_graph().nodes}
    assert {U.residual_split, U.residual_add, U.linear, quantise_operand} <= targets


def tiny_gpt(dropout: float = 0.0) -> nn.Module:
    config = GPTConfig(hidden_size=32, depth=1, heads=2, seq_len=16, dropout=dropout)
    return plain_gpt(dataclasses.replace(config, aligned_labels=True))  # labels: next tokens


@pytest.mark.slow
def test_compiled_chain_matches_eager_chain() -> None:
    eager = simulate_fp8(unit_scale(tiny_gpt()))
    compiled = compile(simulate_fp8(unit_scale(tiny_gpt())))
    compiled.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 256, (2, 16))
    losses, grads = [], []
    for model in (eager, compiled):
        loss = model(ids, labels=ids.roll(-1, dims=1))
        loss.backward()
        losses.append(loss.detach())
        trained = [p for p in model.module.parameters() if p.requires_grad]  # type: ignore[union-attr]
        grads.append(torch.cat([p.grad.flatten() for p in trained]))  # type: ignore[union-attr]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-4)
    # Reassociation inside fused kernels can move a value across an FP8 rounding boundary.
    assert (grads[0] - grads[1]).norm() / grads[0].norm() < 1e-2
    assert all(isinstance(p, type(compiled.passes[-1])) for p in compiled.passes[-1:])
    assert compiled.passes[-1].stage is Stage.COMPILE


def _assert_compiles_no_more_graphs_than_torch_compile(model: nn.Module, vocab: int) -> None:
    """``compile(unit_scale(model))`` over lengths 16, 32, 24, 64, 16, 48 (forward + backward
    of a ``transformers`` model with ``labels``): no more graphs than ``torch.compile(model)``,
    none at a length seen before, and losses and gradients equal the eager unit-scaled
    model's, also at a length neither has seen."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from unitscale.transforms._compile import CompilePass

    lengths = (16, 32, 24, 64, 16, 48)

    def steps(run: Callable[..., object], counted: Callable[[], int]) -> list[int]:
        counts = []
        for length in lengths:
            ids = torch.randint(0, vocab, (2, length))
            run(input_ids=ids, labels=ids).loss.backward()  # type: ignore[attr-defined]
            counts.append(counted())
        return counts

    torch._dynamo.reset()
    reference = CompileCounterWithBackend("inductor")
    theirs = steps(torch.compile(model, backend=reference), lambda: reference.frame_count)

    graphs = 0
    compile_graph = CompilePass.compile_graph

    def counting(self: CompilePass, *args: object) -> object:
        nonlocal graphs
        graphs += 1
        return compile_graph(self, *args)  # type: ignore[arg-type]

    scaled = unit_scale(model)
    eager = copy.deepcopy(scaled)
    fast = compile(scaled)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CompilePass, "compile_graph", counting)
        ours = steps(fast, lambda: graphs)
    assert ours[-1] <= theirs[-1]
    assert ours[4] == ours[3]  # length 16 again: nothing compiled
    assert ours[-1] == ours[1]  # from the second length on, one graph serves all
    for length in (16, 40):  # 40: a length neither has seen
        ids = torch.randint(0, vocab, (2, length))
        losses = []
        for run in (fast, eager):
            run.zero_grad()
            losses.append(run(input_ids=ids, labels=ids).loss)
            losses[-1].backward()
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-5)
        for mine, theirs_ in zip(fast.parameters(), eager.parameters(), strict=True):
            if theirs_.grad is not None:  # every scale, the gradients' included, symbolic
                # atol 1e-5: gradients are unit-scaled (about 1), and compiled code sums in
                # another order (torch 2.8: 1.2e-6 apart on an element of 1e-3).
                torch.testing.assert_close(mine.grad, theirs_.grad, rtol=1e-4, atol=1e-5)
    assert graphs == ours[-1]
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_unit_scaled_gpt2_compiles_no_more_graphs_than_torch_compile() -> None:
    # Scale factors from sizes that vary (sequence length, batch rows) are symbolic under
    # compile: one dynamic graph per piece serves every later length, as for torch.compile,
    # and a length seen before compiles nothing. Losses equal the eager unit-scaled model's.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=128,
        bos_token_id=0, eos_token_id=0, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    _assert_compiles_no_more_graphs_than_torch_compile(transformers.GPT2LMHeadModel(config), 128)


@pytest.mark.slow
def test_compiled_unit_scaled_eager_attention_bert_compiles_no_more_graphs() -> None:
    # Attention written out in eager ops (scores.softmax / F.softmax, not SDPA) goes through
    # U.softmax, whose scales then come from an op taking the symbolic length: the same
    # graph count as torch.compile, nothing compiled at a length seen before.
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=128, max_position_embeddings=128, attn_implementation="eager",
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    model = transformers.BertForMaskedLM(config)
    assert model.config._attn_implementation == "eager"  # the softmax path, not SDPA
    _assert_compiles_no_more_graphs_than_torch_compile(model, 128)


def test_compile_order_errors() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(CaptureError, match=r"track_scales: the module is already compiled"):
        track_scales(compile(model))
    with pytest.raises(CaptureError, match=r"compile: the module is tracked by track_scales"):
        compile(track_scales(model))
    with pytest.raises(CaptureError, match=r"apply compile last"):
        simulate_fp8(compile(model))
    with pytest.raises(CaptureError, match=r"already torch\.compile'd"):
        compile(torch.compile(model))  # type: ignore[arg-type]
    # A compiled module (not yet run) still copies and pickles as configuration.
    compiled = compile(unit_scale(model))
    for clone in (copy.deepcopy(compiled), pickle.loads(pickle.dumps(compiled))):
        assert [type(p) for p in clone.passes] == [type(p) for p in compiled.passes]
        assert torch.equal(clone.weight, compiled.weight)


TRANSFORMS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "unit_scale": unit_scale,
    "simulate_fp8": simulate_fp8,
    "track(fp8(unit))": lambda m: track_scales(simulate_fp8(unit_scale(m))),
}


@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_transformed_module_behaves_like_a_module(name: str) -> None:
    original = tiny_gpt(dropout=0.2).eval()
    ids = torch.randint(0, 256, (2, 16))
    state_before = {k: v.clone() for k, v in original.state_dict().items()}
    out_before = original(ids)

    model = TRANSFORMS[name](original)

    # Keys and checkpoints: the original's checkpoint loads into it, and back.
    assert list(model.state_dict()) == list(state_before)
    model.load_state_dict(original.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(value, state_before[key]), key
    restored = tiny_gpt()
    restored.load_state_dict(model.state_dict())

    # train()/eval(): dropout on, then off.
    model.train()
    torch.manual_seed(1)
    first = model(ids)
    second = model(ids)
    assert not torch.equal(first, second)
    model.eval()
    evaluated = model(ids)
    assert torch.equal(evaluated, model(ids))
    assert not torch.equal(evaluated, first)

    # Copies and pickles run and give the same result.
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert torch.equal(clone(ids), evaluated)

    # Moves with .to(): float64 parameters and outputs, same values up to precision.
    wide = copy.deepcopy(model).to(torch.float64)
    assert all(p.dtype == torch.float64 for p in wide.parameters())
    out = wide(ids)
    assert out.dtype == torch.float64
    assert (out - evaluated.double()).norm() / evaluated.norm() < 1e-2

    # The original is untouched.
    for key, value in original.state_dict().items():
        assert torch.equal(value, state_before[key]), key
    assert torch.equal(original(ids), out_before)


def test_transformed_forward_has_the_wrapped_modules_signature() -> None:
    """Code that reads a model's arguments off ``inspect.signature(model.forward)`` (the
    Hugging Face Trainer's column filter) sees the wrapped module's, not ``*args, **kwargs``;
    ``forward`` still behaves as a bound method, and the class keeps a plain function."""
    original = tiny_gpt().eval()
    ids = torch.randint(0, 256, (2, 16))
    model = unit_scale(original)
    expected = inspect.signature(original.forward)
    for clone in (model, copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert inspect.signature(clone.forward) == expected
        assert list(inspect.signature(clone.forward).parameters)[:2] == [
            "input_ids",
            "attention_mask",
        ]
    assert inspect.isfunction(type(model).forward)
    assert model.forward.__self__ is model and model.forward.__name__ == "forward"
    assert inspect.isfunction(model.forward.__func__)
    assert torch.equal(model.forward(ids), model(ids))
    assert torch.equal(model.forward.__func__(model, ids), model(ids))


# -- a transformed child inside a model transformed again --------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.up(torch.nn.functional.gelu(self.norm(x)))


class UnitBlock(Block):
    """What ``unit_scale(Block())`` computes, written with unitscale.functional."""

    def forward(self, x: Tensor) -> Tensor:
        residual, skip = U.residual_split(x, share=ONE_BRANCH_SHARE)
        h = U.gelu(U.layer_norm(residual, (16,), self.norm.weight, self.norm.bias))
        return U.residual_add(
            U.linear(h, self.up.weight, self.up.bias), skip, share=ONE_BRANCH_SHARE
        )


class Outer(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.block = block
        self.out = nn.Linear(16, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.block(self.inp(x)))


CHILDREN: dict[str, Callable[[nn.Module], nn.Module]] = {
    "unit_scale": unit_scale,
    "simulate_fp8": simulate_fp8,
    "simulate_format": lambda m: simulate_format(m, "e4m3", "e5m2"),
    "track_scales": track_scales,
    "compile": compile,
}
PARENTS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "track_scales": track_scales,
    "simulate_fp8": simulate_fp8,
    "unit_scale": unit_scale,
    "compile": compile,
}
# (child, parent) pairs that cannot compose, and what the error says to do.
REFUSED = {
    **{("track_scales", p): r"put the plain module at 'block'" for p in PARENTS},
    **{("compile", p): r"put the plain module at 'block'" for p in PARENTS},
    ("unit_scale", "unit_scale"): r"unit_scale\(model\) transforms it too",
    ("simulate_fp8", "unit_scale"): r"unit-scale first",
    ("simulate_format", "unit_scale"): r"unit-scale first",
}


def nested(child: str) -> Outer:
    return Outer(CHILDREN[child](Block()))


def block_nodes(graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    return {n.name: n for n in graph.nodes if n.meta.get("module_path", "").startswith("block")}


@pytest.mark.parametrize("child", list(CHILDREN))
@pytest.mark.parametrize("parent", list(PARENTS))
def test_a_transformed_child_composes_or_the_error_names_it(child: str, parent: str) -> None:
    model = nested(child)
    if (child, parent) in REFUSED:
        with pytest.raises(CaptureError, match=rf"the submodule 'block'.*{REFUSED[child, parent]}"):
            PARENTS[parent](model)
        return
    transformed_model = PARENTS[parent](model)
    assert isinstance(model.block, TransformedModule)  # the user's model is not touched
    tracked = (
        transformed_model
        if parent == "track_scales"
        else track_scales(transformed_model)
        if parent != "compile"
        else None
    )
    if tracked is None:  # compile: one graph, the block's ops (as transformed) inside it
        x = torch.randn(4, 16)
        out = transformed_model(x)
        if child != "simulate_format":  # (its stochastic rounding draws other random bits)
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
        capture = transformed_model.capture
        assert capture is not None and len(capture.pieces) == 1
        return
    tracked(torch.randn(4, 16)).sum().backward()
    inside = block_nodes(tracked.scales_graph())
    targets = {n.target for n in inside.values()}
    assert {"block.norm.weight", "block.up.weight"} <= {
        n.meta["clean_name"] for n in inside.values()
    }
    floats = [n for n in inside.values() if n.meta["outputs_float_tensor"]]
    assert floats and all(n.meta["metrics"].fwd is not None for n in floats)
    if child == "unit_scale":  # the child's own transform applies to its ops alone
        assert {U.residual_split, U.residual_add, U.linear, U.gelu} <= targets
        outside = [n for n in tracked.scales_graph().nodes if n.meta.get("module_path") == "out"]
        assert U.linear not in {n.target for n in outside}
    rounded = [n for n in inside.values() if n.target is quantise_operand]
    if child != "unit_scale" or parent == "simulate_fp8":  # operands of block.up's matmul
        assert {n.args[0].meta["clean_name"] for n in rounded} >= {"block.up.weight"}
    else:
        assert not rounded


def test_a_unit_scaled_child_is_unit_scaled_then_rounded_like_by_hand() -> None:
    # simulate_fp8 of a model holding unit_scale(block): the block's ops are unit-scaled
    # (alone, as unit_scale(block) does) and every matmul's operands, the block's included,
    # are rounded: bit for bit what simulate_fp8 of the model written by hand computes.
    model = Outer(unit_scale(Block(), trainable_norms=True))
    reference = Outer(UnitBlock())
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 16)
    torch.testing.assert_close(model.block(x), reference.block(x), rtol=0, atol=0)
    for a, b in zip(
        outputs_and_grads(simulate_fp8(model), x),
        outputs_and_grads(simulate_fp8(reference), x),
        strict=True,
    ):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_compile_of_a_model_holding_a_unit_scaled_child_matches_by_hand() -> None:
    model = Outer(unit_scale(Block(), trainable_norms=True))
    reference = Outer(UnitBlock())
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 16)
    for a, b in zip(
        outputs_and_grads(compile(model), x), outputs_and_grads(reference, x), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_model_holding_a_transformed_child_copies_pickles_and_keeps_its_keys() -> None:
    model = Outer(unit_scale(Block(), trainable_norms=True))
    keys = list(Outer(Block()).state_dict())
    result = simulate_fp8(model)
    assert list(result.state_dict()) == keys
    x = torch.randn(4, 16)
    expected = result(x)
    for clone in (copy.deepcopy(result), pickle.loads(pickle.dumps(result))):
        assert list(clone.state_dict()) == keys
        assert torch.equal(clone(x), expected)


class LoopWithBreak(nn.Module):
    """Blocks in a loop with a graph break in it: TorchDynamo skips this frame and compiles
    each block's forward as a frame of its own (whose own ops have no module stack)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
            print("", end="")
        return x


@pytest.mark.parametrize("parent", ["track_scales", "simulate_fp8"])
def test_a_transformed_child_in_its_own_frame_is_transformed_whole(parent: str) -> None:
    model = LoopWithBreak([Block(), unit_scale(Block())])
    reference = LoopWithBreak([Block(), UnitBlock()])
    reference.load_state_dict(model.state_dict())
    x = torch.randn(8, 16)
    result = PARENTS[parent](model)
    expected = reference(x) if parent == "track_scales" else simulate_fp8(reference)(x)
    assert torch.equal(result(x), expected)
    if parent == "track_scales":
        targets = [n.target for n in result.scales_graph().nodes]
        assert targets.count(U.residual_add) == 1 and U.gelu in targets
