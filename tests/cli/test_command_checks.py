"""Checks the command makes before any work: options parsed without torch, no command, a
memory estimate, an output folder of an earlier run, the thread count."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _hang_guard import HANG_GUARD_S

from unitscale.cli import OptionError, build_parser, main
from unitscale.cli import train as train_command


def _in_fresh_process(code: str) -> list[str]:
    """Run ``code`` in a new interpreter; return its stdout's lines."""
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def test_bad_options_are_refused_before_torch_is_imported() -> None:
    code = (
        "import sys, time, contextlib, io\n"
        "from unitscale.cli import main\n"
        "for argv in (['train', '--stesp', '3'], ['transfer', '--bogus'],\n"
        "             ['analyse', '--seq-len', 'x'], ['train', '--threads', '0'], []):\n"
        "    with contextlib.redirect_stderr(io.StringIO()):\n"
        "        status = main(argv)\n"
        "    print(status, 'torch' in sys.modules)\n"
    )
    assert _in_fresh_process(code) == ["2", "False"] * 5


def test_no_command_prints_the_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: unitscale") and "train" in err and "analyse" in err
    assert err.strip().splitlines()[-1] == (
        "unitscale: error: no command given; choose one of the commands above"
    )


def test_train_defaults_repeated_for_the_parser_equal_the_library_defaults() -> None:
    from unitscale.experiments.models import GPTConfig
    from unitscale.experiments.training import TrainConfig

    config = TrainConfig()
    names = {"width": "hidden_size"}
    for dest, value in train_command.DEFAULTS.items():
        assert getattr(config, names.get(dest, dest)) == value, dest
    args = build_parser("train").parse_args(["train"])
    assert args.steps == config.steps and args.runs is None  # run() gives DEFAULT_RUNS
    from unitscale.cli._memory import BUILTIN_GPT

    gpt = GPTConfig()
    assert (gpt.hidden_size, gpt.depth, gpt.heads) == BUILTIN_GPT


def test_train_threads_option_reaches_torch() -> None:
    args = build_parser("train").parse_args(["train", "--threads", "1"])
    assert args.threads == 1
    assert build_parser("train").parse_args(["train"]).threads is None
    before = torch.get_num_threads()
    try:
        assert train_command.set_threads(args.threads) == 1
        assert torch.get_num_threads() == 1
        assert train_command.set_threads(None) == 1  # None keeps what torch has
    finally:
        torch.set_num_threads(before)


def test_train_runs_with_the_threads_asked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []

    def fake_train(*args: object) -> int:  # the runs themselves: not needed here
        seen.append(torch.get_num_threads())
        return 0

    monkeypatch.setattr(train_command, "_train", fake_train)
    before = torch.get_num_threads()
    try:
        assert main(["train", "--threads", "1", "--out", str(tmp_path / "out")]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [1]


def test_a_huge_seq_len_is_refused_at_once_with_the_estimate() -> None:
    code = (
        "import sys, time, contextlib, io\n"
        "from unitscale.cli import main\n"
        "for argv in (['train', '--seq-len', '100000'], ['analyse', '--seq-len', '100000']):\n"
        "    err = io.StringIO()\n"
        "    start = time.perf_counter()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        status = main(argv)\n"
        "    seconds = time.perf_counter() - start\n"
        "    lines = err.getvalue().strip().splitlines()\n"
        "    print(status, 'torch' in sys.modules, seconds < 2, len(lines),\n"
        "          'needs at least' in lines[0] and 'is available; choose --seq-len' in lines[0])\n"
    )
    assert _in_fresh_process(code) == ["2", "False", "True", "1", "True"] * 2


def test_memory_estimate_suggests_a_seq_len_that_fits() -> None:
    from unitscale.cli._memory import check_memory, estimate_activations

    available = 2**30
    with pytest.raises(OptionError, match=r"choose --seq-len (\d+) or less") as info:
        check_memory("train", 16, 100_000, 128, 2, 4, available=available)
    message = str(info.value)
    assert "--seq-len 100000 with --batch-size 16 needs at least" in message
    assert "1.0 GiB is available" in message
    longest = int(message.split("choose --seq-len ")[1].split()[0])
    assert estimate_activations(16, longest, 128, 2, 4).total <= available
    assert estimate_activations(16, longest + 1, 128, 2, 4).total > available
    check_memory("train", 16, longest, 128, 2, 4, available=available)  # fits: no error
    # A torchrun job over two machines: this one holds half of each batch.
    with pytest.raises(OptionError, match=r"--batch-size 16 \(8 on this machine\) needs"):
        check_memory("train", 16, 100_000, 128, 2, 4, available=available, share=0.5)
    check_memory("train", 32, longest, 128, 2, 4, available=available, share=0.5)
    # The quadratic term: doubling seq_len at least quadruples attention's maps.
    short, long = (estimate_activations(8, s, 128, 2, 4) for s in (1024, 2048))
    assert long.attention_per_block == 4 * short.attention_per_block


def test_analyse_refuses_an_earlier_runs_folder_unless_told(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from unitscale.cli._output import refuse_earlier_outputs

    out = tmp_path / "report"
    out.mkdir()
    (out / "summary.txt").write_text("an earlier run")
    (out / "notes.md").write_text("the user's own file")
    assert main(["analyse", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"unitscale analyse: error: --out {str(out)!r} holds the outputs of an earlier run "
        "(summary.txt); give --overwrite to replace them, or choose another folder"
    )
    assert (out / "summary.txt").read_text() == "an earlier run"
    args = build_parser("analyse").parse_args(["analyse", "--overwrite"])
    assert args.overwrite is True
    patterns = ("scales.csv", "summary.txt")
    refuse_earlier_outputs(out, patterns, overwrite=True)  # told to: no error
    refuse_earlier_outputs(tmp_path / "new", patterns, overwrite=False)  # nothing there


def test_train_and_transfer_help_still_show_the_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from unitscale.experiments.transfer import DEFAULT_CONFIG, MODELS

    for command, shown in (
        ("train", ("optimiser steps per run (default 1000)", "plain-fp32,plain-fp8,")),
        ("transfer", (f"(default {DEFAULT_CONFIG.steps})", f"of {','.join(MODELS)}")),
    ):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for part in shown:
            assert part in text, (command, part)
        assert not any(f"{{{name}}}" in text for name in ("steps", "seed", "threads", "models"))


@pytest.mark.parametrize(("load", "expected"), [(9.6, 1), (0.2, 2)])
def test_train_uses_fewer_threads_when_the_cores_are_busy_and_says_so(
    load: float,
    expected: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import os

    seen: list[int] = []

    def fake_train(*args: object) -> int:
        seen.append(torch.get_num_threads())
        return 0

    monkeypatch.setattr(train_command, "_train", fake_train)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's default on 2 cores
    try:
        assert main(["train", "--out", str(tmp_path / "out")]) == 0
        err = capsys.readouterr().err
        # --threads wins over the load average
        assert main(["train", "--threads", "2", "--out", str(tmp_path / "out2")]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [expected, 2]
    busy = "the cores are busy (1-minute load average 9.6 on 2 cores): 1 torch thread(s)"
    assert (busy in err and "--threads N chooses" in err) == (expected == 1)


def test_analyse_has_the_threads_option_and_the_same_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from unitscale.cli._threads import pick_threads

    assert build_parser("analyse").parse_args(["analyse", "--threads", "1"]).threads == 1
    said: list[str] = []
    monkeypatch.setattr(os, "getloadavg", lambda: (10.0, 10.0, 10.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        assert pick_threads(None, said.append) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert len(said) == 1 and "load average 10.0 on 4 cores" in said[0]


def test_analyse_summary_says_what_a_fraction_means_for_training() -> None:
    # "3 tensors at 1.4% underflow": the summary now says whether that matters.
    from unitscale.cli import analyse

    args = build_parser("analyse").parse_args(["analyse"])
    lines, _ = analyse._summary_lines(args, [])
    text = "\n".join(lines)
    assert "what it means for training: a value that underflows is read as 0" in text
    assert "a weight gradient flushed to zero does not update that weight" in text
    assert "scaling='tensorwise'" in text
