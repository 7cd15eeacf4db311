"""Bundled text, a byte-level tokenizer and deterministic batches for demos and tests.

Design constraints:

- never a download: the default corpus is CPython's own documentation topics
  (:mod:`pydoc_data.topics`, shipped with the standard library), joined in sorted topic order
  so that it is the same on every run of the same Python;
- tokens are bytes (vocabulary 256), so any text file works and nothing needs training;
- every random choice comes from a :class:`torch.Generator` seeded by the caller, so the
  global RNG is never touched and the same seed gives the same batches;
- the held-out split is the tail of the corpus (a fixed fraction), disjoint from training.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from ..errors import UnitScaleError

__all__ = [  # noqa: RUF022 (grouped by kind)
    # errors
    "CorpusError",
    # corpus and tokenizer
    "HELDOUT_FRACTION",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "corpus_tokens",
    "load_corpus",
    "train_heldout_split",
    # batches
    "Batch",
    "batches",
    "example_batch",
    "sample_batch",
]

#: Size of the byte-level vocabulary.
VOCAB_SIZE = 256
#: Fraction of the corpus (its tail) held out from training by default.
HELDOUT_FRACTION = 0.1


class CorpusError(UnitScaleError, ValueError):
    """The text corpus is missing, unreadable or too short for the requested batches."""


class ByteTokenizer:
    """Byte-level tokenizer: a string's UTF-8 bytes are its tokens (vocabulary 256).

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.encode("hé")
        [104, 195, 169]
        >>> tok.decode([104, 195, 169])
        'hé'
    """

    vocab_size: int = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as token ids."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int] | Tensor) -> str:
        """Return the text of token ids (invalid UTF-8 sequences become U+FFFD).

        Raises:
            CorpusError: when an id is outside ``[0, 256)``.
        """
        values = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        bad = [v for v in values if not 0 <= int(v) < VOCAB_SIZE]
        if bad:
            raise CorpusError(
                f"ByteTokenizer.decode: token id {bad[0]} is outside the byte vocabulary "
                f"[0, {VOCAB_SIZE}); decode only ids produced by ByteTokenizer.encode"
            )
        return bytes(int(v) for v in values).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


def _bundled_text() -> bytes:
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:  # pragma: no cover - stripped Python builds only
        raise CorpusError(
            "load_corpus: the bundled corpus comes from CPython's pydoc_data.topics, which this "
            "Python lacks; pass path= to a text file of your own"
        ) from exc
    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def load_corpus(path: str | os.PathLike[str] | None = None) -> bytes:
    """Return the raw bytes of the corpus: a text file, or the bundled text when ``path`` is None.

    Args:
        path: a text file to use instead of the bundled corpus.

    Returns:
        The corpus as bytes (about 470 kB for the bundled text).

    Raises:
        CorpusError: when ``path`` does not exist, is not a file, cannot be read or is empty.

    Example:
        >>> len(load_corpus()) > 100_000
        True
    """
    if path is None:
        return _bundled_text()
    file = Path(path)
    if not file.exists():
        raise CorpusError(f"load_corpus: text file {str(file)!r} does not exist; check the path")
    if not file.is_file():
        raise CorpusError(f"load_corpus: {str(file)!r} is not a file; pass a text file")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise CorpusError(f"load_corpus: cannot read {str(file)!r}: {exc.strerror}") from exc
    if not data:
        raise CorpusError(f"load_corpus: text file {str(file)!r} is empty; pass a file with text")
    return data


def corpus_tokens(path: str | os.PathLike[str] | None = None) -> Tensor:
    """Return the corpus as a 1-D int64 tensor of byte tokens.

    Example:
        >>> t = corpus_tokens()
        >>> t.dtype, int(t.max()) < 256
        (torch.int64, True)
    """
    data = load_corpus(path)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def train_heldout_split(
    tokens: Tensor, heldout_fraction: float = HELDOUT_FRACTION
) -> tuple[Tensor, Tensor]:
    """Split tokens into a training head and a held-out tail (disjoint, deterministic).

    Args:
        tokens: 1-D tensor of token ids.
        heldout_fraction: fraction of the tokens, taken from the end, to hold out; in ``(0, 1)``.

    Returns:
        ``(train, heldout)``, views of ``tokens``.

    Raises:
        CorpusError: when ``heldout_fraction`` is not in ``(0, 1)``.

    Example:
        >>> train, heldout = train_heldout_split(torch.arange(100), 0.1)
        >>> len(train), len(heldout), int(heldout[0])
        (90, 10, 90)
    """
    if not 0.0 < heldout_fraction < 1.0:
        raise CorpusError(
            f"train_heldout_split: heldout_fraction={heldout_fraction!r} must be in (0, 1)"
        )
    n_heldout = max(1, round(len(tokens) * heldout_fraction))
    cut = len(tokens) - n_heldout
    return tokens[:cut], tokens[cut:]


@dataclass(frozen=True, eq=False)
class Batch(Mapping[str, Tensor]):
    """A language-modelling batch; a mapping, so ``model(**batch)`` works.

    As a mapping it holds ``input_ids``, ``attention_mask`` and ``labels``, with ``labels``
    as Hugging Face causal LMs take them: the input ids themselves, which the model shifts
    (position ``t`` is scored against ``labels[:, t + 1]``). So ``model(**batch)`` gives the
    right loss for a transformers causal LM and for :func:`unitscale.models.plain_gpt`
    (which shifts them the same way). ``targets`` (not in the mapping) are the next tokens
    aligned with ``input_ids``, for models that take already-shifted targets
    (:class:`unitscale.TransformerDecoder`'s ``labels``): they also score the last position,
    against the token that follows the window.

    Attributes:
        input_ids: ``(batch, seq_len)`` int64 byte tokens.
        attention_mask: ``(batch, seq_len)`` int64 ones (every position is real text).
        labels: ``(batch, seq_len)`` int64, equal to ``input_ids`` (a copy): unshifted.
        targets: ``(batch, seq_len)`` int64 next-token targets: ``targets[:, t]`` is the
            token that follows ``input_ids[:, t]`` (already shifted).
    """

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    targets: Tensor

    def __getitem__(self, key: str) -> Tensor:
        if key not in ("input_ids", "attention_mask", "labels"):
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(("input_ids", "attention_mask", "labels"))

    def __len__(self) -> int:
        return 3

    def __repr__(self) -> str:
        b, t = self.input_ids.shape
        return f"Batch(batch_size={b}, seq_len={t})"


def _check_sizes(where: str, tokens: Tensor, batch_size: int, seq_len: int) -> None:
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CorpusError(f"{where}: {name}={value!r} must be a positive integer")
    if len(tokens) < seq_len + 1:
        raise CorpusError(
            f"{where}: the text has {len(tokens)} tokens (bytes) but seq_len={seq_len} needs "
            f"at least {seq_len + 1}; use a longer text file or a shorter seq_len"
        )


def sample_batch(
    tokens: Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> Batch:
    """Draw ``batch_size`` random windows of ``seq_len + 1`` tokens from ``tokens``.

    Args:
        tokens: 1-D int64 tokens (e.g. one side of :func:`train_heldout_split`).
        batch_size: number of sequences.
        seq_len: tokens per sequence.
        generator: the source of randomness (the global RNG is not used).

    Returns:
        A :class:`Batch`.

    Raises:
        CorpusError: when a size is not a positive integer or the text is too short.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> b = sample_batch(torch.arange(50), 2, 4, g)
        >>> bool((b.targets[:, :-1] == b.input_ids[:, 1:]).all())
        True
        >>> bool((b.labels == b.input_ids).all())  # unshifted, as transformers takes them
        True
    """
    _check_sizes("sample_batch", tokens, batch_size, seq_len)
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    windows = tokens[starts[:, None] + offsets[None, :]]
    input_ids = windows[:, :-1].contiguous()
    return Batch(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        labels=input_ids.clone(),
        targets=windows[:, 1:].contiguous(),
    )


def batches(
    batch_size: int,
    seq_len: int,
    seed: int = 0,
    split: Literal["train", "heldout"] = "train",
    path: str | os.PathLike[str] | None = None,
    heldout_fraction: float = HELDOUT_FRACTION,
) -> Iterator[Batch]:
    """Yield an endless, deterministic stream of random batches from one side of the split.

    Args:
        batch_size: sequences per batch.
        seq_len: tokens per sequence.
        seed: seeds the stream; the same seed gives the same batches.
        split: ``"train"`` (the head of the corpus) or ``"heldout"`` (its tail).
        path: a text file to use instead of the bundled corpus.
        heldout_fraction: fraction of the corpus held out (see :func:`train_heldout_split`).

    Yields:
        :class:`Batch` objects.

    Raises:
        CorpusError: for an unknown split, a missing file or a text too short.

    Example:
        >>> it = batches(2, 8, seed=1)
        >>> next(it).input_ids.shape
        torch.Size([2, 8])
    """
    if split not in ("train", "heldout"):
        raise CorpusError(f"batches: split={split!r} must be 'train' or 'heldout'")
    train, heldout = train_heldout_split(corpus_tokens(path), heldout_fraction)
    tokens = train if split == "train" else heldout
    _check_sizes(f"batches(split={split!r})", tokens, batch_size, seq_len)
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield sample_batch(tokens, batch_size, seq_len, generator)


def example_batch(
    batch_size: int, seq_len: int, seed: int = 0, path: str | os.PathLike[str] | None = None
) -> Batch:
    """Return one deterministic batch of real text from the training split.

    Args:
        batch_size: sequences per batch.
        seq_len: tokens (bytes) per sequence.
        seed: the same seed gives the same batch.
        path: a text file to use instead of the bundled corpus (CPython's documentation).

    Returns:
        A :class:`Batch`: ``model(**batch)`` passes ``input_ids``, ``attention_mask`` and
        ``labels`` (unshifted, as transformers causal LMs take them); ``batch.targets``
        holds the next tokens aligned with ``input_ids``.

    Raises:
        CorpusError: when ``path`` is missing or too short, or a size is not positive.

    Example:
        >>> batch = example_batch(4, 64, seed=0)
        >>> batch.input_ids.shape, batch.labels.shape
        (torch.Size([4, 64]), torch.Size([4, 64]))
        >>> bool((example_batch(4, 64, seed=0).input_ids == batch.input_ids).all())
        True
    """
    return next(batches(batch_size, seq_len, seed=seed, split="train", path=path))
