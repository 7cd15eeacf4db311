"""``unitscale.experiments.data``: another name for :mod:`unitscale.data`, where the bundled
corpus, tokenizer and batches live (a lower layer, so that :mod:`unitscale.analysis` can offer
``example_batch`` without importing a later layer). Every name is looked up there, so the two
cannot drift apart; code in the package imports :mod:`unitscale.data` itself.
"""

from __future__ import annotations

from typing import Any

from .. import data as _home

__all__ = list(_home.__all__)


def __getattr__(name: str) -> Any:
    try:
        return getattr(_home, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
