"""The bundled corpus and batches, as :mod:`unitscale.experiments` names them.

The code lives in :mod:`unitscale.data` (a lower layer, so that :mod:`unitscale.analysis` can
offer ``example_batch`` without importing a later layer); this module re-exports it.
"""

from ..data import (
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
