"""``unitscale train``'s output: comparable heatmaps across runs."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import unitscale.analysis
from unitscale.cli import main


def test_every_run_s_heatmap_shares_one_colour_range_per_direction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    drawn: list[tuple[str, float]] = []
    original = unitscale.analysis.scale_heatmap

    def recording(table: Any, metric: str, direction: str, **kwargs: Any) -> Any:
        ax = original(table, metric, direction, **kwargs)
        drawn.append((direction, ax.images[0].norm.vmax))
        return ax

    monkeypatch.setattr(unitscale.analysis, "scale_heatmap", recording)
    tiny = ["--steps", "4", "--width", "8", "--heads", "1", "--depth", "1", "--seq-len", "8"]
    tiny += ["--batch-size", "2", "--eval-every", "2", "--eval-batches", "1", "--no-progress"]
    runs = ["--runs", "plain-fp32,unit-scaled-fp32", "--monitor-every", "2"]
    assert main(["train", *tiny, *runs, "--out", str(tmp_path / "out")]) == 0
    by_direction: dict[str, set[float]] = {}
    for direction, vmax in drawn:
        by_direction.setdefault(direction, set()).add(vmax)
    assert len(drawn) == 4 and set(by_direction) == {"fwd", "bwd"}
    # One range per direction, wide enough for the plain model's small gradients.
    assert all(len(v) == 1 for v in by_direction.values()), by_direction
    assert by_direction["bwd"].pop() > 5


TINY = ["--steps", "4", "--width", "8", "--heads", "1", "--depth", "1", "--seq-len", "8"]
TINY += ["--batch-size", "2", "--eval-every", "2", "--eval-batches", "1", "--no-progress"]


def test_ctrl_c_keeps_the_runs_completed_and_the_losses_so_far(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import csv

    from unitscale.experiments import _train_loop

    original = _train_loop._StepProgress.update

    def interrupting(self: Any, loss: float) -> None:  # Ctrl-C after step 2 of the 2nd run
        original(self, loss)
        if self.run == "unit-scaled-fp32" and self.done == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(_train_loop._StepProgress, "update", interrupting)
    out = tmp_path / "out"
    runs = ["--runs", "plain-fp32,unit-scaled-fp32"]
    assert main(["train", *TINY, *runs, "--out", str(out)]) == 130
    summary = (out / "summary.txt").read_text()
    assert summary.startswith("INTERRUPTED (Ctrl-C) during unit-scaled-fp32 after 2 of 4 steps")
    assert "\nruns completed: plain-fp32 (the interrupted run's losses so far" in summary
    assert re.search(r"^plain-fp32\s+[\d.]+\s+[\d.]+", summary, re.M)  # its summary row
    assert not re.search(r"^unit-scaled-fp32\s", summary, re.M)
    with (out / "losses.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    trained = {
        run: [r["train_loss"] for r in rows if r["run"] == run and r["train_loss"]]
        for run in ("plain-fp32", "unit-scaled-fp32")
    }
    assert len(trained["plain-fp32"]) == 4 and len(trained["unit-scaled-fp32"]) == 2
    assert (out / "loss_curves.png").stat().st_size > 0
    assert "interrupted; kept what finished" in capsys.readouterr().err


def test_run_interrupted_carries_the_losses_so_far() -> None:
    from unitscale.experiments.training import RunInterrupted, TrainConfig, train_run

    config = TrainConfig(
        steps=5, batch_size=2, seq_len=8, hidden_size=8, heads=1, depth=1, eval_batches=1
    )
    from unitscale.experiments.runner import training_batches

    stream = iter(training_batches(2, 8, 0))

    def two_then_ctrl_c() -> Any:
        for _ in range(2):
            yield next(stream)
        raise KeyboardInterrupt

    with pytest.raises(RunInterrupted) as info:
        train_run("plain-fp32", config, progress=False, data=two_then_ctrl_c())
    assert isinstance(info.value, KeyboardInterrupt) and info.value.steps_done == 2
    losses = info.value.partial.train_losses
    assert len(losses) == 5 and all(x == x for x in losses[:2]) and losses[2] != losses[2]


@pytest.mark.parametrize("command", ["train", "transfer"])
def test_every_command_refuses_an_earlier_runs_folder_unless_told(
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from unitscale.cli import train as train_command
    from unitscale.experiments import transfer as sweep

    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.txt").write_text("a 200-step result")
    argv = [command, "--quick"] if command == "transfer" else [command, *TINY]
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds the outputs of an earlier run (summary.txt); give --overwrite" in err
    assert (out / "summary.txt").read_text() == "a 200-step result"

    class Told(Exception):
        pass

    def told(*args: object, **kwargs: object) -> None:  # past the check: the work would start
        raise Told

    monkeypatch.setattr(train_command, "_train", told)
    monkeypatch.setattr(sweep, "run_transfer", told)
    assert main([*argv, "--out", str(out), "--overwrite"]) == 1  # the work started
    assert "error: Told" in capsys.readouterr().err
