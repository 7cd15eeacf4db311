"""What every README table generator shares: where the results are, and how a run is cited.

The paths are read as ``paths.RESULTS`` (and so on) by the table modules, so that a test can
point them at a folder of its own with one ``monkeypatch.setattr``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from _history import latest_run

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TRAIN = RESULTS / "train"
TRANSFER = RESULTS / "transfer" / "transfer.json"
TRANSFER_DEPTH = RESULTS / "transfer-depth" / "transfer.json"
TRANSFER_LLAMA = RESULTS / "transfer-llama" / "transfer.json"
COORD_CHECK = RESULTS / "coord_check.json"


def train_results(folder: str) -> dict[str, Any] | None:
    """The ``results.json`` committed in ``TRAIN/folder`` (None until one is committed)."""
    path = TRAIN / folder / "results.json"
    if not path.exists():
        return None
    document: dict[str, Any] = json.loads(path.read_text())
    return document


def _load(run: dict[str, Any]) -> str:
    before = run.get("load_average_before") or run.get("load_average")
    if before is None:
        at_end = run.get("load_average_at_end")
        return f"load {at_end[0]:.1f} at end" if at_end else "load not recorded"
    after = run.get("load_average_after")
    first = before[0] if isinstance(before, list) else before
    if after is None:
        both = before if isinstance(before, list) else [before]
        return "load " + " / ".join(f"{v:.1f}" for v in both)
    return f"load {first:.1f} / {after[0]:.1f}"


def _when(run: dict[str, Any], path: Path) -> str:
    date = run.get("date", "undated")[:10]
    if run.get("device") == "cuda":
        return f"`{path.name}` {date}, {run.get('gpu', 'GPU')}, torch {run.get('torch', '?')}"
    threads = run.get("threads", "?")
    return f"`{path.name}` {date}, {threads} thread{'' if threads == 1 else 's'}, {_load(run)}"


def _seconds(value: float) -> str:
    return f"{value:.1f} s" if value >= 1 else f"{value:.2f} s"


def _met(value: float, target: float | None) -> str:
    if target is None:
        return ""
    return f"<= {target:g}x ({'met' if value <= target else 'not met'})"


def _cuda_run(path: Path) -> dict[str, Any] | None:
    """The newest CUDA run in ``path``, or None (none was measured yet)."""
    try:
        return latest_run(path, "cuda")
    except FileNotFoundError:
        return None
