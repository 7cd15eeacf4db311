"""The report of ``benchmarks/long_run.py``: from the jobs' folders to ``results.json``, the
figures and ``summary.txt``.

Collection is :func:`linear_op_rows` (the GEMM operands and output gradients of each linear
op, out of a :class:`~unitscale.tracking.ScaleMonitor` table); the rest only reads the jobs'
files. Every statement of ``summary.txt`` is computed from ``results.json``'s numbers
(:func:`statements`), never written by hand, so the README can quote it as it stands.

Which tensors are a linear op's GEMM operands: ``simulate_fp8`` inserts a
``quantise_operand`` node after each operand (named ``<operand>_quantised``; a weight's graph
name is its parameter name with ``_`` for ``.``) and a ``quantise_grad`` node after the op
(named ``<output>_grad_quantised``), which rounds the gradient flowing back into it
(``src/unitscale/transforms/lowp/_pass.py``). The monitor records a node's output forward and
the gradient with respect to it backward, so the unrounded operands are the forward values of
the ``quantise_operand`` nodes' sources, and the unrounded output gradient is the backward
value of the ``quantise_grad`` node: what the cast sees, before it saturates or flushes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

#: The roles of a linear op's tensors, in the figures' order, with the formats each is read
#: in: the ``"hardware"`` recipe's (E4M3 operands, an E5M2 output gradient) first; the output
#: gradient in E4M3 as well (what an all-E4M3 recipe, e.g. MXFP8's, would see).
ROLE_FORMATS: dict[str, tuple[str, ...]] = {
    "input": ("e4m3",),
    "weight": ("e4m3",),
    "output_grad": ("e5m2", "e4m3"),
}
#: The format each role is cast to by the run's recipe (``"hardware"``): the in-range verdict.
RECIPE_FORMAT = {role: formats[0] for role, formats in ROLE_FORMATS.items()}
#: ``linear_ops.csv``'s columns.
COLUMNS = ("step", "op", "role", "tensor", "metric", "value")
#: The monitor's metrics ``linear_ops.csv`` keeps (of ``training.MONITOR_METRICS``).
METRICS = ("rms", "abs_max", "overflow_e4m3", "underflow_e4m3", "overflow_e5m2", "underflow_e5m2")


def linear_op_rows(table: pd.DataFrame) -> pd.DataFrame:
    """The unrounded GEMM operands (``input``, ``weight``) and output gradient
    (``output_grad``) of every linear op of a monitored FP8 run, one row per step and metric.

    ``table`` is ``ScaleMonitor.table()`` (or the ``scales_<run>.csv`` of ``unitscale train
    --monitor-every``) of a model under ``simulate_fp8``. Returns the columns
    :data:`COLUMNS` and the metrics :data:`METRICS`; ``op`` is the linear op's module,
    ``tensor`` the recorded node.

    Raises:
        ValueError: no quantised operand in the table (not an FP8 run), or an operand's
            source is missing or ambiguous.
    """
    marked = table[table["op"].isin(("quantise_operand", "quantise_grad"))]
    if marked.empty:
        raise ValueError(
            "linear_op_rows: the table has no quantise_operand node; monitor a run under "
            "simulate_fp8 (e.g. unit-scaled-fp8)"
        )
    forward = table[table["direction"] == "fwd"]
    parts = []
    for module, node, op in marked[["module", "tensor", "op"]].drop_duplicates().itertuples(
        index=False
    ):
        if op == "quantise_grad":
            rows = table[(table["tensor"] == node) & (table["direction"] == "bwd")]
            role = "output_grad"
        else:
            rows = _operand_source(forward, str(node).removesuffix("_quantised"), str(module))
            role = "weight" if (rows["op"] == "parameter").all() else "input"
        if rows.duplicated(["step", "metric"]).any():
            raise ValueError(f"linear_op_rows: {node!r} of {module!r} is recorded twice a step")
        parts.append(rows.assign(op=module, role=role)[list(COLUMNS)])
    frame = pd.concat(parts, ignore_index=True)
    frame = frame[frame["metric"].isin(METRICS)]
    return frame.sort_values(["op", "role", "metric", "step"], kind="stable", ignore_index=True)


def _operand_source(forward: pd.DataFrame, source: str, module: str) -> pd.DataFrame:
    """The forward rows of the node named ``source`` (an activation), or of the parameter
    whose graph name it is (``layers_0_mlp_up_weight`` for ``layers.0.mlp.up.weight``)."""
    rows = forward[forward["tensor"] == source]
    if rows.empty:
        parameters = forward[forward["op"] == "parameter"]
        rows = parameters[parameters["tensor"].str.replace(".", "_", regex=False) == source]
    if rows.empty:
        raise ValueError(f"linear_op_rows: no recorded source {source!r} of {module!r}")
    return rows


def write_linear_op_rows(frame: pd.DataFrame, path: Path) -> Path:
    """Write :func:`linear_op_rows`' frame as CSV with 9 significant digits (a fraction of
    one element in ten million must not round to 0); return the path."""
    frame.to_csv(path, index=False, float_format="%.9g", lineterminator="\n")
    return path


# -- the numbers -----------------------------------------------------------------------------


def _number(value: float) -> float | None:
    """JSON's number: None for NaN/Inf, else rounded to 9 significant digits."""
    value = float(value)
    return float(f"{value:.9g}") if math.isfinite(value) else None


def _optional(value: float | None) -> float | None:
    return None if value is None else _number(value)


def range_figures(frames: dict[int, pd.DataFrame]) -> dict[str, Any]:
    """Per linear op, role and metric, per seed: the first and last recorded value, the
    largest finite value over steps and its (first) step, and how many recorded values were
    not finite (None in JSON). ``frames``: each seed's :func:`linear_op_rows`."""
    import numpy as np

    ops: dict[str, Any] = {}
    for seed, frame in sorted(frames.items()):
        for (op, role, metric), rows in frame.groupby(["op", "role", "metric"], sort=True):
            if not _kept(str(role), str(metric)):
                continue
            rows = rows.sort_values("step")
            values = rows["value"].to_numpy(dtype=float)
            finite = np.isfinite(values)
            top = int(np.where(finite, values, -np.inf).argmax())
            ops.setdefault(op, {}).setdefault(role, {}).setdefault(metric, {})[f"seed{seed}"] = {
                "first": _number(values[0]),
                "last": _number(values[-1]),
                "max": _number(values[top]),
                "max_step": int(rows["step"].iloc[top]),
                "first_step": int(rows["step"].iloc[0]),
                "last_step": int(rows["step"].iloc[-1]),
                "non_finite": int((~finite).sum()),
            }
    return ops


def _kept(role: str, metric: str) -> bool:
    """The metrics ``results.json`` keeps: rms, abs_max, and under/overflow in the role's
    formats."""
    if metric in ("rms", "abs_max"):
        return True
    kind, _, fmt = metric.partition("_")
    return kind in ("overflow", "underflow") and fmt in ROLE_FORMATS.get(role, ())


def gaps_to_fp32(jobs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Each low-precision run's final losses relative to its own FP32 run's, per seed:
    ``(run - fp32) / fp32`` (the library's 'vs FP32'), None where either is missing.
    ``jobs``: per seed label (``seed0``), per run, the final losses."""
    from unitscale.experiments.training import RUN_KINDS

    baselines = {kind.name: kind.baseline for kind in RUN_KINDS}
    gaps: dict[str, Any] = {}
    for seed, runs in sorted(jobs.items()):
        for run, result in sorted(runs.items()):
            fp32 = runs.get(baselines.get(run) or "")
            if fp32 is None:
                continue
            entry: dict[str, Any] = {"baseline": baselines[run]}
            for which in ("train", "heldout"):
                mine, theirs = result[f"final_{which}_loss"], fp32[f"final_{which}_loss"]
                ok = mine is not None and theirs is not None
                entry[which] = _number((mine - theirs) / theirs) if ok else None
            gaps.setdefault(seed, {})[run] = entry
    return gaps


# -- the statements ---------------------------------------------------------------------------


def _entries(ops: dict[str, Any], metric_of: Any) -> Iterable[tuple[str, str, str, dict]]:
    """``(op, role, metric, per-seed figures)`` for the metric ``metric_of(role)`` names."""
    for op, roles in sorted(ops.items()):
        for role in ROLE_FORMATS:
            metric = metric_of(role)
            if metric is not None and metric in roles.get(role, {}):
                yield op, role, metric, roles[role][metric]


def _worst(ops: dict[str, Any], metric_of: Any) -> tuple[float, str] | None:
    """The largest per-step value of ``metric_of(role)`` over ops, roles and seeds, and where."""
    best: tuple[float, str] | None = None
    for op, role, metric, seeds in _entries(ops, metric_of):
        for seed, figures in sorted(seeds.items()):
            value = figures["max"]
            if value is not None and (best is None or value > best[0]):
                where = f"{op} {role} ({metric}, {seed}, step {figures['max_step']})"
                best = (value, where)
    return best


def _mean(values: Iterable[float | None]) -> float:
    finite = [v for v in values if v is not None]
    return sum(finite) / len(finite) if finite else math.nan


def _drifts(ops: dict[str, Any], metric_of: Any, log: bool = False) -> list[tuple[float, str]]:
    """Per op and role, the seed-mean first and last values of ``metric_of(role)``, sorted by
    the size of the change (of log2 with ``log``), largest first, as ``(size, text)``."""
    found = []
    for op, role, metric, seeds in _entries(ops, metric_of):
        first = _mean(f["first"] for f in seeds.values())
        last = _mean(f["last"] for f in seeds.values())
        if not (math.isfinite(first) and math.isfinite(last)):
            continue
        if log:
            if first <= 0 or last <= 0:
                continue
            size = abs(math.log2(last / first))
        else:
            size = abs(last - first)
        steps = next(iter(seeds.values()))
        text = (
            f"{first:.3g} to {last:.3g} on {op} {role} ({metric}, step {steps['first_step']} "
            f"to {steps['last_step']}, mean of {len(seeds)} seed(s))"
        )
        found.append((size, text))
    return sorted(found, key=lambda item: -item[0])


def _among(roles: tuple[str, ...], metric: str) -> Any:
    """``metric_of`` for :func:`_worst`/:func:`_drifts`: ``metric`` (``{fmt}`` filled with the
    role's recipe format) for ``roles``, None for the others."""
    return lambda role: metric.format(fmt=RECIPE_FORMAT[role]) if role in roles else None


#: The forward operands and the backward gradients, stated apart.
GROUPS = {"forward operands": ("input", "weight"), "output gradients": ("output_grad",)}


def _headroom(ops: dict[str, Any], group: str, roles: tuple[str, ...]) -> list[str]:
    """The largest magnitude of ``roles`` at a recorded step, and how far below the largest
    finite value of the recipe's format it stayed (a factor; below 1: it overflowed)."""
    from unitscale.formats import get_format

    top = _worst(ops, _among(roles, "abs_max"))
    if top is None or top[0] <= 0:
        return []
    fmt = RECIPE_FORMAT[roles[0]]
    largest = get_format(fmt).max_absolute_value
    factor = largest / top[0]
    shown = f"{factor:.3g}" if factor < 1000 else f"{factor:,.0f}"
    return [
        f"{group}: largest magnitude {top[0]:.4g} on {top[1]}, {shown}x below "
        f"{fmt.upper()}'s largest value {largest:g}"
    ]


def _non_finite(ops: dict[str, Any]) -> list[str]:
    """A sentence naming the series that recorded a NaN or Inf, if any."""
    series = [
        f"{op} {role} ({metric}, {seed}: {figures['non_finite']})"
        for op, roles in sorted(ops.items())
        for role, metrics in roles.items()
        for metric, seeds in sorted(metrics.items())
        for seed, figures in sorted(seeds.items())
        if figures.get("non_finite")
    ]
    if not series:
        return []
    return [f"non-finite values recorded (series: count) in {', '.join(series)}"]


def statements(ranges: dict[str, Any]) -> list[str]:
    """The sentences ``summary.txt`` gives about the monitored run's ranges, from
    ``results.json``'s ``scale_ranges`` section: whether the static unit scales stayed in
    range (no overflow in the recipe's formats at any recorded step), the E4M3 view of the
    gradients, and what drifted (underflow, rms), for forward operands and gradients apart."""
    ops = ranges.get("ops", {})
    if not ops:
        return ["no scales recorded yet (the monitored run is not complete)"]
    records = ", ".join(f"{n} in {seed}" for seed, n in ranges["recorded_steps_per_seed"].items())
    every_role = tuple(ROLE_FORMATS)
    overflow = _worst(ops, _among(every_role, "overflow_{fmt}"))
    if overflow is None or overflow[0] == 0.0:
        lines = [
            f"static unit scales stayed in range: max overflow 0 (E4M3 operands, E5M2 output "
            f"gradients) on every linear op of {ranges['run']} at every recorded step "
            f"({records})"
        ]
    else:
        lines = [
            f"static unit scales did not stay in range: max overflow {overflow[0]:.3g} on "
            f"{overflow[1]} (recorded steps: {records})"
        ]
    grads = _worst(ops, lambda role: "overflow_e4m3" if role == "output_grad" else None)
    under = _worst(ops, lambda role: "underflow_e4m3" if role == "output_grad" else None)
    if grads is not None and under is not None:
        lines.append(
            "output gradients in E4M3 instead of E5M2: "
            + (f"max overflow {grads[0]:.3g} on {grads[1]}" if grads[0] else "no overflow")
            + f"; largest underflow {under[0]:.3g} on {under[1]}"
        )
    lines += _non_finite(ops)
    for group, roles in GROUPS.items():
        lines += _headroom(ops, group, roles)
        for _, text in _drifts(ops, _among(roles, "underflow_{fmt}"))[:2]:
            lines.append(f"{group}: underflow drifted from {text}")
        top = _worst(ops, _among(roles, "underflow_{fmt}"))
        if top is not None:
            lines.append(f"{group}: largest underflow {top[0]:.3g} on {top[1]}")
        for _, text in _drifts(ops, _among(roles, "rms"), log=True)[:2]:
            lines.append(f"{group}: rms drifted from {text}")
    return lines


def loss_statements(document: dict[str, Any]) -> list[str]:
    """One sentence per low-precision run: its final held-out loss relative to its FP32
    run's, per seed; and every run that stopped on a non-finite loss."""
    lines = []
    runs = sorted({run for seed in document["gaps_to_fp32"].values() for run in seed})
    for run in runs:
        parts, gaps = [], []
        for seed, by_run in sorted(document["gaps_to_fp32"].items()):
            gap = by_run.get(run, {}).get("heldout")
            parts.append(f"{'n/a' if gap is None else f'{gap:+.2%}'} ({seed})")
            gaps += [] if gap is None else [gap]
        mean = f"; mean {sum(gaps) / len(gaps):+.2%}" if len(gaps) > 1 else ""
        lines.append(f"{run}: held-out loss vs its FP32 run {', '.join(parts)}{mean}")
    for seed, runs_ in sorted(document["jobs"].items()):
        for run, job in runs_.items():
            if job.get("stopped_at") is not None:
                lines.append(f"{run} ({seed}) stopped at step {job['stopped_at']}: not finite")
    return lines or ["no run with its FP32 run to compare"]


def write_json(document: dict[str, Any], path: Path) -> Path:
    """Indented, key-sorted JSON with a final newline (the same bytes for the same numbers)."""
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


# -- from the job folders ----------------------------------------------------------------------

#: The monitored run's extract in its job folder (the full scales table is not kept).
LINEAR_OPS = "linear_ops.csv"
#: A job's record, written last: a folder holding it is a completed job.
JOB_RECORD = "job.json"


def job_folder(out: Path, seed: int, kind: str) -> Path:
    """Where the job of ``kind`` at ``seed`` keeps its outputs."""
    return out / f"seed{seed}" / kind


def collect(
    out: Path, seeds: Iterable[int], kinds: Iterable[str], monitored: str
) -> tuple[dict[str, Any], dict[int, pd.DataFrame], dict[int, dict[str, pd.DataFrame]]]:
    """Read the completed jobs under ``out``: their final losses and records (the document's
    ``jobs``, ``missing_jobs``, ``gaps_to_fp32`` and ``scale_ranges``), the monitored run's
    linear-op rows per seed, and every job's ``losses.csv`` per seed and run."""
    jobs: dict[str, dict[str, Any]] = {}
    missing: list[str] = []
    frames: dict[int, pd.DataFrame] = {}
    curves: dict[int, dict[str, pd.DataFrame]] = {}
    for seed in seeds:
        for kind in kinds:
            folder = job_folder(out, seed, kind)
            if not (folder / JOB_RECORD).exists():
                missing.append(f"seed{seed}/{kind}")
                continue
            record = json.loads((folder / JOB_RECORD).read_text(encoding="utf-8"))
            train = json.loads((folder / "results.json").read_text(encoding="utf-8"))
            final = train["runs"][kind]["per_seed"][str(seed)]
            jobs.setdefault(f"seed{seed}", {})[kind] = {
                "final_train_loss": _optional(final["final_train_loss"]),
                "final_heldout_loss": _optional(final["final_heldout_loss"]),
                "stopped_at": final["stopped_at"],
                "wall_s": record["wall_s"],
                "idle": record["idle"],
            }
            curves.setdefault(seed, {})[kind] = pd.read_csv(folder / "losses.csv")
            if kind == monitored and (folder / LINEAR_OPS).exists():
                frames[seed] = pd.read_csv(folder / LINEAR_OPS)
    document = {
        "complete": not missing,
        "missing_jobs": missing,
        "jobs": jobs,
        "gaps_to_fp32": gaps_to_fp32(jobs),
        "scale_ranges": {
            "run": monitored,
            "recorded_steps_per_seed": {
                f"seed{seed}": int(frame["step"].nunique()) for seed, frame in frames.items()
            },
            "ops": range_figures(frames),
        },
    }
    return document, frames, curves


def summary_text(document: dict[str, Any]) -> str:
    """``summary.txt``: the settings, which jobs are done, the final losses and every
    statement of :func:`loss_statements` and :func:`statements`."""
    settings = document["settings"]
    seeds = [f"seed{seed}" for seed in settings["seeds"]]
    total = len(seeds) * len(settings["kinds"])
    lines = [
        f"Static scales over a long run (benchmarks/long_run.py): {settings['steps']} steps, "
        f"seeds {', '.join(map(str, settings['seeds']))}, width {settings['width']}, depth "
        f"{settings['depth']}, heads {settings['heads']}, batch {settings['batch_size']} x "
        f"{settings['seq_len']}, plain lr {settings['lr_plain']}, FP8 recipe 'hardware'",
    ]
    if document["complete"]:
        lines.append(f"jobs: {total} of {total} complete")
    else:
        missing = document["missing_jobs"]
        lines.append(
            f"INCOMPLETE: {len(missing)} of {total} jobs missing ({', '.join(missing)}); "
            "not a result yet"
        )
    lines += ["", "final train / held-out loss:"]
    lines.append(f"  {'run':<22}" + "".join(f"{seed:>20}" for seed in seeds))
    for kind in settings["kinds"]:
        cells = []
        for seed in seeds:
            job = document["jobs"].get(seed, {}).get(kind)
            cells.append(
                "-" if job is None else f"{_loss(job['final_train_loss'])} / "
                f"{_loss(job['final_heldout_loss'])}"
            )
        lines.append(f"  {kind:<22}" + "".join(f"{cell:>20}" for cell in cells))
    lines += ["", "vs FP32 (relative):"]
    lines += [f"- {line}" for line in loss_statements(document)]
    ranges = document["scale_ranges"]
    lines += [
        "",
        f"{ranges['run']}: E4M3/E5M2 range of each linear op's unrounded GEMM operands and "
        f"output gradient, recorded every {settings['monitor_every']} steps:",
    ]
    lines += [f"- {line}" for line in statements(ranges)]
    return "\n".join(lines) + "\n"


def _loss(value: float | None) -> str:
    return "diverged" if value is None or not math.isfinite(value) else f"{value:.4f}"
