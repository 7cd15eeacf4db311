"""The training comparison (unitscale.training) and the ``unitscale train`` command."""

from __future__ import annotations

import csv
import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _hang_guard import HANG_GUARD_S

from unitscale.cli import main
from unitscale.experiments.training import (
    DEFAULT_RUNS,
    RUN_NAMES,
    RunResult,
    TrainConfig,
    TrainConfigError,
    build_run_model,
    fp8_gaps,
    plot_losses,
    summary_text,
    train_run,
    train_runs,
)

# Subprocesses, training runs or a browser: run in full CI, skipped by -m 'not slow'.
pytestmark = pytest.mark.slow

_SCRIPT = Path(sys.executable).with_name("unitscale")
COMMAND = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "unitscale.cli"]
TINY = ["--steps", "4", "--width", "16", "--heads", "2", "--depth", "1", "--batch-size", "2",
        "--seq-len", "16", "--eval-every", "2", "--eval-batches", "1"]  # fmt: skip


def test_config_validation() -> None:
    with pytest.raises(TrainConfigError, match=r"steps=0 must be a positive integer"):
        TrainConfig(steps=0)
    with pytest.raises(TrainConfigError, match=r"unknown run\(s\) \['fp8'\]"):
        TrainConfig(runs=("fp8",))
    with pytest.raises(TrainConfigError, match=r"lists a run twice"):
        TrainConfig(runs=("plain-fp32", "plain-fp32"))
    with pytest.raises(TrainConfigError, match=r"hidden_size=10 must be a multiple of heads=4"):
        TrainConfig(hidden_size=10)
    with pytest.raises(TrainConfigError, match=r"lr_plain=0 must be a positive number"):
        TrainConfig(lr_plain=0)
    with pytest.raises(TrainConfigError, match=r"warmup_steps=-1"):
        TrainConfig(warmup_steps=-1)
    # Runs are always done in the canonical order.
    assert TrainConfig(runs=("unit-scaled-fp8", "plain-fp32")).runs == (
        "plain-fp32",
        "unit-scaled-fp8",
    )


def test_learning_rate_schedule() -> None:
    config = TrainConfig(steps=200, lr_plain=1e-3, lr_unit_scaled=1e-2)
    assert config.warmup == 10
    lrs = [config.lr_at("plain-fp8", s) for s in range(200)]
    assert lrs[9] == pytest.approx(1e-3) and lrs[0] == pytest.approx(1e-4)
    assert all(a <= b for a, b in itertools.pairwise(lrs[:10]))  # warm-up rises
    assert all(a >= b for a, b in itertools.pairwise(lrs[9:]))  # then decays
    assert lrs[-1] == pytest.approx(1e-4)
    assert config.lr_at("unit-scaled-fp32", 100) == pytest.approx(10 * lrs[100])


def test_fp8_runs_start_from_the_fp32_weights() -> None:
    config = TrainConfig(hidden_size=16, heads=2, depth=1, seq_len=16, seed=3)
    for family in ("plain", "unit-scaled"):
        fp32 = build_run_model(f"{family}-fp32", config).state_dict()
        fp8 = build_run_model(f"{family}-fp8", config).state_dict()
        assert fp32.keys() == fp8.keys()
        assert all(torch.equal(fp32[k], fp8[k]) for k in fp32)


def test_unit_scaled_runs_are_the_default_umup_decoder_with_umup_adamw() -> None:
    """The unit-scaled family is the library's default u-μP decoder (as
    ``us.TransformerDecoder(...)`` builds it), trained by ``unitscale.optim.AdamW`` at u-μP's
    documented default learning rate, each parameter at its u-μP rule."""
    import unitscale as us
    from unitscale.experiments.training import build_optimiser
    from unitscale.experiments.transfer import DEFAULT_MUP_LR
    from unitscale.optim import lr_scale_func_adam

    assert TrainConfig().lr_unit_scaled == DEFAULT_MUP_LR
    config = TrainConfig(hidden_size=32, heads=2, depth=2, seq_len=16, seed=3)
    model = build_run_model("unit-scaled-fp32", config)
    torch.manual_seed(config.seed)
    default = us.TransformerDecoder(32, depth=2, heads=2, vocab_size=256)
    assert type(model) is type(default) and model.mup
    expected = default.state_dict()
    assert model.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    optimiser = build_optimiser("unit-scaled-fp32", model, config)
    assert isinstance(optimiser, us.optim.AdamW)
    # Each group holds the base rate (what the schedule sets) and its parameters' u-μP factor.
    lrs = {id(p): g["lr"] * g["lr_scale"] for g in optimiser.param_groups for p in g["params"]}
    for p in model.parameters():
        assert lrs[id(p)] == pytest.approx(DEFAULT_MUP_LR * lr_scale_func_adam(p))
    assert {g["weight_decay"] for g in optimiser.param_groups} == {0.0}
    # The plain family keeps torch's Adam at its swept rate.
    plain = build_run_model("plain-fp32", config)
    optimiser = build_optimiser("plain-fp32", plain, config)
    assert type(optimiser) is torch.optim.Adam
    assert {g["lr"] for g in optimiser.param_groups} == {config.lr_plain}


def test_diverging_run_stops_and_monitor_reports_where() -> None:
    config = TrainConfig(
        steps=6, batch_size=2, seq_len=16, hidden_size=16, heads=2, depth=1, eval_batches=1,
        warmup_steps=0, lr_plain=1e30, monitor_every=100, runs=("plain-fp32",),
    )  # fmt: skip
    result = train_run("plain-fp32", config, progress=False)
    assert result.stopped_at is not None and 0 < result.stopped_at < 6
    assert all(math.isfinite(v) for v in result.train_losses[: result.stopped_at])
    assert all(math.isnan(v) for v in result.train_losses[result.stopped_at :])
    assert math.isnan(result.final_heldout_loss)
    report = result.non_finite
    assert report is not None and report.step == result.stopped_at
    assert report.tensor is not None and report.direction == "fwd"
    assert "NaN at step" in summary_text({"plain-fp32": result}, config)


def test_summary_checks_the_two_percent_claim() -> None:
    def result(name: str, train: float, heldout: float) -> RunResult:
        return RunResult(name, 1e-3, [train], {1: heldout}, train, heldout)

    results = {
        "plain-fp32": result("plain-fp32", 2.0, 2.0),
        "plain-fp8": result("plain-fp8", 2.1, 2.06),
        "unit-scaled-fp32": result("unit-scaled-fp32", 2.0, 2.0),
        "unit-scaled-fp8": result("unit-scaled-fp8", 2.01, 1.99),
    }
    gaps = fp8_gaps(results)
    assert gaps["plain"] == pytest.approx((0.05, 0.03))
    assert gaps["unit-scaled"] == pytest.approx((0.005, -0.005))
    text = summary_text(results, TrainConfig(steps=1))
    assert "plain in simulated FP8 vs FP32: held-out +3.00%, train +5.00% (NOT within 2%)" in text
    assert "unit-scaled in simulated FP8 vs FP32: held-out -0.50%, train +0.50% (within 2%)" in text


def test_scaled_fp8_baselines_in_the_default_set_and_the_table() -> None:
    """Plain FP8 with torchao's tensorwise scaling is a default baseline (delayed
    on request), the table says which FP8 runs have no scales, and each scaled run is set
    against its own FP32 run."""
    assert "plain-fp8-tensorwise" in DEFAULT_RUNS and "plain-fp8-delayed" not in DEFAULT_RUNS
    assert set(DEFAULT_RUNS) < set(RUN_NAMES) and TrainConfig().runs == DEFAULT_RUNS

    def result(name: str, heldout: float) -> RunResult:
        return RunResult(name, 1e-3, [heldout], {1: heldout}, heldout, heldout)

    results = {
        name: result(name, loss)
        for name, loss in (
            ("plain-fp32", 2.0),
            ("plain-fp8", 2.2),
            ("plain-fp8-tensorwise", 2.02),
            ("plain-fp8-delayed", 2.04),
            ("unit-scaled-fp32", 2.0),
            ("unit-scaled-fp8", 2.01),
        )
    }
    text = summary_text(results, TrainConfig(steps=1))
    lines = {line.split()[0]: line for line in text.splitlines() if line[:1].isalpha()}
    assert lines["run"].split()[-1] == "scaling"
    assert lines["plain-fp8"].endswith("no scaling")
    assert lines["unit-scaled-fp8"].endswith("no scaling")
    assert lines["plain-fp8-tensorwise"].endswith("tensorwise")
    assert lines["plain-fp8-delayed"].endswith("delayed")
    assert not lines["plain-fp32"].rstrip().endswith("scaling")
    assert (
        "plain in simulated FP8 with tensorwise scaling (plain-fp8-tensorwise) vs FP32: "
        "held-out +1.00%, train +1.00%"
    ) in text
    assert "with delayed scaling (plain-fp8-delayed) vs FP32: held-out +2.00%" in text


def test_scaled_fp8_runs_share_weights_batches_and_seed() -> None:
    """A tiny run of the plain FP8 kinds: the same first batch from the same weights, and
    delayed scaling's first step (current amax, the stated rule) equals tensorwise's."""
    config = TrainConfig(
        steps=2, batch_size=2, seq_len=16, hidden_size=16, heads=2, depth=1, eval_every=2,
        eval_batches=1, runs=("plain-fp32", "plain-fp8", "plain-fp8-tensorwise",
                              "plain-fp8-delayed"),
    )  # fmt: skip
    results = train_runs(config, progress=False)
    first = {name: r.train_losses[0] for name, r in results.items()}
    assert first["plain-fp8-delayed"] == first["plain-fp8-tensorwise"]
    for name in ("plain-fp8", "plain-fp8-tensorwise"):
        assert first[name] == pytest.approx(first["plain-fp32"], abs=0.02)
        assert first[name] != first["plain-fp32"]  # rounded, so not bit-identical
    assert all(len(r.train_losses) == 2 for r in results.values())


def test_bad_options_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--runs", "plain-fp32,fp16"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "unknown run(s) fp16; choose from plain-fp32,plain-fp8" in err
    assert main(["train", "--steps", "0"]) == 2
    assert "'0' must be at least 1" in capsys.readouterr().err
    # Options that are each valid but do not go together: a usage error too, in options.
    assert main(["train", "--width", "10", "--heads", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "unitscale train: error: --width 10 must be a multiple of --heads 4" in err


def _unitscale(*args: str, cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "UNITSCALE_DEBUG": ""}
    return subprocess.Popen(
        [*COMMAND, *args], cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def test_command_writes_outputs_and_is_deterministic(tmp_path: Path) -> None:
    # Two runs at once (same seed, same options), compared byte for byte.
    args = [*TINY, "--monitor-every", "2", "--seed", "5"]
    procs = [_unitscale("train", *args, "--out", f"out{i}", cwd=tmp_path) for i in (1, 2)]
    outputs = [p.communicate(timeout=HANG_GUARD_S) for p in procs]
    for proc, (_, stderr) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, stderr
    out1, out2 = tmp_path / "out1", tmp_path / "out2"
    stdout, stderr = outputs[0]

    # Same seed: byte-identical loss and scale tables.
    csvs = ["losses.csv", "effective_rates.csv", *(f"scales_{run}.csv" for run in DEFAULT_RUNS)]
    for name in csvs:
        assert (out1 / name).read_bytes() == (out2 / name).read_bytes(), name

    with (out1 / "losses.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == [run for run in DEFAULT_RUNS for _ in range(5)]
    assert [r["step"] for r in rows[:5]] == ["0", "1", "2", "3", "4"]
    assert [r["heldout_loss"] != "" for r in rows[:5]] == [False, False, True, False, True]
    assert all(2.0 < float(r["train_loss"]) < 6.0 for r in rows if r["train_loss"])
    # The FP32 and FP8 runs see the same batches from the same weights: close first losses.
    first = {r["run"]: float(r["train_loss"]) for r in rows if r["step"] == "0"}
    assert first["plain-fp8"] == pytest.approx(first["plain-fp32"], abs=0.02)
    assert first["unit-scaled-fp8"] == pytest.approx(first["unit-scaled-fp32"], abs=0.02)

    for name in ["loss_curves.png", "report.html", "summary.txt"] + [
        f"scales_{run}_{d}.png" for run in DEFAULT_RUNS for d in ("fwd", "bwd")
    ]:
        assert (out1 / name).stat().st_size > 1000, name
    report = (out1 / "report.html").read_text(encoding="utf-8")
    assert report.count('src="data:image/png;base64,') == 1 + 2 * len(DEFAULT_RUNS)
    assert "http://" not in report and "https://" not in report

    # The printed table: one line per run with its final losses, and the claim checked.
    table = {line.split()[0]: line.split() for line in stdout.splitlines() if line[:1].isalpha()}
    for run in DEFAULT_RUNS:
        assert float(table[run][2]) > 0 and float(table[run][3]) > 0
    assert "unit-scaled in simulated FP8 vs FP32: held-out" in stdout
    assert stdout == (out1 / "summary.txt").read_text(encoding="utf-8")
    assert "plain-fp32" in stderr and "4/4" in stderr  # progress bars


def test_progress_off_a_terminal_is_a_plain_line_per_tenth(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from unitscale.training import TrainConfig, train_run

    config = TrainConfig(steps=20, batch_size=1, seq_len=8, hidden_size=8, heads=1, depth=1,
                         eval_every=10, eval_batches=1)  # fmt: skip
    train_run("plain-fp32", config, progress=True)  # pytest's stderr is not a terminal
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert [line.split(",")[0] for line in lines] == [
        f"plain-fp32: step {step}/20" for step in range(2, 21, 2)
    ]


def test_train_report_shows_results_once_and_no_python_none(tmp_path: Path) -> None:
    import re

    from unitscale.training import TrainConfig, train_run, write_train_report

    config = TrainConfig(steps=2, batch_size=1, seq_len=8, hidden_size=8, heads=1, depth=1,
                         eval_every=1, eval_batches=1)  # fmt: skip
    results = {"plain-fp32": train_run("plain-fp32", config, progress=False)}
    text = write_train_report(results, config, tmp_path / "report.html").read_text()
    visible = re.sub(r"<[^>]+>", " ", text.split("<body>", 1)[1])
    final_loss = f"{results['plain-fp32'].final_heldout_loss:.4f}"
    assert visible.count(final_loss) == 1  # one results table, not the table and its text copy
    assert "None" not in visible
    assert "warmup_steps 0 (default: 5% of steps)" in " ".join(visible.split())
    assert "monitor_every off" in " ".join(visible.split())


def test_zoomed_panel_spans_the_unit_scaled_fp8_fp32_gap() -> None:
    # Unit-scaled runs end 0.02 apart near 1.35; plain FP8 did not train (3.3, a spike to 5.5).
    steps = 200
    levels = {"plain-fp32": 1.5, "plain-fp8": 3.3, "unit-scaled-fp32": 1.35,
              "unit-scaled-fp8": 1.37}  # fmt: skip
    results = {}
    for name, level in levels.items():
        losses = [level + 4.0 * math.exp(-s / 20) + 0.005 * math.sin(s) for s in range(steps)]
        results[name] = RunResult(name, 0.1, train_losses=losses, heldout={steps: level})
    results["plain-fp8"].train_losses[170] = 5.5
    low, high = plot_losses(results).axes[1].get_ylim()
    assert low < 1.35 and high > 1.37
    # The gap fills a visible part of the panel (it was 0.02 of 1-5.5, i.e. 0.5%).
    assert 0.02 / (high - low) > 0.2
    assert plot_losses(results).axes[1].get_xlim() == (150, 200)


# -- FP8 scope, real FP8 runs and several seeds ------------------------------------------------
def test_every_fp8_run_rounds_the_linear_ops_explicitly() -> None:
    """Both models in the scope real FP8 and torchao's recipe run in (attention in FP32);
    the FP16 runs keep every matmul, as when their results were recorded."""
    from unitscale.experiments.training import FP8_OPS, RUN_KINDS

    assert FP8_OPS == "linear"
    for kind in RUN_KINDS:
        expected = {"fp32": "", "fp8": "linear", "fp16": "matmuls", "mxfp8": "linear",
                    "mxfp4": "linear", "nvfp4": "linear"}[kind.precision]  # fmt: skip
        assert kind.ops == expected, kind.name
    config = TrainConfig(hidden_size=16, heads=2)
    for run in ("plain-fp8", "plain-fp8-tensorwise", "unit-scaled-fp8"):
        (graph_pass,) = build_run_model(run, config).passes  # type: ignore[union-attr]
        assert graph_pass.ops == "linear", run
    (fp16_pass,) = build_run_model("unit-scaled-fp16", config).passes  # type: ignore[union-attr]
    assert fp16_pass.ops == "matmuls"


def test_block_scaled_run_kinds() -> None:
    """The six block-scaled kinds (not default): each family's linear ops as block-scaled
    GEMMs against its own FP32 run; a tiny run of one trains and is summarised."""
    from unitscale.experiments.training import RUN_KINDS
    from unitscale.formats import get_format
    from unitscale.transforms.lowp._blocks import BlockFormatPass

    names = [f"{family}-{fmt}" for fmt in ("mxfp8", "mxfp4", "nvfp4")
             for family in ("plain", "unit-scaled")]  # fmt: skip
    kinds = {kind.name: kind for kind in RUN_KINDS}
    for name in names:
        assert name in RUN_NAMES and name not in DEFAULT_RUNS
        assert kinds[name].baseline == name.rsplit("-", 1)[0] + "-fp32"
    config = TrainConfig(hidden_size=32, heads=2)
    (graph_pass,) = build_run_model("unit-scaled-nvfp4", config).passes  # type: ignore[union-attr]
    assert isinstance(graph_pass, BlockFormatPass) and graph_pass.ops == "linear"
    assert graph_pass.bwd_block == get_format("nvfp4", rounding="stochastic")
    config = TrainConfig(
        steps=2, batch_size=2, seq_len=16, hidden_size=32, heads=2, depth=1, eval_every=2,
        eval_batches=1, runs=("unit-scaled-fp32", "unit-scaled-mxfp8"),
    )  # fmt: skip
    results = train_runs(config, progress=False)
    first = {name: r.train_losses[0] for name, r in results.items()}
    assert first["unit-scaled-mxfp8"] == pytest.approx(first["unit-scaled-fp32"], abs=0.05)
    assert first["unit-scaled-mxfp8"] != first["unit-scaled-fp32"]
    text = summary_text(results, config)
    assert "unit-scaled in simulated MXFP8 (unit-scaled-mxfp8, " in text
    assert "MXFP8, per-block scales" in text


def _has_to_fp8() -> bool:
    """Whether real FP8 runs here: ``to_fp8`` exists and this torch has float8 GEMMs."""
    import unitscale.transforms
    from unitscale.transforms.lowp import _gemm

    return hasattr(unitscale.transforms, "to_fp8") and _gemm.float8_device_error("cpu") is None


def test_real_fp8_runs_are_not_default_and_name_their_scaling() -> None:
    from unitscale.experiments.training import RUN_KINDS

    real = {kind.name: kind for kind in RUN_KINDS if kind.real}
    assert set(real) == {
        "plain-fp8-tensorwise-real",
        "plain-fp8-rowwise-real",
        "unit-scaled-fp8-real",
    }
    assert not set(real) & set(DEFAULT_RUNS)
    assert real["plain-fp8-tensorwise-real"].scaling == "tensorwise"
    assert real["plain-fp8-rowwise-real"].scaling == "rowwise"
    assert real["unit-scaled-fp8-real"].scaling == "none"
    assert all(kind.ops == "linear" for kind in real.values())


def test_real_fp8_runs_without_to_fp8_say_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import unitscale.transforms

    monkeypatch.delattr(unitscale.transforms, "to_fp8", raising=False)  # an older install
    config = TrainConfig(hidden_size=16, heads=2)
    with pytest.raises(TrainConfigError, match=r"need unitscale.transforms.to_fp8"):
        build_run_model("unit-scaled-fp8-real", config)


@pytest.mark.slow
@pytest.mark.skipif(not _has_to_fp8(), reason="needs real FP8 (to_fp8, float8 GEMMs)")
def test_real_fp8_runs_equal_the_simulated_runs_on_the_cpu() -> None:
    config = TrainConfig(
        steps=3, batch_size=2, seq_len=16, hidden_size=16, heads=2, depth=1, eval_every=3,
        eval_batches=1, runs=("plain-fp8-tensorwise", "plain-fp8-tensorwise-real",
                              "unit-scaled-fp8", "unit-scaled-fp8-real"),
    )  # fmt: skip
    results = train_runs(config, progress=False)
    for simulated in ("plain-fp8-tensorwise", "unit-scaled-fp8"):
        real = results[f"{simulated}-real"]
        # The same ops and scales (tests/transforms/test_to_fp8.py): equal where the CPU's
        # float8 GEMM sums as the simulation does (torch 2.13's oneDNN here: bit for bit);
        # torch 2.8's applies the scales after the sum, a last-bit difference (1.7e-7 of the
        # loss at the third step, measured): within 1e-5 relative.
        assert real.train_losses == pytest.approx(results[simulated].train_losses, rel=1e-5)
        assert real.final_heldout_loss == pytest.approx(
            results[simulated].final_heldout_loss, rel=1e-5
        ), simulated


def test_rowwise_runs_are_torchaos_rowwise_recipe_on_request() -> None:
    """plain-fp8-rowwise simulates torchao's rowwise recipe (the linear ops, its own
    scales), plain-fp8-rowwise-real runs it through to_fp8; neither is in the default set."""
    from unitscale.experiments.training import RUN_KINDS

    kinds = {kind.name: kind for kind in RUN_KINDS}
    for name in ("plain-fp8-rowwise", "plain-fp8-rowwise-real"):
        assert name in RUN_NAMES and name not in DEFAULT_RUNS
        assert kinds[name].scaling == "rowwise" and kinds[name].ops == "linear"
        assert kinds[name].family == "plain" and kinds[name].baseline == "plain-fp32"
    assert not kinds["plain-fp8-rowwise"].real and kinds["plain-fp8-rowwise-real"].real
    config = TrainConfig(hidden_size=16, heads=2)
    (graph_pass,) = build_run_model("plain-fp8-rowwise", config).passes  # type: ignore[union-attr]
    assert (graph_pass.scaling, graph_pass.ops) == ("rowwise", "linear")


def _to_fp8_runs_rowwise() -> bool:
    """Whether ``to_fp8`` runs the rowwise recipe here (float8 GEMMs, and the recipe built)."""
    if not _has_to_fp8():
        return False
    from unitscale.formats import FormatError
    from unitscale.transforms import to_fp8

    try:  # torch 2.8's CPU kernel refuses rowwise scales at the first call
        to_fp8(torch.nn.Linear(16, 16), scaling="rowwise")(torch.randn(16, 16))
    except FormatError:
        return False
    return True


@pytest.mark.slow
def test_rowwise_runs_train_and_real_equals_simulated_on_the_cpu() -> None:
    runs = ["plain-fp32", "plain-fp8-rowwise"]
    real = _to_fp8_runs_rowwise()
    if real:
        runs.append("plain-fp8-rowwise-real")
    config = TrainConfig(
        steps=2, batch_size=2, seq_len=16, hidden_size=16, heads=2, depth=1, eval_every=2,
        eval_batches=1, runs=tuple(runs),
    )  # fmt: skip
    results = train_runs(config, progress=False)
    first = {name: r.train_losses[0] for name, r in results.items()}
    assert first["plain-fp8-rowwise"] == pytest.approx(first["plain-fp32"], abs=0.02)
    assert first["plain-fp8-rowwise"] != first["plain-fp32"]  # rounded
    if not real:
        pytest.skip("to_fp8 has no rowwise float8 GEMMs here: the simulated run alone ran")
    rowwise = results["plain-fp8-rowwise"]
    assert results["plain-fp8-rowwise-real"].train_losses == rowwise.train_losses


def test_seeds_option_runs_each_seed_and_summarises_mean_and_spread(tmp_path: Path) -> None:
    import json

    tiny = ["--steps", "2", "--batch-size", "2", "--width", "8", "--heads", "1", "--depth",
            "1", "--seq-len", "8", "--eval-every", "2", "--eval-batches", "1",
            "--no-progress"]  # fmt: skip
    out = tmp_path / "out"
    runs = ["--runs", "plain-fp32,plain-fp8"]
    assert main(["train", *tiny, *runs, "--seeds", "0,3", "--out", str(out)]) == 0
    document = json.loads((out / "results.json").read_text())
    assert document["seeds"] == [0, 3] and document["fp8_ops"] == "linear"
    fp8 = document["runs"]["plain-fp8"]
    assert set(fp8["per_seed"]) == {"0", "3"}
    for seed in (0, 3):  # each seed's own run, as a one-seed run of that seed gives it
        single = train_run("plain-fp8", TrainConfig(
            steps=2, batch_size=2, hidden_size=8, heads=1, depth=1, seq_len=8, eval_every=2,
            eval_batches=1, seed=seed, runs=("plain-fp8",)), progress=False)  # fmt: skip
        assert fp8["per_seed"][str(seed)]["final_heldout_loss"] == single.final_heldout_loss
        assert (out / f"seed{seed}" / "losses.csv").exists()
    heldout = [fp8["per_seed"][s]["heldout_vs_fp32"] for s in ("0", "3")]
    stats = fp8["stats"]["heldout_vs_fp32"]
    assert stats["mean"] == pytest.approx(sum(heldout) / 2)
    assert stats["min"] == min(heldout) and stats["max"] == max(heldout)
    assert set(fp8["stats"]) == {"final_train_loss", "final_heldout_loss", "train_vs_fp32",
                                 "heldout_vs_fp32"}  # fmt: skip
    summary = (out / "summary.txt").read_text()
    assert "seeds 0, 3" in summary and "±" in summary and "held-out vs FP32" in summary
    # One seed (the default) says so, and writes results.json too.
    one = tmp_path / "one"
    assert main(["train", *tiny, *runs, "--out", str(one)]) == 0
    assert json.loads((one / "results.json").read_text())["seeds"] == [0]


def test_seeds_option_parsing() -> None:
    import argparse

    from unitscale.cli.train import _seed_list

    assert _seed_list("3") == (0, 1, 2) and _seed_list("4,1") == (4, 1)
    for bad in ("0", "x", "1,1", "1,a"):
        with pytest.raises(argparse.ArgumentTypeError):
            _seed_list(bad)
