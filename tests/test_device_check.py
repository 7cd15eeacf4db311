"""benchmarks/device_check.sh, the run prepared for a lent GPU, as a dry run on the CPU: every
step runs at a tiny size, and the FP8 step writes one JSON record per variant. Measured on
this 2-core machine shared by several jobs: 237-288 s in all, with the tracking and
compile_lengths benchmarks running out of their time."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("CI") == "true" and os.environ.get("UNITSCALE_CI_README_LEG") != "1",
    reason="4 minutes of benchmarks at a tiny size: CI runs it once, in the README's "
    "environment (.ci/run); each step's code is tested on every leg by its own tests",
)
def test_device_check_dry_run_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "DEVICE": "cpu", "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "device_check.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    log = done.stdout
    exits = dict(re.findall(r"^=== (\w+): exit (\d+) ===$", log, flags=re.M))
    steps = "preflight fp8_tests fp8_step fsdp_allgather tests formats tracking fp8_scaling"
    steps += " compile_lengths"
    assert list(exits) == steps.split(), log[-4000:]  # every step ran, in this order
    # the FP8 steps pass; another step may only run out of its time on a loaded shared CPU
    # (its limit sized for a GPU, doubled here), never fail otherwise
    assert all(
        exits[name] == "0" for name in ("preflight", "fp8_tests", "fp8_step", "fsdp_allgather")
    ), exits
    assert set(exits.values()) <= {"0", "124"}, (exits, log[-4000:], done.stderr[-2000:])
    preflight = json.loads((tmp_path / "preflight.json").read_text())
    assert preflight["device"] == "cpu" and "torch" in preflight and "torchao" in preflight
    runs = json.loads((tmp_path / "fp8_step.json").read_text())["runs"]
    ours = {run["variant"]: run["result"] for run in runs if run.get("variant")}
    assert list(ours)[:2] == ["bf16-plain", "to_fp8-none-unit_scale"]  # the FP8 step first
    assert len(ours) == 8
    for name, result in ours.items():
        if "rowwise" in name and "rowwise scales" in result.get("error", ""):
            continue  # a CPU kernel without rowwise scales (torch 2.8's): refused, said why
        if name.startswith("to_fp8"):  # what ran in FP8 is recorded, so no silent fallback
            assert result["converted_flop_share"] == 1.0, (name, result)
        elif name.startswith("torchao") and "status" in result:
            assert result["status"].startswith("absent")
    assert log.index("=== preflight") < log.index("=== fp8_tests") < log.index("=== fp8_step")
