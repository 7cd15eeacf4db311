"""Ordinary user code under the transforms: what must hold (docs/design.rst, "Contracts").

Each test is a defect found in review: a tracked or transformed
model must behave like the untransformed one for the caller (inputs, checkpoints, grad modes,
Python side effects) and record everything it runs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unitscale.capture import example_value
from unitscale.transforms import compile, simulate_fp8, track_scales, unit_scale


def by_name(graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    return {n.meta["clean_name"]: n for n in graph.nodes if n.op != "output"}


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


# -- grad modes ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_tracking_works_without_grad(mode: type) -> None:
    model = _MLP()
    tracked = track_scales(model)
    x = torch.randn(3, 8)
    with mode():
        out = tracked(x)
    assert torch.equal(out, model(x))
    nodes = [n for n in tracked.scales_graph().nodes if n.meta.get("outputs_float_tensor")]
    assert nodes
    for node in nodes:
        assert node.meta["metrics"].fwd is not None, node.name
        assert node.meta["metrics"].bwd is None, node.name


def test_inference_tensors_as_inputs_under_inference_mode() -> None:
    tracked = track_scales(_MLP())
    with torch.inference_mode():
        x = torch.randn(3, 8)
        tracked(x)
        tracked(x)  # the same inference tensor again: recorded, never shared by version
    assert by_name(tracked.scales_graph())["x"].meta["metrics"].fwd.numel == 24


# -- the caller's inputs ---------------------------------------------------------------------
def test_inputs_are_not_modified_and_their_gradient_is_tracked() -> None:
    tracked = track_scales(_MLP())
    x = torch.randn(3, 8)
    mask = torch.ones(3, 8)
    tracked(x).sum().backward()
    assert not x.requires_grad and x.grad_fn is None and x.is_leaf
    assert x._version == 0
    assert by_name(tracked.scales_graph())["x"].meta["metrics"].bwd is not None
    assert not mask.requires_grad


class _InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.linear(x)


def test_in_place_op_on_an_input_works_as_untracked() -> None:
    model = _InPlace()
    tracked = track_scales(model)
    x, y = torch.ones(3, 4), torch.ones(3, 4)
    out = tracked(x)
    expected = model(y)
    assert torch.equal(x, y)  # the caller sees the same in-place effect
    assert torch.equal(out, expected)
    assert x._version > 0  # and autograd sees the change, as it would untracked
    assert not x.requires_grad
    out.sum().backward()
    nodes = by_name(tracked.scales_graph())
    assert nodes["linear"].meta["metrics"].bwd is not None


def test_an_input_returned_as_is_is_the_callers_tensor() -> None:
    class Identity(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x * self.scale

    x = torch.randn(2, 3)
    same, _ = track_scales(Identity())(x)
    assert same is x


# -- checkpoints of a parent holding a transformed block -------------------------------------
class _Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


@pytest.mark.parametrize("transform", [track_scales, unit_scale, simulate_fp8, compile])
def test_parent_checkpoint_round_trips_with_a_transformed_block(transform: object) -> None:
    parent = _Parent()
    parent.block = transform(parent.block)  # type: ignore[operator]
    state = parent.state_dict()
    names = [n for n, _ in parent.named_parameters()]
    buffers = [n for n, _ in parent.named_buffers()]
    assert set(state) == set(names) | set(buffers)
    assert "block.0.weight" in state and not any(".module." in k for k in state)

    other = _Parent()
    other.block = transform(other.block)  # type: ignore[operator]
    result = other.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in other.state_dict().items():
        assert torch.equal(value, state[key]), key
    # The checkpoint of a parent of the untransformed block loads too, and back.
    plain = _Parent()
    plain.load_state_dict(state)
    other.load_state_dict(plain.state_dict())


# -- ScaleMonitor's replay -------------------------------------------------------------------
class _Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.norm(self.linear(x)) + 10).mean()


def test_monitor_replay_leaves_buffers_as_the_step_left_them() -> None:
    import copy
    import warnings

    from unitscale.tracking import ScaleMonitor

    model = _Normed()
    reference = copy.deepcopy(model)
    monitor = ScaleMonitor(model, every=None)
    report = None
    for step in range(3):
        x = torch.randn(8, 4) + step
        if step == 2:
            x[0, 0] = float("nan")
        monitor.module(x).backward()
        reference(x).backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = monitor.step()
        assert torch.equal(model.norm.num_batches_tracked, reference.norm.num_batches_tracked)
        for name in ("running_mean", "running_var"):
            ours, theirs = getattr(model.norm, name), getattr(reference.norm, name)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0, equal_nan=True)
    assert report is not None and report.tensor == "x"  # the replay ran and found the NaN


# -- the built-in unit-scaled GPT and masked attention ---------------------------------------
@pytest.mark.parametrize("transform", [track_scales, compile])
def test_unit_scaled_gpt_refuses_padding_under_a_transform(transform: object) -> None:
    from unitscale.experiments.models import GPTConfig, ModelConfigError, unit_scaled_gpt

    model = unit_scaled_gpt(GPTConfig(hidden_size=32, depth=1, heads=2, seq_len=16))
    transformed = transform(model)  # type: ignore[operator]
    ids = torch.randint(0, 256, (2, 16))
    ones = torch.ones(2, 16, dtype=torch.long)
    torch.testing.assert_close(transformed(ids, attention_mask=ones), model(ids))
    padded = ones.clone()
    padded[0, 12:] = 0
    with pytest.raises(ModelConfigError, match="padding"):
        transformed(ids, attention_mask=padded)


def test_masked_attention_with_is_causal_is_scaled_and_combines_both() -> None:
    from unitscale.functional import masked_scaled_dot_product_attention

    q, k, v = torch.randn(3, 2, 4, 64, 32)
    padding = torch.ones(64, 64, dtype=torch.bool)
    padding[:, 40:] = False
    both = padding & torch.ones(64, 64, dtype=torch.bool).tril()
    out = masked_scaled_dot_product_attention(q, k, v, attn_mask=padding, is_causal=True)
    assert torch.equal(out, masked_scaled_dot_product_attention(q, k, v, attn_mask=both))
    additive = torch.zeros(64, 64).masked_fill(~padding, float("-inf"))
    combined = masked_scaled_dot_product_attention(q, k, v, attn_mask=additive, is_causal=True)
    assert torch.equal(out, combined)
    assert 0.8 < out.std().item() < 1.2  # unit-scaled (the plain op gives about 0.4)


# -- torch.vmap inside a tracked forward -----------------------------------------------------
class _Vmapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.vmap(lambda row: (row * 2).sin())(self.linear(x))
        return y.sum(-1)


def test_vmap_inside_forward_is_recorded_unwrapped() -> None:
    from unitscale.tracking import metrics

    model = _Vmapped()
    tracked = track_scales(model)
    x = torch.randn(3, 4)
    out = tracked(x)
    assert torch.equal(out, model(x))
    out.sum().backward()
    graph = tracked.scales_graph()
    nodes = by_name(graph)
    inside = [n for n in graph.nodes if n.meta.get("outputs_float_tensor")]
    for node in inside:
        assert node.meta["metrics"].fwd is not None, node.name
    # The value computed inside vmap, over every batch element.
    assert nodes["mul"].meta["metrics"].fwd.numel == 12
    expected = (model.linear(x) * 2).abs().mean().item()
    assert nodes["mul"].meta["metrics"].fwd.mean_abs == pytest.approx(expected, rel=1e-6)
    assert nodes["x"].meta["metrics"].bwd is not None
    assert not metrics._kernel.failed  # statistics did not fall back to eager for the process


# -- frames TorchDynamo gives up on ----------------------------------------------------------
class _BreakInLoop(nn.Module):
    """TorchDynamo gives up on ``forward`` (a graph break inside a loop) and runs it eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for block in self.blocks:
            x = block(x)
            if x.sum().item() > 1e9:
                x = x * 0
        return x


@pytest.mark.parametrize("transform", [unit_scale, simulate_fp8, compile])
def test_uncaptured_frame_warning_says_what_was_not_transformed(transform: object) -> None:
    model = transform(_BreakInLoop())  # type: ignore[operator]
    with pytest.warns(UserWarning, match="outside the graphs TorchDynamo captured") as caught:
        model(torch.randn(2, 4))
    message = str(caught[0].message)
    assert "Nothing was transformed" in message
    assert "not transformed: the ops using first.weight, first.bias, blocks.0.weight" in message
    if transform is unit_scale:
        assert "unit_scale re-initialised first.weight, first.bias, blocks.0.weight" in message
    else:
        assert "re-initialised" not in message


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up = nn.LayerNorm(4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(F.gelu(self.norm(x)))


class _BlocksWithBreak(nn.Module):
    """TorchDynamo skips ``forward`` and compiles each block's forward as a frame of its own,
    whose own ops (the gelu, the add) carry no module stack."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Residual() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            print("", end="")
        return x


def test_the_ops_of_a_block_in_its_own_frame_are_named_after_it() -> None:
    tracked = track_scales(_BlocksWithBreak())
    tracked(torch.randn(2, 4))
    graph = tracked.scales_graph()
    paths = {n.name: n.meta["module_path"] for n in graph.nodes if n.op == "call_function"}
    assert paths == {
        "layer_norm": "blocks.0.norm",
        "gelu": "blocks.0",
        "linear": "blocks.0.up",
        "add": "blocks.0",
        "layer_norm_1": "blocks.1.norm",
        "gelu_1": "blocks.1",
        "linear_1": "blocks.1.up",
        "add_1": "blocks.1",
    }


# -- variable-length batches -----------------------------------------------------------------
def test_variable_lengths_do_not_recompile_per_length() -> None:
    from unitscale.experiments.models import GPTConfig, plain_gpt

    model = plain_gpt(GPTConfig(hidden_size=32, depth=1, heads=2, seq_len=64))
    tracked = track_scales(model)
    for length in (16, 23, 37, 50, 64, 19):
        ids = torch.randint(0, 256, (2, length))
        labels = ids.roll(-1, dims=1)
        tracked.zero_grad(set_to_none=True)  # parameter statistics are param.grad's
        tracked(ids, labels=labels).backward()
    # One static capture, then one with a dynamic length that serves every other length.
    assert tracked.capture is not None and len(tracked.capture.pieces) <= 2
    fresh = track_scales(model)
    fresh(ids, labels=labels).backward()
    ours, theirs = by_name(tracked.scales_graph()), by_name(fresh.scales_graph())
    assert ours.keys() == theirs.keys()
    # Sizes Dynamo passes to a dynamic graph are not shown as inputs.
    state = set(model.state_dict())
    placeholders = {n for n, node in ours.items() if node.op == "placeholder"}
    assert placeholders - state == {"input_ids", "labels"}
    for name, node in theirs.items():
        assert ours[name].meta.get("shape") == node.meta.get("shape"), name
        if node.meta["metrics"] is None:
            continue
        for direction in ("fwd", "bwd"):
            expected = getattr(node.meta["metrics"], direction)
            got = getattr(ours[name].meta["metrics"], direction)
            assert (got is None) == (expected is None), (name, direction)
            if expected is not None:
                assert got.numel == expected.numel and got.rms == expected.rms, name


@pytest.mark.parametrize("transform", [unit_scale, simulate_fp8])
def test_variable_lengths_under_a_transform_reuse_one_dynamic_graph(transform: object) -> None:
    from unitscale.experiments.models import GPTConfig, plain_gpt

    model = transform(plain_gpt(GPTConfig(hidden_size=32, depth=1, heads=2, seq_len=64)))  # type: ignore[operator]
    outputs = {}
    for length in (16, 23, 37, 50, 19):
        ids = torch.randint(0, 256, (2, length))
        outputs[length] = (ids, model(ids, labels=ids))
    assert model.capture is not None and len(model.capture.pieces) <= 2
    # The caller's tensors carry no Dynamo marks (the marks are on internal aliases), and the
    # same tensor passed twice stays one graph input.
    assert not hasattr(ids, "_dynamo_weak_dynamic_indices")
    for piece in model.capture.pieces:
        nodes = [n for n in piece.graph.nodes if n.op == "placeholder"]
        inputs = [
            kind
            for kind, node in zip(piece.placeholders, nodes, strict=True)
            if kind[0] == "input" and isinstance(example_value(node), torch.Tensor)
        ]
        assert inputs == [("input", "input_ids")], inputs
    # Each length's loss equals that of a static capture of the same weights.
    for length, (ids, loss) in outputs.items():
        static = copy.deepcopy(model)
        assert torch.equal(static(ids, labels=ids), loss), length
