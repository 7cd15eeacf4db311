"""Wall time of ``unitscale analyse`` on its defaults, as a new user first runs it.

Each run is a new process (``python -m unitscale analyse`` in a fresh working directory),
timed from its start to its exit, interpreter start-up, imports and teardown included:

- ``cold``: every cache the command can use is new and empty: ``HOME`` (matplotlib's font
  cache, ``~/.cache``), ``MPLCONFIGDIR`` and ``TORCHINDUCTOR_CACHE_DIR`` (the native kernels
  are built at install: no cache); the operating system's file cache is not dropped;
- ``warm``: the caches of the previous cold run kept.

Cold and warm runs alternate; the medians are reported, with each phase's start as the
command prints it (``[  2.0s] plain: tracking ...``) for the last cold run. Target: cold
at most 10 s. Each run is appended to ``benchmarks/results/analyse.json``.

Run: ``python benchmarks/bench_analyse.py [--rounds N]``
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _history import append_run, machine_state

RESULTS = Path(__file__).parent / "results" / "analyse.json"
TARGET_COLD_S = 10.0
_PHASE = re.compile(r"^\[\s*([0-9.]+)s\] (.+)$")


def _environment(root: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("HOME", "MPLCONFIGDIR", "TORCHINDUCTOR_CACHE_DIR"):
        path = root / name.lower()
        path.mkdir(parents=True, exist_ok=True)
        env[name] = str(path)
    env.pop("UNITSCALE_STATS", None)
    return env


def one_run(root: Path, work: Path) -> tuple[float, list[tuple[float, str]]]:
    """Seconds from start to exit of one ``unitscale analyse``, and its printed phases."""
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "unitscale", "analyse"],
        cwd=work,
        env=_environment(root),
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"unitscale analyse failed ({done.returncode}):\n{done.stderr}")
    phases = []
    for line in (done.stdout + done.stderr).splitlines():
        match = _PHASE.match(line.strip())
        if match:
            phases.append((float(match.group(1)), match.group(2)))
    return seconds, phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    run: dict[str, Any] = {**machine_state(), "rounds": args.rounds}
    cold: list[float] = []
    warm: list[float] = []
    phases: list[tuple[float, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            root = Path(tmp) / f"round{k}"
            seconds, phases = one_run(root, root / "cold")
            cold.append(seconds)
            seconds, _ = one_run(root, root / "warm")
            warm.append(seconds)
            print(f"round {k}: cold {cold[-1]:.2f} s, warm {warm[-1]:.2f} s", flush=True)
    run["seconds"] = {
        "cold": round(statistics.median(cold), 2),
        "warm": round(statistics.median(warm), 2),
        "cold_all": [round(v, 2) for v in cold],
        "warm_all": [round(v, 2) for v in warm],
    }
    run["target_cold_s"] = TARGET_COLD_S
    run["last_cold_phases"] = [{"at_s": at, "phase": name} for at, name in phases]
    print(run["seconds"], flush=True)
    append_run(args.out, run)


if __name__ == "__main__":
    main()
