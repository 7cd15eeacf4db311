"""u-μP parameter tags: on every module, through copies, state dicts, transforms and compile."""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable

import pytest
import torch
import torch._dynamo.testing
from torch import nn

import unitscale as us
from unitscale.parameter import (
    Parameter,
    ParameterTagError,
    has_mup_tags,
    tag_model,
    tag_module,
    tag_parameter,
)
from unitscale.transforms import compile, simulate_format, simulate_fp8, track_scales, unit_scale


def tags(module: nn.Module) -> dict[str, tuple[str, int | None]]:
    return {
        name: (p.mup_type, p.mup_scaling_depth)  # type: ignore[attr-defined]
        for name, p in module.named_parameters()
    }


def assert_all_tagged(module: nn.Module) -> None:
    untagged = [n for n, p in module.named_parameters() if not has_mup_tags(p)]
    assert not untagged, untagged
    assert all(isinstance(p, Parameter) for p in module.parameters())


MODULES: dict[str, Callable[[], nn.Module]] = {
    "Linear": lambda: us.Linear(8, 4),
    "LinearReadout": lambda: us.LinearReadout(8, 4),
    "Conv1d": lambda: us.Conv1d(4, 4, 3),
    "LayerNorm": lambda: us.LayerNorm(8),
    "RMSNorm": lambda: us.RMSNorm(8),
    "Embedding": lambda: us.Embedding(10, 8),
    "MLP": lambda: us.MLP(8, bias=True),
    "MHSA": lambda: us.MHSA(8, heads=2, bias=True),
    "TransformerLayer": lambda: us.TransformerLayer(8, heads=2),
    "TransformerDecoder": lambda: us.TransformerDecoder(8, depth=3, heads=2, vocab_size=10),
}

EXPECTED_TYPES = {
    "Linear": {"weight": "weight", "bias": "bias"},
    "LinearReadout": {"weight": "output", "bias": "bias"},
    "Conv1d": {"weight": "weight", "bias": "bias"},
    "LayerNorm": {"weight": "norm", "bias": "bias"},
    "RMSNorm": {"weight": "norm"},
    "Embedding": {"weight": "weight"},
}


@pytest.mark.parametrize("name", list(MODULES))
def test_every_module_tags_its_parameters(name: str) -> None:
    module = MODULES[name]()
    assert_all_tagged(module)
    if name in EXPECTED_TYPES:
        assert {n: t for n, (t, _) in tags(module).items()} == EXPECTED_TYPES[name]


def test_decoder_tags_types_and_depth() -> None:
    model = us.TransformerDecoder(8, depth=3, heads=2, vocab_size=10, trainable_norms=True)
    found = tags(model)
    assert found["embedding.weight"] == ("weight", None)
    assert found["readout.weight"] == ("output", None)
    assert found["final_norm.weight"] == ("norm", None)
    assert found["layers.2.attn.qkv.weight"] == ("weight", 3)
    assert found["layers.0.mlp_norm.weight"] == ("norm", 3)
    assert {d for n, (_, d) in found.items() if n.startswith("layers.")} == {3}
    gpt = us.TransformerDecoder(8, 3, 2, 10, trainable_norms=True, block="gpt")  # LayerNorm
    assert tags(gpt)["layers.0.mlp_norm.bias"] == ("bias", 3)


def test_parameter_is_an_nn_parameter_and_checks_its_tags() -> None:
    p = Parameter(torch.ones(3), "norm", 2)
    assert isinstance(p, nn.Parameter) and p.requires_grad
    assert "mup_type='norm'" in repr(p)
    with pytest.raises(ParameterTagError, match="mup_type='hidden'"):
        Parameter(torch.ones(3), "hidden")
    with pytest.raises(ParameterTagError, match="mup_scaling_depth=0"):
        Parameter(torch.ones(3), "weight", 0)
    with pytest.raises(ParameterTagError, match=r"expected an nn\.Parameter"):
        tag_parameter(torch.ones(3), "weight")  # type: ignore[arg-type]


def test_tag_parameter_keeps_identity_and_ties() -> None:
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    model = nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tag_module(model, output=head.weight)
    assert head.weight is emb.weight and emb.weight.mup_type == "output"  # type: ignore[attr-defined]
    assert opt.param_groups[0]["params"][0] is emb.weight


# --------------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------------


def _decoder() -> nn.Module:
    return us.TransformerDecoder(8, depth=2, heads=2, vocab_size=10, mup=True)


def test_tags_survive_deepcopy_pickle_and_torch_save() -> None:
    model = _decoder()
    expected = tags(model)
    assert tags(copy.deepcopy(model)) == expected
    assert tags(pickle.loads(pickle.dumps(model))) == expected
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert tags(torch.load(buffer, weights_only=False)) == expected
    p = Parameter(torch.ones(2), "bias", 4)
    copied = copy.deepcopy(p)
    assert copied is not p and torch.equal(copied, p) and copied.mup_scaling_depth == 4


def test_tags_survive_to_and_load_state_dict() -> None:
    model = _decoder()
    expected = tags(model)
    model.to(torch.float64)
    assert tags(model) == expected
    assert model.readout.weight.dtype == torch.float64
    model.load_state_dict(_decoder().double().state_dict())
    assert tags(model) == expected
    model.half().float()
    assert tags(model) == expected
    assert_all_tagged(model)


# --------------------------------------------------------------------------------------------
# transforms and compile
# --------------------------------------------------------------------------------------------


class PlainBlock(nn.Module):
    """A plain PyTorch model with a norm, a residual add and a readout."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.up(self.norm(x)))

    def get_output_embeddings(self) -> nn.Module:
        return self.head


TRANSFORMS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "unit_scale": unit_scale,
    "simulate_fp8": simulate_fp8,
    "simulate_format": lambda m: simulate_format(m, "e4m3", "e5m2"),
    "track_scales": track_scales,
    "compile": compile,
    "fp8 of unit_scale": lambda m: simulate_fp8(unit_scale(m)),
    "track of fp8 of unit_scale": lambda m: track_scales(simulate_fp8(unit_scale(m))),
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.slow) if name == "compile" else name
        for name in TRANSFORMS
    ],
)
def test_transforms_keep_tags(name: str) -> None:
    model = us.TransformerDecoder(8, depth=2, heads=2, vocab_size=10, mup=True)
    expected = tags(model)
    transformed = TRANSFORMS[name](model)
    assert tags(transformed) == expected
    ids = torch.randint(0, 10, (2, 6))
    transformed(ids, ids).backward()
    assert tags(transformed) == expected
    assert_all_tagged(copy.deepcopy(transformed))
    assert tags(pickle.loads(pickle.dumps(transformed))) == expected


def test_unit_scale_tags_a_plain_model() -> None:
    model = unit_scale(PlainBlock())
    assert {n: t for n, (t, _) in tags(model).items()} == {
        "norm.weight": "norm",
        "norm.bias": "bias",
        "up.weight": "weight",
        "up.bias": "bias",
        "head.weight": "output",
    }
    us.optim.AdamW(model.parameters(), lr=0.1)  # every parameter has a rule


@pytest.mark.slow
def test_unit_scale_tags_a_transformers_model() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=3, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
        bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip
    model = unit_scale(transformers.GPT2LMHeadModel(config))
    found = tags(model)
    assert_all_tagged(model)
    # unit_scale unties lm_head from wte: u-muP's readout and embedding differ
    assert found["transformer.wte.weight"] == ("weight", None)
    assert found["lm_head.weight"] == ("output", None)
    assert found["transformer.h.1.attn.c_attn.weight"] == ("weight", 3)
    assert found["transformer.h.0.ln_1.weight"] == ("norm", 3)
    assert found["transformer.ln_f.bias"] == ("bias", None)
    opt = us.optim.AdamW(model.named_parameters(), lr=0.05)
    ids = torch.randint(0, 64, (2, 16))
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_tag_model_finds_the_residual_stack() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(5))
            self.mixed = nn.ModuleList([nn.Linear(4, 4), nn.LayerNorm(4)])

    net = tag_model(Net())
    assert {p.mup_scaling_depth for p in net.blocks.parameters()} == {5}  # type: ignore[attr-defined]
    assert {p.mup_scaling_depth for p in net.mixed.parameters()} == {None}  # type: ignore[attr-defined]


def test_torch_compile_of_a_tagged_model_is_one_graph() -> None:
    torch._dynamo.reset()  # other tests compiled this forward: start from its first compile
    counter = torch._dynamo.testing.CompileCounter()
    model = us.TransformerDecoder(8, depth=2, heads=2, vocab_size=10, mup=True, attn_mult=2.0)
    expected = tags(model)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    ids = torch.randint(0, 10, (2, 6))
    loss = compiled(ids, ids)
    loss.backward()
    assert counter.frame_count == 1
    assert tags(model) == expected
    assert loss.item() == pytest.approx(model(ids, ids).item(), rel=1e-5)


def test_depth_containers_set_depth_and_follow_appends() -> None:
    layers = us.DepthModuleList([us.Linear(4, 4), us.Linear(4, 4)])
    assert {p.mup_scaling_depth for p in layers.parameters()} == {2}  # type: ignore[attr-defined]
    layers.append(us.Linear(4, 4))
    assert {p.mup_scaling_depth for p in layers.parameters()} == {3}  # type: ignore[attr-defined]
    seq = us.DepthSequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert tags(seq) == {
        "0.weight": ("weight", 2),
        "0.bias": ("bias", 2),
        "1.weight": ("norm", 2),
        "1.bias": ("bias", 2),
    }
    seq.append(nn.Linear(4, 4))
    assert {d for _, d in tags(seq).values()} == {3}
    assert torch.equal(seq(torch.ones(1, 4)), seq[2](seq[1](seq[0](torch.ones(1, 4)))))


def test_plain_readout_is_not_tagged_as_a_mup_readout() -> None:
    # A plain unit-scaled readout (1/sqrt(fan_in)) is applied like a hidden weight: u-muP
    # optimisers must give it the weight rule, not the u-muP readout's lr x 1.
    plain = us.TransformerDecoder(8, depth=2, heads=2, vocab_size=10, mup=False)
    assert plain.readout.weight.mup_type == "weight"  # type: ignore[attr-defined]
    opt = us.optim.AdamW(plain.parameters(), lr=1.0)
    lr_of = {id(p): g["lr"] * g.get("lr_scale", 1.0) for g in opt.param_groups for p in g["params"]}
    assert lr_of[id(plain.readout.weight)] == pytest.approx(1 / 8**0.5)
    mup = us.TransformerDecoder(8, depth=2, heads=2, vocab_size=10)
    assert mup.readout.weight.mup_type == "output"  # type: ignore[attr-defined]
