"""Run ``unitscale train`` as a new user does and record what it took: the committed run.

Runs ``python -m unitscale train --out DIR [options]`` in a fresh process (imports, data
loading, every run of the default set, the report: everything a user waits for), polls the
load average while it runs, and writes ``run.json`` beside the outputs: the command, the
code commit, wall time, load average before, during (maximum of the 1-minute figure) and
after, the thread count and torch version. The outputs (``summary.txt``, ``losses.csv``,
``loss_curves.png``) are copied to ``--results`` (default
``benchmarks/results/train/hardware-recipe-seed0``), where ``benchmarks/readme_tables.py``
reads them for the README's FP8 table. Run it on an idle machine: ``run.json`` says whether
it was (a 1-minute load above the core count means the time is not an idle-machine time).

With ``--seeds`` (several seeds), ``results.json`` and each seed's ``seed<N>/`` outputs are
copied too; the README's FP8 claim is generated from the multi-seed run:
``python benchmarks/train_wall_time.py --results
benchmarks/results/train/hardware-recipe-seeds -- --seeds 0,1,2``.

Run: ``python benchmarks/train_wall_time.py [--results DIR] [-- extra train options]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "train" / "hardware-recipe-seed0"
OUTPUTS = ("summary.txt", "losses.csv", "loss_curves.png", "results.json")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def _threads(options: list[str]) -> int:
    """The torch threads ``unitscale train`` runs with: ``--threads N`` if given, else what
    it picks from the load average (one per free core), computed as it does at the start."""
    for i, option in enumerate(options):
        if option == "--threads" and i + 1 < len(options):
            return int(options[i + 1])
        if option.startswith("--threads="):
            return int(option.split("=", 1)[1])
    from unitscale.cli._threads import pick_threads

    default = torch.get_num_threads()
    try:
        return pick_threads(None, lambda line: None)
    finally:
        torch.set_num_threads(default)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("train_options", nargs="*", help="after --: options for unitscale train")
    args = parser.parse_args()
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        command = [sys.executable, "-m", "unitscale", "train", "--out", str(out)]
        command += [*args.train_options, "--no-progress"]
        threads = _threads(args.train_options)
        before, start_iso = _load(), _now()
        peak = before[0]
        start = time.perf_counter()
        process = subprocess.Popen(command)
        while process.poll() is None:
            time.sleep(2.0)
            peak = max(peak, _load()[0])
        wall = time.perf_counter() - start
        after = _load()
        if process.returncode != 0:
            raise SystemExit(f"unitscale train exited with {process.returncode}")
        args.results.mkdir(parents=True, exist_ok=True)
        for folder in [out, *sorted(out.glob("seed*"))]:  # seed<N>/: with several seeds
            target = args.results / folder.relative_to(out)
            target.mkdir(parents=True, exist_ok=True)
            for name in OUTPUTS:
                if (folder / name).exists():
                    shutil.copy(folder / name, target / name)
    shown = ["python", "-m", "unitscale", "train", *args.train_options, "--no-progress"]
    record = {
        "command": " ".join(shown),
        "options": " ".join(args.train_options) or "defaults: the default run set, seed 0",
        "code_commit": commit,
        "exit_status": process.returncode,
        "start": start_iso,
        "end": _now(),
        "wall_s": round(wall, 1),
        "load_average_before": before,
        "load_average_1min_peak_during": peak,
        "load_average_after": after,
        "cpus": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "idle": before[0] < 1.0 and peak <= (os.cpu_count() or 1) + 0.5,  # train itself: ~2
    }
    (args.results / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
