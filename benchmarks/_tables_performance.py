"""The performance table: each row from the newest run of one ``bench_*.py`` in
``benchmarks/results``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _tables_common as paths
from _history import latest_run, read_runs
from _tables_common import _cuda_run, _met, _seconds, _when

# A first tracked call is TorchDynamo's capture plus what tracking adds to it; what it adds has
# a target of its own beside the total (docs/guide/performance.rst, "Tracking").
_OVER_DYNAMO_TARGET_S = 0.2


def ops_rows() -> list[str]:
    path = paths.RESULTS / "ops.json"
    run = latest_run(path)
    rows = []
    for mode in ("eager", "compiled"):
        cells = []
        target = None
        for result in run["results"]:
            wall = result["wall"][mode]
            target = wall["target"]
            cells.append(f"{wall['ratio']:.2f}x ({result['tokens']} x {result['width']})")
        worst = max(r["wall"][mode]["ratio"] for r in run["results"])
        rows.append(
            f"| unit-scaled Linear+GELU stack vs `torch.nn`, fwd+bwd, {mode} (`bench_ops.py`) "
            f"| {', '.join(cells)} | {_met(worst, target)} | {_when(run, path)} |"
        )
    return rows


def formats_rows(device: str = "cpu") -> list[str]:
    path = paths.RESULTS / "formats.json"
    run = latest_run(path) if device == "cpu" else _cuda_run(path)
    if run is None:
        return []
    per_threads = run.get("per_thread_count") or run["runs"]
    rows = []
    for entry in per_threads:
        threads = f"{entry['threads']} thread{'' if entry['threads'] == 1 else 's'}"
        if device != "cpu":
            threads = "CUDA"
        for mode in ("compiled", "eager"):
            e4m3 = entry["results"][mode]["e4m3"]
            worst = entry["summary"]
            cells = ", ".join(
                f"{rounding} {e4m3[rounding]['ratio_vs_clone']:.2f}x "
                f"(worst format {worst[f'{mode}_{rounding}_worst_ratio']:.2f}x)"
                for rounding in ("nearest", "stochastic")
            )
            targets = run.get("targets_ratio_vs_clone", {})
            if "compiled" in targets:  # per mode: compiled vs a clone, eager vs torch's cast
                worst = entry["summary"]
                if mode == "compiled":
                    target = ", ".join(
                        f"{k} {_met(worst[f'compiled_{k}_worst_ratio'], v)} (worst format)"
                        for k, v in targets["compiled"].items()
                    )
                else:
                    vs_cast = worst["eager_nearest_worst_ratio_vs_torch_cast"]
                    verdict = "met" if vs_cast <= 1 else "not met"
                    target = (
                        f"nearest no slower than torch's cast round trip: worst format "
                        f"{vs_cast:.2f}x of it ({verdict})"
                    )
            else:
                target = ", ".join(f"{k} {v:g}x" for k, v in targets.items())
            rows.append(
                f"| E4M3 `quantise` of {run['numel']:,} float32 values vs `x.clone()`, {mode}, "
                f"{threads} (`bench_formats.py`) "
                f"| {cells} | {target} "
                f"| {_when({**run, 'threads': entry['threads']}, path)} |"
            )
        if "users_path" in entry:
            rows.append(_users_path_row(run, entry, threads, path))
    return rows


def _users_path_row(run: dict[str, Any], entry: dict[str, Any], threads: str, path: Path) -> str:
    """``torch.compile(fmt.quantise)`` as users write it: several formats, one process."""
    users = entry["users_path"]
    cells = ", ".join(f"{key} {r['ratio_vs_clone']:.2f}x" for key, r in users.items())
    worst = max(r["ratio_vs_clone"] for r in users.values())
    target = min(r["target"] for r in users.values())
    return (
        f"| `torch.compile(fmt.quantise)` of {run['numel']:,} float32 values vs `x.clone()`, "
        f"default options, these formats compiled in one process, {threads} "
        f"(`bench_formats.py`) | {cells} | each {_met(worst, target)} "
        f"| {_when({**run, 'threads': entry['threads']}, path)} |"
    )


def tracking_rows(device: str = "cpu") -> list[str]:
    path = paths.RESULTS / "tracking.json"
    run = latest_run(path) if device == "cpu" else _cuda_run(path)
    if run is None:
        return []
    on = ", CUDA" if device != "cpu" else ""
    rows = []
    for name, result in run["models"].items():
        if "step_s" in result and isinstance(result["step_s"], dict):  # interleaved format
            ratio, memory = result["time_ratio"], result["peak_memory_ratio"]
            first = result["first_call_s"]
            tracked, untracked = _seconds(first["tracked"]), _seconds(first["untracked"])
            first_text = f"first call {tracked} (untracked {untracked})"
            how = "interleaved, median of per-round ratios"
            target = result.get("target")
            if "read_s" in result:  # the step reads the graph: its cost shown apart
                how += "; step = forward, backward, `scales_graph()` held and read"
                first_text += (
                    f", reading {result['read_share_of_untracked_step']:.1%} of an untracked "
                    f"step (without it {result['time_ratio_without_read']:.2f}x)"
                )
        else:  # older format: separate processes, ru_maxrss
            ratio, memory = result["time_ratio"], result["peak_memory_ratio"]
            first_text = (
                f"first call {result['tracked']['first_call_s']:.1f} s "
                f"(untracked {result['untracked']['first_call_s']:.1f} s)"
            )
            how = "separate processes; memory is the process's lifetime peak"
            target = None
        rows.append(
            f"| `track_scales` step vs untracked, {name}{on} (`bench_tracking.py`, {how}) "
            f"| time {ratio:.2f}x, peak memory {memory:.2f}x, {first_text} "
            f"| {_met(ratio, target)} | {_when(run, path)} |"
        )
    fresh = run.get("first_call_fresh_process")
    if fresh:
        step = fresh["first_step_s"]
        rows.append(
            f"| first step of a new process, {fresh['model']}, tracked vs untracked "
            f"(`bench_tracking.py`, median of {fresh['rounds']} processes each) "
            f"| tracked {_seconds(step['tracked'])}, untracked {_seconds(step['untracked'])}, "
            f'`torch.compile(backend="eager")` {_seconds(step["dynamo_eager"])}: '
            f"tracking {fresh['extra_s']:+.2f} s over untracked, "
            f"{fresh['extra_over_dynamo_s']:+.2f} s over TorchDynamo's capture "
            f"| +{fresh['target_extra_s']:g} s over untracked "
            f"({'met' if fresh['extra_s'] <= fresh['target_extra_s'] else 'not met'}); "
            f"+{_OVER_DYNAMO_TARGET_S:g} s over TorchDynamo's capture "
            f"({'met' if fresh['extra_over_dynamo_s'] <= _OVER_DYNAMO_TARGET_S else 'not met'}) "
            f"| {_when(run, path)} |"
        )
    varying = run.get("variable_lengths")
    if varying:
        lengths = varying["lengths_in_order"]
        growth = varying["rss_growth_second_pass_bytes"] / 2**20
        rows.append(
            f"| `track_scales` on batches of changing length, {varying['model']}, lengths "
            f"{min(lengths)} to {max(lengths)} shuffled, two passes (`bench_tracking.py`) "
            f"| {varying['captured_graphs']} TorchDynamo captures in all, "
            f"{varying['new_captures_after_second_length']} after the second length; "
            f"time {varying['second_pass_time_ratio']:.2f}x untracked (second pass); "
            f"resident memory {growth:+.1f} MiB over the second pass "
            f"| no capture per length after the second "
            f"({'met' if varying['new_captures_after_second_length'] == 0 else 'not met'}) "
            f"| {_when(run, path)} |"
        )
    reads = run.get("statistics_vs_read")
    if reads:
        labels = (
            ("extension", "native kernel as tracking calls it (CPython extension)"),
            ("native", "native kernel through `tensor_stats`"),
            (
                "pytorch",
                "PyTorch kernel run eagerly (`UNITSCALE_STATS=eager`; what runs "
                "without the native build)",
            ),
        )
        for key, label in labels:
            if key not in next(iter(reads["sizes"].values())):
                continue  # measured before the extension existed, or without it
            cells = ", ".join(
                f"{int(size):,}: {ratios[key]:.2f}x" for size, ratios in reads["sizes"].items()
            )
            worst = max(ratios[key] for ratios in reads["sizes"].values())
            rows.append(
                f"| one tensor's tracking statistics vs one read (`x.abs().sum()`), float32, "
                f"CPU, {label} (`bench_tracking.py`) | {cells} | "
                f"{_met(worst, reads['target'])} | {_when(run, path)} |"
            )
        batched = reads.get("batched_small")
        if batched:
            cells = ", ".join(f"{int(size):,}: {ratio:.2f}x" for size, ratio in batched.items())
            rows.append(
                "| small tensors' tracking statistics vs one read each, float32, CPU, PyTorch "
                "ops as tracking runs them (64 queued, read in batches of up to 2**18 "
                "elements; "
                f"`bench_tracking.py`) | {cells} | {_met(max(batched.values()), reads['target'])} "
                f"| {_when(run, path)} |"
            )
    return rows


def tracking_zoo_rows(device: str = "cpu") -> list[str]:
    """``bench_tracking_zoo.py``: the tracked step over many tiny architectures, if measured
    (on ``device``)."""
    path = paths.RESULTS / "tracking_zoo.json"
    if not path.exists():
        return []
    run = latest_run(path) if device == "cpu" else _cuda_run(path)
    if run is None:
        return []
    summary = run["summary"]
    if "median_time_ratio" not in summary:
        return []
    worst = ", ".join(f"{arch} {ratio:.2f}x" for arch, ratio in summary["worst_5"].items())
    failed = f"; failed: {', '.join(summary['failed'])}" if summary["failed"] else ""
    median_met = summary["median_time_ratio"] <= summary["target_median"]
    max_met = summary["max_time_ratio"] <= summary["target_max"]
    batch, seq = run["batch_seq"]
    return [
        f"| `track_scales` step vs untracked, {summary['architectures']} tiny `transformers` "
        f"architectures (2 layers, h64, batch {batch} x {seq}; `bench_tracking_zoo.py`, "
        "interleaved, median of per-round ratios; step = forward, backward, `scales_graph()` "
        f"held and read) | median {summary['median_time_ratio']:.2f}x "
        f"({summary['min_time_ratio']:.2f}-{summary['max_time_ratio']:.2f}x; without the read "
        f"{summary['median_time_ratio_without_read']:.2f}x); worst: {worst}{failed} "
        f"| median <= {summary['target_median']:g}x ({'met' if median_met else 'not met'}), "
        f"none over {summary['target_max']:g}x ({'met' if max_met else 'not met'}) "
        f"| {_when(run, path)} |"
    ]


def optim_rows() -> list[str]:
    path = paths.RESULTS / "optim.json"
    run = latest_run(path)
    cells = ", ".join(
        f"{'foreach' if r['foreach'] else 'for-loop'} {r['ratio_umup_over_torch']:.2f}x"
        for r in run["results"]
    )
    shape = run["results"][0]
    return [
        f"| `unitscale.optim.AdamW` step vs `torch.optim.AdamW`, u-muP decoder width "
        f"{shape['width']} depth {shape['depth']} (`bench_optim.py`, interleaved) | {cells} "
        f"| 1.00x (parameter groups only) | {_when(run, path)} |"
    ]


def distributed_rows() -> list[str]:
    path = paths.RESULTS / "distributed.json"
    run = latest_run(path)
    return [
        f"| `scales_graph()` reduced over {run['processes']} gloo ranks vs a DDP training step, "
        f"built-in GPT under `unit_scale`, {run['tensors']} tensors (`bench_distributed.py`, "
        f"interleaved; paid on recorded steps only) | reduction "
        f"{1e3 * (run['read_reduced_s'] - run['read_local_s']):.1f} ms = "
        f"{100 * run['reduction_vs_step']:.1f}% of a {1e3 * run['step_s']:.0f} ms step |  "
        f"| {_when(run, path)} |"
    ]


def train_step_rows() -> list[str]:
    path = paths.RESULTS / "train_step.json"
    if not path.exists():
        return []
    run = latest_run(path)
    model = run["model"]
    cells = ", ".join(
        f"{name} {r['ratio_fp8_vs_fp32']:.2f}x "
        f"({r['fp8_step_ms']:.0f} vs {r['fp32_step_ms']:.0f} ms)"
        for name, r in run["families"].items()
    )
    worst = max(r["ratio_fp8_vs_fp32"] for r in run["families"].values())
    target = next(iter(run["families"].values()))["target"]
    return [
        f"| `unitscale train` step, FP8 (`simulate_fp8`, {model['fp8_recipe']} recipe) vs "
        f"FP32, both compiled, GPT width {model['hidden_size']} depth {model['depth']}, batch "
        f"{model['batch_size']} x {model['seq_len']} (`bench_train_step.py`, interleaved, "
        f"median of per-round ratios; step times are medians) "
        f"| {cells} | {_met(worst, target)} | {_when(run, path)} |"
    ]


def analyse_rows() -> list[str]:
    path = paths.RESULTS / "analyse.json"
    if not path.exists():
        return []
    run = latest_run(path)
    cold, warm = run["seconds"]["cold"], run["seconds"]["warm"]
    target = run["target_cold_s"]
    return [
        f"| `unitscale analyse` on defaults, new process each time, cold = fresh HOME, "
        f"matplotlib, Inductor and unitscale caches (`bench_analyse.py`, alternating, medians "
        f"of {run['rounds']}) | cold {_seconds(cold)}, warm {_seconds(warm)} "
        f"| <= {target:g} s cold ({'met' if cold <= target else 'not met'}) "
        f"| {_when(run, path)} |"
    ]


_COMPILE_LENGTHS_MODELS = {
    "gpt2": "`compile(unit_scale(gpt2))`",
    "bert-eager": "`compile(unit_scale(bert))`, eager attention (softmax),",
}


def compile_lengths_rows() -> list[str]:
    """Graphs compiled over changing lengths (``bench_compile_lengths.py``), if measured: the
    newest CPU run of each model (runs that do not name one are GPT-2's)."""
    path = paths.RESULTS / "compile_lengths.json"
    newest: dict[str, dict[str, Any]] = {}
    for run in read_runs(path):
        if run.get("device", "cpu") == "cpu":
            newest[run.get("model_name", "gpt2")] = run
    rows = []
    for name, run in newest.items():  # in the order the models were first measured
        ours, theirs = run["unitscale_compile_unit_scale"], run["torch_compile"]
        lengths = ", ".join(str(n) for n in run["lengths"])
        verdict = "met" if run["meets_target"] else "not met"
        label = _COMPILE_LENGTHS_MODELS.get(name, f"`compile(unit_scale({name}))`")
        rows.append(
            f"| {label} vs `torch.compile(model)`, lengths {lengths}, "
            f"forward + backward (`bench_compile_lengths.py`) "
            f"| {ours['graphs']} graphs vs {theirs['graphs']}; "
            f"{ours['graphs_at_lengths_seen_before']} at lengths seen before "
            f"| no more graphs, none for a seen length ({verdict}) | {_when(run, path)} |"
        )
    return rows


def performance_table() -> str:
    lines = ["| what | measured | target | run |", "|---|---|---|---|"]
    lines += ops_rows() + formats_rows() + train_step_rows() + tracking_rows()
    lines += tracking_zoo_rows()
    lines += compile_lengths_rows()
    lines += analyse_rows()
    lines += optim_rows() + distributed_rows()
    # Where a GPU was lent: the same benchmarks' newest CUDA runs (benchmarks/device_check.sh).
    lines += formats_rows("cuda") + tracking_rows("cuda") + tracking_zoo_rows("cuda")
    return "\n".join(lines)
