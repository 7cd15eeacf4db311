"""The coordinate check: u-μP keeps each layer's output and its change flat across width and
depth; the standard parametrisation does not.

Setup (both parametrisations): a fixed batch of 4 x 32 tokens, vocabulary 128, heads of
width 32, 3 optimiser steps at one learning rate for every size. u-μP:
``TransformerDecoder()`` (u-μP by default) with ``unitscale.optim.AdamW(lr=0.3)``. Standard
parametrisation: :class:`unitscale.models.PlainGPT` (GPT-2's N(0, 0.02) initialisation) with
``torch.optim.AdamW(lr=1e-2)``.

What is compared, per layer, after the last step: ``size`` (rms of the output) and
``change`` (rms of output minus its initial value). Across widths every layer is the same
coordinate. Across depths the *last* block's output and the logits are (block ``i`` of a deep
model holds a smaller share of the stream than block ``i`` of a shallow one, by design).
The embedding's change falls like ``1/sqrt(width)``: u-μP's embedding learning-rate rule
(``1/sqrt(width)``, see :func:`unitscale.optim.lr_scale_func_adam`) chose that on purpose;
the test checks the predicted ratio.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import unitscale as us
from unitscale.experiments.coord_check import coord_data, decoder_layers
from unitscale.models import GPTConfig, PlainGPT

VOCAB, BATCH, SEQ, STEPS = 128, 4, 32, 3
WIDTHS = [64, 128, 256, 512]
DEPTHS = [2, 4, 8]
# u-muP: max / min over sizes of each layer's size and change
FLAT = 2.0


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def umup_records(widths: list[int], depths: list[int], layers: Any) -> list[dict[str, Any]]:
    return coord_data(
        lambda w, d: us.TransformerDecoder(w, d, w // 32, VOCAB),
        lambda m: us.optim.AdamW(m.parameters(), lr=0.3, weight_decay=0.0),
        lambda m, b: m(*b),
        _batch(),
        widths,
        depths,
        layers,
        steps=STEPS,
    )


def sp_records(widths: list[int]) -> list[dict[str, Any]]:
    return coord_data(
        lambda w, d: PlainGPT(GPTConfig(VOCAB, w, d, w // 32, SEQ, aligned_labels=True)),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        lambda m, b: m(b[0], labels=b[1]),
        _batch(),
        widths,
        [2],
        lambda d: ["token_embedding", *(f"blocks.{i}" for i in range(d)), "lm_head"],
        steps=STEPS,
    )


def final(records: list[dict[str, Any]], layer: str, key: str) -> list[float]:
    return [r[key] for r in records if r["layer"] == layer and r["step"] == STEPS]


def spread(values: list[float]) -> float:
    return max(values) / min(values)


@pytest.mark.slow
def test_umup_is_flat_across_width_and_sp_is_not(single_thread: None) -> None:
    umup = umup_records(WIDTHS, [2], decoder_layers)
    for layer in ("layers.0", "layers.1", "readout"):
        for key in ("size", "change"):
            values = final(umup, layer, key)
            assert spread(values) < FLAT, (layer, key, values)
    embedding = final(umup, "embedding", "change")
    # u-muP's embedding rule: change ~ 1/sqrt(width), 512 vs 64 -> sqrt(8) = 2.83
    assert embedding[0] / embedding[-1] == pytest.approx(math.sqrt(8), rel=0.3)
    assert spread(final(umup, "embedding", "size")) < 1.1

    sp = sp_records(WIDTHS)
    logits_change = final(sp, "lm_head", "change")
    block_change = final(sp, "blocks.1", "change")
    # the standard parametrisation's updates grow with width
    assert logits_change[-1] / logits_change[0] > 4.0, logits_change
    assert block_change[-1] / block_change[0] > 10.0, block_change
    assert logits_change == sorted(logits_change)


@pytest.mark.slow
def test_umup_is_flat_across_depth(single_thread: None) -> None:
    records = umup_records([64], DEPTHS, lambda d: ["embedding", f"layers.{d - 1}", "readout"])
    for key in ("size", "change"):
        last_block = [
            r[key]
            for r in records
            if r["step"] == STEPS and r["layer"] == f"layers.{r['depth'] - 1}"
        ]
        assert len(last_block) == len(DEPTHS)
        assert spread(last_block) < FLAT, (key, last_block)
        for layer in ("embedding", "readout"):
            assert spread(final(records, layer, key)) < FLAT, (layer, key)


# --------------------------------------------------------------------------------------------
# the logits' change after 10 AdamW steps at lr 2^-6, width 256 over width 64
# --------------------------------------------------------------------------------------------

LOGIT_STEPS, LOGIT_LR, LOGIT_WIDTHS = 10, 2.0**-6, (64, 256)
# u-muP: the logits move the same at every width (the band below). Measured here (256 over
# 64): 0.97 default decoder (RoPE; 0.97 without), 0.83 unit_scale(Llama), 0.75
# unit_scale(GPT-2) (fixed norms, u-muP's residual rule; 0.75 and 0.80 with trainable norms
# and equal residual shares); an earlier unit_scale gave 1.44 and 1.36. Controls with
# torch's AdamW: plain unit scaling 2.51 (2.55 without RoPE), standard Llama 2.81.
TRANSFER_BAND = (0.5, 1.3)


def _llama(width: int) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
        num_attention_heads=width // 32, num_key_value_heads=width // 32,
        max_position_embeddings=SEQ, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _gpt2(width: int) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=width, n_layer=2, n_head=width // 32, n_positions=SEQ,
        attn_implementation="sdpa", bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def logit_change(make: Any, make_optimiser: Any, width: int, steps: int = LOGIT_STEPS) -> float:
    """rms of the logits' change on a fixed batch after ``steps`` steps on it."""
    torch.manual_seed(0)
    model = make(width)
    optimiser = make_optimiser(model)
    inputs, labels = _batch()
    with torch.no_grad():
        first = _logits(model, inputs)
    for _ in range(steps):
        optimiser.zero_grad()
        logits = _logits(model, inputs)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
        optimiser.step()
    with torch.no_grad():
        return (_logits(model, inputs) - first).pow(2).mean().sqrt().item()


def _umup_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return us.optim.AdamW(model.parameters(), LOGIT_LR, weight_decay=0.0)


def _torch_adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), LOGIT_LR, weight_decay=0.0)


def _unit_scaled(make: Any) -> Any:
    from unitscale.transforms import unit_scale

    return lambda width: unit_scale(make(width))


COORD_MODELS = {
    "default decoder": (lambda w: us.TransformerDecoder(w, 2, w // 32, VOCAB), _umup_adamw),
    "unit_scale(llama)": (_unit_scaled(_llama), _umup_adamw),
    "unit_scale(gpt2)": (_unit_scaled(_gpt2), _umup_adamw),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COORD_MODELS))
def test_logit_change_does_not_depend_on_width(name: str, single_thread: None) -> None:
    make, make_optimiser = COORD_MODELS[name]
    small, large = (logit_change(make, make_optimiser, w) for w in LOGIT_WIDTHS)
    assert TRANSFER_BAND[0] < large / small < TRANSFER_BAND[1], (small, large)


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        lambda w: us.TransformerDecoder(w, 2, w // 32, VOCAB, mup=False),  # unit scaling only
        _llama,  # the standard parametrisation
    ],
    ids=["plain unit scaling", "standard llama"],
)
def test_logit_change_control_fails_the_band(make: Any, single_thread: None) -> None:
    # With torch's AdamW (one rate for all), the logits' change grows with width: the
    # coordinate check above can fail (measured 2.55x and 2.81x, 64 -> 256).
    small, large = (logit_change(make, _torch_adamw, w) for w in LOGIT_WIDTHS)
    assert large / small > TRANSFER_BAND[1], (small, large)
