"""``unitscale.data``: the name DESIGN.md and the README use for
``unitscale.experiments.data`` (where the code lives)."""

from ..experiments.data import (
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
