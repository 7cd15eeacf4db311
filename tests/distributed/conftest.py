"""Spawning the ranks of a data-parallel check: local gloo processes, bounded by a timeout."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _hang_guard import HANG_GUARD_S

WORKERS = Path(__file__).parent
RANK_TIMEOUT_S = float(HANG_GUARD_S)


def free_port() -> int:
    """A TCP port free on this machine now (the ranks rendezvous on it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_all(procs: list[subprocess.Popen[bytes]], deadline: float) -> int | None:
    """-1 once every rank exits 0; the first failed rank's index (the others may be stuck in
    a collective waiting for it); None past the deadline."""
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                return rank
        if all(code == 0 for code in codes):
            return -1
        time.sleep(0.1)
    return None


def spawn(script: str, args: list[str], out: Path, world: int = 2) -> list[dict[str, Any]]:
    """Run ``script`` as ``world`` gloo ranks; return each rank's ``rank<R>.json``.

    A rank that fails or a run that hangs past ``RANK_TIMEOUT_S`` fails the test (every rank
    is killed) with the ranks' output, instead of blocking the suite.
    """
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.update(WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    logs = [out / f"rank{rank}.log" for rank in range(world)]
    handles = [log.open("w") for log in logs]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKERS / script), *args, str(out)],
            env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
        for rank, handle in enumerate(handles)
    ]
    try:
        failed = _wait_all(procs, time.monotonic() + RANK_TIMEOUT_S)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for handle in handles:
            handle.close()
    if failed is None:
        pytest.fail(f"{script}: the ranks did not finish within {RANK_TIMEOUT_S:.0f} s")
    if failed >= 0 and not _aborted_at_exit(out / f"rank{failed}.json", logs[failed]):
        pytest.fail(f"rank {failed} of {script} failed:\n{logs[failed].read_text()[-4000:]}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.fixture(scope="module")
def spawn_ranks() -> Callable[..., list[dict[str, Any]]]:
    """:func:`spawn`, for the tests of this folder."""
    return spawn


def _skip_unless_fsdp_averages(results: list[dict[str, Any]]) -> None:
    """Skip an FSDP2 check where torch's own FSDP2 does not average gradients over gloo."""
    probe = results[0]["fsdp-averages"]
    if not probe["averages"]:
        pytest.skip(
            f"torch {probe['torch']}'s FSDP2 over gloo does not average gradients (a plain "
            f"nn.Linear gets {probe['ratio']:.3f}x one process's), so no model can match one "
            "process there"
        )


@pytest.fixture(scope="module")
def skip_unless_fsdp_averages() -> Callable[[list[dict[str, Any]]], None]:
    """Skip an FSDP2 check where torch's own FSDP2 does not average gradients over gloo
    (measured by the workers' ``fsdp-averages`` check)."""
    return _skip_unless_fsdp_averages


def _aborted_at_exit(result: Path, log: Path) -> bool:
    """Whether a failed rank finished its work (its JSON is written, last thing it does) and
    then aborted while the interpreter shut down: gloo's threads sometimes end with
    "terminate called without an active exception" at exit, after every collective is done.
    Its results are complete; any other failure still fails the test."""
    text = log.read_text()
    return result.exists() and text.rstrip().endswith(
        "terminate called without an active exception"
    )
