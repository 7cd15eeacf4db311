"""Failures the command used to hide: each now ends the command with a one-line reason."""

from __future__ import annotations

from pathlib import Path

import pytest

import unitscale.analysis
from unitscale.cli import main

FACTORY = """
import torch
from torch import nn
from unitscale.transforms import simulate_fp8


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.head = nn.Linear(16, 256)

    def forward(self, input_ids, **unused):
        return self.head(torch.tanh(self.emb(input_ids)))


def simulated():
    # Trackable, but unit_scale refuses a model already simulate_fp8'd ("unit-scale first").
    return simulate_fp8(Tiny())
"""


def _errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if not line.startswith("[")]


def test_analyse_fails_when_the_unit_scaled_twin_cannot_be_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "mine.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("UNITSCALE_DEBUG", raising=False)
    args = ["analyse", "--model", "mine.py:simulated", "--forward-only", "--seq-len", "8"]
    assert main([*args, "--batch-size", "2", "--out", "out"]) == 1
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1, errors
    assert errors[0].startswith("unitscale analyse: error: unit_scale(mine.simulated) failed: ")
    assert "unit-scale first" in errors[0]
    assert not (tmp_path / "out").exists()


def test_train_does_not_turn_a_heatmap_bug_into_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken_heatmap(*args: object, **kwargs: object) -> None:
        raise ValueError("a bug in the heatmap")

    monkeypatch.setattr(unitscale.analysis, "scale_heatmap", broken_heatmap)
    monkeypatch.delenv("UNITSCALE_DEBUG", raising=False)
    tiny = ["--steps", "2", "--width", "8", "--heads", "1", "--depth", "1", "--seq-len", "8"]
    tiny += ["--batch-size", "2", "--eval-every", "1", "--eval-batches", "1", "--no-progress"]
    args = ["train", *tiny, "--runs", "plain-fp32", "--monitor-every", "1"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 1
    errors = _errors(capsys.readouterr().err)
    assert errors == ["unitscale train: error: ValueError: a bug in the heatmap"]


@pytest.mark.parametrize("command", ["analyse", "train"])
def test_an_out_folder_that_cannot_be_created_fails_before_the_work(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.delenv("UNITSCALE_DEBUG", raising=False)
    assert main([command, "--out", str(tmp_path / "a-file" / "out")]) == 2  # a bad option
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"unitscale {command}: error: --out '{tmp_path / 'a-file' / 'out'}' cannot be created: "
        "Not a directory; choose another"
    ]  # one line, and no progress: nothing was tracked or trained
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_a_creatable_out_folder_is_checked_without_leaving_it_behind(tmp_path: Path) -> None:
    from unitscale.cli._output import check_out_folder

    assert check_out_folder(str(tmp_path / "new" / "deeper")) == tmp_path / "new" / "deeper"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--text", "short.txt", "--seq-len", "64"],
            "unitscale analyse: error: the text has 9 tokens (bytes) but --seq-len 64 needs at "
            "least 65; use a longer text file or a shorter --seq-len",
        ),
        (
            ["--text", "missing.txt"],
            "unitscale analyse: error: text file 'missing.txt' does not exist; check the path",
        ),
    ],
)
def test_corpus_errors_use_the_command_terms(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    expected: str,
) -> None:
    (tmp_path / "short.txt").write_text("short text")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("UNITSCALE_DEBUG", raising=False)
    assert main(["analyse", *args]) == 2  # about --text and --seq-len: a usage error
    assert _errors(capsys.readouterr().err) == [expected]


def test_help_texts_have_no_doubled_percent_and_give_defaults(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for command in ("analyse", "train"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "%%" not in text
        assert "--batch-size N sequences in the batch (default 8)" in text or command == "train"
        assert "--seq-len N bytes per sequence (default" in text
    with pytest.raises(SystemExit):
        main(["analyse", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    # How a factory's model is called, and what it may return.
    for phrase in ("input_ids, attention_mask, labels", "already shifted", "(batch, seq, vocab)"):
        assert phrase in text


@pytest.mark.parametrize("command", ["analyse", "train", "transfer"])
def test_missing_plotting_extra_is_named_before_any_work(
    command: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "pandas", None)  # `import pandas` now fails
    out = tmp_path / "out"
    assert main([command, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert f"unitscale {command} needs pandas: pip install 'unitscale[analysis]'" in err
    assert not out.exists()


# -- what the command feeds a factory's model, and usage errors ------------------------------
MODELS = """
import torch
from torch import nn


class Tiny(nn.Module):
    def __init__(self, vocab=256, embedded=256):
        super().__init__()
        self.emb = nn.Embedding(embedded, 16)
        self.head = nn.Linear(16, vocab)

    def forward(self, input_ids):
        return self.head(torch.tanh(self.emb(input_ids)))


class Pair(Tiny):
    def forward(self, input_ids):
        logits = super().forward(input_ids)
        return logits, logits.mean()


def pair():
    return Pair()


def small_head():
    return Tiny(vocab=128)


def small_embedding():
    return Tiny(vocab=100, embedded=100)
"""


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        (
            "pair",
            "model 'models.pair' returned a tuple of 2: the command cannot tell which is the "
            "loss or the logits; return the loss (a scalar), an output with .loss, or the "
            "(batch, seq, vocab) logits alone",
        ),
        (
            "small_head",  # bytes of the bundled text are mostly ASCII: no IndexError either
            "model 'models.small_head': its logits cover 128 tokens; the command feeds byte "
            "tokens 0-255 (input_ids and labels), so the model needs a vocabulary of at least 256",
        ),
        (
            "small_embedding",
            "model 'models.small_embedding': IndexError: index out of range in self; the "
            "command feeds byte tokens 0-255 (input_ids and labels), so the model needs a "
            "vocabulary of at least 256",
        ),
    ],
)
def test_a_factory_model_the_command_cannot_feed_is_refused_with_the_reason(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    factory: str,
    expected: str,
) -> None:
    (tmp_path / "models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("UNITSCALE_DEBUG", raising=False)
    args = ["analyse", "--model", f"models.py:{factory}", "--batch-size", "2", "--seq-len", "16"]
    assert main(args) == 1
    assert _errors(capsys.readouterr().err) == [f"unitscale analyse: error: {expected}"]
    assert not (tmp_path / "unitscale-report").exists()


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("nosuch", "expected 'builtin', 'hf:<model_type>' or 'path/to/file.py:factory'"),
        ("missing.py:build", "file 'missing.py' does not exist"),
        ("models.py:nosuch", "models.py has no function 'nosuch'"),
    ],
)
def test_a_bad_model_option_is_a_usage_error(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    spec: str,
    reason: str,
) -> None:
    (tmp_path / "models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("UNITSCALE_DEBUG", raising=False)
    assert main(["analyse", "--model", spec]) == 2
    assert _errors(capsys.readouterr().err) == [
        f"unitscale analyse: error: --model {spec!r}: {reason}"
    ]
