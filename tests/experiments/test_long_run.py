"""benchmarks/long_run.py, the static-scales experiment over a long run: which tensors it
reads as a linear op's GEMM operands, the statements it derives from them, and the script at
a tiny size (outputs, resumption, a fabricated overflow named in the summary)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pandas as pd
import pytest
import torch
from _hang_guard import HANG_GUARD_S

from unitscale.experiments.training import (
    MONITOR_METRICS,
    TrainConfig,
    build_optimiser,
    build_run_model,
)
from unitscale.tracking import ScaleMonitor

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--steps", "20", "--monitor-every", "5", "--eval-every", "10", "--eval-batches", "1",
        "--width", "32", "--heads", "2", "--depth", "1", "--seeds", "0", "--kinds",
        "unit-scaled-fp32,unit-scaled-fp8", "--job-timeout", str(HANG_GUARD_S)]  # fmt: skip


@pytest.fixture(scope="module")
def modules() -> Iterator[tuple[ModuleType, ModuleType]]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _long_run_report
        import long_run

        yield long_run, _long_run_report
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _monitored_step(config: TrainConfig) -> tuple[pd.DataFrame, torch.nn.Module]:
    model = build_run_model("unit-scaled-fp8", config)
    monitor = ScaleMonitor(model, every=1, metrics=MONITOR_METRICS)
    optimiser = build_optimiser("unit-scaled-fp8", model, config)
    ids = torch.randint(0, 256, (2, 16))
    monitor.module(ids, labels=ids).backward()
    monitor.step()
    optimiser.zero_grad()
    return monitor.table(), model


def test_the_operands_read_are_the_unrounded_tensors_of_every_linear_op(
    modules: Any, single_thread: None
) -> None:
    report = modules[1]
    config = TrainConfig(hidden_size=16, heads=2, depth=1)
    table, model = _monitored_step(config)
    rows = report.linear_op_rows(table)
    ops = {"layers.0.attn.qkv", "layers.0.attn.out", "layers.0.mlp.up", "layers.0.mlp.down",
           "readout"}  # fmt: skip
    assert set(rows["op"]) == ops
    assert set(map(tuple, rows[["op", "role"]].drop_duplicates().to_numpy())) == {
        (op, role) for op in ops for role in ("input", "weight", "output_grad")
    }
    # the operands before their cast (not the quantise_operand nodes), the output gradient
    # before its cast (the quantise_grad node's backward)
    quantised = rows["tensor"].str.endswith("_quantised")
    assert set(rows[quantised]["role"]) == {"output_grad"}
    assert rows[rows["role"] == "output_grad"]["tensor"].str.endswith("_grad_quantised").all()
    # a weight operand is the parameter itself, unrounded: its rms is the parameter's
    weights = rows[(rows["role"] == "weight") & (rows["metric"] == "rms")]
    parameters = dict(model.module.named_parameters())
    for op, value in zip(weights["op"], weights["value"], strict=True):
        expected = parameters[f"{op}.weight"].detach().double().pow(2).mean().sqrt().item()
        assert value == pytest.approx(expected, rel=1e-6)
    # the rounded operand is not what is read: its rms differs from the unrounded input's
    rms = table[(table["metric"] == "rms") & (table["direction"] == "fwd")]
    rms = dict(zip(rms["tensor"], rms["value"], strict=True))
    inputs = rows[(rows["role"] == "input") & (rows["metric"] == "rms")]
    assert all(
        rms[f"{tensor}_quantised"] != value
        for tensor, value in zip(inputs["tensor"], inputs["value"], strict=True)
    )
    with pytest.raises(ValueError, match="no quantise_operand"):
        report.linear_op_rows(table[~table["op"].str.startswith("quantise")])


def _frame(values: dict[tuple[str, str, str], list[float]], steps: list[int]) -> pd.DataFrame:
    rows = [
        (step, op, role, "t", metric, value)
        for (op, role, metric), series in values.items()
        for step, value in zip(steps, series, strict=True)
    ]
    return pd.DataFrame(rows, columns=["step", "op", "role", "tensor", "metric", "value"])


def _fabricated(overflow: float) -> dict[int, pd.DataFrame]:
    """Two seeds, two ops, three records; one input overflows by ``overflow`` at step 200
    of seed 1, one output gradient's underflow drifts from 1e-4 to 3e-2, one weight's rms
    doubles, one input's largest magnitude peaks at 56 at step 100."""
    steps = [0, 100, 200]
    frames = {}
    for seed in (0, 1):
        values: dict[tuple[str, str, str], list[float]] = {}
        for op in ("layers.0.mlp.up", "layers.1.mlp.down"):
            for role, formats in (("input", ["e4m3"]), ("weight", ["e4m3"]),
                                  ("output_grad", ["e5m2", "e4m3"])):  # fmt: skip
                for fmt in formats:
                    values[(op, role, f"overflow_{fmt}")] = [0.0, 0.0, 0.0]
                    values[(op, role, f"underflow_{fmt}")] = [1e-4, 1e-4, 1e-4]
                values[(op, role, "rms")] = [1.0, 1.0, 1.0]
                values[(op, role, "abs_max")] = [4.0, 4.0, 4.0]
        if seed == 1:
            values[("layers.1.mlp.down", "input", "overflow_e4m3")] = [0.0, 0.0, overflow]
        values[("layers.0.mlp.up", "output_grad", "underflow_e5m2")] = [1e-4, 1e-3, 3e-2]
        values[("layers.1.mlp.down", "weight", "rms")] = [1.0, 1.5, 2.0]
        values[("layers.0.mlp.up", "input", "abs_max")] = [4.0, 56.0, 8.0]
        frames[seed] = _frame(values, steps)
    return frames


def _ranges(report: ModuleType, frames: dict[int, pd.DataFrame]) -> dict[str, Any]:
    return {
        "run": "unit-scaled-fp8",
        "recorded_steps_per_seed": {f"seed{s}": 3 for s in frames},
        "ops": report.range_figures(frames),
    }


def test_the_statements_are_derived_from_the_figures(modules: Any) -> None:
    report = modules[1]
    lines = report.statements(_ranges(report, _fabricated(0.0)))
    assert lines[0].startswith("static unit scales stayed in range: max overflow 0")
    assert "(3 in seed0, 3 in seed1)" in lines[0]
    drift = "output gradients: underflow drifted from 0.0001 to 0.03 on layers.0.mlp.up output_grad"
    assert any(line.startswith(drift) for line in lines), lines
    assert any(
        line.startswith("forward operands: rms drifted from 1 to 2 on layers.1.mlp.down weight")
        for line in lines
    ), lines
    assert (
        "forward operands: largest magnitude 56 on layers.0.mlp.up input (abs_max, seed0, "
        "step 100), 8x below E4M3's largest value 448"
    ) in lines
    assert (
        "output gradients: largest magnitude 4 on layers.0.mlp.up output_grad (abs_max, seed0, "
        "step 0), 14,336x below E5M2's largest value 57344"
    ) in lines
    lines = report.statements(_ranges(report, _fabricated(0.125)))
    assert lines[0] == (
        "static unit scales did not stay in range: max overflow 0.125 on layers.1.mlp.down "
        "input (overflow_e4m3, seed1, step 200) (recorded steps: 3 in seed0, 3 in seed1)"
    )
    figures = report.range_figures(_fabricated(0.125))["layers.1.mlp.down"]["input"]
    assert figures["overflow_e4m3"]["seed1"] == {
        "first": 0.0, "last": 0.125, "max": 0.125, "max_step": 200, "first_step": 0,
        "last_step": 200, "non_finite": 0,
    }  # fmt: skip
    frames = _fabricated(0.0)  # a NaN is counted, and the largest finite value kept
    hit = (frames[0]["op"] == "layers.0.mlp.up") & (frames[0]["metric"] == "rms")
    frames[0].loc[hit & (frames[0]["role"] == "input") & (frames[0]["step"] == 100), "value"] = (
        float("nan")
    )
    rms = report.range_figures(frames)["layers.0.mlp.up"]["input"]["rms"]["seed0"]
    assert (rms["max"], rms["max_step"], rms["non_finite"]) == (1.0, 0, 1)
    assert (
        "non-finite values recorded (series: count) in layers.0.mlp.up input (rms, seed0: 1)"
        in report.statements(_ranges(report, frames))
    )
    assert not any("non-finite" in line for line in lines)
    assert report.statements({"run": "unit-scaled-fp8", "ops": {}}) == [
        "no scales recorded yet (the monitored run is not complete)"
    ]


def test_a_folder_in_use_is_not_taken_over(modules: Any, tmp_path: Path) -> None:
    long_run = modules[0]
    folder = tmp_path / "unit-scaled-fp8.partial"
    folder.mkdir()
    (folder / "pid.json").write_text(json.dumps({"scheduler": 1, "train": 1}))  # init: alive
    with pytest.raises(SystemExit, match="in use by process"):
        long_run._claim(folder)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=HANG_GUARD_S)  # fmt: skip
    (folder / "pid.json").write_text(json.dumps({"train": int(done.stdout)}))  # ended
    (folder / "job.log").write_text("stale")
    long_run._claim(folder)
    assert list(folder.iterdir()) == []


def test_the_options_are_checked_before_any_job(
    modules: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    long_run = modules[0]
    for options, message in (
        (["--kinds", "plain-fp32,nope", "--monitor", "plain-fp32"], "unknown or repeated"),
        (["--monitor", "unit-scaled-fp32"], "choose a simulated FP8 run"),
        (["--kinds", "plain-fp32"], "--monitor unit-scaled-fp8 is not one of --kinds"),
    ):
        with pytest.raises(SystemExit):
            long_run.parse_args([*options, "--out", str(tmp_path)])
        assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_script_at_a_tiny_size_resumes_and_reports(
    modules: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    long_run = modules[0]
    out = tmp_path / "long"
    assert long_run.main([*TINY, "--out", str(out), "--jobs", "2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "loss_curves.png", "overflow_underflow.png", "results.json", "seed0", "summary.txt",
    ]  # fmt: skip
    assert sorted(p.name for p in (out / "seed0").iterdir()) == [
        "unit-scaled-fp32",
        "unit-scaled-fp8",
    ]
    monitored = out / "seed0" / "unit-scaled-fp8"
    assert sorted(p.name for p in monitored.iterdir()) == [
        "job.json", "job.log", "linear_ops.csv", "losses.csv", "results.json",
        "scales_unit-scaled-fp8_bwd.png", "scales_unit-scaled-fp8_fwd.png",
    ]  # fmt: skip
    assert not list(out.rglob("scales_*.csv")) and not list(out.rglob("report.html"))
    assert not (out / "seed0" / "unit-scaled-fp32" / "linear_ops.csv").exists()
    record = json.loads((monitored / "job.json").read_text())
    assert record["command"].startswith("python -m unitscale train --runs unit-scaled-fp8")
    assert "--monitor-every 5" in record["command"]
    assert len(record["code_commit"]) == 40 and record["wall_s"] > 0
    assert 0 < record["cpu_s"] < 2 * record["wall_s"]  # its own process's, one thread
    assert len(record["load_average_before"]) == 3 and record["torch_threads"] == 1
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and results["missing_jobs"] == []
    fp8 = results["jobs"]["seed0"]["unit-scaled-fp8"]
    fp32 = results["jobs"]["seed0"]["unit-scaled-fp32"]
    gap = results["gaps_to_fp32"]["seed0"]["unit-scaled-fp8"]["heldout"]
    expected = (fp8["final_heldout_loss"] - fp32["final_heldout_loss"]) / fp32["final_heldout_loss"]
    assert gap == pytest.approx(expected, rel=1e-6)
    assert results["scale_ranges"]["recorded_steps_per_seed"] == {"seed0": 4}  # 0, 5, 10, 15
    assert len(results["scale_ranges"]["ops"]) == 5
    first = (out / "results.json").read_bytes()

    # resumed: nothing runs again, the same results.json
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a completed job was started again")

    monkeypatch.setattr(long_run.subprocess, "Popen", refuse)
    assert long_run.main([*TINY, "--out", str(out)]) == 0
    assert (out / "results.json").read_bytes() == first
    with pytest.raises(SystemExit, match="was run with steps=20"):
        long_run.main([*TINY, "--out", str(out), "--steps", "30"])

    # a fabricated overflow in the monitored run's figures is the one the summary names
    table = pd.read_csv(monitored / "linear_ops.csv")
    hit = (table["op"] == "layers.0.mlp.up") & (table["role"] == "weight")
    table.loc[hit & (table["metric"] == "overflow_e4m3") & (table["step"] == 10), "value"] = 0.375
    table.to_csv(monitored / "linear_ops.csv", index=False)
    assert long_run.main([*TINY, "--out", str(out), "--report-only"]) == 0
    summary = (out / "summary.txt").read_text()
    assert (
        "static unit scales did not stay in range: max overflow 0.375 on layers.0.mlp.up "
        "weight (overflow_e4m3, seed0, step 10)"
    ) in summary
    ranges = json.loads((out / "results.json").read_text())["scale_ranges"]["ops"]
    assert ranges["layers.0.mlp.up"]["weight"]["overflow_e4m3"]["seed0"]["max"] == 0.375
    _the_readme_states_what_the_summary_states(out, monkeypatch)

    _an_interrupted_job_runs_again_alone(long_run, out, results, monkeypatch)


def _the_readme_states_what_the_summary_states(out: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README's long-run section (benchmarks/readme_tables.py) has every job's losses, each
    gap to its own FP32 run, and the summary's statements, the fabricated overflow included."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_tables
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    train = out.parent / "train"
    train.mkdir()
    (train / readme_tables.LONG_RUN_FOLDER).symlink_to(out)
    monkeypatch.setattr(readme_tables.paths, "TRAIN", train)
    monkeypatch.setattr(readme_tables.paths, "ROOT", out.parent)
    table = readme_tables.long_run_table()
    original = (out / "results.json").read_bytes()
    results = json.loads(original)
    fp8 = results["jobs"]["seed0"]["unit-scaled-fp8"]
    gap = results["gaps_to_fp32"]["seed0"]["unit-scaled-fp8"]
    curve = pd.read_csv(out / "seed0" / "unit-scaled-fp8" / "losses.csv").dropna(
        subset=["heldout_loss"]
    )
    lowest = curve.loc[curve["heldout_loss"].idxmin()]
    gaps = f"{gap['heldout']:+.2%} / {gap['train']:+.2%}"
    row = next(line for line in table.splitlines() if line.startswith("| unit-scaled-fp8 |"))
    assert row == (
        f"| unit-scaled-fp8 | {fp8['final_train_loss']:.4f} / "
        f"{fp8['final_heldout_loss']:.4f} | {lowest['heldout_loss']:.4f} "
        f"({int(lowest['step'])}) | {gaps} | {gaps} |"
    )
    assert "| unit-scaled-fp32 |" in table and "20 steps, width 32, depth 1, heads 2" in table
    summary = (out / "summary.txt").read_text()
    statements = [line.removeprefix("- ") for line in table.splitlines() if line[:2] == "- "]
    assert statements and all(line in summary for line in statements)
    assert any(line.startswith("static unit scales did not stay in range") for line in statements)
    (out / "results.json").write_text(json.dumps({**results, "complete": False,
                                                  "missing_jobs": ["seed1/x"]}))  # fmt: skip
    assert readme_tables.long_run_table().startswith("Not committed yet (1 jobs missing)")
    (out / "results.json").write_bytes(original)
    (train / readme_tables.LONG_RUN_FOLDER).unlink()


def _an_interrupted_job_runs_again_alone(
    long_run: ModuleType, out: Path, results: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale ``.partial`` folder and no completed one: reported missing, then that job,
    and only it, is run again, with the same losses."""
    monkeypatch.undo()
    started = []
    popen = long_run.subprocess.Popen

    def counting(command: list[str], **kwargs: Any) -> Any:
        if "--runs" in command:  # not git, which subprocess.run starts through Popen too
            started.append(command[command.index("--runs") + 1])
        return popen(command, **kwargs)

    monkeypatch.setattr(long_run.subprocess, "Popen", counting)
    before = results["jobs"]["seed0"]["unit-scaled-fp32"]
    (out / "seed0" / "unit-scaled-fp32").rename(out / "seed0" / "unit-scaled-fp32.partial")
    report_only = [*TINY, "--out", str(out), "--report-only"]
    assert long_run.main(report_only) == 0
    assert (
        "INCOMPLETE: 1 of 2 jobs missing (seed0/unit-scaled-fp32)"
        in (out / "summary.txt").read_text()
    )
    assert long_run.main([*TINY, "--out", str(out)]) == 0
    assert started == ["unit-scaled-fp32"]
    again = json.loads((out / "results.json").read_text())["jobs"]["seed0"]["unit-scaled-fp32"]
    assert again["final_heldout_loss"] == before["final_heldout_loss"]
    assert not list(out.rglob("*.partial"))


def test_an_interrupt_stops_the_running_jobs_and_keeps_nothing_partial_as_done(
    modules: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    long_run = modules[0]
    started: list[Any] = []
    popen = long_run.subprocess.Popen

    def keep(command: list[str], **kwargs: Any) -> Any:
        process = popen(command, **kwargs)
        started.append(process)
        return process

    sleep, calls = time.sleep, []

    def interrupt(seconds: float) -> None:  # Ctrl-C once, in the first wait of the scheduler
        calls.append(seconds)
        if len(calls) == 1:
            raise KeyboardInterrupt
        sleep(seconds)

    monkeypatch.setattr(long_run.subprocess, "Popen", keep)
    monkeypatch.setattr(long_run.time, "sleep", interrupt)
    out = tmp_path / "long"
    assert long_run.main([*TINY, "--out", str(out), "--jobs", "2"]) == 130
    jobs = [p for p in started if "--runs" in p.args]
    assert len(jobs) == 2 and all(p.returncode is not None for p in jobs)  # stopped
    assert sorted(p.name for p in (out / "seed0").iterdir()) == [
        "unit-scaled-fp32.partial",
        "unit-scaled-fp8.partial",
    ]
    assert not (out / "results.json").exists()
