"""simulate_fp8's scope (``ops="linear"`` / ``"matmuls"``): the operands it rounds per op, on
the built-in models, transformers' GPT-2 (Conv1D) and mixture-of-experts models (grouped
matmuls), the summary of what it rounded, and torchao's recipe on the built-in GPT."""

from __future__ import annotations

import copy
import logging
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unitscale.data import example_batch
from unitscale.errors import UnitScaleError
from unitscale.models import GPTConfig, plain_gpt
from unitscale.modules import TransformerDecoder
from unitscale.transforms import FP8Summary, fp8_summary, scaling_cost, simulate_fp8, unit_scale

# FP8 mechanics on plain models without scales, on purpose: the warning that says so
# (tested in test_simulate_scaling.py) is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.* has no unit scaling:UserWarning")

_CONFIG = GPTConfig(hidden_size=32, depth=2, heads=2, seq_len=16)


def _rounded_per_op(model: nn.Module) -> dict[str, int]:
    """Operands rounded per op node (by op name) in the graphs of the model's last call."""
    counts: Counter[str] = Counter()
    for invocation in model.capture.last_trace:  # type: ignore[union-attr]
        for op, _operand in invocation.piece.data.get("simulate_format", []):
            counts[op] += 1
    return dict(counts)


def _kinds(model: nn.Module, op_names: dict[str, int]) -> dict[str, str]:
    """Op node name -> its target's name, for the ops in ``op_names``."""
    kinds = {}
    for invocation in model.capture.last_trace:  # type: ignore[union-attr]
        for node in invocation.piece.graph.nodes:
            if node.name in op_names:
                kinds[node.name] = getattr(node.target, "__name__", str(node.target))
    return kinds


@pytest.mark.parametrize("family", ["plain", "unit-scaled"])
def test_linear_scope_rounds_exactly_the_linear_operands_of_the_builtin_decoder(
    family: str,
) -> None:
    torch.manual_seed(0)
    if family == "plain":
        model: nn.Module = plain_gpt(_CONFIG)
    else:
        model = TransformerDecoder(32, 2, 2, 256)
    ids = example_batch(2, 16)["input_ids"]
    linears = 9  # per block: qkv, out, up, down (gated: up is one op); plus the readout
    per_scope = {}
    for ops in ("linear", "matmuls"):
        fp8 = simulate_fp8(model, ops=ops)  # type: ignore[arg-type]
        fp8(ids, labels=ids).backward()
        per_op = _rounded_per_op(fp8)
        per_scope[ops] = per_op
        kinds = _kinds(fp8, per_op)
        linear_ops = [op for op, kind in kinds.items() if "linear" in kind]
        attention = [op for op, kind in kinds.items() if "attention" in kind]
        assert len(linear_ops) == linears and all(per_op[op] == 2 for op in linear_ops)
        if ops == "linear":
            assert set(per_op) == set(linear_ops)  # nothing else is rounded
            summary = fp8_summary(fp8)
            assert len(summary.converted) == linears
            assert [reason for _, reason in summary.not_converted] == [
                "outside ops='linear'"
            ] * 2  # the two blocks' attention
        else:
            assert len(attention) == 2 and all(per_op[op] == 3 for op in attention)
            assert set(per_op) == {*linear_ops, *attention}
            assert not fp8_summary(fp8).not_converted
    assert sum(per_scope["linear"].values()) == 2 * linears
    assert sum(per_scope["matmuls"].values()) == 2 * linears + 6


def test_ops_is_a_recipe_field_and_an_argument() -> None:
    import dataclasses

    from unitscale.transforms import FP8_RECIPES

    recipe = dataclasses.replace(FP8_RECIPES["hardware"], ops="linear")
    torch.manual_seed(0)
    model = plain_gpt(_CONFIG)
    ids = example_batch(2, 16)["input_ids"]
    by_recipe = simulate_fp8(model, recipe=recipe)
    by_argument = simulate_fp8(model, ops="linear")
    overridden = simulate_fp8(model, recipe=recipe, ops="matmuls")
    for fp8 in (by_recipe, by_argument, overridden):
        fp8(ids, labels=ids)
    assert _rounded_per_op(by_recipe) == _rounded_per_op(by_argument)
    assert sum(_rounded_per_op(overridden).values()) == 24
    assert simulate_fp8(model).passes[-1].ops == "matmuls"  # type: ignore[attr-defined]


def test_summary_errors_and_text() -> None:
    with pytest.raises(UnitScaleError, match="not a transformed model"):
        fp8_summary(nn.Linear(2, 2))
    fp8 = simulate_fp8(nn.Linear(2, 2))
    with pytest.raises(UnitScaleError, match="has not been called"):
        fp8_summary(fp8)
    unit = unit_scale(nn.Linear(4, 4))
    unit(torch.ones(2, 4))
    with pytest.raises(UnitScaleError, match="runs no FP8 transform"):
        fp8_summary(unit)
    fp8(torch.ones(3, 2))
    assert fp8_summary(fp8) == FP8Summary("simulate_fp8", ("linear",), ())
    assert str(fp8_summary(fp8)) == "simulate_fp8: 1 op(s) in FP8, every matmul-like op"


class _RawMM(nn.Module):
    """A matmul through an aten op that simulate_fp8 has no table entry for."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.aten.mm.default(x, self.weight) + F.linear(x, self.weight)


def test_an_unrecognised_matmul_is_reported_and_warned_about() -> None:
    fp8 = simulate_fp8(_RawMM())
    with pytest.warns(UserWarning, match=r"1 matmul-like op\(s\) run in the model's own"):
        fp8(torch.randn(3, 4))
    summary = fp8_summary(fp8)
    assert summary.converted == ("linear",)
    ((_, reason),) = summary.not_converted
    assert "not recognised" in reason


# -- transformers: GPT-2's Conv1D and mixture-of-experts grouped matmuls ------------------------


def _transformers() -> Any:
    return pytest.importorskip("transformers")


def _gpt2() -> nn.Module:
    transformers = _transformers()
    config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32)
    return transformers.GPT2LMHeadModel(config)


def _moe(name: str) -> nn.Module:
    transformers = _transformers()
    common = dict(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=128,
    )  # fmt: skip
    if name == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        return transformers.MixtralForCausalLM(config)
    config = transformers.Qwen3MoeConfig(
        **common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16
    )
    return transformers.Qwen3MoeForCausalLM(config)


def _run(model: nn.Module) -> nn.Module:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        # No op skipped with a warning (nor silently: the counts below).
        warnings.filterwarnings("error", message="simulate_fp8", category=UserWarning)
        # ...though a plain model without scales is warned about (tested elsewhere)
        warnings.filterwarnings("ignore", message=r".* has no unit scaling", category=UserWarning)
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return model


@pytest.mark.slow
@pytest.mark.parametrize("unit_scaled", [False, True], ids=["plain", "unit_scaled"])
def test_gpt2_conv1d_matmuls_are_rounded(unit_scaled: bool) -> None:
    torch.manual_seed(0)
    model = _gpt2()
    if unit_scaled:
        model = unit_scale(model)
    for ops, expected in (("matmuls", 24), ("linear", 18)):
        fp8 = _run(simulate_fp8(model, ops=ops))  # type: ignore[arg-type]
        per_op = _rounded_per_op(fp8)
        kinds = _kinds(fp8, per_op)
        addmm = [op for op, kind in kinds.items() if "addmm" in kind]
        # Each block: c_attn, c_proj (attention), c_fc, c_proj (MLP): 2 operands each.
        assert len(addmm) == 8 and all(per_op[op] == 2 for op in addmm), per_op
        assert sum(per_op.values()) == expected  # + the readout's 2, + attention's 3 x 2
        assert len(fp8_summary(fp8).converted) == (11 if ops == "matmuls" else 9)


def _grouped_nodes(model: nn.Module) -> list[Any]:
    return [
        node
        for invocation in model.capture.last_trace  # type: ignore[union-attr]
        for node in invocation.piece.graph.nodes
        if "grouped_mm" in str(node.target)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_grouped_matmuls_are_rounded(name: str) -> None:
    torch.manual_seed(0)
    model = _moe(name)
    reference = copy.deepcopy(model)
    fp8 = _run(simulate_fp8(model))
    grouped = _grouped_nodes(fp8)
    assert len(grouped) == 2  # the experts' gate-up and down projections
    per_op = _rounded_per_op(fp8)
    for node in grouped:
        assert per_op[node.name] == 2  # the routed tokens and the experts' weights
    # The gradient at every rounded op's output is rounded too (E5M2), the grouped ones'
    # included: with tensorwise scaling, one scaled rounding per op in the backward.
    scaled = _run(simulate_fp8(model, scaling="tensorwise"))
    converted = fp8_summary(scaled).converted
    assert scaling_cost(scaled).backward == len(converted) == len(fp8_summary(fp8).converted)
    # The experts' weights get gradients through the rounded operands, and FP8 changes them.
    rounded_grads = [p.grad for n, p in fp8.named_parameters() if "experts" in n]
    out = reference(**_ids())
    out.loss.backward()
    exact = [p.grad for n, p in reference.named_parameters() if "experts" in n]
    assert rounded_grads and all(g is not None for g in rounded_grads)
    assert any(not torch.equal(a, b) for a, b in zip(rounded_grads, exact, strict=True))
    # With ops="linear", the grouped matmuls are reported, not silently skipped.
    linear = _run(simulate_fp8(model, ops="linear"))
    left = dict(fp8_summary(linear).not_converted)
    assert sum(1 for reason in left.values() if reason == "outside ops='linear'") == 3


def _ids() -> dict[str, Tensor]:
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def test_summary_is_logged_once_at_capture(caplog: pytest.LogCaptureFixture) -> None:
    fp8 = simulate_fp8(nn.Linear(2, 2), ops="linear")
    with caplog.at_level(logging.INFO, logger="unitscale"):
        fp8(torch.ones(1, 2))
        fp8(torch.ones(1, 2))  # the same graph: not captured again, not logged again
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("simulate_fp8")]
    assert lines == ["simulate_fp8: 1 op(s) in FP8, every matmul-like op (graph 0)"]
