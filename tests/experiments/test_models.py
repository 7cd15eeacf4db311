"""The built-in GPT-style models: configuration, behaviour and determinism."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from unitscale.errors import UnitScaleError
from unitscale.experiments.data import example_batch
from unitscale.experiments.models import (
    GPTConfig,
    ModelConfigError,
    PlainGPT,
    UnitScaledGPT,
    plain_gpt,
    unit_scaled_gpt,
)

SMALL = GPTConfig(hidden_size=32, depth=2, heads=4, seq_len=32)


def _by_hand(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@pytest.mark.slow
def test_example_batch_gives_a_transformers_causal_lm_its_loss_with_one_shift() -> None:
    """``model(**example_batch(...))``: a transformers causal LM shifts ``labels`` itself, so
    its loss is that of its logits at positions ``0..T-2`` against ``input_ids[:, 1:]``
    (one shift, not two)."""
    transformers = pytest.importorskip("transformers")
    batch = example_batch(2, 16, seed=0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    lm = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        loss = lm(**batch).loss
        logits = lm(input_ids=batch.input_ids).logits
    torch.testing.assert_close(loss, _by_hand(logits[:, :-1], batch.input_ids[:, 1:]))


@pytest.mark.parametrize("build", [plain_gpt, unit_scaled_gpt])
def test_built_in_models_take_example_batch_as_transformers_does(build: Any) -> None:
    """The built-in models take ``model(**batch)`` like a transformers causal LM (one shift
    inside) and, built with ``aligned_labels=True``, the already-shifted ``Batch.targets``
    (every position scored)."""
    batch = example_batch(2, 16, seed=0)
    model = build(SMALL, seed=0).eval()
    aligned = build(dataclasses.replace(SMALL, aligned_labels=True), seed=0).eval()
    with torch.no_grad():
        logits = model(batch.input_ids)
        by_hand = _by_hand(logits[:, :-1], batch.input_ids[:, 1:])
        torch.testing.assert_close(model(**batch), by_hand, rtol=1e-5, atol=1e-5)
        got = aligned(batch.input_ids, labels=batch.targets)
        torch.testing.assert_close(got, _by_hand(logits, batch.targets), rtol=1e-5, atol=1e-5)


def test_config_validates_and_derives_sizes() -> None:
    config = GPTConfig()
    assert (config.vocab_size, config.hidden_size, config.heads) == (256, 128, 4)
    assert config.head_size == 32 and config.mlp_size == 512
    with pytest.raises(ModelConfigError, match="hidden_size=30 must be a multiple of heads=4"):
        GPTConfig(hidden_size=30)
    with pytest.raises(UnitScaleError, match="depth=0 must be a positive integer"):
        GPTConfig(depth=0)
    with pytest.raises(ModelConfigError, match=r"dropout=1.0 must be in \[0, 1\)"):
        GPTConfig(dropout=1.0)


def test_plain_gpt_loss_at_init_is_uniform_cross_entropy() -> None:
    model = plain_gpt(SMALL, seed=0)
    batch = example_batch(4, 32, seed=0)
    loss = model(**batch)
    assert loss.shape == ()
    # N(0, 0.02) weights give near-zero logits: cross-entropy close to log(256).
    assert abs(loss.item() - math.log(256)) < 0.05
    logits = model(batch.input_ids)
    assert logits.shape == (4, 32, 256)


def test_plain_gpt_is_deterministic_and_keeps_global_rng() -> None:
    state = torch.get_rng_state()
    a, b, c = plain_gpt(SMALL, seed=1), plain_gpt(SMALL, seed=1), plain_gpt(SMALL, seed=2)
    assert torch.equal(torch.get_rng_state(), state)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_plain_gpt_is_causal_and_honours_the_padding_mask() -> None:
    model = plain_gpt(SMALL, seed=0).eval()
    ids = example_batch(1, 16, seed=0).input_ids
    changed = ids.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    with torch.no_grad():
        before, after = model(ids), model(changed)
    assert torch.equal(before[:, :10], after[:, :10])  # the past cannot see the future
    assert not torch.allclose(before[:, 10:], after[:, 10:])
    # A key masked out as padding does not influence any other position.
    mask = torch.ones_like(ids)
    mask[0, 3] = 0
    with torch.no_grad():
        masked = model(ids, attention_mask=mask)
        masked_changed = model(
            torch.where(torch.arange(16) == 3, (ids + 7) % 256, ids), attention_mask=mask
        )
    others = torch.arange(16) != 3
    torch.testing.assert_close(masked[:, others], masked_changed[:, others], rtol=0, atol=1e-6)
    assert torch.isfinite(masked).all()


def test_plain_gpt_residual_adds_are_plain_adds_in_forward() -> None:
    # A graph transform finds residual adds as `x = x + ...` in the blocks' forward.
    import inspect

    from unitscale.experiments.models import Block

    source = inspect.getsource(Block.forward)
    assert "x = x + self.attn(" in source and "x = x + self.mlp(" in source


def test_plain_gpt_trains_on_bundled_text() -> None:
    model = plain_gpt(SMALL, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batch = example_batch(8, 32, seed=0)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = model(**batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 1.0


def test_inputs_are_checked() -> None:
    model = plain_gpt(SMALL)
    with pytest.raises(ModelConfigError, match=r"sequence length 40 exceeds config\.seq_len=32"):
        model(torch.zeros(1, 40, dtype=torch.long))
    with pytest.raises(ModelConfigError, match=r"must have shape \(batch, seq_len\)"):
        model(torch.zeros(40, dtype=torch.long))
    assert isinstance(model, PlainGPT)


def _scales(model: torch.nn.Module) -> object:
    from unitscale.analysis import graph_to_dataframe
    from unitscale.transforms import track_scales

    tracked = track_scales(model)
    tracked(**example_batch(4, 32, seed=0)).backward()
    df = graph_to_dataframe(tracked.scales_graph())
    ops = ("linear", "layer_norm", "add", "gelu", "scaled_dot_product_attention")
    return df[~df.weight & df.op.isin(ops)]


def test_unit_scaled_twin_matches_the_plain_layout() -> None:
    plain, twin = plain_gpt(SMALL, seed=0), unit_scaled_gpt(SMALL, seed=0)
    assert isinstance(twin, UnitScaledGPT)
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in twin.named_parameters()]
    assert all(
        a.shape == b.shape for a, b in zip(plain.parameters(), twin.parameters(), strict=True)
    )
    batch = example_batch(4, 32, seed=0)
    assert twin(batch.input_ids).shape == (4, 32, 256)
    loss = twin(**batch)
    assert loss.shape == () and abs(loss.item() - math.log(256)) < 0.5
    state = torch.get_rng_state()
    again = unit_scaled_gpt(SMALL, seed=0)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(again.lm_head.weight, twin.lm_head.weight)
    with pytest.raises(ModelConfigError, match="attention_mask has zeros"):
        twin(batch.input_ids, attention_mask=torch.zeros_like(batch.input_ids))


def test_unit_scaled_twin_keeps_activations_and_gradients_near_unit_scale() -> None:
    config = GPTConfig(hidden_size=64, depth=1, seq_len=32)
    twin = _scales(unit_scaled_gpt(config, seed=0))
    plain = _scales(plain_gpt(config, seed=0))
    assert len(twin) >= 2 * 8  # embedding add, norms, linears, attention, gelu, residual adds
    # Unit scaling: every op's output and gradient rms within a factor ~2.5 of 1 ...
    assert twin.rms.between(0.4, 2.5).all(), twin[["name", "direction", "rms"]]
    # ... where the plain model's gradients are orders of magnitude smaller.
    assert plain[plain.direction == "bwd"].rms.max() < 0.05
