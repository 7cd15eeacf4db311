"""Cost of scale tracking over 35 tiny ``transformers`` architectures.

Each architecture is built from its ``transformers`` config with random weights (nothing is
downloaded) at 2 layers, hidden 64, 4 attention heads (2 key-value heads where the family has
grouped queries), intermediate 128, vocabulary 1000, with the head users train: causal LM for
decoders, masked LM for encoders, conditional generation for encoder-decoders. The batch is
2 x 16 tokens with an all-ones attention mask and the tokens as labels.

Decoders (``AutoModelForCausalLM``): llama, mistral, mixtral (4 experts, top 2), qwen2,
qwen3, gemma, gemma2, phi, phi3, gpt2, gpt_neo, gptj, gpt_neox, opt, bloom, falcon, mpt,
stablelm, starcoder2, olmo, cohere, codegen, granite, gpt_bigcode. Encoders
(``AutoModelForMaskedLM``): bert, roberta, distilbert, albert, electra, deberta, deberta-v2,
xlm-roberta. Encoder-decoders (``AutoModelForSeq2SeqLM``): t5, bart, pegasus.

Per architecture, ``bench_tracking.paired_steps`` measures the untracked model and its tracked
copy alternately (a step: forward, backward, ``scales_graph()`` held until the next step and
every node's forward and backward statistics read), the median of the per-round paired
ratios after a warm-up step, the ratio without the read, and the number of graphs and graph
breaks TorchDynamo made for the tracked model (its counters over the tracked model's first
call). An architecture that fails to build, capture or track is recorded with its error.
Summary: the median, minimum and maximum ratio and the worst five; the target is a median of
at most 2x and none over 4x.

Each run is appended to ``benchmarks/results/tracking_zoo.json`` with the date and load.

On a machine busy with other work, ``--threads 1`` keeps PyTorch's thread pool from
waiting on cores that other processes hold (a 2-thread step of these tiny models then takes
up to a second, whatever is tracked); the run records its thread count.

Run: ``python benchmarks/bench_tracking_zoo.py [--archs llama,bert] [--rounds N]
[--threads N] [--device cuda]``
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from _history import append_run, machine_state
from bench_tracking import paired_steps

RESULTS = Path(__file__).parent / "results" / "tracking_zoo.json"
TARGET_MEDIAN, TARGET_MAX = 2.0, 4.0
BATCH, SEQ, VOCAB = 2, 16, 1000

# Shared sizes; configs map these names onto their own (e.g. GPT-2's n_embd) through their
# attribute maps; the per-family entries below name what a family calls differently.
_COMMON = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "max_position_embeddings": 128,
}
_GQA = {"num_key_value_heads": 2}
DECODERS: dict[str, dict[str, Any]] = {
    "llama": _GQA,
    "mistral": _GQA,
    "mixtral": {**_GQA, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2": _GQA,
    "qwen3": {**_GQA, "head_dim": 16},
    "gemma": {**_GQA, "head_dim": 16},
    "gemma2": {**_GQA, "head_dim": 16},
    "phi": {},
    "phi3": {**_GQA, "pad_token_id": 0},
    "gpt2": {"n_inner": 128, "n_positions": 128},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 16},
    "gptj": {"n_inner": 128, "n_positions": 128, "rotary_dim": 8},
    "gpt_neox": {},
    "opt": {"ffn_dim": 128, "word_embed_proj_dim": 64},
    "bloom": {"n_head": 4},
    "falcon": {"new_decoder_architecture": False, "multi_query": True},
    "mpt": {"d_model": 64, "n_heads": 4, "n_layers": 2, "expansion_ratio": 2, "max_seq_len": 128},
    "stablelm": _GQA,
    "starcoder2": _GQA,
    "olmo": {},
    "cohere": _GQA,
    "codegen": {"n_inner": 128, "n_positions": 128, "n_ctx": 128, "rotary_dim": 8},
    "granite": _GQA,
    "gpt_bigcode": {"n_inner": 128, "n_positions": 128},
}
ENCODERS: dict[str, dict[str, Any]] = {
    "bert": {},
    "roberta": {"max_position_embeddings": 130},
    "distilbert": {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 128},
    "albert": {"embedding_size": 32},
    "electra": {"embedding_size": 64},
    "deberta": {},
    "deberta-v2": {},
    "xlm-roberta": {"max_position_embeddings": 130},
}
ENCODER_DECODERS: dict[str, dict[str, Any]] = {
    "t5": {
        "d_model": 64,
        "d_kv": 16,
        "d_ff": 128,
        "num_layers": 2,
        "num_heads": 4,
        "decoder_start_token_id": 0,
    },
    "bart": {
        "d_model": 64,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
    },
    "pegasus": {
        "d_model": 64,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
    },
}
ARCHS = [*DECODERS, *ENCODERS, *ENCODER_DECODERS]


def build(arch: str) -> torch.nn.Module:
    """The tiny model of ``arch`` with its training head, random weights, train mode."""
    import transformers

    if arch in DECODERS:
        auto, extra = transformers.AutoModelForCausalLM, DECODERS[arch]
    elif arch in ENCODERS:
        auto, extra = transformers.AutoModelForMaskedLM, ENCODERS[arch]
    else:
        auto, extra = transformers.AutoModelForSeq2SeqLM, ENCODER_DECODERS[arch]
    config = transformers.AutoConfig.for_model(arch, **{**_COMMON, **extra})
    config.use_cache = False
    return auto.from_config(config).train()


def run_arch(arch: str, rounds: int, device: str = "cpu") -> dict[str, Any]:
    """One architecture's paired steps, Dynamo's graph count, or the error it raised."""
    from torch._dynamo.utils import counters

    from unitscale.transforms import track_scales

    torch.manual_seed(0)
    try:
        plain = build(arch)
    except Exception as error:  # a family this transformers cannot build
        return {"error": f"build: {type(error).__name__}: {error}"}
    plain = plain.to(device)
    tracked = track_scales(copy.deepcopy(plain))
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), device=device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    graphs_before = counters["stats"]["unique_graphs"]
    breaks_before = sum(counters["graph_break"].values())
    start = time.perf_counter()
    try:
        result = paired_steps(plain, tracked, inputs, rounds, device)
    except Exception as error:  # recorded: a model that tracking cannot run
        traceback.print_exc()
        return {"error": f"track: {type(error).__name__}: {error}"[:500]}
    nodes = list(tracked.scales_graph().nodes)  # type: ignore[operator]
    return {
        "parameters": sum(p.numel() for p in plain.parameters()),
        **result,
        "dynamo_graphs": counters["stats"]["unique_graphs"] - graphs_before,
        "dynamo_graph_breaks": sum(counters["graph_break"].values()) - breaks_before,
        "tracked_nodes": len(nodes),
        "seconds": round(time.perf_counter() - start, 2),
    }


def summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Median, minimum, maximum and worst five of the architectures' ratios; failures."""
    ratios = {arch: r["time_ratio"] for arch, r in results.items() if "time_ratio" in r}
    if not ratios:
        return {"failed": sorted(results)}
    worst = sorted(ratios, key=ratios.__getitem__, reverse=True)[:5]
    median = statistics.median(ratios.values())
    return {
        "architectures": len(ratios),
        "median_time_ratio": round(median, 4),
        "min_time_ratio": round(min(ratios.values()), 4),
        "max_time_ratio": round(max(ratios.values()), 4),
        "worst_5": {arch: ratios[arch] for arch in worst},
        "median_time_ratio_without_read": round(
            statistics.median(results[a]["time_ratio_without_read"] for a in ratios), 4
        ),
        "median_cpu_time_ratio": round(
            statistics.median(results[a]["cpu_time_ratio"] for a in ratios), 4
        ),
        "max_cpu_time_ratio": round(max(results[a]["cpu_time_ratio"] for a in ratios), 4),
        "target_median": TARGET_MEDIAN,
        "target_max": TARGET_MAX,
        "met": median <= TARGET_MEDIAN and max(ratios.values()) <= TARGET_MAX,
        "failed": sorted(set(results) - set(ratios)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's own)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    archs = args.archs.split(",")
    unknown = sorted(set(archs) - set(ARCHS))
    if unknown:
        parser.error(f"unknown architectures {unknown}; choose from {','.join(ARCHS)}")
    import transformers

    transformers.logging.set_verbosity_error()
    run: dict[str, Any] = {
        **machine_state(),
        "transformers": transformers.__version__,
        "device": args.device,
        "rounds": args.rounds,
        "batch_seq": [BATCH, SEQ],
        "statistic": "median over rounds of tracked/untracked step time, interleaved",
        "architectures": {},
    }
    for arch in archs:
        run["architectures"][arch] = result = run_arch(arch, args.rounds, args.device)
        keys = ("time_ratio", "time_ratio_without_read", "cpu_time_ratio", "error")
        brief = {k: result.get(k) for k in keys}
        print(arch, brief, f"graphs {result.get('dynamo_graphs')}", flush=True)
    run["summary"] = summary(run["architectures"])
    print("summary", run["summary"], flush=True)
    append_run(args.out, run)


if __name__ == "__main__":
    main()
