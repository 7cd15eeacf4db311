"""The experiment runner and report writer that ``train`` and ``transfer`` share."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from unitscale.errors import UnitScaleError
from unitscale.experiments import _train_config, report, training, transfer
from unitscale.experiments.data import Batch
from unitscale.experiments.runner import (
    Schedule,
    evaluation_batches,
    train_loop,
    training_batches,
)


def test_train_and_transfer_evaluate_on_the_same_samples() -> None:
    train_config = training.TrainConfig(batch_size=4, seq_len=32, eval_batches=3, seed=5)
    transfer_config = transfer.TransferConfig(batch_size=4, seq_len=32, eval_batches=3, seed=5)
    for split in ("train", "heldout"):
        ours = training._eval_batches(train_config, split)  # type: ignore[arg-type]
        theirs = transfer._eval_data(transfer_config, split)  # type: ignore[arg-type]
        assert len(ours) == len(theirs) == 3
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.input_ids, b.input_ids)
    # ...and they are not the training stream's first batches.
    first = next(iter(training_batches(4, 32, 5)))
    assert not torch.equal(first.input_ids, ours[0].input_ids)


def test_both_experiments_follow_the_runner_s_schedule() -> None:
    schedule = Schedule(steps=60, warmup=7)
    train_config = training.TrainConfig(steps=60, warmup_steps=7, lr_plain=0.3)
    transfer_config = transfer.TransferConfig(steps=60, warmup_steps=7)
    for step in range(60):
        assert train_config.lr_at("plain-fp32", step) == schedule.lr(0.3, step)
        assert transfer_config.lr_factor(step) == schedule.lr(1.0, step)
    assert schedule.lr(1.0, 0) == pytest.approx(1 / 7)
    assert schedule.lr(1.0, 59) == pytest.approx(0.1)


class _Bigram(nn.Module):
    """A tiny model with the experiments' calling convention."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(256, 256)

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        logits = self.table(input_ids)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _data(steps: int) -> list[Batch]:
    stream = iter(training_batches(2, 8, 0))
    return [next(stream) for _ in range(steps)]


def test_loop_evaluates_every_n_steps_and_at_the_end_with_the_schedule() -> None:
    model = _Bigram()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.5)
    schedule = Schedule(steps=5, warmup=2)
    seen: list[float] = []
    lrs: list[float] = []
    held = evaluation_batches(2, 8, 0, "heldout", 1)
    result = train_loop(
        model, optimiser, _data(5), schedule, eval_every=2, heldout=held, train_eval=held,
        on_step=lambda loss: (seen.append(loss), lrs.append(optimiser.param_groups[0]["lr"])),
    )  # fmt: skip
    assert sorted(result.heldout) == [2, 4, 5]
    assert result.losses == seen and len(seen) == 5 and result.stopped_at is None
    assert lrs == [schedule.lr(0.5, s) for s in range(5)]
    assert result.final_train_loss == result.heldout[5]  # same batch given for both
    assert len(result.data_digest) == 16


def test_loop_stops_at_a_non_finite_loss_before_its_step() -> None:
    model = _Bigram()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    with torch.no_grad():
        model.table.weight[0, 0] = math.inf
    data = _data(4)
    data[1] = Batch(*(torch.zeros_like(t) for t in (*data[1].values(), data[1].targets)))
    result = train_loop(
        model, optimiser, data, Schedule(steps=4), eval_every=10,
        heldout=data[:1], train_eval=data[:1],
    )  # fmt: skip
    assert result.stopped_at == 1 and len(result.losses) == 2
    assert not math.isfinite(result.losses[-1])
    assert result.heldout == {} and math.isnan(result.final_train_loss)


def test_loop_says_when_the_data_runs_out() -> None:
    model = _Bigram()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UnitScaleError, match=r"data ran out after 2 of 3 steps"):
        train_loop(model, optimiser, _data(2), Schedule(steps=3), eval_every=1,
                   heldout=_data(1), train_eval=_data(1))  # fmt: skip


def test_every_run_kind_is_compared_with_an_fp32_run_of_its_family() -> None:
    kinds = {kind.name: kind for kind in training.RUN_KINDS}
    assert tuple(kinds) == training.RUN_NAMES
    for kind in kinds.values():
        if kind.baseline is None:
            assert not kind.fp8
            continue
        baseline = kinds[kind.baseline]
        assert baseline.family == kind.family and baseline.baseline is None
        transform = repr(kind.transform)  # the block-scaled kinds simulate their formats
        assert any(name in transform for name in ("simulate_fp8", "to_fp8", "simulate_format"))


def test_report_page_is_self_contained_and_escaped(tmp_path: Path) -> None:
    path = report.write_html_page(
        tmp_path / "r.html", "t<", "h&", [report.html_table(["a"], [["<b>"]])]
    )
    page = path.read_text(encoding="utf-8")
    assert "<title>t&lt;</title>" in page and "<h1>h&amp;</h1>" in page
    assert "<td>&lt;b&gt;</td>" in page and "default-src 'none'" in page
    assert "http:" not in page and "https:" not in page and 'src="http' not in page


def test_settings_rows_resolve_defaults_and_join_sequences() -> None:
    rows = dict(report.settings_rows(transfer.TransferConfig(), {"seed": "zero"}))
    assert rows["widths"] == "32, 64, 128, 256"
    assert rows["seed"] == "zero"
    assert rows["warmup_steps"] == "default"


def test_a_run_kind_is_one_registry_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []

    def transform(model: nn.Module, config: training.TrainConfig) -> nn.Module:
        built.append(type(model).__name__)
        return model

    extra = training.RunKind("plain-extra", "plain", transform, "plain-fp32", default=False)
    kinds = (*training.RUN_KINDS, extra)
    monkeypatch.setattr(_train_config, "RUN_KINDS", kinds)
    monkeypatch.setattr(_train_config, "RUN_NAMES", tuple(k.name for k in kinds))
    monkeypatch.setattr(_train_config, "_KINDS", {k.name: k for k in kinds})
    assert "plain-extra" not in training.TrainConfig().runs  # not a default run
    config = training.TrainConfig(
        steps=1, batch_size=1, seq_len=8, hidden_size=8, heads=1, depth=1, eval_batches=1,
        runs=("plain-extra", "plain-fp32", "plain-fp8"),
    )  # fmt: skip
    assert config.runs == ("plain-fp32", "plain-fp8", "plain-extra")
    results = training.train_runs(config, progress=False)
    assert built == ["PlainGPT"]  # its transform, on its family's model
    rows = {row[0]: row for row in training.summary_rows(results)}
    assert rows["plain-extra"][4] != ""  # compared with its baseline
    # Drawn apart from every other run of its family.
    labels = {line.get_label() for line in training.plot_losses(results).axes[0].get_lines()}
    assert {"plain-fp32", "plain-fp8", "plain-extra"} <= labels
    plain = [k.name for k in kinds if k.family == "plain"]
    assert len({repr(training._line_style(name)) for name in plain}) == len(plain)
