"""track_scales: capture, names, graph breaks, real models, numerics and pruning."""

from __future__ import annotations

import copy
import math
import pickle
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn, randn_like

from unitscale import UnitScaleError
from unitscale.transforms import (
    Metrics,
    prune_non_float_tensors,
    prune_same_scale_tensors,
    prune_selected_nodes,
    track_scales,
)


class SeedModel(nn.Module):
    """The example model of the seed document, line for line."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 64)
        self.linear = nn.Linear(64, 64)

    def forward(self, idxs: Tensor) -> tuple[Tensor, Tensor]:
        x = self.emb(idxs)  # emb has 1 float arg (weights) -> depends on tol
        _x = x.flatten(start_dim=0, end_dim=-1)  # 1 float, same scale -> prune
        x = _x.view(x.shape)  # 1 float arg, same scale -> prune
        y = self.linear(x)  # scale changes -> shouldn't be pruned
        scores = F.softmax(y, dim=-1)  # scale changes -> shouldn't be pruned
        top_idx = torch.argmax(scores, dim=-1)  # not float -> shouldn't be pruned
        top_idx = torch.unsqueeze(top_idx, -1)  # not float -> shouldn't be pruned
        top_score_x = torch.gather(x, -1, top_idx)  # small change -> depends on tol
        top_score_x += randn_like(top_score_x)  # 2 floats, same scale -> no prune
        return top_score_x, top_idx


def names(graph: torch.fx.Graph) -> list[str]:
    return [n.meta["clean_name"] for n in graph.nodes if n.op != "output"]


def by_name(graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    return {n.meta["clean_name"]: n for n in graph.nodes if n.op != "output"}


@pytest.fixture(scope="module")
def seed_graph() -> torch.fx.Graph:
    torch.manual_seed(0)
    tracked = track_scales(SeedModel())
    out, _ = tracked(torch.randint(0, 256, (8, 32)))
    out.backward(torch.randn_like(out))
    return tracked.scales_graph()


def test_graph_is_empty_before_any_call() -> None:
    assert len(track_scales(SeedModel()).scales_graph().nodes) == 0


def test_seed_example_names(seed_graph: torch.fx.Graph) -> None:
    assert names(seed_graph) == [
        "emb.weight", "idxs", "linear.weight", "linear.bias",
        "x", "_x", "x_1", "y", "scores", "top_idx", "top_idx_1",
        "top_score_x", "randn_like", "top_score_x_1",
    ]  # fmt: skip
    nodes = by_name(seed_graph)
    assert nodes["y"].target is torch._C._nn.linear
    assert nodes["x"].target is F.embedding
    assert nodes["scores"].target is F.softmax
    assert nodes["y"].meta["module_path"] == "linear"
    assert nodes["x"].meta["module_path"] == "emb"
    assert nodes["emb.weight"].meta["module_path"] == "emb"
    assert nodes["scores"].meta["module_path"] == ""
    assert nodes["linear.weight"].meta["requires_grad"] is True
    assert nodes["y"].meta["requires_grad"] is False
    assert [a.meta["clean_name"] for a in nodes["y"].all_input_nodes] == [
        "x_1", "linear.weight", "linear.bias",
    ]  # fmt: skip
    assert len(set(names(seed_graph))) == len(names(seed_graph))


def test_seed_example_metrics(seed_graph: torch.fx.Graph) -> None:
    nodes = by_name(seed_graph)
    for name, node in nodes.items():
        if node.meta["outputs_float_tensor"]:
            assert isinstance(node.meta["metrics"], Metrics), name
            assert node.meta["metrics"].fwd is not None, name
        else:
            assert node.meta["metrics"] is None
    assert not nodes["idxs"].meta["outputs_float_tensor"]
    assert not nodes["top_idx"].meta["outputs_float_tensor"]
    # Gradients reach x (through gather) but not the linear (argmax has no gradient).
    assert nodes["x"].meta["metrics"].bwd is not None
    assert nodes["emb.weight"].meta["metrics"].bwd is not None
    assert nodes["y"].meta["metrics"].bwd is None
    assert nodes["linear.weight"].meta["metrics"].bwd is None
    # flatten/view do not change values.
    assert nodes["_x"].meta["metrics"].fwd == nodes["x"].meta["metrics"].fwd
    assert nodes["x"].meta["metrics"].fwd.numel == 8 * 32 * 64
    assert nodes["x"].meta["shape"] == (8, 32, 64)


def test_seed_example_pruning(seed_graph: torch.fx.Graph) -> None:
    before = names(seed_graph)
    non_float = names(prune_non_float_tensors(seed_graph))
    assert {"idxs", "top_idx", "top_idx_1"}.isdisjoint(non_float)
    assert set(before) - set(non_float) == {"idxs", "top_idx", "top_idx_1"}

    tight = names(prune_same_scale_tensors(seed_graph))
    assert "_x" not in tight and "x_1" not in tight
    for kept in ["y", "scores", "top_score_x_1", "x", "top_score_x", "idxs", "top_idx"]:
        assert kept in tight
    loose = names(prune_same_scale_tensors(seed_graph, rtol=0.5))
    assert "x" not in loose  # embedding: depends on rtol
    for kept in ["y", "scores", "top_score_x_1", "top_score_x"]:
        assert kept in loose
    # gather only changes scale by a small factor in the forward pass; with a huge
    # tolerance it goes, while ops with several float inputs are never pruned.
    loosest = names(prune_same_scale_tensors(seed_graph, rtol=2.0**10))
    assert "top_score_x" not in loosest
    assert "y" in loosest and "top_score_x_1" in loosest
    assert names(seed_graph) == before  # arguments are not mutated


def test_pruning_keeps_data_flow_connected(seed_graph: torch.fx.Graph) -> None:
    pruned = by_name(prune_same_scale_tensors(seed_graph))
    assert pruned["y"].all_input_nodes[0].meta["clean_name"] == "x"
    selected = by_name(prune_selected_nodes(seed_graph, [F.softmax, torch.Tensor.view]))
    assert "scores" not in selected and "x_1" not in selected
    assert "_x" in selected
    assert selected["top_idx"].all_input_nodes[0].meta["clean_name"] == "y"


def test_pruning_rejects_untracked_graph() -> None:
    graph = torch.fx.symbolic_trace(nn.Linear(2, 2)).graph
    with pytest.raises(UnitScaleError, match="scales_graph"):
        prune_same_scale_tensors(graph)
    with pytest.raises(UnitScaleError, match=r"torch\.fx\.Graph"):
        prune_non_float_tensors("not a graph")  # type: ignore[arg-type]


class Breaking(nn.Module):
    """Data-dependent control flow, a print, and .item(): three graph breaks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        if h.sum() > 0:
            h = h * 2
        else:
            h = h * 3
        print("", end="")
        k = self.b(h)
        s = k.abs().mean().item()
        return self.c(k) * s


def test_graph_breaks_are_joined_in_order() -> None:
    torch.manual_seed(0)
    tracked = track_scales(Breaking())
    tracked(torch.randn(4, 16)).sum().backward()
    graph = tracked.scales_graph()
    nodes = by_name(graph)
    assert len({n.meta["subgraph"] for n in nodes.values()}) >= 3
    order = [n.meta["subgraph"] for n in graph.nodes if n.op == "call_function"]
    assert order == sorted(order)
    # Every Linear is present, forward and backward, and data crosses the breaks.
    linears = [n for n in nodes.values() if n.target is torch._C._nn.linear]
    assert len(linears) == 3
    for node in linears:
        assert node.meta["metrics"].fwd is not None and node.meta["metrics"].bwd is not None
    assert linears[1].all_input_nodes[0].meta["subgraph"] < linears[1].meta["subgraph"]
    assert linears[1].all_input_nodes[0].op != "placeholder"
    assert linears[2].all_input_nodes[0] is linears[1]
    inputs = [n for n in graph.nodes if n.op == "placeholder" and not n.meta["requires_grad"]]
    assert [n.meta["clean_name"] for n in inputs] == ["x"]


def test_outputs_and_gradients_are_bit_identical_with_dropout() -> None:
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.3), nn.Linear(64, 8))
    model.train()
    tracked = track_scales(model)
    x = torch.randn(16, 32)
    torch.manual_seed(123)
    expected = model(x)
    expected.square().sum().backward()
    torch.manual_seed(123)
    actual = tracked(x.clone())
    actual.square().sum().backward()
    assert torch.equal(actual, expected)
    for (name, p), q in zip(model.named_parameters(), tracked.module.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_original_module_is_untouched_and_parameters_independent() -> None:
    model = nn.Linear(8, 8)
    before = copy.deepcopy(model.state_dict())
    tracked = track_scales(model)
    tracked(torch.randn(2, 8)).sum().backward()
    assert model.weight.grad is None
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert tracked.module.weight is not model.weight
    assert list(tracked.state_dict()) == list(model.state_dict())


def test_float_input_gets_gradient_tracked() -> None:
    tracked = track_scales(nn.Linear(8, 4))
    x = torch.randn(3, 8)
    tracked(x).sum().backward()
    assert not x.requires_grad  # tracked through an internal alias (docs/design.rst, "Contracts")
    node = by_name(tracked.scales_graph())["input"]
    assert node.meta["metrics"].bwd is not None


def test_rerun_updates_and_recompile_gives_latest_graph() -> None:
    tracked = track_scales(nn.Linear(8, 8))
    tracked(torch.ones(2, 8))
    first = by_name(tracked.scales_graph())["linear"].meta["metrics"].fwd
    tracked(torch.ones(2, 8) * 100)
    second = by_name(tracked.scales_graph())["linear"].meta["metrics"].fwd
    assert second.mean_abs > 10 * first.mean_abs
    tracked(torch.ones(5, 3, 8))
    latest = by_name(tracked.scales_graph())["linear"]
    assert latest.meta["shape"] == (5, 3, 8)
    assert latest.meta["metrics"].fwd.numel == 5 * 3 * 8


@dataclass
class Out:
    loss: Tensor
    parts: dict[str, Tensor]


class Awkward(nn.Module):
    """Keyword args, masks, in-place ops, empty and integer tensors, dict/dataclass outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: Tensor, mask: Tensor | None = None, *, scale: float = 1.0) -> Out:
        h = self.proj(x) * scale
        if mask is not None:
            h = h.masked_fill(~mask, 0.0)
        h.relu_()
        empty = h[:, :0].sum(-1)
        count = mask.sum() if mask is not None else torch.tensor(0)
        return Out(loss=h.mean() + empty.mean().nan_to_num(), parts={"h": h, "count": count})


def test_awkward_model_is_tracked() -> None:
    tracked = track_scales(Awkward())
    mask = torch.rand(4, 8) > 0.5
    out = tracked(torch.randn(4, 8), mask=mask, scale=2.0)
    assert isinstance(out, Out) and set(out.parts) == {"h", "count"}
    out.loss.backward()
    nodes = by_name(tracked.scales_graph())
    assert "mask" in nodes and not nodes["mask"].meta["outputs_float_tensor"]
    empties = [n for n in nodes.values() if n.meta.get("shape") == (4, 0)]
    assert empties and empties[0].meta["metrics"].fwd.numel == 0


def test_nan_and_inf_inputs_give_defined_metrics() -> None:
    tracked = track_scales(nn.Linear(4, 4))
    x = torch.tensor([[1.0, float("nan"), 2.0, float("inf")]])
    tracked(x).sum().backward()
    fwd = by_name(tracked.scales_graph())["input"].meta["metrics"].fwd
    assert (fwd.nan_count, fwd.inf_count) == (1, 1)
    assert math.isnan(fwd.mean_abs)


def test_tracked_model_deepcopies_and_pickles() -> None:
    tracked = track_scales(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    x = torch.randn(2, 4)
    y = tracked(x)
    for clone in (copy.deepcopy(tracked), pickle.loads(pickle.dumps(tracked))):
        assert torch.equal(clone(x), y)
        clone(x).sum().backward()
        assert "0.weight" in names(clone.scales_graph())
        assert clone.module[0].weight is not tracked.module[0].weight


def test_not_a_module_is_a_clear_error() -> None:
    with pytest.raises(UnitScaleError, match=r"track_scales: expected a torch\.nn\.Module"):
        track_scales(lambda x: x)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_transformers_models_show_every_layer(arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32,
            bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
            intermediate_size=128, vocab_size=128, max_position_embeddings=32,
        )  # fmt: skip
        model = transformers.BertForMaskedLM(config)
    model.eval()
    tracked = track_scales(model)
    ids = torch.randint(0, 128, (2, 16))
    out = tracked(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    assert torch.equal(out.logits, reference.logits)
    out.loss.backward()
    graph = tracked.scales_graph()
    params = {n.meta["clean_name"]: n for n in graph.nodes if n.meta.get("requires_grad")}
    expected = {name for name, _ in model.named_parameters()}
    assert set(params) == expected
    linear_like = [n for n in expected if (n.endswith("weight") and "layer" in n) or ".h." in n]
    for layer in range(2):
        assert any(f".{layer}." in n for n in linear_like)
    for name, node in params.items():
        metrics = node.meta["metrics"]
        assert metrics.fwd is not None and metrics.bwd is not None, name
    ops = {getattr(n.target, "__name__", n.target) for n in graph.nodes if n.op != "placeholder"}
    assert "linear" in ops or "addmm" in ops


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        print("", end="")  # a graph break inside a loop: Dynamo skips the caller's frame
        return x + torch.relu(h)


class LoopWithBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 4)

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits, labels)


def test_graph_break_in_a_loop_is_still_captured_whole() -> None:
    torch.manual_seed(0)
    model = LoopWithBreak()
    tracked = track_scales(model)
    x, labels = torch.randn(3, 8), torch.tensor([0, 1, 2])
    with pytest.warns(UserWarning, match="replayed with unitscale's eager tracer"):
        loss = tracked(x, labels)
    assert torch.equal(loss, model(x, labels))
    loss.backward()
    for call in range(2):  # the second call uses the eager tracer directly
        graph = tracked.scales_graph()
        nodes = by_name(graph)
        linears = [n for n in graph.nodes if n.target is torch._C._nn.linear]
        assert [n.meta["module_path"] for n in linears] == [
            "blocks.0.proj",
            "blocks.1.proj",
            "head",
        ]
        assert linears[1].all_input_nodes[0] is nodes["add"]
        assert nodes["logits"].target is torch._C._nn.linear
        assert nodes["cross_entropy"].meta["metrics"].bwd is not None
        for name in ["blocks.0.proj.weight", "blocks.1.proj.weight", "head.weight"]:
            assert nodes[name].meta["metrics"].bwd is not None, name
        assert nodes["x"].meta["metrics"].bwd is not None
        if call == 0:
            tracked(x, labels).backward()


class CountingLoop(LoopWithBreak):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        self.calls += 1
        return super().forward(x, labels)


def test_replay_says_side_effects_ran_twice_and_later_calls_run_once() -> None:
    tracked = track_scales(CountingLoop())
    x, labels = torch.randn(3, 8), torch.tensor([0, 1, 2])
    with pytest.warns(UserWarning, match="side effects of the forward .* happened twice"):
        tracked(x, labels)
    assert tracked.module.calls == 2  # the Dynamo run and its replay
    tracked(x, labels)  # the eager tracer directly: once
    assert tracked.module.calls == 3


def test_transformed_module_keeps_the_original_names() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    tracked = track_scales(model)
    assert [n for n, _ in tracked.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert list(tracked.state_dict()) == list(model.state_dict())
    tracked.load_state_dict(model.state_dict())
    assert tracked.to(torch.float64).module[0].weight.dtype == torch.float64


class Reshapes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6))

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight.t()  # a parameter's only use is a reshape
        h = x @ w
        flat = h.flatten()  # h's only use
        both = h.transpose(0, 1) * 2 + h.sum()  # h has several uses
        return flat.square().sum() + both.sum()


def test_reshape_statistics_are_exact() -> None:
    torch.manual_seed(0)
    model = Reshapes()
    x = torch.randn(3, 6)
    tracked = track_scales(model)
    tracked(x).backward()
    nodes = by_name(tracked.scales_graph())
    reference = {}
    h = x @ model.weight.t()
    h.retain_grad()
    flat = h.flatten()
    flat.retain_grad()
    (flat.square().sum() + (h.transpose(0, 1) * 2 + h.sum()).sum()).backward()
    reference = {"h": h, "flat": flat}
    for name, tensor in reference.items():
        metrics = nodes[name].meta["metrics"]
        assert metrics.fwd.mean_abs == pytest.approx(tensor.abs().mean().item(), rel=1e-6)
        assert metrics.bwd.mean_abs == pytest.approx(tensor.grad.abs().mean().item(), rel=1e-6)
    assert nodes["w"].meta["metrics"].bwd is not None
    assert nodes["weight"].meta["metrics"].bwd.mean_abs == pytest.approx(
        model.weight.grad.abs().mean().item(), rel=1e-6
    )


def test_unrecorded_calls_leave_the_recorded_statistics_alone() -> None:
    from unitscale.tracking import TrackScalesPass

    tracked = track_scales(nn.Linear(4, 4))
    tracked(torch.ones(2, 4)).sum().backward()
    before = by_name(tracked.scales_graph())["weight"].meta["metrics"].bwd
    track = tracked.pass_of_type(TrackScalesPass)
    assert isinstance(track, TrackScalesPass)
    track.enabled = False
    tracked(torch.ones(2, 4) * 1000).sum().backward()
    after = by_name(tracked.scales_graph())["weight"].meta["metrics"].bwd
    assert after == before


class SameObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        g = h.float()  # float32 already: the same tensor object
        print("", end="")  # h crosses a graph break unchanged
        return (g * 2).sum() + h.square().sum()


def test_a_tensor_seen_twice_has_the_same_exact_statistics() -> None:
    torch.manual_seed(0)
    model = SameObject()
    x = torch.randn(3, 4)
    tracked = track_scales(model)
    tracked(x).backward()
    nodes = by_name(tracked.scales_graph())
    h = model.proj(x)
    h.retain_grad()
    ((h.float() * 2).sum() + h.square().sum()).backward()
    for name in ("h", "g"):
        metrics = nodes[name].meta["metrics"]
        assert metrics.fwd.mean_abs == pytest.approx(h.abs().mean().item(), rel=1e-6)
        assert metrics.bwd.mean_abs == pytest.approx(h.grad.abs().mean().item(), rel=1e-6)


class BreakingLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.up(x))
        torch._dynamo.graph_break()  # this layer's frame is compiled once, run for both
        return x + self.down(h)


class TwoBreakingLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = BreakingLayer()
        self.second = BreakingLayer()

    def forward(self, x: Tensor) -> Tensor:
        return self.second(self.first(x))


def test_a_piece_reused_for_another_layer_is_named_after_that_layer() -> None:
    model = TwoBreakingLayers()
    tracked = track_scales(model)
    x = torch.randn(4, 8)
    out = tracked(x)
    assert torch.equal(out, model(x))
    out.square().mean().backward()
    graph = tracked.scales_graph()
    params = {
        n.meta["clean_name"]
        for n in graph.nodes
        if n.op == "placeholder" and n.meta["requires_grad"]
    }
    assert params == {name for name, _ in model.named_parameters()}
    for node in graph.nodes:
        if node.op == "placeholder" and node.meta["requires_grad"]:
            assert node.meta["metrics"].bwd is not None, node.meta["clean_name"]
    linears = [n for n in graph.nodes if n.target is torch._C._nn.linear]
    assert [n.meta["module_path"] for n in linears] == [
        "first.up", "first.down", "second.up", "second.down"
    ]  # fmt: skip
    weights = [n.args[1].meta["clean_name"] for n in linears]
    assert weights == ["first.up.weight", "first.down.weight", "second.up.weight",
                       "second.down.weight"]  # fmt: skip


def test_the_statistics_mode_is_read_once_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``UNITSCALE_STATS`` is read at the start of each tracked call, not once per tensor
    (reading the environment costs a third of a small tensor's statistics), and a change
    takes effect at the next call."""
    from unitscale.tracking import metrics
    from unitscale.tracking._recording import _pass as _recorder

    monkeypatch.delenv("UNITSCALE_STATS", raising=False)  # the default, whatever ran before
    reads: list[str] = []
    read = metrics._mode

    def counted() -> str:
        reads.append(read())
        return reads[-1]

    monkeypatch.setattr(metrics, "_mode", counted)
    monkeypatch.setattr(_recorder, "_mode", counted, raising=False)
    tracked = track_scales(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)))
    tracked(torch.randn(4, 8)).sum().backward()
    assert reads == ["auto"]
    monkeypatch.setenv("UNITSCALE_STATS", "eager")
    tracked(torch.randn(4, 8)).sum().backward()
    assert reads == ["auto", "eager"]
    graph = tracked.scales_graph()
    recorded = [n for n in graph.nodes if n.meta.get("metrics") is not None]
    assert len(recorded) >= 6
    assert all(n.meta["metrics"].fwd is not None for n in recorded)


def test_activation_gradient_hooks_need_no_handles_and_go_at_the_next_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gradient hooks on plain activations are added without ``register_hook``'s removable
    handle (its cost), beside a user's own hooks, and removed when the next call starts."""
    registered: list[Tensor] = []
    register = Tensor.register_hook

    def counted(self: Tensor, hook: object) -> object:
        registered.append(self)
        return register(self, hook)  # type: ignore[arg-type]

    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    tracked = track_scales(model)
    tracked(torch.randn(4, 8)).sum().backward()  # captured before counting
    monkeypatch.setattr(Tensor, "register_hook", counted)
    seen: list[Tensor] = []
    out = tracked(torch.randn(4, 8))
    user = out.register_hook(lambda grad: seen.append(grad))  # the user's, with a handle
    ours = dict(out._backward_hooks or {})
    assert len(ours) == 2
    assert [id(t) for t in registered] == [id(out)]  # the user's call only
    out.sum().backward()
    assert len(seen) == 1
    graph = tracked.scales_graph()
    records = [n.meta["metrics"] for n in graph.nodes if n.meta.get("metrics") is not None]
    assert sum(m.bwd is not None for m in records) >= 6  # activations' gradients recorded
    user.remove()
    assert len(out._backward_hooks) == 1  # ours stays until the next call...
    tracked(torch.randn(4, 8))
    assert len(out._backward_hooks) == 0  # ...which removes it


class _ReturnsItsInputAndWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self.proj(x), x, self.proj.weight, torch.arange(3)


def test_outputs_that_are_inputs_or_parameters_are_not_missing_ops() -> None:
    """An output no graph produced is missing ops (replayed eagerly, with a warning) unless
    it is one of the call's inputs or parameters, whatever the order of the outputs."""
    import warnings

    torch.manual_seed(0)
    model = _ReturnsItsInputAndWeight()
    tracked = track_scales(model)
    x = torch.randn(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out, same_x, weight, index = tracked(x)
    assert not [w for w in caught if "outside the graphs" in str(w.message)]
    assert same_x is x and weight is tracked.proj.weight
    assert torch.equal(out, model(x)[0]) and torch.equal(index, torch.arange(3))
    names = [node.meta.get("module_path") for node in tracked.scales_graph().nodes]
    assert "proj" in names
