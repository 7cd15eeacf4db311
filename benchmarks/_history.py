"""Benchmark results as an appended history: every run is kept, with the state of the machine.

Each results file is ``{"runs": [run, run, ...]}``, oldest first. A run records when it was
made, the load average before and after it (other work on the machine slows what a ratio is
divided by as much as what it measures, so a loaded run is reported as such), the torch and
Python versions, the thread count and the benchmark's own settings and results. Files written
before this format (one run, no ``runs`` key) are kept as the first entry of the history.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["append_run", "latest_run", "machine_state", "read_runs"]


def machine_state() -> dict[str, Any]:
    """What a result depends on besides the code: date, versions, threads, load average."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_average_before": [round(v, 2) for v in os.getloadavg()],
        **({"gpu": torch.cuda.get_device_name()} if torch.cuda.is_available() else {}),
    }


def read_runs(path: Path) -> list[dict[str, Any]]:
    """Every run recorded in ``path``, oldest first ([] if the file does not exist)."""
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    if isinstance(data, dict) and isinstance(data.get("runs"), list) and "history" in data:
        return list(data["runs"])
    return [data]  # a file from before histories: one run


def latest_run(path: Path, device: str = "cpu") -> dict[str, Any]:
    """The newest run in ``path`` measured on ``device`` ("cpu" for runs that do not say):
    a CUDA run appended to a history leaves the CPU figures as they were."""
    runs = [run for run in read_runs(path) if run.get("device", "cpu") == device]
    if not runs:
        raise FileNotFoundError(f"no {device} benchmark results in {path}: run the benchmark first")
    return runs[-1]


def append_run(path: Path, run: dict[str, Any]) -> None:
    """Add ``run`` (with the load average after it) to the history in ``path``."""
    run = {**run, "load_average_after": [round(v, 2) for v in os.getloadavg()]}
    runs = [*read_runs(path), run]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"history": "runs, oldest first", "runs": runs}, indent=1) + "\n")
    print(f"appended run {len(runs)} to {path}")
