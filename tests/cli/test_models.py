"""How ``unitscale analyse`` calls the models it is given (``unitscale.cli._models``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from unitscale.analysis import graph_to_dataframe, risk_summary
from unitscale.cli import CommandError
from unitscale.cli._models import NamedModel, call_model, resolve_models
from unitscale.data import example_batch
from unitscale.transforms import prune_same_scale_tensors, track_scales

FACTORIES = """
import torch
import torch.nn.functional as F
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 256)

    def forward(self, input_ids):
        return self.head(torch.relu(self.mid(self.emb(input_ids))))


class TinyWithLoss(Tiny):
    def forward(self, input_ids, labels):
        logits = super().forward(input_ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class Pairs(Tiny):
    def forward(self, input_ids):
        return super().forward(input_ids)[:, :2]


def logits():
    return Tiny()


def own_loss():
    return TinyWithLoss()


def wrong_shape():
    return Pairs()
"""


def _track(entry: NamedModel, batch_size: int = 4, seq_len: int = 32) -> tuple[float, object]:
    batch = example_batch(batch_size, seq_len, seed=0)
    tracked = track_scales(entry.model)
    loss = call_model(entry, tracked, batch)
    loss.backward()
    return float(loss.detach()), tracked.scales_graph()


@pytest.fixture
def factories(tmp_path: Path) -> Path:
    path = tmp_path / "mine.py"
    path.write_text(FACTORIES)
    return path


def test_a_logits_model_gets_the_verdict_of_the_same_model_returning_its_loss(
    factories: Path,
) -> None:
    """The loss is part of what is unit-scaled: the twins of the two factories agree.

    Tolerance: the counts of tensors at risk are equal (0 tensors apart) in E4M3 and E5M2,
    the twins' losses agree to 1e-6, and the twin's logit gradient has an RMS within 2x of 1 (a loss
    computed outside the twin left it near 2^-15).
    """
    verdicts = {}
    for name in ("logits", "own_loss"):
        plain, twin = resolve_models(f"{factories}:{name}", seq_len=32, seed=0)
        _track(plain)  # the plain model runs as well
        twin_loss, graph = _track(twin)
        table = graph_to_dataframe(graph)
        logit_grad = table[(table["module"] == "head") & (table["op"] == "linear")]
        logit_grad = logit_grad[logit_grad["direction"] == "bwd"]
        assert len(logit_grad) == 1
        assert 0.5 < float(logit_grad["rms"].iloc[0]) < 2.0
        summary = risk_summary(graph_to_dataframe(prune_same_scale_tensors(graph)))
        verdicts[name] = (twin_loss, {
            f: (summary.formats[f].underflow, summary.formats[f].overflow)
            for f in ("e4m3", "e5m2")
        })  # fmt: skip
    assert math.isclose(verdicts["logits"][0], verdicts["own_loss"][0], rel_tol=1e-6)
    assert verdicts["logits"][1] == verdicts["own_loss"][1]
    assert verdicts["logits"][1]["e5m2"] == (0, 0)


def test_a_factory_model_keeps_its_parameter_names_and_class_name(factories: Path) -> None:
    plain, twin = resolve_models(f"{factories}:logits", seq_len=16, seed=0)
    names = [n for n, _ in plain.model.named_parameters()]
    assert names == ["emb.weight", "mid.weight", "mid.bias", "head.weight", "head.bias"]
    assert type(plain.model).__name__ == "Tiny"
    assert list(twin.model.state_dict()) == list(plain.model.state_dict())
    batch = example_batch(2, 16, seed=0)
    expected = torch.nn.functional.cross_entropy(
        type(plain.model).__mro__[1].forward(plain.model, batch.input_ids).flatten(0, 1),
        batch.targets.flatten(),  # the command's convention: labels already shifted
    )
    assert torch.equal(call_model(plain, plain.model, batch), expected)


def test_a_factory_model_with_outputs_of_the_wrong_shape_is_refused(factories: Path) -> None:
    plain, _ = resolve_models(f"{factories}:wrong_shape", seq_len=16, seed=0)
    with pytest.raises(CommandError, match=r"returned \(2, 2, 256\): expected a scalar loss.*"
                       r"or logits of shape \(2, 16, vocab\)"):  # fmt: skip
        call_model(plain, plain.model, example_batch(2, 16, seed=0))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_type", "objective", "head"),
    [
        ("gpt2", "causal-lm", "GPT2LMHeadModel"),
        ("bert", "masked-lm", "BertForMaskedLM"),
        ("t5", "seq2seq", "T5ForConditionalGeneration"),
        ("bart", "seq2seq", "BartForConditionalGeneration"),
    ],
)
def test_each_hf_family_runs_with_its_own_objective(
    model_type: str, objective: str, head: str, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("transformers")
    from unitscale.cli._models import hf_model, hf_objective, objective_batch

    with caplog.at_level("WARNING"):
        model = hf_model(model_type, seq_len=32, seed=0)
        assert type(model).__name__ == head and hf_objective(model.config) == objective
        assert sum(p.numel() for p in model.parameters()) < 2_000_000  # built small
        batch = example_batch(2, 32, seed=0)
        loss = call_model(NamedModel(model_type, model, objective), model, batch)
    assert not [r for r in caplog.records if "is_decoder" in r.getMessage()]
    assert getattr(model.config, "is_decoder", False) is False or objective == "seq2seq"
    # Random weights: about log(256) nats per predicted byte.
    assert loss.shape == () and abs(loss.item() - math.log(256)) < 1.0
    values = objective_batch(objective, batch, model.config)
    if objective == "masked-lm":
        predicted = values["labels"] != -100
        assert 0.05 < predicted.float().mean().item() < 0.3 and predicted.any(dim=1).all()
        assert torch.equal(values["labels"][predicted], batch.input_ids[predicted])
        assert (values["input_ids"][predicted] == 0).all()
    elif objective == "seq2seq":
        assert values["input_ids"].shape == values["labels"].shape == (2, 16)
        assert torch.equal(torch.cat([values["input_ids"], values["labels"]], 1), batch.input_ids)
    else:
        assert torch.equal(values["labels"], batch.input_ids)


def test_transformers_messages_are_silenced_while_the_command_works() -> None:
    pytest.importorskip("transformers")
    import warnings

    from transformers.utils import logging as hf_logging

    from unitscale.cli._models import quiet_transformers

    before = hf_logging.get_verbosity()
    with quiet_transformers():
        assert hf_logging.get_verbosity() == hf_logging.ERROR
        assert not hf_logging.get_logger("transformers.modeling_utils").isEnabledFor(
            hf_logging.WARNING
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.warn_explicit("noise", UserWarning, "x.py", 1, module="transformers.x")
            warnings.warn_explicit("kept", UserWarning, "y.py", 1, module="mine")
        assert [str(w.message) for w in caught] == ["kept"]
    assert hf_logging.get_verbosity() == before
