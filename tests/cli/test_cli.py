"""The ``unitscale`` command, run as a subprocess the way a user runs it."""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _hang_guard import HANG_GUARD_S

import unitscale
from unitscale.cli import main

_SCRIPT = Path(sys.executable).with_name("unitscale")
COMMAND = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "unitscale.cli"]
ENV = {**os.environ, "UNITSCALE_DEBUG": ""}
# Subprocesses: run in full CI, skipped by -m 'not slow'.
pytestmark = pytest.mark.slow

FACTORY = """
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.head = nn.Linear(16, 256)

    def forward(self, input_ids):
        return self.head(torch.tanh(self.emb(input_ids)))


def make():
    return Tiny()


def broken():
    raise RuntimeError("weights not found\\nsecond line")


def needs_width(width):
    return nn.Linear(width, width)
"""


def unitscale_cmd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=HANG_GUARD_S
    )


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def summary_counts(stdout: str, model: str) -> list[int]:
    match = re.search(rf"^{re.escape(model)}\s+([\d.]+)((?:\s+\d+){{5}})\s*$", stdout, re.M)
    assert match is not None, stdout
    return [int(v) for v in match[2].split()]


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[Path, object]]:
    """``unitscale analyse`` with no arguments, twice, in two fresh folders.

    The two runs go side by side: graph capture is mostly single-threaded Python.
    """
    folders = [tmp_path_factory.mktemp(name) for name in ("first", "second")]
    procs = [
        subprocess.Popen(
            [*COMMAND, "analyse"],
            cwd=cwd,
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cwd in folders
    ]
    runs = []
    for cwd, proc in zip(folders, procs, strict=True):
        stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)
        runs.append((cwd, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)))
    return runs


def test_version_and_help(tmp_path: Path) -> None:
    version = unitscale_cmd("--version", cwd=tmp_path)
    assert (
        version.returncode == 0 and version.stdout.strip() == f"unitscale {unitscale.__version__}"
    )
    top = unitscale_cmd("--help", cwd=tmp_path)
    assert top.returncode == 0 and "analyse" in top.stdout


def test_subcommand_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["analyse", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--model", "--batch-size", "--seq-len", "--seed", "--forward-only", "--out"):
        assert option in text
    assert main([]) == 2  # no subcommand: the overview, and a failed status
    assert "analyse" in capsys.readouterr().err


def test_default_run_writes_every_output_and_a_summary(
    default_runs: list[tuple[Path, subprocess.CompletedProcess[str]]],
) -> None:
    cwd, run = default_runs[0]
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    # Progress is shown on stderr while it works.
    assert re.search(r"\[\s*[\d.]+s\] plain: tracking a forward and backward step", run.stderr)
    assert "unit-scaled: tracking" in run.stderr
    out = cwd / "unitscale-report"
    files = {p.name for p in out.iterdir()}
    assert files == {
        "scales.csv",
        "scales_plain.png",
        "scales_unit-scaled.png",
        "scales_side_by_side.png",
        "report.html",
        "summary.txt",
    }
    for png in ("scales_plain.png", "scales_unit-scaled.png", "scales_side_by_side.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.image import imread

    plain, unit, both = (
        imread(out / f"scales_{n}.png") for n in ("plain", "unit-scaled", "side_by_side")
    )
    # Both plots, unchanged, left to right (20 white pixels apart), top-aligned.
    assert both.shape[1] == plain.shape[1] + 20 + unit.shape[1]
    assert both.shape[0] == max(plain.shape[0], unit.shape[0])
    assert (both[: plain.shape[0], : plain.shape[1], :3] == plain[..., :3]).all()
    assert (both[: unit.shape[0], -unit.shape[1] :, :3] == unit[..., :3]).all()
    assert 'id="unitscale-data"' in (out / "report.html").read_text()
    rows = read_csv(out / "scales.csv")
    assert {r["model"] for r in rows} == {"plain", "unit-scaled"}
    assert {r["direction"] for r in rows} == {"fwd", "bwd"}
    plain_weights = {r["name"] for r in rows if r["model"] == "plain" and r["weight"] == "True"}
    assert {"token_embedding.weight", "blocks.1.mlp.down.weight", "lm_head.weight"} <= plain_weights
    # The summary: one line per model with loss, tensors and E4M3/E5M2 counts, then the worst.
    assert (out / "summary.txt").read_text() == run.stdout
    plain = summary_counts(run.stdout, "plain")
    unit = summary_counts(run.stdout, "unit-scaled")
    assert plain[0] > 50 and unit[0] > 50
    # Unit scaling is the point: far fewer tensors underflow in E4M3 than in the plain model.
    assert unit[1] < plain[1] / 2
    assert "worst in E4M3, plain:" in run.stdout
    assert re.search(r"\(gradient\): \d+\.\d% underflow in E4M3", run.stdout)
    # The key bias's gradient (zero but for rounding noise) is no false alarm.
    assert "qkv.bias" not in run.stdout
    # The tensors column counts the rows of the pruned table: values and gradients.
    table = [r for r in rows if r["model"] == "unit-scaled"]
    assert unit[0] <= len(table) and plain[0] <= len(rows) - len(table)
    # It ends with a one-line conclusion naming the model with fewer tensors at risk.
    last = run.stdout.splitlines()[-1]
    assert last == (
        f"conclusion: in E4M3, unit-scaled has the fewest tensors at risk "
        f"({unit[1] + unit[2]} of {unit[0]}; plain {plain[1] + plain[2]} of {plain[0]})."
    )


def test_same_seed_gives_byte_identical_tables(
    default_runs: list[tuple[Path, subprocess.CompletedProcess[str]]],
) -> None:
    (first, run1), (second, run2) = default_runs
    assert run1.returncode == 0 and run2.returncode == 0
    a = (first / "unitscale-report" / "scales.csv").read_bytes()
    b = (second / "unitscale-report" / "scales.csv").read_bytes()
    assert a == b
    assert run1.stdout == run2.stdout


def test_user_factory_forward_only(tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text(FACTORY)
    run = unitscale_cmd(
        "analyse",
        "--model",
        "mine.py:make",
        "--forward-only",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--seed",
        "3",
        "--out",
        "out",
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    rows = read_csv(tmp_path / "out" / "scales.csv")
    assert {r["model"] for r in rows} == {"mine.make", "unit_scale(mine.make)"}
    assert {r["direction"] for r in rows} == {"fwd"}
    assert {"emb.weight", "head.weight", "head.bias"} <= {r["name"] for r in rows}
    assert "batch 2 x 16, seed 3, forward" in run.stdout
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert f"wrote {len(written)} files to out/: " in run.stdout and len(written) == 6
    wrote = next(line for line in run.stdout.splitlines() if line.startswith("wrote "))
    assert sorted(wrote.split(": ", 1)[1].split(", ")) == written


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["analyse", "--batch-size", "0"], 2, r"argument --batch-size: '0' must be at least 1"),
        (["analyse", "--model", "nowhere.py:make"], 2, r"file 'nowhere.py' does not exist"),
        (["analyse", "--model", "mine.py:broken"], 1, r"the factory failed: RuntimeError: weights"),
    ],
)
def test_bad_input_fails_with_one_line(
    tmp_path: Path, args: list[str], status: int, message: str
) -> None:
    (tmp_path / "mine.py").write_text(FACTORY)
    run = unitscale_cmd(*args, cwd=tmp_path)
    assert run.returncode == status
    lines = run.stderr.strip().splitlines()
    errors = [line for line in lines if not line.startswith("[")]  # progress lines aside
    assert len(errors) == 1, run.stderr
    assert errors[0].startswith("unitscale analyse: error: ") and re.search(message, errors[0])
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "unitscale-report").exists()


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (
            ["analyse", "--bogus"],
            2,
            r"^unitscale analyse: error: unrecognized arguments: --bogus "
            r"\(see 'unitscale analyse --help'\)$",
        ),
        (
            ["--bogus"],
            2,
            r"^unitscale: error: unrecognized arguments: --bogus \(see 'unitscale --he",
        ),
        (["frobnicate"], 2, r"invalid choice: 'frobnicate'"),
        (["analyse", "--seq-len", "x"], 2, r"'x' is not an integer"),
        (["analyse", "--model", "hf:not-a-model"], 2, r"unknown Hugging Face model type"),
        (["analyse", "--model", "weird"], 2, r"expected 'builtin', 'hf:<model_type>' or"),
        (["analyse", "--model", "mine.py:absent"], 2, r"has no function 'absent'"),
        (["analyse", "--model", "mine.py:needs_width"], 1, r"factory failed: TypeError"),
        (["analyse", "--text", "missing.txt"], 2, r"text file 'missing.txt' does not exist"),
    ],
)
def test_more_bad_input_in_process(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    status: int,
    message: str,
) -> None:
    (tmp_path / "mine.py").write_text(FACTORY.replace("def make", "def _unused_make"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("UNITSCALE_DEBUG", raising=False)
    assert main(args) == status
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if not line.startswith("[")]
    assert len(errors) == 1 and re.search(message, errors[0]), captured.err


def test_hf_models_are_built_small_and_offline() -> None:
    pytest.importorskip("transformers")
    from unitscale.cli._models import NamedModel, call_model, hf_model
    from unitscale.data import example_batch

    model = hf_model("gpt2", seq_len=32, seed=0)
    assert model.config.n_embd == 64 and model.config.n_layer == 2
    assert model.config.vocab_size == 256
    assert sum(p.numel() for p in model.parameters()) < 500_000
    entry = NamedModel("gpt2", model, "causal-lm")
    loss = call_model(entry, model, example_batch(2, 32))
    assert loss.shape == () and 4.0 < loss.item() < 7.0  # about log(256) at random init
