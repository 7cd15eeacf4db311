"""Cost of scale tracking: step time and peak memory of a tracked model vs the untracked one.

One process per model: the untracked model and its tracked copy (``track_scales``) run
alternately on the same batch, one step of each per round, so that other work on the machine
slows both alike; the reported time ratio is the median of the per-round ratios. A tracked step
is what a user does: forward, backward, ``graph = tracked.scales_graph()`` kept until the next
step's (a user's loop holds the last graph, so it cannot be refilled in place), and every
node's forward and backward statistics read. The reading (``scales_graph()`` and the reads) is
timed on its own too: ``read_s`` and ``read_share_of_untracked_step``, and
``time_ratio_without_read`` (forward and backward only), and ``cpu_time_ratio`` (the same
ratio of the process's CPU time: on a shared machine, what the steps compute without the
waits for a core, a figure for one torch thread). Also reported: each one's first
call (Dynamo capture and any compile included), and each step's own peak memory: on CPU
the peak resident set size of the step above the resident size just before it (the kernel's
high-water mark is reset before each step and freed heap memory returned to the system, so
earlier steps and model building do not count); on CUDA
``max_memory_allocated`` above the allocation before the step.

Models are built from ``transformers`` configs with random weights (no download):

- ``bert4``: 4-layer BERT, hidden 256, vocab 2000, batch 16 x 128 (masked LM);
- ``bert2``: 2-layer BERT, hidden 128, vocab 2000, batch 4 x 64;
- ``tiny``: 2-layer BERT, hidden 64, vocab 2000, batch 2 x 16;
- ``gpt2``: 4-layer GPT-2, hidden 256, vocab 50257, batch 16 x 128 (causal LM).

Also reported (``first_call_fresh_process``): the first step of a new process on ``bert2``,
untracked, tracked and under ``torch.compile(backend="eager")`` (TorchDynamo's capture
alone, the ``torch.compile`` call timed with the step, as tracking sets TorchDynamo up in its
first call), three processes each, alternating; imports and model building are not timed.
It is what a user starting a run waits for: TorchDynamo's one-time start-up counts.

Also reported (``statistics_vs_read``): the cost of one tensor's statistics against one read
of it (``x.abs().sum()``), interleaved, for float32 tensors of 2**11 to 2**22 elements, on
each CPU path: the native kernel (the default; the target is 3x) and the PyTorch kernel run
eagerly (``UNITSCALE_STATS=eager``, what runs without a C compiler).

Also reported (``variable_lengths``): ``bert2`` on batches whose sequence length changes every
step (16 to 128 in steps of 8, shuffled), tracked and untracked alternating, two passes over
the lengths: the number of graphs TorchDynamo captured for the tracked model (the target is no
new capture per length after the second length: one static, one with a dynamic length), the
median step-time ratio of the second pass, and the resident set size after each pass (bounded
memory: the second pass, seeing no new length, should not grow it).

Each run is appended to ``benchmarks/results/tracking.json`` with the date and load.

Run: ``python benchmarks/bench_tracking.py [--models bert4,bert2,tiny,gpt2] [--rounds N]
[--device cpu|cuda] [--no-variable-lengths]``
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _history import append_run, machine_state

RESULTS = Path(__file__).parent / "results" / "tracking.json"
SIZES = {  # layers, hidden, vocab, batch, sequence length
    "bert4": (4, 256, 2000, 16, 128),
    "bert2": (2, 128, 2000, 4, 64),
    "tiny": (2, 64, 2000, 2, 16),
    "gpt2": (4, 256, 50257, 16, 128),
}
TARGETS = {"bert4": 1.15, "bert2": 1.5, "tiny": 3.0}


def build(name: str) -> torch.nn.Module:
    import transformers

    layers, hidden, vocab, _, _ = SIZES[name]
    if name == "gpt2":
        gpt = transformers.GPT2Config(
            n_layer=layers, n_embd=hidden, n_head=4, vocab_size=vocab, n_positions=512
        )
        gpt.use_cache = False
        return transformers.GPT2LMHeadModel(gpt)
    bert = transformers.BertConfig(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        intermediate_size=4 * hidden,
        vocab_size=vocab,
        max_position_embeddings=512,
    )
    return transformers.BertForMaskedLM(bert)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * ctypes.CDLL(None).getpagesize()


def _high_water_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_high_water() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back, so RSS is what is live
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def measured_step(step: Callable[[], None], device: str) -> tuple[float, int]:
    """Seconds and peak bytes (above the start) of one call of ``step``."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        _reset_high_water()
        base = _rss_bytes()
    start = time.perf_counter()
    step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = _high_water_bytes() - base
    return seconds, peak


def run_model(name: str, rounds: int, device: str) -> dict[str, Any]:
    from unitscale.transforms import track_scales

    torch.manual_seed(0)
    plain = build(name).to(device).train()
    tracked = track_scales(copy.deepcopy(plain))
    _, _, vocab, batch, seq = SIZES[name]
    ids = torch.randint(0, min(vocab, 1000), (batch, seq), device=device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    return {
        "layers_hidden_vocab_batch_seq": list(SIZES[name]),
        **paired_steps(plain, tracked, inputs, rounds, device),
        "target": TARGETS.get(name),
    }


def paired_steps(
    plain: torch.nn.Module,
    tracked: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    rounds: int,
    device: str,
) -> dict[str, Any]:
    """Untracked and tracked steps of ``plain`` and its tracked copy on ``inputs`` (whose
    model output has a ``.loss``), alternating for ``rounds`` rounds after the first call and
    one warm-up step each: the step times, their median per-round ratio, the reading's share
    and the ratio without it, the first calls and each step's peak memory."""

    def plain_step() -> None:
        plain.zero_grad(set_to_none=True)
        plain(**inputs).loss.backward()

    held: list[Any] = [None]  # the user's last graph, held until the next step's
    read_times: list[float] = []

    def tracked_step() -> None:
        tracked.zero_grad(set_to_none=True)
        tracked(**inputs).loss.backward()
        start = time.perf_counter()
        held[0] = tracked.scales_graph()  # type: ignore[operator]
        read_statistics(held[0])
        read_times.append(time.perf_counter() - start)

    first = {
        "untracked": measured_step(plain_step, device)[0],
        "tracked": measured_step(tracked_step, device)[0],
    }
    plain_step(), tracked_step()  # warm: allocator caches, any second-call work
    read_times.clear()
    times: dict[str, list[float]] = {"untracked": [], "tracked": []}
    cpu: dict[str, list[float]] = {"untracked": [], "tracked": []}
    peaks: dict[str, list[int]] = {"untracked": [], "tracked": []}
    for _ in range(rounds):
        for key, step in (("untracked", plain_step), ("tracked", tracked_step)):
            cpu_start = time.process_time()
            seconds, peak = measured_step(step, device)
            cpu[key].append(time.process_time() - cpu_start)
            times[key].append(seconds)
            peaks[key].append(peak)
    pairs = list(zip(times["tracked"], times["untracked"], read_times, strict=True))
    ratios = [t / u for t, u, _ in pairs]
    cpu_ratios = [t / max(u, 1e-9) for t, u in zip(cpu["tracked"], cpu["untracked"], strict=True)]
    peak = {key: statistics.median(values) for key, values in peaks.items()}
    return {
        "step": "forward, backward, scales_graph() held, every node's statistics read",
        "step_s": {key: round(statistics.median(v), 5) for key, v in times.items()},
        "time_ratio": round(statistics.median(ratios), 4),
        "time_ratio_range": [round(min(ratios), 4), round(max(ratios), 4)],
        "read_s": round(statistics.median(read_times), 5),
        "read_share_of_untracked_step": round(statistics.median(r / u for _, u, r in pairs), 4),
        "time_ratio_without_read": round(statistics.median((t - r) / u for t, u, r in pairs), 4),
        # The process's CPU time instead of wall time: on a machine shared with other work
        # (and one torch thread) what the step computes, without the waits for a core.
        "cpu_time_ratio": round(statistics.median(cpu_ratios), 4),
        "first_call_s": {key: round(v, 3) for key, v in first.items()},
        "step_peak_bytes": {key: int(v) for key, v in peak.items()},
        "peak_memory_ratio": round(peak["tracked"] / max(peak["untracked"], 1), 4),
    }


def read_statistics(graph: Any) -> float:
    """What a user reads of a scales graph: every node's forward and backward statistics."""
    total = 0.0
    for node in graph.nodes:
        metrics = node.meta.get("metrics")
        if metrics is None:
            continue
        for data in (metrics.fwd, metrics.bwd):
            if data is not None:
                total += data.std + data.abs_max
    return total


def variable_lengths(name: str, device: str) -> dict[str, Any]:
    """Tracked vs untracked steps on a batch whose length changes every step (see above)."""
    import random

    from torch._dynamo.utils import counters

    from unitscale.transforms import track_scales

    torch.manual_seed(0)
    plain = build(name).to(device).train()
    tracked = track_scales(copy.deepcopy(plain))
    _, _, vocab, batch, _ = SIZES[name]
    lengths = list(range(16, 129, 8))
    random.Random(0).shuffle(lengths)
    batches = {}
    for length in lengths:
        ids = torch.randint(0, min(vocab, 1000), (batch, length), device=device)
        batches[length] = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    held: list[Any] = [None]

    def step(model: torch.nn.Module, length: int) -> None:
        model.zero_grad(set_to_none=True)
        model(**batches[length]).loss.backward()
        if model is tracked:
            held[0] = tracked.scales_graph()  # type: ignore[operator]
            read_statistics(held[0])

    captures_before = counters["stats"]["unique_graphs"]
    passes = []
    for _ in range(2):
        ratios, captures = [], []
        for length in lengths:
            untracked_s = measured_step(functools.partial(step, plain, length), device)[0]
            tracked_s = measured_step(functools.partial(step, tracked, length), device)[0]
            ratios.append(tracked_s / untracked_s)
            captures.append(counters["stats"]["unique_graphs"] - captures_before)
        _reset_high_water()
        passes.append(
            {
                "median_time_ratio": round(statistics.median(ratios), 4),
                "captured_graphs_after_each_step": captures,
                "rss_bytes_after": _rss_bytes(),
            }
        )
    first, second = passes
    return {
        "model": name,
        "lengths_in_order": lengths,
        "passes": passes,
        "captured_graphs": second["captured_graphs_after_each_step"][-1],
        "new_captures_after_second_length": (
            first["captured_graphs_after_each_step"][-1]
            - first["captured_graphs_after_each_step"][1]
            + second["captured_graphs_after_each_step"][-1]
            - first["captured_graphs_after_each_step"][-1]
        ),
        "second_pass_time_ratio": second["median_time_ratio"],
        "rss_growth_second_pass_bytes": second["rss_bytes_after"] - first["rss_bytes_after"],
    }


_FIRST_CALL = """
import sys, time, torch
sys.path.insert(0, {here!r})
from bench_tracking import build, SIZES
torch.set_num_threads({threads})
torch.manual_seed(0)
model = build({name!r}).train()
if {variant!r} == "tracked":
    from unitscale.transforms import track_scales
    model = track_scales(model)
_, _, vocab, batch, seq = SIZES[{name!r}]
ids = torch.randint(0, min(vocab, 1000), (batch, seq))
start = time.perf_counter()
if {variant!r} == "dynamo_eager":  # timed: track_scales sets TorchDynamo up at its first call
    model = torch.compile(model, backend="eager")
model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
if {variant!r} == "tracked":
    model.scales_graph()
print(time.perf_counter() - start)
"""


def first_call_fresh(name: str, rounds: int) -> dict[str, Any]:
    """The first step of a new process (imports and model building before the clock starts),
    untracked and tracked alternately in ``rounds`` pairs of processes: what a user waits
    for, TorchDynamo's one-time start-up in the process included."""
    import subprocess
    import sys

    times: dict[str, list[float]] = {"untracked": [], "tracked": [], "dynamo_eager": []}
    for _ in range(rounds):
        for key in times:
            code = _FIRST_CALL.format(
                here=str(Path(__file__).parent),
                threads=torch.get_num_threads(),
                name=name,
                variant=key,
            )
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            )
            times[key].append(float(out.stdout.strip().splitlines()[-1]))
    median = {key: statistics.median(values) for key, values in times.items()}
    return {
        "model": name,
        "rounds": rounds,
        "first_step_s": {key: round(value, 3) for key, value in median.items()},
        "extra_s": round(median["tracked"] - median["untracked"], 3),
        "target_extra_s": 1.0,
        # TorchDynamo's own share: the same first step under torch.compile(backend="eager").
        "extra_over_dynamo_s": round(median["tracked"] - median["dynamo_eager"], 3),
    }


def statistics_vs_read(rounds: int) -> dict[str, Any]:
    """Median over rounds of (statistics time / ``x.abs().sum()`` time) per size and path."""
    import os

    from unitscale.tracking import metrics

    out: dict[str, Any] = {"target": 3.0, "sizes": {}}
    # What tracking calls per tensor: the native kernel's CPython extension where it is
    # built (one call: layout, statistics, the host list); tensor_stats (the general native
    # path or the PyTorch kernel, and a tensor of the values) otherwise and for the others.
    fast = metrics.fast_stats(load=True)
    paths = [("native", "auto"), ("pytorch", "eager")]
    if fast is not None:
        paths.insert(0, ("extension", "auto"))
    for exponent in (11, 15, 19, 22):
        x = torch.randn(2**exponent)
        repeat = max(3, 2 ** (20 - exponent))
        ratios: dict[str, list[float]] = {path: [] for path, _ in paths}
        for _ in range(rounds):
            for path, mode in paths:
                os.environ["UNITSCALE_STATS"] = mode
                compute = fast.summary if path == "extension" else metrics.tensor_stats
                compute(x)  # warm
                start = time.perf_counter()
                for _ in range(repeat):
                    compute(x)
                stats = time.perf_counter() - start
                start = time.perf_counter()
                for _ in range(repeat):
                    x.abs().sum()
                read = time.perf_counter() - start
                ratios[path].append(stats / read)
        os.environ.pop("UNITSCALE_STATS", None)
        out["sizes"][str(2**exponent)] = {
            path: round(statistics.median(values), 3) for path, values in ratios.items()
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert4,bert2,tiny,gpt2")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-variable-lengths", action="store_true")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run: dict[str, Any] = {
        **machine_state(),
        "device": args.device,
        "rounds": args.rounds,
        "statistic": "median over rounds of tracked/untracked step time, interleaved",
        "models": {},
    }
    for name in args.models.split(","):
        run["models"][name] = result = run_model(name, args.rounds, args.device)
        print(name, result, flush=True)
    if not args.no_variable_lengths:
        run["variable_lengths"] = variable_lengths("bert2", args.device)
        print("variable lengths", run["variable_lengths"], flush=True)
    if args.device == "cpu":
        run["first_call_fresh_process"] = first_call_fresh("bert2", 3)
        print("first call, fresh process", run["first_call_fresh_process"], flush=True)
        run["statistics_vs_read"] = statistics_vs_read(args.rounds)
        print("statistics vs one read", run["statistics_vs_read"], flush=True)
    append_run(args.out, run)


if __name__ == "__main__":
    main()
