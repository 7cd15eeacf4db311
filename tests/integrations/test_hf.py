"""ScaleMonitorCallback: ScaleMonitor inside a Hugging Face ``Trainer.train()``, offline."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from unitscale.analysis import graph_to_dataframe, tensorboard_available  # noqa: E402
from unitscale.integrations import IntegrationError, ScaleMonitorCallback  # noqa: E402
from unitscale.tracking import (  # noqa: E402
    LONG_COLUMNS,
    MonitorError,
    NonFiniteError,
    NonFiniteWarning,
)
from unitscale.transforms import track_scales  # noqa: E402

VOCAB, SEQ = 64, 16
NAN_WEIGHT = "transformer.h.0.mlp.c_fc.weight"


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, rows: int = 16) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _RecordingTrainer(Trainer):
    """Keeps each training step's inputs and CPU RNG state (public override point)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[dict[str, Any], Any, torch.Tensor]] = []

    def training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any = None) -> Any:
        self.seen.append((dict(inputs), num_items_in_batch, torch.get_rng_state()))
        return super().training_step(model, inputs, num_items_in_batch)


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)  # random weights from the config: no download


def _train(
    tmp_path: Path, callbacks: list[TrainerCallback], steps: int, model: nn.Module | None = None
) -> _RecordingTrainer:
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), max_steps=steps, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = _RecordingTrainer(
        model=model if model is not None else _model(),
        args=args,
        train_dataset=_Tokens(),
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


def _losses(trainer: Trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


class _TokensAndExtra(_Tokens):
    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**super().__getitem__(i), "row": i}  # a column the model does not take


@pytest.mark.slow
def test_trainer_trains_a_unit_scaled_model_with_default_arguments(tmp_path: Path) -> None:
    """``Trainer`` keeps the dataset columns that ``inspect.signature(model.forward)``
    names (``remove_unused_columns=True`` by default): a unit-scaled model shows the wrapped
    model's arguments, so its batches keep ``input_ids`` and ``labels`` (and drop ``row``)
    rather than arriving empty."""
    from unitscale.transforms import unit_scale

    model = unit_scale(_model())
    initial = copy.deepcopy(model)
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), max_steps=2, per_device_train_batch_size=4,
        learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, seed=0, disable_tqdm=True,
    )  # fmt: skip
    assert args.remove_unused_columns
    trainer = _RecordingTrainer(model=model, args=args, train_dataset=_TokensAndExtra())
    trainer.train()
    assert [sorted(inputs) for inputs, _, _ in trainer.seen] == [["input_ids", "labels"]] * 2
    losses = _losses(trainer)
    assert len(losses) == 2 and all(np.isfinite(losses))
    pairs = zip(model.parameters(), initial.parameters(), strict=True)
    assert any(not torch.equal(p, q) for p, q in pairs)  # the optimiser stepped


@pytest.mark.slow
def test_trainer_run_records_track_scales_values_and_keeps_losses(tmp_path: Path) -> None:
    plain = _train(tmp_path / "plain", [], steps=4)

    model = _model()
    initial = copy.deepcopy(model)
    signature = inspect.signature(model.forward)
    callback = ScaleMonitorCallback(every=2, output_dir=tmp_path / "scales")
    monitored = _train(tmp_path / "monitored", [callback], steps=4, model=model)

    # Monitoring changes nothing the Trainer computes: same losses, same final weights.
    assert _losses(monitored) == _losses(plain) and len(_losses(plain)) == 4
    for (name, p), q in zip(model.named_parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    # The model is left as it was: no instance forward, the same signature.
    assert "forward" not in model.__dict__
    assert inspect.signature(model.forward) == signature

    monitor = callback.monitor
    assert monitor is not None and monitor.step_count == 4
    assert monitor.recorded_steps == [0, 2]
    assert callback.non_finite is None
    table = monitor.table()
    assert tuple(table.columns) == LONG_COLUMNS

    # Step 0's records are track_scales' on the initial weights and the Trainer's first batch
    # (same inputs, same RNG state for dropout), every metric within rtol 1e-6.
    inputs, num_items, rng = monitored.seen[0]
    initial.config.use_cache = False  # as the Trainer sets it (TrainingArguments.use_cache)
    tracked = track_scales(initial).train()
    torch.set_rng_state(rng)
    tracked(**inputs, num_items_in_batch=num_items).loss.backward()
    reference = graph_to_dataframe(tracked.scales_graph())
    mine = table[table["step"] == 0].pivot_table(
        index=["tensor", "direction"], columns="metric", values="value", dropna=False
    )
    theirs = reference.set_index(["name", "direction"])[list(mine.columns)]
    assert len(mine) == len(theirs) > 100
    theirs = theirs.loc[mine.index]
    np.testing.assert_allclose(mine.to_numpy(), theirs.to_numpy(), rtol=1e-6, atol=0)
    assert NAN_WEIGHT in set(table["tensor"])

    # Files: the long table and a heatmap per direction.
    out = tmp_path / "scales"
    assert sorted(p.name for p in callback.written) == [
        "scales.csv", "scales_rms_bwd.png", "scales_rms_fwd.png",
    ]  # fmt: skip
    assert all(p.parent == out and p.stat().st_size > 0 for p in callback.written)
    assert (out / "tensorboard").exists() == tensorboard_available()
    # The Trainer's loss normaliser is passed to the model but is not data: the monitor may
    # have it (TorchDynamo makes it a graph input on recent torch; torch 2.8 folds it into
    # the graph), the CSV and the heatmaps do not.
    written = pd.read_csv(out / "scales.csv")
    assert "num_items_in_batch" not in set(written["tensor"])
    assert len(written) == len(table) - (table["tensor"] == "num_items_in_batch").sum()
    assert set(written["tensor"]) == set(callback.model_table()["tensor"])


class _InjectNaN(TrainerCallback):
    """Sets one weight element to NaN before optimiser step ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            with torch.no_grad():
                kwargs["model"].get_parameter(NAN_WEIGHT)[0, 0] = float("nan")


@pytest.mark.slow
def test_injected_nan_is_located_and_stops_training(tmp_path: Path) -> None:
    # Step 2 is not recorded (every=3): the monitor replays it to find the first NaN.
    callback = ScaleMonitorCallback(every=3, on_non_finite="stop", save=False)
    with pytest.warns(NonFiniteWarning, match=rf"optimiser step 3\).*{NAN_WEIGHT}"):
        trainer = _train(tmp_path, [_InjectNaN(at=2), callback], steps=6)
    report = callback.non_finite
    assert report is not None
    assert (report.step, report.tensor, report.direction) == (2, NAN_WEIGHT, "fwd")
    assert report.nan_count == 1 and report.numel == 32 * 128
    assert trainer.state.global_step == 3  # "stop" ended training after that step
    assert callback.written == []


def _direct_begin(callback: ScaleMonitorCallback, model: nn.Module, tmp_path: Path) -> Any:
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    callback.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    return args


def test_training_calls_go_through_the_monitor_and_evaluation_calls_do_not(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    callback = ScaleMonitorCallback(every=1, tensorboard=False)
    args = _direct_begin(callback, model, tmp_path)
    state, control = TrainerState(), TrainerControl()
    x = torch.randn(4, 8)

    expected = copy.deepcopy(model)(x)
    out = model(x)  # a training call: through the monitored module
    assert torch.equal(out, expected)
    out.pow(2).mean().backward()
    callback.on_pre_optimizer_step(args, state, control)
    assert callback.monitor is not None and callback.monitor.recorded_steps == [0]

    model.eval()
    model(x)  # an evaluation call: the model's own forward, not seen by the monitor
    model.train()
    with torch.no_grad():
        model(x)
    with pytest.raises(MonitorError, match=r"monitor\.module was not called during step 1"):
        callback.on_pre_optimizer_step(args, state, control)

    callback.on_train_end(args, state, control)
    assert "forward" not in model.__dict__
    assert sorted(p.name for p in callback.written) == [
        "scales.csv", "scales_rms_bwd.png", "scales_rms_fwd.png",
    ]  # fmt: skip
    assert all(p.parent == tmp_path / "unitscale-scales" for p in callback.written)


def test_an_existing_instance_forward_is_kept_and_restored(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    calls: list[int] = []
    own = model.forward

    def patched(x: torch.Tensor) -> torch.Tensor:  # as accelerate's autocast wrapper does
        calls.append(1)
        return own(x)

    model.forward = patched  # type: ignore[method-assign]
    callback = ScaleMonitorCallback(every=1, tensorboard=False, save=False)
    args = _direct_begin(callback, model, tmp_path)
    model(torch.randn(2, 4)).sum().backward()
    assert calls  # the monitored capture ran the instance forward the model had
    callback.on_pre_optimizer_step(args, TrainerState(), TrainerControl())
    callback.on_train_end(args, TrainerState(), TrainerControl())
    assert model.__dict__["forward"] is patched


def test_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(IntegrationError, match="on_non_finite='loud' must be"):
        ScaleMonitorCallback(on_non_finite="loud")  # type: ignore[arg-type]
    with pytest.raises(IntegrationError, match=r"every=0 must be a positive integer"):
        ScaleMonitorCallback(every=0)
    with pytest.raises(IntegrationError, match=r"heatmaps=\['rms'\]: \['rms'\] not among"):
        ScaleMonitorCallback(metrics=["mean_abs"])
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    args.torch_compile = True
    with pytest.raises(IntegrationError, match="torch_compile=True"):
        ScaleMonitorCallback().on_train_begin(
            args, TrainerState(), TrainerControl(), model=nn.Linear(2, 2)
        )


@pytest.mark.skipif(tensorboard_available(), reason="tensorboard is installed")
def test_tensorboard_true_without_tensorboard_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(IntegrationError, match="needs the tensorboard package"):
        _direct_begin(ScaleMonitorCallback(tensorboard=True), nn.Linear(2, 2), tmp_path)


def test_raise_on_nan_restores_the_model_first(tmp_path: Path) -> None:
    model = nn.Linear(4, 2)
    callback = ScaleMonitorCallback(every=5, on_non_finite="raise", tensorboard=False)
    args = _direct_begin(callback, model, tmp_path)
    with torch.no_grad():
        model.weight[1, 2] = float("inf")
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(NonFiniteError, match=r"'weight'.*0 NaN and 1 Inf of 8 elements"):
        callback.on_pre_optimizer_step(args, TrainerState(), TrainerControl())
    assert "forward" not in model.__dict__  # training stops: the model is as it was
    report = callback.non_finite
    assert report is not None and (report.step, report.tensor) == (0, "weight")


def _unit_scaled_gpt2() -> nn.Module:
    from unitscale.transforms import unit_scale

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = unit_scale(GPT2LMHeadModel(config), trainable_norms=True)
    with torch.no_grad():  # capture now: unit_scale initialises matmul weights at capture
        model(input_ids=torch.zeros(1, SEQ, dtype=torch.long))
    return model


def _accumulating_run(tmp_path: Path, recipe: bool) -> tuple[dict[str, float], Any, nn.Module]:
    """One optimiser step of 4 micro-batches of 4 rows under the callback; the parameter
    gradients' rms the callback recorded, the micro-batches, and the initial model."""
    from unitscale.data_parallel import gradient_accumulation

    model = _unit_scaled_gpt2()
    initial = copy.deepcopy(model)
    callback = ScaleMonitorCallback(every=1, save=False, tensorboard=False)
    args = TrainingArguments(
        output_dir=str(tmp_path / "trainer"), max_steps=1, per_device_train_batch_size=4,
        gradient_accumulation_steps=4, learning_rate=1e-3, report_to="none",
        save_strategy="no", use_cpu=True, seed=0, disable_tqdm=True,
        max_grad_norm=0.0,  # no clipping: the callback reads param.grad after it
    )  # fmt: skip
    trainer = _RecordingTrainer(
        model=model, args=args, train_dataset=_Tokens(), callbacks=[callback]
    )
    if recipe:  # docs/guide/distributed.rst, "Gradient accumulation"
        trainer.model_accepts_loss_kwargs = False  # the model's own mean loss
        trainer.loss_is_scaled_for_ga = True  # not divided by the 4 micro-batches
        with gradient_accumulation(4):
            trainer.train()
    else:
        trainer.train()
    assert callback.monitor is not None
    table = callback.monitor.table()
    names = {n for n, _ in model.named_parameters()}
    rows = table[
        (table["direction"] == "bwd") & (table["metric"] == "rms") & table["tensor"].isin(names)
    ]
    return dict(zip(rows["tensor"], rows["value"], strict=True)), trainer.seen, initial


@pytest.mark.slow
def test_gradient_accumulation_recipe_gives_the_whole_batch(tmp_path: Path) -> None:
    """Under the Trainer, with the documented recipe, the parameter
    gradients the callback records after 4 accumulated micro-batches equal (rtol 1e-5) those
    of one call on the 16 rows (so also their unit scale); the Trainer's defaults (the loss
    divided by 4 or by ``num_items_in_batch``, micro-batch counts) give other values."""
    recorded, seen, initial = _accumulating_run(tmp_path / "recipe", recipe=True)
    whole = torch.cat([inputs["input_ids"] for inputs, _, _ in seen])
    assert len(seen) == 4 and whole.shape == (16, SEQ)
    initial(input_ids=whole, labels=whole).loss.backward()
    expected = {
        n: float(p.grad.double().pow(2).mean().sqrt()) for n, p in initial.named_parameters()
    }
    assert len(recorded) > 10 and sorted(recorded) == sorted(expected)
    assert recorded == pytest.approx(expected, rel=1e-5)
    naive, _, _ = _accumulating_run(tmp_path / "naive", recipe=False)
    ratios = [naive[n] / expected[n] for n in expected]
    assert max(abs(r - 1) for r in ratios) > 0.3, ratios
