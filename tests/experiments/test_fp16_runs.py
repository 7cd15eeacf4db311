"""The simulated-FP16 runs of ``unitscale train``: the plain model with dynamic loss scaling
(``torch.amp.GradScaler``) and the unit-scaled model with none."""

from __future__ import annotations

import argparse

import pytest
import torch

from unitscale.cli import train as train_command
from unitscale.experiments import _train_loop, training
from unitscale.experiments.runner import Schedule, evaluation_batches, train_loop
from unitscale.experiments.training import (
    DEFAULT_RUNS,
    FP16_CAST,
    RunResult,
    TrainConfig,
    build_optimiser,
    build_run_model,
    summary_text,
    train_run,
)

FP16_RUNS = ("plain-fp16-loss-scaling", "unit-scaled-fp16")
TINY = dict(
    batch_size=4, seq_len=16, hidden_size=32, heads=2, depth=1, eval_every=10, eval_batches=1
)


def test_fp16_runs_are_selectable_but_not_default() -> None:
    assert not set(FP16_RUNS) & set(DEFAULT_RUNS)
    names = train_command._run_list("plain-fp32,plain-fp16-loss-scaling,unit-scaled-fp16")
    assert names == ("plain-fp32", "plain-fp16-loss-scaling", "unit-scaled-fp16")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown run"):
        train_command._run_list("plain-fp16")
    config = TrainConfig(runs=("unit-scaled-fp16", "plain-fp16-loss-scaling", "plain-fp32"))
    assert set(config.runs) == {"plain-fp32", *FP16_RUNS}
    kinds = {kind.name: kind for kind in training.RUN_KINDS}
    assert kinds["plain-fp16-loss-scaling"].loss_scaling
    assert not kinds["unit-scaled-fp16"].loss_scaling
    assert [kinds[n].baseline for n in FP16_RUNS] == ["plain-fp32", "unit-scaled-fp32"]
    assert {kinds[n].precision for n in FP16_RUNS} == {"fp16"}


def test_fp16_runs_round_the_fp8_recipe_tensors_in_ieee_fp16_from_the_fp32_weights() -> None:
    config = TrainConfig(**TINY)
    for family, run in (("plain", "plain-fp16-loss-scaling"), ("unit-scaled", "unit-scaled-fp16")):
        model = build_run_model(run, config)
        (graph_pass,) = model.passes
        # The hardware recipe's tensors: the operands and each matmul's output gradient.
        assert graph_pass.fwd_format == FP16_CAST and graph_pass.output_grad_format == FP16_CAST
        assert graph_pass.bwd_format is None
        fp32 = build_run_model(f"{family}-fp32", config).state_dict()
        assert all(torch.equal(fp32[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_the_scaler_backs_off_and_skips_steps_when_fp16_gradients_overflow() -> None:
    config = TrainConfig(steps=3, **TINY)
    model = build_run_model("plain-fp16-loss-scaling", config)
    optimiser = build_optimiser("plain-fp16-loss-scaling", model, config)
    # A scale no gradient survives in FP16: the output gradients round to inf.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = evaluation_batches(4, 16, 0, "train", 3)
    done = train_loop(model, optimiser, data[:1], Schedule(1), eval_every=10, heldout=data[:1],
                      train_eval=data[:1], grad_scaler=scaler)  # fmt: skip
    assert done.skipped_steps == 1 and scaler.get_scale() == 2.0**59
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # The same step with a scale the gradients fit: taken, the weights move.
    scaler = torch.amp.GradScaler("cpu")
    done = train_loop(model, optimiser, data[:1], Schedule(1), eval_every=10, heldout=data[:1],
                      train_eval=data[:1], grad_scaler=scaler)  # fmt: skip
    assert done.skipped_steps == 0 and scaler.get_scale() == 2.0**16
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_skipped_steps_are_counted_and_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    # The run's scaler starting at 2**60: it halves on each overflowing step until the
    # scaled gradients fit FP16, then steps; every halving is a skipped step.
    monkeypatch.setattr(
        _train_loop, "_grad_scaler", lambda model: torch.amp.GradScaler("cpu", init_scale=2.0**60)
    )
    config = TrainConfig(steps=60, runs=("plain-fp32", "plain-fp16-loss-scaling"), **TINY)
    results = training.train_runs(config, progress=False)
    r = results["plain-fp16-loss-scaling"]
    assert r.skipped_steps is not None and 10 < r.skipped_steps < 60
    assert r.loss_scale == 2.0 ** (60 - r.skipped_steps)
    assert sum(r.train_losses[-5:]) / 5 < sum(r.train_losses[:5]) / 5 - 0.2  # trains after
    text = summary_text(results, config)
    assert f"the loss scaler skipped {r.skipped_steps} of 60 steps" in text
    assert "plain in simulated FP16 with dynamic loss scaling (plain-fp16-loss-scaling)" in text
    assert results["plain-fp32"].skipped_steps is None


@pytest.mark.slow
@pytest.mark.parametrize("run", FP16_RUNS)
def test_fp16_runs_train(run: str) -> None:
    r = train_run(run, TrainConfig(steps=20, runs=(run,), **TINY), progress=False)
    assert r.stopped_at is None
    assert sum(r.train_losses[-5:]) / 5 < r.train_losses[0] - 0.5
    if run == "plain-fp16-loss-scaling":
        assert r.skipped_steps == 0 and r.loss_scale == 2.0**16  # GradScaler's default
    else:
        assert r.skipped_steps is None and r.loss_scale is None


def test_summary_sets_fp16_runs_against_their_fp32_runs() -> None:
    def result(name: str, loss: float, skipped: int | None = None) -> RunResult:
        r = RunResult(name, 1e-3, [loss] * 4, {4: loss}, loss, loss)
        r.skipped_steps, r.loss_scale = skipped, None if skipped is None else 2.0**14
        return r

    names = ("plain-fp32", "plain-fp16-loss-scaling", "unit-scaled-fp32", "unit-scaled-fp16")
    losses = (2.0, 2.1, 2.0, 2.02)
    results = {
        n: result(n, loss, 2 if n == "plain-fp16-loss-scaling" else None)
        for n, loss in zip(names, losses, strict=True)
    }
    text = summary_text(results, TrainConfig(steps=4, runs=names))
    rows = {line.split()[0]: line for line in text.splitlines() if line[:1].isalpha()}
    assert rows["plain-fp16-loss-scaling"].endswith("FP16, loss scaling")
    assert "+5.00%" in rows["plain-fp16-loss-scaling"]
    assert rows["unit-scaled-fp16"].endswith("FP16, no scaling")
    assert "+1.00%" in rows["unit-scaled-fp16"]
    assert "skipped 2 of 4 steps" in text and "final loss scale 16384" in text
    assert "unit-scaled in simulated FP16 without loss scaling (unit-scaled-fp16) vs FP32: " \
        "held-out +1.00%" in text  # fmt: skip
    assert "initial scale 2**16" in text
    # The FP8 claim lines are not about these runs.
    assert "simulated FP8" not in text
