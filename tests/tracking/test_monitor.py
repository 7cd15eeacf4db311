"""ScaleMonitor: scales every N steps of a training loop, and the first NaN/Inf located."""

from __future__ import annotations

import copy
import math
import pickle
import warnings
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import unitscale.tracking._recording._pass as recorder
from unitscale.analysis import (
    graph_to_dataframe,
    scale_heatmap,
    tensorboard_available,
    tensorboard_sink,
    write_tensorboard,
)
from unitscale.experiments.data import batches
from unitscale.experiments.models import GPTConfig, plain_gpt, unit_scaled_gpt
from unitscale.tracking import (
    LONG_COLUMNS,
    MonitorError,
    MonitorRecord,
    NonFiniteError,
    NonFiniteWarning,
    ScaleMonitor,
)
from unitscale.transforms import compile as compile_module
from unitscale.transforms import simulate_fp8, track_scales

CONFIG = GPTConfig(hidden_size=16, depth=1, heads=2, seq_len=16)


@pytest.fixture
def stats_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the tensor statistics the tracking pass computes (one list entry per call), by
    either path: the native extension's one call, or deferred_stats (where it declines)."""
    calls: list[int] = []
    original = recorder.deferred_stats
    extension = recorder.fast_stats()

    def counting(x: torch.Tensor, **options: Any) -> Any:
        calls.append(x.numel())
        return original(x, **options)

    class Counting:
        to_data = extension.to_data if extension is not None else None

        @staticmethod
        def summary(x: torch.Tensor) -> Any:
            entry = extension.summary(x)
            if entry is not None:
                calls.append(x.numel())
            return entry

    monkeypatch.setattr(recorder, "deferred_stats", counting)
    monkeypatch.setattr(recorder, "fast_stats", lambda: Counting if extension else None)
    return calls


def _models() -> dict[str, nn.Module]:
    return {
        "plain": plain_gpt(CONFIG, seed=0),
        "simulate_fp8(unit-scaled)": simulate_fp8(unit_scaled_gpt(CONFIG, seed=0)),
    }


@pytest.mark.parametrize("kind", ["plain", "simulate_fp8(unit-scaled)"])
def test_records_only_chosen_steps_and_matches_track_scales(
    kind: str, stats_calls: list[int]
) -> None:
    model = _models()[kind]
    monitor = ScaleMonitor(model, every=3)
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = batches(2, 16, seed=0)
    per_step: list[int] = []
    reference = None
    for step in range(7):
        batch = next(data)
        if step == 3:  # what track_scales sees for this step's weights and batch
            tracked = track_scales(model)
            tracked(batch.input_ids, labels=batch.labels).backward()
            reference = graph_to_dataframe(tracked.scales_graph())
        stats_calls.clear()
        loss = monitor.module(batch.input_ids, labels=batch.labels)
        loss.backward()
        assert monitor.step() is None
        per_step.append(len(stats_calls))
        optimiser.step()
        optimiser.zero_grad()

    # Statistics are computed on steps 0, 3 and 6 only: nothing at all on the others.
    assert [n > 0 for n in per_step] == [True, False, False, True, False, False, True]
    assert monitor.recorded_steps == [0, 3, 6]
    table = monitor.table()
    assert tuple(table.columns) == LONG_COLUMNS
    assert sorted(table["step"].unique()) == [0, 3, 6]

    # Step 3's records are track_scales' on the same weights and batch, value for value.
    assert reference is not None
    mine = table[table["step"] == 3].pivot_table(
        index=["tensor", "direction"], columns="metric", values="value", dropna=False
    )
    theirs = reference.set_index(["name", "direction"])[list(mine.columns)]
    assert len(mine) == len(theirs) > 50
    theirs = theirs.loc[mine.index]
    np.testing.assert_array_equal(mine.to_numpy(), theirs.to_numpy())
    assert set(table["direction"]) == {"fwd", "bwd"}


def test_monitored_module_trains_the_models_own_parameters() -> None:
    model = plain_gpt(CONFIG, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monitor = ScaleMonitor(model, every=2)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)  # the user's optimiser, unchanged
    batch = next(batches(2, 16, seed=1))
    monitor.module(batch.input_ids, labels=batch.labels).backward()
    monitor.step()
    optimiser.step()
    after = model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    with torch.no_grad():
        expected = model(batch.input_ids, labels=batch.labels)
        got = monitor.module(batch.input_ids, labels=batch.labels)
    assert torch.equal(expected, got)
    # A copy of the monitored module is an independent tracked module, not monitored.
    clone = copy.deepcopy(monitor.module)
    monitor.step()
    clone(batch.input_ids, labels=batch.labels)
    with pytest.raises(MonitorError, match=r"not called during step 2"):
        monitor.step()
    assert pickle.loads(pickle.dumps(monitor.module))._monitor is None


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        print("", end="")  # a graph break inside a loop: Dynamo skips the caller's frame
        return x + torch.relu(h)


class LoopWithBreak(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def test_model_dynamo_cannot_capture_whole_is_monitored_whole() -> None:
    model = LoopWithBreak()
    monitor = ScaleMonitor(model, every=2)
    x = torch.randn(3, 8)
    for step in range(3):
        if step == 0:
            with pytest.warns(UserWarning, match="replayed with unitscale's eager tracer"):
                loss = monitor.module(x)
        else:
            loss = monitor.module(x)
        assert torch.equal(loss, model(x))
        loss.backward()
        monitor.step()
    table = monitor.table()
    for step in (0, 2):
        rows = table[(table["step"] == step) & (table["metric"] == "rms")]
        linears = rows[(rows["op"] == "linear") & (rows["direction"] == "bwd")]
        assert list(linears["module"]) == ["blocks.0.proj", "blocks.1.proj", "head"]


class Overflowing(nn.Module):
    """``c(b(relu(a(x))))``: ``b``'s weights are huge, so ``b``'s output overflows when x is big."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 1)
        with torch.no_grad():
            self.a.weight.copy_(torch.eye(4))
            self.a.bias.zero_()
            self.b.weight.copy_(torch.rand(4, 4) * 1e30)  # outputs ~1e30: finite in float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        g = self.b(h)
        return self.c(g).mean()


def test_first_inf_in_forward_located_on_an_unrecorded_step() -> None:
    model = Overflowing()
    monitor = ScaleMonitor(model, every=5)  # records steps 0 and 5: step 3 needs a replay
    optimiser = torch.optim.SGD(model.parameters(), lr=0.0)
    found = []
    for step in range(5):
        x = torch.rand(3, 4) + 0.5
        if step == 3:
            x = x * 1e10  # b's output: 1e40 overflows to inf
        loss = monitor.module(x)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        rng = torch.get_rng_state()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = monitor.step()
        found.append(report)
        if step == 3:
            assert [str(w.message) for w in caught if w.category is NonFiniteWarning] == [
                f"ScaleMonitor: {report}"
            ]
            # The replay leaves the user's gradients and random stream as they were.
            assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
            assert torch.equal(torch.get_rng_state(), rng)
        optimiser.step()
        optimiser.zero_grad()
    assert found[:3] == [None, None, None] and found[4] is None  # reported once, at step 3
    report = found[3]
    assert report is not None and monitor.non_finite is report
    assert (report.step, report.direction, report.module, report.op) == (3, "fwd", "b", "linear")
    assert report.tensor == "g"
    assert report.inf_count > 0 and report.numel == 12
    assert "loss" in report.trigger
    assert [name for name, _ in report.neighbours] == ["h", "b.weight", "b.bias"]
    assert 1e10 < report.neighbours[0][1] < 1e11  # the input that made it overflow
    assert "value of 'g' (module 'b', op linear)" in report.message


class SqrtAtZero(nn.Module):
    """``sqrt(x * w)``: finite forward, but the gradient of ``y`` is inf where ``x`` is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.w
        z = torch.sqrt(y)
        return z.sum()


def test_first_inf_in_backward_located_and_raised() -> None:
    model = SqrtAtZero()
    monitor = ScaleMonitor(model, every=None, on_non_finite="raise")
    for step in range(3):
        x = torch.rand(3, 4) + 0.1
        if step == 2:
            x[1, 2] = 0.0
        monitor.module(x).backward()
        if step < 2:
            assert monitor.step() is None
    with pytest.raises(NonFiniteError, match=r"step 2: first NaN/Inf in the gradient of 'y'") as e:
        monitor.step()
    report = e.value.report
    assert (report.tensor, report.direction, report.trigger) == ("y", "bwd", "gradients")
    assert (report.inf_count, report.nan_count) == (1, 0)
    assert report.neighbours == (("z", 1.0),)  # the finite gradient it was computed from
    assert monitor.step_count == 3  # the step still ended


def test_recorded_step_sees_inf_that_never_reaches_the_weights() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.relu(x * self.w)
            return torch.sqrt(y).sum()  # inf gradient at y == 0, zeroed by relu's backward

    model = Masked()
    monitor = ScaleMonitor(model, every=1, on_non_finite="ignore")
    x = torch.tensor([[1.0, -1.0, 2.0, 3.0]])
    monitor.module(x).backward()
    assert model.w.grad is not None and bool(torch.isfinite(model.w.grad).all())
    report = monitor.step()
    assert report is not None and report.trigger == "tracked tensor"
    assert (report.tensor, report.direction, report.inf_count) == ("y", "bwd", 1)


def test_usage_errors() -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(MonitorError, match=r"every=0 must be a positive integer"):
        ScaleMonitor(model, every=0)
    with pytest.raises(MonitorError, match=r"unknown metric\(s\) \['scale'\]"):
        ScaleMonitor(model, metrics=["scale"])
    with pytest.raises(MonitorError, match=r"on_non_finite='stop'"):
        ScaleMonitor(model, on_non_finite="stop")  # type: ignore[arg-type]
    with pytest.raises(MonitorError, match=r"already tracked"):
        ScaleMonitor(track_scales(model))
    with pytest.raises(MonitorError, match=r"compiled by unitscale.transforms.compile"):
        ScaleMonitor(compile_module(model))
    with pytest.raises(MonitorError, match=r"_orig_mod"):
        ScaleMonitor(torch.compile(model))

    monitor = ScaleMonitor(model, every=1)
    with pytest.raises(MonitorError, match=r"monitor.module was not called during step 0"):
        monitor.step()
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor.module(torch.ones(2, 4)).sum().backward()
    optimiser.step()
    with pytest.raises(MonitorError, match=r"before optimizer.step\(\)"):
        monitor.step()


def _one_step_monitor() -> ScaleMonitor:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    monitor = ScaleMonitor(model, every=2, metrics=["rms", "abs_max"])
    for _ in range(3):
        monitor.module(torch.randn(4, 8)).pow(2).mean().backward()
        monitor.step()
    return monitor


def test_csv_and_tensorboard_export(tmp_path: pytest.TempPathFactory) -> None:
    monitor = _one_step_monitor()
    path = monitor.to_csv(tmp_path / "scales.csv")  # type: ignore[operator]
    # Full precision: the values read back exactly (pandas < 3 parses floats exactly only when
    # asked to; pandas 3 does by default and deprecates the argument).
    exact = {"float_precision": "round_trip"} if int(pd.__version__.split(".")[0]) < 3 else {}
    back = pd.read_csv(path, **exact)
    assert list(back.columns) == list(LONG_COLUMNS)
    assert set(back["metric"]) == {"rms", "abs_max"}
    table = monitor.table()
    np.testing.assert_array_equal(back["value"].to_numpy(), table["value"].to_numpy())

    class FakeWriter:
        def __init__(self) -> None:
            self.points: list[tuple[str, float, int]] = []

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.points.append((tag, value, step))

    writer = FakeWriter()
    write_tensorboard(monitor.records, writer, metrics=["rms"])
    rms = table[table["metric"] == "rms"]
    assert len(writer.points) == len(rms)
    assert {step for _, _, step in writer.points} == {0, 2}
    weight = rms[(rms["tensor"] == "0.weight") & (rms["direction"] == "bwd") & (rms["step"] == 2)]
    assert ("rms/bwd/0.weight", weight["value"].item(), 2) in writer.points
    with pytest.raises(MonitorError, match=r"metric\(s\) \['mean_abs'\] were not kept"):
        write_tensorboard(monitor.records, writer, metrics=["mean_abs"])


class _Writer:
    def __init__(self) -> None:
        self.points: list[tuple[str, float, int]] = []
        self.flushes = 0

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.points.append((tag, value, step))

    def flush(self) -> None:
        self.flushes += 1


def _train_three_steps(monitor: ScaleMonitor) -> None:
    torch.manual_seed(0)
    for _ in range(3):
        monitor.module(torch.randn(4, 8)).pow(2).mean().backward()
        monitor.step()


def test_on_record_receives_each_recorded_step_as_it_is_recorded() -> None:
    received: list[tuple[int, int]] = []  # (step count when called, steps in the records)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))

    def on_record(records: list[MonitorRecord]) -> None:
        received.append((monitor.step_count, len({r.step for r in records})))

    monitor = ScaleMonitor(model, every=2, metrics=["rms"], on_record=on_record)
    _train_three_steps(monitor)
    assert received == [(0, 1), (2, 1)]  # during step 0 and step 2, one step each
    assert monitor.records and all(isinstance(r, MonitorRecord) for r in monitor.records)
    with pytest.raises(MonitorError, match=r"on_record=3 must be callable"):
        ScaleMonitor(model, on_record=3)  # type: ignore[arg-type]


def test_tensorboard_sink_while_training_equals_writing_afterwards() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    live = _Writer()
    monitor = ScaleMonitor(
        model, every=2, metrics=["rms"], on_record=tensorboard_sink(live, ["rms"])
    )
    _train_three_steps(monitor)
    after = _Writer()
    write_tensorboard(monitor.records, after, ["rms"])
    assert live.points and live.points == after.points
    flushes = live.flushes
    monitor.close()
    assert live.flushes == flushes + 1


@pytest.mark.skipif(tensorboard_available(), reason="tensorboard is installed")
def test_tensorboard_folder_without_tensorboard_is_a_clear_error(tmp_path: object) -> None:
    with pytest.raises(MonitorError, match=r"needs the tensorboard package: pip install"):
        tensorboard_sink(str(tmp_path))


def test_heatmap_log2_colours_labels_and_non_finite_cells() -> None:
    table = pd.DataFrame(
        {
            "step": [0, 5, 0, 5, 0, 5],
            "tensor": ["w", "w", "y", "y", "v", "v"],
            "direction": "fwd",
            "metric": "rms",
            "value": [1.0, 8.0, 0.25, math.inf, 2.0, 16.0],
            "label": ["w", "w", "m: y", "m: y", "m: v", "m: v"],
            "row": [0, 0, 1, 1, 2, 2],
            "same_scale": [False, False, False, False, True, True],
        }
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ax = scale_heatmap(table, "rms")
        image = ax.images[0].get_array()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["w", "m: y"]  # v is a view: pruned
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "5"]
    assert image[0].tolist() == [0.0, 3.0]
    assert image[1, 0] == -2.0 and bool(image.mask[1, 1])  # Inf is not coloured...
    overlay = ax.images[1].get_array()
    assert overlay.mask.tolist() == [[True, True], [True, False]]  # ...but drawn black
    assert ax.images[0].norm.vmin == -3.0 and ax.images[0].norm.vmax == 3.0
    assert len(scale_heatmap(table, "rms", prune_same_scale=False).get_yticklabels()) == 3
    with pytest.raises(MonitorError, match=r"no bwd values of metric 'rms'"):
        scale_heatmap(table, "rms", "bwd")


def test_monitor_heatmap_from_training() -> None:
    monitor = _one_step_monitor()
    ax = scale_heatmap(monitor.table(), "rms", "bwd")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "2"]
    assert "gradients" in ax.get_title()
