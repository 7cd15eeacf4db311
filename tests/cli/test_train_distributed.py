"""``unitscale train`` data-parallel: ``--nproc 2`` and torchrun give one process's losses.

Each case is one run of 2 gloo ranks (slow). Tolerance: 1e-5 absolute on every loss of a
few steps (float32 gradient sums in another order; measured ~1e-6). The FP8 runs differed by
~1e-3 from the first step when each rank's mean loss gave its examples twice one process's
gradient. FP8 runs with per-tensor scales take each rank's own amax, as
torchao does by default (``docs/guide/fp8.rst``), so their forward rounding differs from one
process's: they are checked within 3e-3 (measured up to 9e-4 over 3 steps). MXFP8 (blocks
of 32 tokens, as many as each rank holds here) matches within 1e-5; the MXFP4 and NVFP4 runs
round gradients stochastically, each rank with its own draws: within 3e-2 (measured up to
1.6e-2 over 3 steps, losses near 5.4).
"""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _hang_guard import HANG_GUARD_S

import unitscale.transforms
from unitscale.cli import main
from unitscale.experiments.training import RUN_KINDS, TrainConfig, train_run
from unitscale.transforms.lowp._gemm import float8_device_error

pytestmark = pytest.mark.slow

SIZE = ["--steps", "3", "--batch-size", "4", "--seq-len", "16", "--width", "32"]
SIZE += ["--depth", "1", "--heads", "2", "--eval-every", "2", "--eval-batches", "1"]
RUN = "unit-scaled-fp32"
ENV = {**os.environ, "UNITSCALE_DEBUG": "", "OMP_NUM_THREADS": "1"}


def _one_process_losses(run: str = RUN) -> list[tuple[str, str]]:
    config = TrainConfig(
        steps=3, batch_size=4, seq_len=16, hidden_size=32, depth=1, heads=2, eval_every=2,
        eval_batches=1, runs=(run,),
    )  # fmt: skip
    result = train_run(run, config, progress=False)
    heldout = {step: f"{loss:.6f}" for step, loss in result.heldout.items()}
    rows = [(f"{loss:.6f}", heldout.get(step, "")) for step, loss in enumerate(result.train_losses)]
    return [*rows, ("", heldout[config.steps])]


def _losses(path: Path, run: str = RUN) -> list[tuple[str, str]]:
    with path.open() as f:
        rows = [row for row in csv.DictReader(f) if row["run"] == run]
        return [(row["train_loss"], row["heldout_loss"]) for row in rows]


def _assert_close(
    got: list[tuple[str, str]], want: list[tuple[str, str]], tolerance: float = 1e-5, run: str = ""
) -> None:
    assert len(got) == len(want), run
    for (train, heldout), (train_ref, heldout_ref) in zip(got, want, strict=True):
        for value, ref in ((train, train_ref), (heldout, heldout_ref)):
            assert (value == "") == (ref == ""), run
            if ref:
                assert float(value) == pytest.approx(float(ref), abs=tolerance), run


# Every run kind this installation can run (the real-FP8 ones need float8 GEMMs).
_REAL = hasattr(unitscale.transforms, "to_fp8") and float8_device_error("cpu") is None


def _runs_here(kind: object) -> bool:
    """Whether this installation runs ``kind``: the real-FP8 kinds need float8 GEMMs, the
    rowwise one also a CPU kernel with rowwise scales (torch 2.8's refuses them)."""
    if not getattr(kind, "real", False):
        return True
    if not _REAL:
        return False
    if getattr(kind, "scaling", "") not in ("rowwise", "rowwise_with_gw_hp"):
        return True
    import torch

    from unitscale.formats import FormatError

    try:
        unitscale.transforms.to_fp8(torch.nn.Linear(16, 16), scaling="rowwise")(torch.randn(16, 16))
    except FormatError:
        return False
    return True


_KINDS = [k for k in RUN_KINDS if _runs_here(k)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_nproc_2_matches_one_process_for_every_run_kind(tmp_path: Path) -> None:
    # Every run kind, FP8 included: the gradients each rank rounds are one process's.
    out = tmp_path / "out"
    command = [sys.executable, "-m", "unitscale", "train", *SIZE, "--nproc", "2"]
    command += ["--runs", ",".join(kind.name for kind in _KINDS)]
    result = subprocess.run(
        [*command, "--out", str(out), "--no-progress"],
        capture_output=True, text=True, env=ENV, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    for kind in _KINDS:
        # Two half-batch gradients averaged by the all-reduce are summed in another order
        # than one process's whole batch: float32 rounding, 1.1e-5 after 3 steps on torch
        # 2.8 (a missing average or a rank's stale weights moves the losses by > 1e-2).
        tolerance = 3e-3 if kind.scaling not in ("", "none") else 1e-4  # per-rank amax
        if any(f in kind.name for f in ("mxfp4", "nvfp4")):  # stochastic gradient rounding:
            # each rank draws its own random bits, so two processes and one do not round
            # alike: measured up to 1.6e-2 over 3 steps on torch 2.13, 4.6e-2 on torch 2.8
            # (unit-scaled-mxfp4); a gap of this size is noise, not a reduction error
            tolerance = 1e-1
        got = _losses(out / "losses.csv", kind.name)
        _assert_close(got, _one_process_losses(kind.name), tolerance, kind.name)
    assert result.stdout.count("wrote ") == 1  # rank 0 alone reports and writes
    # ...and it alone prints the stage lines.
    assert result.stderr.count(f"training {len(_KINDS)} run(s)") == 1, result.stderr
    for run in (kind.name for kind in _KINDS):
        assert result.stderr.count(f"{run}: done in") == 1, result.stderr


def test_a_batch_the_processes_cannot_share_is_a_usage_error_before_they_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from unitscale.cli import _launch

    def no_launch(*args: object) -> None:
        raise AssertionError("ranks started")

    monkeypatch.setattr(_launch, "launch", no_launch)
    out = tmp_path / "out"
    # --threads: no "cores are busy" line on a loaded machine; the error is the one line
    argv = ["train", "--nproc", "2", "--batch-size", "3", "--threads", "1", "--out", str(out)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert "unitscale train: error: --batch-size 3 is not a multiple of --nproc 2" in captured.err
    assert not out.exists()


def test_torchrun_matches_one_process(tmp_path: Path) -> None:
    out = tmp_path / "out"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    launcher += ["--master-port", str(_free_port())]
    result = subprocess.run(
        [*launcher, "-m", "unitscale", "train", *SIZE, "--runs", RUN, "--out", str(out),
         "--no-progress"],
        capture_output=True, text=True, env=ENV, timeout=HANG_GUARD_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_close(_losses(out / "losses.csv"), _one_process_losses())


FAILING = """
import torch.distributed as dist
from unitscale.cli._launch import launch


def target():
    if dist.get_rank() == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()  # rank 0 waits for rank 1 here: without the launcher's care, a hang


if __name__ == "__main__":
    launch(target, 2)
"""


def test_a_failing_rank_fails_the_launch_with_its_error(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text(FAILING)
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=ENV, timeout=HANG_GUARD_S
    )
    assert result.returncode != 0
    assert "rank 1 of 2 failed: ValueError: rank one cannot go on" in result.stderr


def test_a_group_joined_from_the_environment_is_left_when_the_block_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torchrun's group is destroyed when the command ends (its threads ended before the
    interpreter exits), a group joined before is kept, and one process is not several."""
    import torch.distributed as dist

    from unitscale.cli._launch import group_from_environment

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    for key, value in {**env, "RANK": "0", "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    assert not dist.is_initialized()
    with group_from_environment() as several:
        assert dist.is_initialized() and not several
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="stop"), group_from_environment():
        raise RuntimeError("stop")
    assert not dist.is_initialized()
    dist.init_process_group("gloo")
    try:
        with group_from_environment():
            pass
        assert dist.is_initialized()  # not this block's to leave
    finally:
        dist.destroy_process_group()
