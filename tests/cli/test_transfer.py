"""``unitscale transfer``: option errors (fast, in process) and the quick run (slow, a
subprocess run the way a user runs it)."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _hang_guard import HANG_GUARD_S

from unitscale.cli import main
from unitscale.experiments.transfer import CSV_COLUMNS

_SCRIPT = Path(sys.executable).with_name("unitscale")
COMMAND = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "unitscale.cli"]
ENV = {**os.environ, "UNITSCALE_DEBUG": ""}


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err  # one line, no traceback
    assert captured.out == ""
    return lines[0]


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--widths", "32,abc"], 2, r"argument --widths: 'abc' in '32,abc' is not an integer"),
        (["--widths", "0,32"], 2, r"'0' in '0,32' must be at least 1"),
        (["--widths", ","], 2, r"',' lists no sizes"),
        (["--widths", "32,32"], 2, r"'32,32' lists a size twice"),
        (["--widths", "48,64"], 2, r"widths \[48\] are not multiples of the head size 32"),
        (["--widths", "64"], 2, r"vary='width' needs at least two widths, got \[64\]"),
        (["--vary", "depth", "--widths", "32,64"], 2, r"takes one value of widths"),
        (["--vary", "heads"], 2, r"argument --vary: invalid choice: 'heads'"),
        (["--steps", "0"], 2, r"argument --steps: '0' must be at least 1"),
        (["--threads", "0"], 2, r"argument --threads: '0' must be at least 1"),
        (["--seeds", "0"], 2, r"argument --seeds: '0' must be at least 1"),
        (["--seed", "-1"], 2, r"seed=-1 must be a non-negative integer"),
        (["--model", "hf:gpt9"], 2, r"argument --model: invalid choice: 'hf:gpt9'"),
        (["--optimizer", "sgd"], 2, r"argument --optimizer: invalid choice: 'sgd'"),
        (["--depth-rule", "mup"], 2, r"argument --depth-rule: invalid choice: 'mup'"),
    ],
)
def test_bad_options_are_one_line_errors(
    args: list[str], status: int, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["transfer", *args, "--out", str(out)]) == status
    line = _error(capsys)
    assert line.startswith("unitscale transfer: error:")
    assert re.search(message, line), line
    assert not out.exists()  # checked before any work


def test_out_that_is_a_file_is_refused_before_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "results.txt"
    target.write_text("keep me")
    assert main(["transfer", "--quick", "--out", str(target)]) == 2  # a bad option
    line = _error(capsys)
    assert f"--out {str(target)!r} exists and is not a folder" in line
    assert target.read_text() == "keep me"


def test_out_that_cannot_be_created_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["transfer", "--quick", "--out", str(blocker / "sub")]) == 2
    assert "cannot be created" in _error(capsys)


def _quick(out: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, "transfer", "--quick", "--seed", "0", *options, "--out", str(out)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )


@pytest.mark.slow
def test_ctrl_c_keeps_the_runs_completed_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C left an empty folder after a long sweep: the completed runs are kept in
    transfer.csv, summary.txt says where it stopped, no claim is judged, an earlier run's
    outputs (replaced under --overwrite) are removed, and the status is 130."""
    from unitscale.experiments.transfer import _sweep

    original = _sweep.train_one
    calls = []

    def interrupting(*args: object, **kwargs: object) -> object:  # Ctrl-C in the 3rd run
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_sweep, "train_one", interrupting)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("transfer.json", "report.html", "effective_rates.csv"):
        (out / name).write_text("an earlier run's")
    tiny = ["--quick", "--steps", "2", "--no-progress", "--overwrite", "--out", str(out)]
    assert main(["transfer", *tiny]) == 130
    captured = capsys.readouterr()
    assert "interrupted; kept what finished" in captured.err
    summary = (out / "summary.txt").read_text()
    assert captured.out == summary
    assert summary.startswith("INTERRUPTED (Ctrl-C) after 2 of 14 runs")
    assert "no claim judged" in summary and "claim (1)" not in summary
    assert summary.count("  seed 0 standard fp32 width 32 depth 2 lr ") == 2
    assert {p.name for p in out.iterdir()} == {"transfer.csv", "summary.txt"}
    with (out / "transfer.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len({r["lr"] for r in rows}) == 2 and {r["width"] for r in rows} == {"32"}
    assert {r["step"] for r in rows if r["final"] == "True"} == {"2"}


def test_quick_run_writes_every_output_and_is_deterministic(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = _quick(out)
    assert result.returncode == 0, result.stderr
    again = _quick(tmp_path / "again")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again" / "transfer.csv").read_bytes() == (out / "transfer.csv").read_bytes()
    names = {p.name for p in out.iterdir()}
    assert names == {
        "transfer.csv",
        "transfer.json",
        "transfer.png",
        "report.html",
        "summary.txt",
        "effective_rates.csv",
    }
    rates = list(csv.DictReader((out / "effective_rates.csv").open(newline="")))
    assert {r["width"] for r in rates} == {"32", "64"} and {r["tag"] for r in rates} == {
        "weight",
        "output",
    }
    with (out / "transfer.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    # One row per run and evaluation: 24 steps, evaluated every 12 (unless a run diverged).
    runs = {tuple(r[c] for c in CSV_COLUMNS[:6]) for r in rows}
    assert len(runs) == 14
    finished = [r for r in rows if r["final"] == "True" and r["heldout_loss"]]
    assert len(rows) == 2 * len(finished) + (14 - len(finished))
    assert {r["step"] for r in finished} == {"24"}
    # Progress: one line per run (2 parametrisations x 2 widths x 3 lrs + 2 FP8) on stderr.
    assert result.stderr.count("] [") == 14 and "[14/14] u-muP fp8" in result.stderr
    document = json.loads((out / "transfer.json").read_text())
    assert len(document["runs"]) == 14 and [c["number"] for c in document["claims"]] == [1, 2, 3, 4]
    assert document["config"]["steps"] == 24 and document["threads"] == 1
    summary = (out / "summary.txt").read_text()
    assert result.stdout == summary
    for claim in document["claims"]:
        assert f"claim ({claim['number']}) {claim['statement']}: {claim['verdict']}" in summary
    page = (out / "report.html").read_text()
    assert "data:image/png;base64," in page and "http://" not in page and "https://" not in page
    # A quick run says so everywhere, and holds no claim.
    assert document["quick"] is True and "QUICK SMOKE RUN (--quick)" in summary
    assert "QUICK SMOKE RUN (--quick)" in page
    assert all(claim["verdict"] != "held" for claim in document["claims"])
    # Sweeps and claims are HTML tables; the settings show resolved defaults, never None.
    assert "<pre>" not in page and "<th>k=-1</th>" in page and "<th>verdict</th>" in page
    assert "<td>warmup_steps</td><td>1 (default: 5% of steps)</td>" in page
    assert ">None<" not in page
    assert (out / "transfer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quick_llama_run_trains_the_transformers_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    out = tmp_path / "llama"
    result = _quick(out, "--model", "hf:llama")
    assert result.returncode == 0, result.stderr
    document = json.loads((out / "transfer.json").read_text())
    assert document["command"] == "unitscale transfer --model hf:llama --quick"
    assert document["config"]["model"] == "hf:llama" and document["quick"] is True
    # 2 parametrisations x 2 widths x 3 lrs + 2 FP8, none diverged at the default rate.
    assert len(document["runs"]) == 14 and "[14/14] u-muP fp8" in result.stderr
    defaults = [r for r in document["runs"] if r["lr_step"] == 0 and r["precision"] == "fp32"]
    assert len(defaults) == 4 and all(r["final_heldout_loss"] < 5.0 for r in defaults)
    summary = (out / "summary.txt").read_text()
    assert "model hf:llama" in summary and "unit_scale(LlamaForCausalLM)" in summary
    assert all(claim["verdict"] != "held" for claim in document["claims"])


def test_the_default_output_folders_are_ignored_by_git() -> None:
    from unitscale.cli import analyse, train, transfer

    ignored = (Path(__file__).resolve().parents[2] / ".gitignore").read_text().splitlines()
    for command in (analyse, train, transfer):
        assert f"{command.DEFAULT_OUT}/" in ignored, command.__name__


@pytest.mark.slow
def test_python_m_unitscale_transfer_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "unitscale", "transfer", "--help"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0 and "--vary {width,depth}" in result.stdout
