"""Output helpers shared by the subcommands: progress lines and file names."""

from __future__ import annotations

import re
import sys
import time

__all__ = ["Progress", "slug"]


class Progress:
    """Stage lines on stderr with the time elapsed since the command started."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f}s] {message}", file=sys.stderr, flush=True)


def slug(name: str, default: str) -> str:
    """``name`` as a file-name part (``"gpt2 (HF)"`` -> ``"gpt2_HF"``), ``default`` if empty."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or default
