"""``unitscale.data``: bundled text, a byte-level tokenizer and deterministic batches.

A layer of its own below :mod:`unitscale.analysis` (whose ``example_batch`` it is) and
``unitscale.experiments`` (which re-exports it as ``unitscale.experiments.data``): it needs
only :mod:`unitscale.errors` and torch. The code is in ``_corpus.py``.
"""

from ._corpus import (
    HELDOUT_FRACTION,
    VOCAB_SIZE,
    Batch,
    ByteTokenizer,
    CorpusError,
    batches,
    corpus_tokens,
    example_batch,
    load_corpus,
    sample_batch,
    train_heldout_split,
)

__all__ = [
    "HELDOUT_FRACTION",
    "VOCAB_SIZE",
    "Batch",
    "ByteTokenizer",
    "CorpusError",
    "batches",
    "corpus_tokens",
    "example_batch",
    "load_corpus",
    "sample_batch",
    "train_heldout_split",
]
