"""Cost of scale tracking: step time and peak memory of a tracked model vs the untracked one.

Each measurement runs in a fresh subprocess (so peak memory is that configuration's own):
a forward+backward step of a 4-layer BERT (hidden 256, batch 16, sequence 128) and a GPT-2 of
similar size, built from ``transformers`` configs with random weights. Reported: median step
time over repeats, first-call time (Dynamo capture included), and peak memory above the
process's resident size just before the first step (ru_maxrss on CPU,
``torch.cuda.max_memory_allocated`` on CUDA). Ratios tracked/untracked are written to
``benchmarks/results/tracking.json``.

Run: ``python benchmarks/bench_tracking.py [--repeats N] [--device cpu|cuda]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "tracking.json"


def build(arch: str) -> Any:
    import transformers

    if arch == "bert":
        config = transformers.BertConfig(
            num_hidden_layers=4,
            hidden_size=256,
            num_attention_heads=4,
            intermediate_size=1024,
            vocab_size=30522,
            max_position_embeddings=512,
        )
        return transformers.BertForMaskedLM(config)
    config = transformers.GPT2Config(
        n_layer=4, n_embd=256, n_head=4, vocab_size=50257, n_positions=512, use_cache=False
    )
    return transformers.GPT2LMHeadModel(config)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(arch: str, tracked: bool, repeats: int, device: str) -> dict[str, float]:
    import torch

    from unitscale.transforms import track_scales

    torch.manual_seed(0)
    model = build(arch).to(device)
    model.train()
    if tracked:
        model = track_scales(model)
    ids = torch.randint(0, 1000, (16, 128), device=device)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def step() -> None:
        out = model(**batch)
        out.loss.backward()
        if tracked:
            model.scales_graph()  # reading the metrics is part of the tracked step
        if device == "cuda":
            torch.cuda.synchronize()

    base = rss_bytes()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"step_s": statistics.median(times), "first_call_s": first, "peak_bytes": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", nargs=2, metavar=("ARCH", "TRACKED"))
    args = parser.parse_args()
    if args.child:
        arch, tracked = args.child
        print(json.dumps(child(arch, tracked == "1", args.repeats, args.device)))
        return
    import torch

    results: dict[str, Any] = {
        "torch": torch.__version__,
        "device": args.device,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "batch": 16,
        "seq_len": 128,
        "models": {},
    }
    for arch in ("bert", "gpt2"):
        runs = {}
        for tracked in ("0", "1"):
            cmd = [sys.executable, __file__, "--child", arch, tracked]
            cmd += ["--repeats", str(args.repeats), "--device", args.device]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            runs["tracked" if tracked == "1" else "untracked"] = json.loads(out.splitlines()[-1])
        plain, tracked_run = runs["untracked"], runs["tracked"]
        results["models"][arch] = {
            **runs,
            "time_ratio": tracked_run["step_s"] / plain["step_s"],
            "peak_memory_ratio": tracked_run["peak_bytes"] / max(plain["peak_bytes"], 1),
        }
        print(arch, json.dumps(results["models"][arch], indent=1), flush=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
