"""Beyond GPT-2 and BERT: transformers architectures built from tiny configs, as users run them.

One model per family: decoder-only (Llama with grouped-query attention, GPT-NeoX with
rotary embeddings), mixture-of-experts (Mixtral: data-dependent routing), encoder-only
(RoBERTa), encoder-decoder (T5 with relative position buckets, BART) and vision (ViT).
Random weights from a config: nothing is downloaded.

For each: ``track_scales`` is captured whole (no warning: the suite turns unitscale's
UserWarnings into errors), its loss and every parameter gradient are bit-identical to the
untracked model's under the same seed, and every parameter that gets a gradient has forward
and backward statistics; ``unit_scale`` tags every parameter for u-μP and keeps the
parameter names; ``simulate_fp8`` of it changes the loss (FP8 rounding really happens) by
less than 5%.

Nothing is skipped silently: for each transform, :data:`UNSAID` holds a check that lists the
ops (or parameters) the transform neither handled nor reported; it must list none. A
transform that reports what it skips adds its check there (``simulate_fp8`` and ``to_fp8``:
every matmul-like op of the captured graphs is in ``fp8_summary``, converted or not
converted with a reason).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from unitscale.capture import TransformedModule
from unitscale.parameter import has_mup_tags
from unitscale.transforms import (
    fp8_summary,
    simulate_fp8,
    to_fp8,
    track_scales,
    tracking_coverage,
    unit_scale,
    unit_scale_summary,
)
from unitscale.transforms.lowp import _gemm
from unitscale.transforms.lowp._operands import matmul_operands
from unitscale.transforms.lowp._ops import looks_matmul_like

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

_HIDDEN = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
_SEQ2SEQ = dict(d_model=64, vocab_size=128)


def _llama() -> nn.Module:
    config = transformers.LlamaConfig(**_HIDDEN, vocab_size=128, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def _gpt_neox() -> nn.Module:
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**_HIDDEN, vocab_size=128))


def _mixtral() -> nn.Module:
    config = transformers.MixtralConfig(
        **_HIDDEN, vocab_size=128, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(config)


def _roberta() -> nn.Module:
    return transformers.RobertaForMaskedLM(transformers.RobertaConfig(**_HIDDEN, vocab_size=128))


def _t5() -> nn.Module:
    config = transformers.T5Config(
        **_SEQ2SEQ, d_ff=128, num_layers=2, num_heads=4, d_kv=16, decoder_start_token_id=0
    )
    return transformers.T5ForConditionalGeneration(config)


def _bart() -> nn.Module:
    config = transformers.BartConfig(
        **_SEQ2SEQ, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
    )  # fmt: skip
    return transformers.BartForConditionalGeneration(config)


def _vit() -> nn.Module:
    config = transformers.ViTConfig(**_HIDDEN, image_size=32, patch_size=8, num_labels=10)
    return transformers.ViTForImageClassification(config)


def _text_inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (2, 16))
    return {"input_ids": ids, "labels": ids}


def _seq2seq_inputs() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 128, (2, 16)), "labels": torch.randint(0, 128, (2, 8))}


def _image_inputs() -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.tensor([1, 7])}


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], dict[str, torch.Tensor]]]] = {
    "llama": (_llama, _text_inputs),
    "gpt_neox": (_gpt_neox, _text_inputs),
    "mixtral": (_mixtral, _text_inputs),
    "roberta": (_roberta, _text_inputs),
    "t5": (_t5, _seq2seq_inputs),
    "bart": (_bart, _seq2seq_inputs),
    "vit": (_vit, _image_inputs),
}


# Measured on torch 2.8.0 (transformers 5.20, Python 3.10), fine on 2.13 and 2.14: older
# Dynamo breaks these graphs where newer releases do not, and some ops then run between the
# captured pieces, outside tracking. Strict: a case that starts passing must be unmarked.
_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
KNOWN_ON_TORCH_BEFORE_2_13 = {
    ("tracking", "llama"): "the embedding's gradient differs from the untracked model's",
    ("tracking", "mixtral"): "the embedding's gradient differs from the untracked model's",
    ("fp8", "vit"): "simulated FP8 moves the loss by 7% (2.39 vs 2.58)",
    ("fp8", "bart"): "layernorm_embedding runs between captured pieces: unit_scale warns so",
}


def _known_failure(request: pytest.FixtureRequest, test: str, name: str) -> None:
    reason = KNOWN_ON_TORCH_BEFORE_2_13.get((test, name))
    if reason is not None and _TORCH < (2, 13):
        request.applymarker(pytest.mark.xfail(strict=True, reason=f"torch < 2.13: {reason}"))


def _loss_and_grads(model: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(1)  # dropout, where a config has it, draws the same masks
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _float_ops(graph: torch.fx.Graph) -> list[str]:
    """Names of the op nodes of a captured graph (as Dynamo gave it) with a float output."""
    found = []
    for node in graph.nodes:
        value = node.meta.get("example_value")
        if node.op.startswith("call_") and isinstance(value, torch.Tensor):
            if value.is_floating_point():
                found.append(node.name)
    return found


def _unit_scale_unsaid(model: TransformedModule) -> list[str]:
    """Float ops of ``unit_scale``'s graphs that are neither replaced, nor reported as left
    as they are, nor scale-neutral; and the ops it left as they are if nothing said so."""
    unsaid = []
    summary = unit_scale_summary(model)
    assert model.capture is not None
    for invocation in model.capture.last_trace:
        data = invocation.piece.data["unit_scale"]
        said = set(data["replaced"]) | {name for name, *_ in data["residual_adds"]}
        said |= {name for name, _ in data["left_as_is"]} | set(data["scale_neutral"])
        if data["left_as_is"] and not data.get("reported"):
            unsaid.extend(f"{name} (not logged)" for name, _ in data["left_as_is"])
        unsaid.extend(name for name in _float_ops(invocation.piece.graph) if name not in said)
    assert len(summary.left_as_is) == sum(
        len(inv.piece.data["unit_scale"]["left_as_is"]) for inv in model.capture.last_trace
    )
    return unsaid


def _track_scales_unsaid(model: TransformedModule) -> list[str]:
    """Parameters that got a gradient but have no node in ``scales_graph()``, unless
    ``tracking_coverage`` reports them (the call also warned: the suite makes that fail)."""
    graph = model.scales_graph()
    nodes = {n.meta["clean_name"] for n in graph.nodes if n.op == "placeholder"}
    reported = set(tracking_coverage(model).missing_parameters)
    used = [n for n, p in model.named_parameters() if p.grad is not None]
    return [n for n in used if n not in nodes and n not in reported]


def _matmul_like(node: torch.fx.Node) -> bool:
    return bool(matmul_operands(node)) or node.target is torch.einsum or looks_matmul_like(node)


def _fp8_unsaid(transform: str) -> Callable[[TransformedModule], list[str]]:
    """Per captured graph of the last call: matmul-like ops of the graph as Dynamo gave it
    that ``fp8_summary`` neither lists as converted nor as not converted (with a reason)."""

    def unsaid(model: TransformedModule) -> list[str]:
        summary = fp8_summary(model, transform)
        assert model.capture is not None
        out = [f"{op}: no reason" for op, reason in summary.not_converted if not reason]
        pieces = {id(inv.piece): inv.piece for inv in model.capture.last_trace}.values()
        for piece in pieces:
            converted, left = piece.data["fp8_summary"][transform]
            ops = [n.name for n in piece.graph.nodes if _matmul_like(n)]
            if len(ops) != len(converted) + len(left):
                out.append(f"graph {piece.index}: {ops} against {converted} and {left}")
        return out

    return unsaid


#: Per transform, what it skipped without saying so (see the module docstring).
UNSAID: dict[str, Callable[[TransformedModule], list[str]]] = {
    "unit_scale": _unit_scale_unsaid,
    "track_scales": _track_scales_unsaid,
    "simulate_fp8": _fp8_unsaid("simulate_fp8"),
    "to_fp8": _fp8_unsaid("to_fp8"),
}


def _call_strictly(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The model's loss; a transform's UserWarning (an op it could not handle) fails."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "error", category=UserWarning, message=r"(unit_scale|track_scales|simulate_)"
        )
        return model(**inputs).loss


@pytest.fixture(params=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[str, nn.Module, dict[str, torch.Tensor]]:
    build, make_inputs = CASES[request.param]
    model = build().train()
    model.config.use_cache = False
    return request.param, model, make_inputs()


def test_tracking_is_whole_and_bit_identical(
    case: tuple[str, nn.Module, dict], request: pytest.FixtureRequest
) -> None:
    name, model, inputs = case
    _known_failure(request, "tracking", name)
    tracked = track_scales(model)
    loss, grads = _loss_and_grads(tracked, inputs)
    expected_loss, expected_grads = _loss_and_grads(model, inputs)
    assert torch.equal(loss, expected_loss), name
    assert grads.keys() == expected_grads.keys(), name
    for key, grad in expected_grads.items():
        assert torch.equal(grads[key], grad), (name, key)

    graph = tracked.scales_graph()
    params = {
        node.meta["clean_name"]: node.meta["metrics"]
        for node in graph.nodes
        if node.op == "placeholder" and node.meta.get("requires_grad")
    }
    assert set(expected_grads) <= set(params), (name, set(expected_grads) - set(params))
    for key in expected_grads:
        metrics = params[key]
        assert metrics.fwd is not None and metrics.bwd is not None, (name, key)
        assert metrics.bwd.numel == expected_grads[key].numel(), (name, key)
    float_nodes = [n for n in graph.nodes if n.meta.get("outputs_float_tensor")]
    assert all(n.meta["metrics"].fwd is not None for n in float_nodes), name
    assert tracking_coverage(tracked).complete, (name, str(tracking_coverage(tracked)))
    assert not UNSAID["track_scales"](tracked), name


def test_unit_scale_and_fp8_simulation(
    case: tuple[str, nn.Module, dict], request: pytest.FixtureRequest
) -> None:
    name, model, inputs = case
    _known_failure(request, "fp8", name)
    scaled = unit_scale(model)
    _call_strictly(scaled, inputs)
    assert not UNSAID["unit_scale"](scaled), name
    loss, grads = _loss_and_grads(scaled, inputs)
    assert torch.isfinite(loss), name
    assert all(torch.isfinite(g).all() for g in grads.values()), name
    # the same parameters, plus the output head where u-muP untied it from the embedding
    names = [n for n, _ in scaled.named_parameters()]
    assert set(names) >= {n for n, _ in model.named_parameters()}
    assert set(names) <= {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert scaled.state_dict().keys() == model.state_dict().keys()
    untagged = [n for n, p in scaled.named_parameters() if not has_mup_tags(p)]
    assert not untagged, (name, untagged)

    fp8 = simulate_fp8(scaled)
    fp8_loss, _ = _loss_and_grads(fp8, inputs)
    assert not UNSAID["simulate_fp8"](fp8), name
    assert not torch.equal(fp8_loss, loss), name  # the operands were really rounded
    assert abs(fp8_loss - loss) / loss < 0.05, (name, fp8_loss.item(), loss.item())
    if _gemm.float8_device_error("cpu") is None:  # real FP8: the linear ops' scope
        real = to_fp8(scaled)
        _loss_and_grads(real, inputs)
        assert not UNSAID["to_fp8"](real), name
        assert fp8_summary(real).converted, name
