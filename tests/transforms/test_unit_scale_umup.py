"""unit_scale's u-μP scheme: fixed norms, the paper's residual rule (Appendix G)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import unitscale as us
import unitscale.functional as U
from unitscale.transforms import ResidualTau, unit_scale

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 16


def _llama(layers: int, width: int = 64) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=SEQ, attn_implementation="sdpa", use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _gpt2(layers: int = 2, width: int = 64) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=width, n_layer=layers, n_head=2, n_positions=SEQ,
        attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _norms(model: nn.Module) -> dict[str, nn.Parameter]:
    return {
        f"{prefix}.{name}": param
        for prefix, sub in model.named_modules()
        if type(sub).__name__.endswith("Norm")
        for name, param in sub.named_parameters(recurse=False)
    }


@pytest.mark.slow
@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_norms_are_fixed_and_linear_biases_train(make: object) -> None:
    model = unit_scale(make(2))  # type: ignore[operator]
    norms = _norms(model.module)
    assert norms  # the test can tell: the model has norm parameters
    for name, param in norms.items():
        assert not param.requires_grad, name
        expected = 0.0 if name.endswith("bias") else 1.0
        assert torch.equal(param, torch.full_like(param, expected)), name
    trainable = {n: p for n, p in model.module.named_parameters() if p.requires_grad}
    assert not set(norms) & set(trainable)
    biases = {n: p for n, p in trainable.items() if p.mup_type == "bias"}  # type: ignore[attr-defined]
    assert bool(biases) == (make is _gpt2)  # GPT-2's Conv1D biases train, Llama has none
    # a step of the u-muP optimiser moves the weights and leaves the norms at 1 / 0
    before = {n: p.detach().clone() for n, p in norms.items()}
    opt = us.optim.AdamW(model.parameters(), lr=0.5)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all(torch.equal(norms[n], before[n]) for n in norms)
    assert all(p.grad is not None for p in trainable.values())


def test_trainable_norms_keeps_them_trainable() -> None:
    assert not unit_scale(_gpt2()).module.transformer.ln_f.weight.requires_grad  # default
    model = unit_scale(_gpt2(), trainable_norms=True)
    norms = _norms(model.module)
    assert norms and all(p.requires_grad for p in norms.values())
    assert unit_scale(_gpt2(), mup=False).module.transformer.ln_f.weight.requires_grad


def _shares(taus: list[float]) -> list[float]:
    """Each source's share of the final stream's variance: the embedding first, then every
    branch, from the taus of the adds (a branch enters with sqrt(tau), and every later add
    scales the stream by sqrt(1 - tau'))."""
    shares = [1.0]
    for tau in taus:
        shares = [s * (1.0 - tau) for s in shares] + [tau]
    return shares


def _adds(model: nn.Module) -> list[tuple[str, float]]:
    capture = model.capture  # type: ignore[attr-defined]
    return [
        (kind, tau)
        for invocation in capture.last_trace
        for _, kind, tau in invocation.piece.data["unit_scale"]["residual_adds"]
    ]


@pytest.mark.parametrize("layers", [2, 8])
def test_embedding_attention_and_mlp_each_hold_a_third_of_a_llamas_stream(layers: int) -> None:
    model = unit_scale(_llama(layers))
    ids = _ids()
    model(input_ids=ids)
    adds = _adds(model)
    kinds = [kind for kind, _ in adds]
    assert kinds == ["attention", "mlp"] * layers
    shares = _shares([tau for _, tau in adds])
    attention = sum(s for s, kind in zip(shares[1:], kinds, strict=True) if kind == "attention")
    mlp = sum(s for s, kind in zip(shares[1:], kinds, strict=True) if kind == "mlp")
    assert [shares[0], attention, mlp] == pytest.approx([1 / 3] * 3, rel=1e-9)


@pytest.mark.slow
def test_embedding_share_measured_through_the_scaled_stream() -> None:
    # The same third, measured: the stream entering the final norm of the 8-layer Llama,
    # with every branch output zeroed, is the embedding's part alone (1/sqrt(3) of its std).
    model = unit_scale(_llama(8, width=256))
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(1))
    streams: list[torch.Tensor] = []
    final_norm = model.module.model.norm
    handle = final_norm.register_forward_pre_hook(lambda _, args: streams.append(args[0]))
    embedded = model.module.model.embed_tokens.weight[ids]
    with torch.no_grad():
        model(input_ids=ids)
        for layer in model.module.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model(input_ids=ids)
    handle.remove()
    full, embedding_only = streams
    ratio = embedding_only.std().item() / embedded.std().item()
    assert ratio == pytest.approx(1 / math.sqrt(3), rel=1e-4)
    assert full.std().item() == pytest.approx(1.0, abs=0.25)


# The paper's rule (Blake et al. 2024, Appendix G), written out here: with L transformer
# layers, alpha = residual_mult, rho = residual_attn_ratio,
#   beta_attn^2 = alpha^2 * 2 rho^2 / (1 + rho^2) / L,  beta_mlp^2 = alpha^2 * 2 / (1 + rho^2) / L,
# the unnormalised stream after branch k has variance S_k = 1 + sum_{j<=k} beta_j^2, and the
# unit-scaled add multiplies the branch by beta_k / sqrt(S_k) and the skip by
# sqrt(S_{k-1} / S_k). tau (the branch's variance share) is the branch multiplier squared.
def paper_multipliers(layers: int, alpha: float, rho: float) -> list[tuple[float, float]]:
    attn = alpha**2 * 2 * rho**2 / (1 + rho**2) / layers
    mlp = alpha**2 * 2 / (1 + rho**2) / layers
    variance, out = 1.0, []
    for k in range(2 * layers):
        beta_sq = attn if k % 2 == 0 else mlp
        total = variance + beta_sq
        out.append((math.sqrt(beta_sq / total), math.sqrt(variance / total)))
        variance += beta_sq
    return out


@pytest.mark.parametrize("layers", [1, 2, 3, 8, 24])
@pytest.mark.parametrize(("alpha", "rho"), [(1.0, 1.0), (2.0, 0.5), (0.3, 3.0)])
def test_residual_multipliers_are_the_papers(layers: int, alpha: float, rho: float) -> None:
    expected = paper_multipliers(layers, alpha, rho)
    rule = U.transformer_residual_scaling_rule(alpha, rho)
    tau = ResidualTau(residual_mult=alpha, residual_attn_ratio=rho)
    for k, (branch, skip) in enumerate(expected):
        kind = "attention" if k % 2 == 0 else "mlp"
        ratio = rule(k, 2 * layers)  # the reference's tau: the branch's std over the skip's
        assert ratio == pytest.approx(tau.tau(kind, k + 1, layers=2 * layers), rel=1e-12)
        for value in (ratio**2 / (1 + ratio**2), tau.share(kind, k + 1, layers=2 * layers)):
            assert (math.sqrt(value), math.sqrt(1 - value)) == pytest.approx(
                (branch, skip), rel=1e-12
            ), (k, kind)
    # depth-muP: the unnormalised branch weights recovered from our taus
    # (S_k = S_{k-1} / (1 - tau_k), beta_k^2 = tau_k S_k) are the paper's times 1/sqrt(L)
    variance = 1.0
    for k in range(2 * layers):
        value = tau.share("attention" if k % 2 == 0 else "mlp", k + 1, layers=2 * layers)
        variance /= 1.0 - value
        share = rho**2 if k % 2 == 0 else 1.0
        assert value * variance * layers == pytest.approx(
            alpha**2 * 2 * share / (1 + rho**2), rel=1e-12
        )


@pytest.mark.parametrize(("alpha", "rho"), [(2.0, 0.5), (0.3, 3.0)])
def test_unit_scale_takes_the_rules_mults(alpha: float, rho: float) -> None:
    model = unit_scale(_llama(3), residual_mult=alpha, residual_attn_ratio=rho)
    ids = _ids()
    model(input_ids=ids)
    taus = [tau for _, tau in _adds(model)]
    expected = [branch**2 for branch, _ in paper_multipliers(3, alpha, rho)]
    assert taus == pytest.approx(expected, rel=1e-12)


def test_equal_shares_stays_an_option() -> None:
    model = unit_scale(_llama(2), residual_tau=ResidualTau(rule="equal_shares"))
    model(input_ids=_ids())
    assert [tau for _, tau in _adds(model)] == pytest.approx([1 / 2, 1 / 3, 1 / 4, 1 / 5])


def test_bad_rule_or_mult_is_a_clear_error() -> None:
    with pytest.raises(us.errors.UnitScaleError, match="rule='paper'"):
        ResidualTau().tau("mlp", 1)
    with pytest.raises(us.errors.UnitScaleError, match="ResidualTau\\(rule='depth'\\)"):
        ResidualTau(rule="depth")
    with pytest.raises(us.errors.UnitScaleError, match="residual_mult=-1"):
        unit_scale(_llama(2), residual_mult=-1.0)


class _LMLoss(nn.Module):
    """A transformers causal LM with the loss inside ``forward`` (``unit_scale`` then makes
    it the unit-scaled cross-entropy) and already-shifted labels (``unitscale.data``'s)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def get_output_embeddings(self) -> nn.Module:
        return self.lm.get_output_embeddings()  # type: ignore[operator,no-any-return]

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=input_ids).logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def heldout_losses_of_a_trained_llama(
    trainable_norms: bool, steps: int = 200
) -> tuple[float, float]:
    """Held-out loss of ``unit_scale(tiny Llama)`` before and after ``steps`` AdamW steps at
    u-μP's default learning rate, 0.5, on the bundled corpus."""
    from unitscale.data import VOCAB_SIZE, batches

    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = _LMLoss(transformers.LlamaForCausalLM(config))
    model = unit_scale(lm, trainable_norms=trainable_norms)
    heldout = [b for b, _ in zip(batches(16, 32, seed=1, split="heldout"), range(4), strict=False)]

    def evaluate() -> float:
        with torch.no_grad():
            return sum(model(b.input_ids, b.labels).item() for b in heldout) / len(heldout)

    initial = evaluate()
    opt = us.optim.AdamW(model.parameters(), lr=0.5)
    for batch, _ in zip(batches(16, 32, seed=0), range(steps), strict=False):
        opt.zero_grad()
        model(batch.input_ids, batch.labels).backward()
        opt.step()
    return initial, evaluate()


@pytest.mark.slow
def test_a_unit_scaled_llama_learns_at_the_default_learning_rate() -> None:
    # u-muP's recommended scheme (norms fixed) at its default lr: the held-out loss falls by
    # at least 5% in 200 steps (docs/guide/umup.rst gives the numbers, and those with
    # trainable norms)
    initial, final = heldout_losses_of_a_trained_llama(trainable_norms=False)
    assert final < 0.95 * initial, (initial, final)


def test_plain_unit_scaling_keeps_equal_shares_unless_a_mult_is_given() -> None:
    # as TransformerDecoder(mup=False): the running mean, tau = 1 / (k + 1)
    model = unit_scale(_llama(2), mup=False)
    model(input_ids=_ids())
    assert [tau for _, tau in _adds(model)] == pytest.approx([1 / 2, 1 / 3, 1 / 4, 1 / 5])
    model = unit_scale(_llama(2), mup=False, residual_mult=1.0)
    model(input_ids=_ids())
    assert [tau for _, tau in _adds(model)] == pytest.approx([1 / 3, 1 / 4, 1 / 5, 1 / 6])
