"""The bundled corpus, the byte tokenizer and deterministic batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unitscale.data import (
    VOCAB_SIZE,
    Batch,
    ByteTokenizer,
    CorpusError,
    batches,
    corpus_tokens,
    example_batch,
    load_corpus,
    train_heldout_split,
)
from unitscale.errors import UnitScaleError


def test_bundled_corpus_is_real_text_without_download() -> None:
    text = load_corpus().decode("utf-8")
    assert len(text) > 100_000
    # CPython's documentation topics: English prose about Python.
    for phrase in ("assert", "The ", "statement", "expression"):
        assert phrase in text
    assert load_corpus() == load_corpus()  # same order every time


def test_tokenizer_round_trips_any_text() -> None:
    tok = ByteTokenizer()
    text = "unit scaling: σ = 1 ✓\n"
    ids = tok.encode(text)
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    with pytest.raises(CorpusError, match="token id 300 is outside the byte vocabulary"):
        tok.decode([65, 300])


def test_example_batch_shapes_targets_and_determinism() -> None:
    batch = example_batch(4, 32, seed=3)
    assert isinstance(batch, Batch)
    for key in ("input_ids", "attention_mask", "labels"):
        assert batch[key].shape == (4, 32)
        assert batch[key].dtype == torch.int64
    assert batch.targets.shape == (4, 32) and batch.targets.dtype == torch.int64
    assert set(dict(batch)) == {"input_ids", "attention_mask", "labels"}
    # labels are unshifted (the model shifts), targets the next tokens
    assert torch.equal(batch.labels, batch.input_ids) and batch.labels is not batch.input_ids
    assert torch.equal(batch.targets[:, :-1], batch.input_ids[:, 1:])
    assert bool((batch.attention_mask == 1).all())
    assert int(batch.input_ids.max()) < VOCAB_SIZE
    again = example_batch(4, 32, seed=3)
    assert torch.equal(again.input_ids, batch.input_ids)
    assert torch.equal(again.targets, batch.targets)
    other = example_batch(4, 32, seed=4)
    assert not torch.equal(other.input_ids, batch.input_ids)
    # Each row is a contiguous window of the corpus.
    corpus = load_corpus()
    row = bytes(batch.input_ids[0].tolist()) + bytes([int(batch.targets[0, -1])])
    assert row in corpus


def test_example_batch_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    example_batch(2, 8, seed=1)
    assert torch.equal(torch.get_rng_state(), state)


def test_user_text_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.txt"
    path.write_text("abcdefgh" * 20)
    batch = example_batch(3, 16, seed=0, path=path)
    assert set(batch.input_ids.flatten().tolist()) <= set(b"abcdefgh")
    assert torch.equal(batch.targets[:, :-1], batch.input_ids[:, 1:])


def test_missing_short_or_empty_text_gives_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match=r"text file '.*nope\.txt' does not exist"):
        example_batch(2, 8, path=tmp_path / "nope.txt")
    with pytest.raises(CorpusError, match="is not a file"):
        example_batch(2, 8, path=tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(CorpusError, match="is empty"):
        example_batch(2, 8, path=empty)
    short = tmp_path / "short.txt"
    short.write_text("0123456789")
    with pytest.raises(CorpusError, match=r"has 9 tokens .* seq_len=64 needs at least 65"):
        example_batch(2, 64, path=short)
    with pytest.raises(UnitScaleError, match="batch_size=0 must be a positive integer"):
        example_batch(0, 8)
    with pytest.raises(CorpusError, match="split='test' must be"):
        next(batches(2, 8, split="test"))  # type: ignore[arg-type]


def test_train_and_heldout_are_disjoint_and_batches_stay_in_their_split() -> None:
    tokens = corpus_tokens()
    train, heldout = train_heldout_split(tokens, 0.1)
    assert len(train) + len(heldout) == len(tokens)
    assert abs(len(heldout) / len(tokens) - 0.1) < 1e-3
    assert torch.equal(torch.cat([train, heldout]), tokens)
    heldout_bytes = bytes(heldout.tolist())
    stream = batches(2, 24, seed=0, split="heldout")
    for _ in range(3):
        batch = next(stream)
        for row in batch.input_ids:
            assert bytes(row.tolist()) in heldout_bytes
    # The stream is deterministic and does not repeat its first batch.
    a, b = batches(2, 24, seed=5), batches(2, 24, seed=5)
    first = [next(a).input_ids for _ in range(3)]
    second = [next(b).input_ids for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(first, second, strict=True))
    assert not torch.equal(first[0], first[1])
    with pytest.raises(CorpusError, match=r"heldout_fraction=1.5 must be in \(0, 1\)"):
        train_heldout_split(tokens, 1.5)


def test_experiments_data_is_another_name_for_unitscale_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``unitscale.experiments.data`` looks every name up in :mod:`unitscale.data`: the same
    objects, and a name the home gains is there too (the two cannot drift apart)."""
    import unitscale.data as home
    import unitscale.experiments.data as alias

    assert alias.__all__ == home.__all__
    for name in home.__all__:
        assert getattr(alias, name) is getattr(home, name)
    monkeypatch.setattr(home, "added_later", object(), raising=False)
    assert alias.added_later is home.added_later
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        _ = alias.missing
