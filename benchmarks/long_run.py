"""Static scales over a long run: ``unitscale train`` at 10x its default steps, resumable.

The experiment: 10,000 steps on the default size, seeds 0 and 1, of the unit-scaled model in
simulated FP8 with no scales (``unit-scaled-fp8``), the plain model with torchao's tensorwise
and rowwise recipes (``plain-fp8-tensorwise``, ``plain-fp8-rowwise``) and the unit-scaled
model in MXFP8 (``unit-scaled-mxfp8``), each with its FP32 run (``plain-fp32``,
``unit-scaled-fp32``); the plain runs at ``--lr-plain 0.0015`` as the committed multi-seed
table (``benchmarks/results/train/hardware-recipe-seeds/run.json``). A
:class:`~unitscale.tracking.ScaleMonitor` records the ``unit-scaled-fp8`` run every 100 steps
(``unitscale train --monitor-every``): of each linear op's unrounded GEMM operands and output
gradient, the fraction of elements that overflow or underflow E4M3 (and E5M2, the gradients'
format in the ``"hardware"`` recipe).

Each (seed, run) is one job: ``python -m unitscale train --runs RUN --seed S ...`` in its own
process (one torch thread), writing into ``OUT/seed<S>/<run>.partial/``, renamed to
``OUT/seed<S>/<run>/`` once its ``job.json`` (the command, the code commit, the wall and CPU
time, the load average before, at its peak and after) is written. A completed job is never
run again: stop the script at any time (Ctrl-C, or a cut-off session) and run the same
command to go on. ``--jobs 2`` runs two jobs at once, the longest first. The monitored job
keeps ``linear_ops.csv`` (the linear ops' rows of its scales table); the full table, the HTML
report and the per-job loss plot are dropped to keep the folder small enough to commit.

When every job is complete (or with ``--report-only``), ``OUT`` gets ``results.json`` (every
job's final losses, each low-precision run's gap to its FP32 run, and per linear op and
tensor the first, last and largest overflow and underflow fractions and rms),
``overflow_underflow.png``, ``loss_curves.png`` and ``summary.txt``, whose statements are
computed from those numbers (``benchmarks/_long_run_report.py``).

Run: ``python benchmarks/long_run.py --jobs 2`` (2.9 CPU hours in the committed run, about
1.5 h on 2 idle cores; see docs/guide/experiments.rst); ``--dry-run`` lists the jobs, their
state and their commands.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pandas as pd
import torch
from _long_run_plots import plot_fractions, plot_losses
from _long_run_report import (
    JOB_RECORD,
    LINEAR_OPS,
    collect,
    job_folder,
    linear_op_rows,
    summary_text,
    write_json,
    write_linear_op_rows,
)
from train_wall_time import _load, _now

from unitscale.experiments.training import RUN_KINDS

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "train" / "long-run-10k"
KINDS = (
    "plain-fp32",
    "plain-fp8-tensorwise",
    "plain-fp8-rowwise",
    "unit-scaled-fp32",
    "unit-scaled-fp8",
    "unit-scaled-mxfp8",
)
#: ``unitscale train`` outputs a job does not keep (the results folder is committed;
#: ``job.log`` keeps the command's summary.)
DROPPED = ("report.html", "effective_rates.csv", "loss_curves.png", "summary.txt")
#: The options a completed job must share with this invocation to count as done.
SETTINGS = (
    "steps",
    "width",
    "depth",
    "heads",
    "batch_size",
    "seq_len",
    "lr_plain",
    "eval_every",
    "eval_batches",
    "monitor_every",
)
POLL_S = 1.0
#: CPU milliseconds per step at the default size, one thread (measured on 2 busy cores, see
#: docs/guide/experiments.rst): the longest jobs start first, so that ``--jobs 2`` does not
#: end with one core idle while the other trains an MXFP8 run. Other kinds count 100.
STEP_MS = {
    "plain-fp32": 34,
    "plain-fp8-tensorwise": 54,
    "plain-fp8-rowwise": 96,
    "unit-scaled-fp32": 57,
    "unit-scaled-fp8": 74,
    "unit-scaled-mxfp8": 205,
}


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _name_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add = parser.add_argument
    add("--out", type=Path, default=DEFAULT_OUT, help="results folder (default %(default)s)")
    add("--steps", type=int, default=10_000, help="steps per run (default %(default)s)")
    add("--seeds", type=_int_list, default=(0, 1), help="comma-separated (default 0,1)")
    add("--kinds", type=_name_list, default=KINDS, help="comma-separated unitscale train runs")
    add("--monitor", default="unit-scaled-fp8", help="the run whose scales are recorded")
    add("--monitor-every", type=int, default=100, help="record every N steps (default 100)")
    add("--eval-every", type=int, default=100, help="held-out loss every N steps")
    add("--eval-batches", type=int, default=8, help="batches per evaluation (default 8)")
    add("--width", type=int, default=128)
    add("--depth", type=int, default=2)
    add("--heads", type=int, default=4)
    add("--batch-size", type=int, default=16)
    add("--seq-len", type=int, default=64)
    add("--lr-plain", type=float, default=0.0015, help="the plain runs' peak lr")
    add("--jobs", type=int, default=1, help="jobs at once, one torch thread each")
    add("--job-timeout", type=float, default=None, help="stop a job after S seconds (a hang guard)")
    add("--report-only", action="store_true", help="run nothing; report what is complete")
    add("--dry-run", action="store_true", help="list the jobs and their commands")
    args = parser.parse_args(argv)
    kinds = {kind.name: kind for kind in RUN_KINDS}
    unknown = [name for name in args.kinds if name not in kinds]
    if unknown or not args.kinds or len(set(args.kinds)) != len(args.kinds):
        parser.error(f"--kinds: unknown or repeated {unknown or args.kinds}; choose from "
                     f"{','.join(kinds)}")  # fmt: skip
    if args.monitor not in args.kinds:
        parser.error(f"--monitor {args.monitor} is not one of --kinds {','.join(args.kinds)}")
    monitored = kinds[args.monitor]
    if monitored.precision != "fp8" or monitored.real:  # no quantise nodes to read otherwise
        parser.error(f"--monitor {args.monitor}: choose a simulated FP8 run (simulate_fp8)")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    return args


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The experiment's settings, as ``results.json`` records them."""
    values = {name: getattr(args, name) for name in SETTINGS}
    return {**values, "seeds": list(args.seeds), "kinds": list(args.kinds),
            "monitored": args.monitor}  # fmt: skip


def train_options(seed: int, kind: str, args: argparse.Namespace) -> list[str]:
    """The ``unitscale train`` options of one job (``--out`` apart)."""
    options = ["--runs", kind, "--seed", str(seed), "--steps", str(args.steps)]
    for name in ("width", "depth", "heads", "batch_size", "seq_len", "eval_every"):
        options += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    options += ["--eval-batches", str(args.eval_batches), "--lr-plain", repr(args.lr_plain)]
    if kind == args.monitor:
        options += ["--monitor-every", str(args.monitor_every)]
    return [*options, "--threads", "1", "--no-progress"]


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it lies inside it (the record is portable)."""
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _git(*command: str) -> str:
    done = subprocess.run(["git", *command], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip()


@dataclass
class _Running:
    """One job in flight."""

    seed: int
    kind: str
    folder: Path
    options: list[str]
    process: subprocess.Popen[bytes]
    log: IO[bytes]
    started: float
    start_iso: str
    before: list[float]
    peak: float


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _claim(folder: Path) -> None:
    """Empty the job's ``.partial`` folder for a fresh start, unless a live process (this
    script or its ``unitscale train``) still uses it."""
    lock = folder / "pid.json"
    if lock.exists():
        pids = json.loads(lock.read_text(encoding="utf-8")).values()
        live = [pid for pid in pids if _alive(int(pid))]
        if live:
            raise SystemExit(
                f"long_run: {_shown(folder)} is in use by process(es) {live}; wait for them, "
                "or stop them and delete the folder"
            )
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)


def _start(seed: int, kind: str, args: argparse.Namespace) -> _Running:
    final = job_folder(args.out, seed, kind)
    folder = final.with_name(f"{kind}.partial")
    _claim(folder)
    shutil.rmtree(final, ignore_errors=True)  # a folder without job.json: not complete
    options = train_options(seed, kind, args)
    command = [sys.executable, "-m", "unitscale", "train", *options, "--out", str(folder)]
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    log = (folder / "job.log").open("wb")
    before = _load()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    pids = {"scheduler": os.getpid(), "train": process.pid}
    (folder / "pid.json").write_text(json.dumps(pids), encoding="utf-8")
    print(f"long run: started seed{seed}/{kind} (pid {process.pid})", file=sys.stderr)
    return _Running(seed, kind, folder, options, process, log, time.perf_counter(), _now(),
                    before, before[0])  # fmt: skip


def _slim(folder: Path, monitored: bool) -> None:
    """Keep what the report needs: drop :data:`DROPPED`, the TensorBoard scalars, and the
    scales table once its linear ops' rows are in ``linear_ops.csv`` (the monitored run)."""
    for name in DROPPED:
        (folder / name).unlink(missing_ok=True)
    shutil.rmtree(folder / "tensorboard", ignore_errors=True)  # where tensorboard is installed
    tables = sorted(folder.glob("scales_*.csv"))
    if monitored:
        if len(tables) != 1:
            raise ValueError(f"expected one scales table in {folder}, got {tables}")
        write_linear_op_rows(linear_op_rows(pd.read_csv(tables[0])), folder / LINEAR_OPS)
    for table in tables:
        table.unlink()


def _finish(
    job: _Running, args: argparse.Namespace, commit: dict[str, Any], cpu_s: float
) -> str | None:
    """Record a job that ended (``cpu_s``: its process's CPU seconds); return None, or why it
    failed."""
    wall = time.perf_counter() - job.started
    job.log.close()
    name = f"seed{job.seed}/{job.kind}"
    if job.process.returncode != 0:
        tail = (job.folder / "job.log").read_text(errors="replace").splitlines()[-5:]
        return f"{name} exited with {job.process.returncode}:\n  " + "\n  ".join(tail)
    try:
        _slim(job.folder, job.kind == args.monitor)
    except ValueError as exc:
        return f"{name}: its outputs could not be read: {exc}"
    ran = json.loads((job.folder / "results.json").read_text(encoding="utf-8"))
    run_s = ran["runs"][job.kind]["per_seed"][str(job.seed)]["seconds"]
    cpus, peak = os.cpu_count() or 1, job.peak
    record = {
        "command": " ".join(["python -m unitscale train", *job.options, "--out",
                             _shown(job_folder(args.out, job.seed, job.kind))]),
        "settings": {**{n: getattr(args, n) for n in SETTINGS}, "seed": job.seed,
                     "kind": job.kind, "monitored": job.kind == args.monitor},
        **commit,
        "start": job.start_iso,
        "end": _now(),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu_s, 1),
        "run_s": run_s,
        "run_ms_per_step": round(1000 * run_s / args.steps, 1),  # build and evaluations in
        "load_average_before": job.before,
        "load_average_1min_peak_during": peak,
        "load_average_after": _load(),
        "concurrent_jobs": args.jobs,
        "cpus": cpus,
        "torch_threads": 1,
        "torch": torch.__version__,
        # idle: the 1-minute load never rose above this script's own jobs
        "idle": peak <= args.jobs + 0.5,
    }  # fmt: skip
    write_json(record, job.folder / JOB_RECORD)
    (job.folder / "pid.json").unlink()
    job.folder.rename(job_folder(args.out, job.seed, job.kind))
    print(f"long run: {name} done in {wall:.0f}s", file=sys.stderr)
    return None


def _children_cpu_s() -> float:
    """User and system CPU seconds of this process's reaped children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _stop(running: list[_Running]) -> None:
    """Stop the jobs in flight: SIGTERM, then SIGKILL after a minute or a second Ctrl-C."""
    for job in running:
        job.process.terminate()
    for job in running:
        try:
            job.process.wait(timeout=60)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            job.process.kill()
            job.process.wait()
        job.log.close()


def run_jobs(pending: list[tuple[int, str]], args: argparse.Namespace) -> list[str]:
    """Run ``pending`` jobs, ``args.jobs`` at once; return the failures' messages. On Ctrl-C
    or SIGTERM the running jobs are stopped (their ``.partial`` folders restart next time)."""
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    commit = {"code_commit": _git("rev-parse", "HEAD"), "code_dirty": dirty}
    queue, running, failures = list(pending), [], []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        while queue or running:
            while queue and len(running) < args.jobs:
                running.append(_start(*queue.pop(0), args))
            time.sleep(POLL_S)
            load = _load()[0]
            for job in list(running):
                job.peak = max(job.peak, load)
                limit = args.job_timeout
                if limit is not None and time.perf_counter() - job.started > limit:
                    job.process.kill()  # a hang: _finish reports the failure
                cpu = _children_cpu_s()
                if job.process.poll() is not None:  # reaped: its CPU time joins the children's
                    running.remove(job)
                    failure = _finish(job, args, commit, _children_cpu_s() - cpu)
                    failures += [failure] if failure else []
    except BaseException:  # Ctrl-C, SIGTERM or a bug: no job left running unwatched
        _stop(running)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    return failures


def _check_done(done: list[tuple[int, str]], args: argparse.Namespace) -> None:
    """Refuse to mix: a completed job run with other settings is not this experiment's."""
    for seed, kind in done:
        record = json.loads((job_folder(args.out, seed, kind) / JOB_RECORD).read_text())
        differ = [n for n in SETTINGS if record["settings"].get(n) != getattr(args, n)]
        if kind != args.monitor:  # only the monitored job's record depends on it
            differ = [n for n in differ if n != "monitor_every"]
        if record["settings"].get("monitored") != (kind == args.monitor):
            differ.append("monitored")
        if differ:
            theirs = ", ".join(f"{n}={record['settings'].get(n)}" for n in differ)
            raise SystemExit(
                f"long_run: {_shown(job_folder(args.out, seed, kind))} was run with {theirs}, "
                "not this invocation's settings: choose another --out or delete that folder"
            )


def write_report(args: argparse.Namespace) -> str:
    """Write ``results.json``, the figures and ``summary.txt`` from the completed jobs;
    return the summary."""
    document, frames, curves = collect(args.out, args.seeds, args.kinds, args.monitor)
    document["settings"] = settings_of(args)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(document, args.out / "results.json")
    if frames:
        plot_fractions(frames, args.monitor, args.out / "overflow_underflow.png")
    if curves:
        plot_losses(curves, args.out / "loss_curves.png")
    text = summary_text(document)
    (args.out / "summary.txt").write_text(text, encoding="utf-8")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    jobs = [(seed, kind) for seed in args.seeds for kind in args.kinds]
    done = [j for j in jobs if (job_folder(args.out, *j) / JOB_RECORD).exists()]
    _check_done(done, args)
    pending = sorted((j for j in jobs if j not in done), key=lambda j: -STEP_MS.get(j[1], 100))
    print(f"long run: {len(done)} of {len(jobs)} jobs complete, {len(pending)} to run "
          f"({args.jobs} at once) in {_shown(args.out)}", file=sys.stderr)  # fmt: skip
    if args.dry_run:
        cpu_h = sum(STEP_MS.get(kind, 100) for _, kind in pending) * args.steps / 3.6e6
        print(f"pending: about {cpu_h:.1f} CPU hours of training steps at the default size's "
              "step times (STEP_MS), in this order:")  # fmt: skip
        for seed, kind in [*done, *pending]:
            state = "done" if (seed, kind) in done else "to run"
            options = " ".join(train_options(seed, kind, args))
            print(f"seed{seed}/{kind} [{state}]: python -m unitscale train {options}")
        return 0
    if pending and not args.report_only:
        try:
            failures = run_jobs(pending, args)
        except KeyboardInterrupt:
            print("long run: interrupted; completed jobs are kept: run again to go on",
                  file=sys.stderr)  # fmt: skip
            return 130
        if failures:
            print("long run: failed jobs (rerun to retry):\n" + "\n".join(failures),
                  file=sys.stderr)  # fmt: skip
            return 1
    sys.stdout.write(write_report(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
