"""Compiled graphs for changing lengths: ``compile(unit_scale(model))`` vs ``torch.compile``.

A 1-layer ``transformers`` model (width 32, random weights, no dropout; ``--model gpt2``, the
default, attends with ``F.scaled_dot_product_attention``; ``--model bert-eager`` is BERT with
``attn_implementation="eager"``, whose attention is written out with a softmax) runs forward
and backward on batches of 2 sequences whose length changes every step (16, 32, 24, 64, 16,
48 by default). For ``torch.compile(model)`` the graphs are counted with Dynamo's compile
counter; for unitscale's chain, the graphs its compile pass hands to Inductor (one per
captured piece). Reported per variant: the graphs compiled after each step, the time of each
step (compilation included) and the graphs compiled at lengths seen before. Targets: no more
graphs than ``torch.compile(model)``, none at a length seen before.

Each run is appended to ``benchmarks/results/compile_lengths.json`` with the date, the load
and the model (``model_name``: ``gpt2`` or ``bert-eager``; runs without it are GPT-2's).

Run: ``python benchmarks/bench_compile_lengths.py [--model gpt2|bert-eager]
[--lengths 16,32,24,64,16,48] [--device cpu|cuda]``
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _history import append_run, machine_state

RESULTS = Path(__file__).parent / "results" / "compile_lengths.json"


MODELS = {
    "gpt2": "GPT-2, 1 layer, width 32, batch 2, forward + backward",
    "bert-eager": "BERT (eager attention: softmax), 1 layer, width 32, batch 2, forward + backward",
}


def build(model: str, device: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if model == "bert-eager":
        bert = transformers.BertConfig(
            num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
            vocab_size=128, max_position_embeddings=256, attn_implementation="eager",
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        return transformers.BertForMaskedLM(bert).to(device)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=128, n_positions=256,
        bos_token_id=0, eos_token_id=0, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).to(device)


def steps(
    model: Callable[..., Any], graphs: Callable[[], int], lengths: list[int], device: str
) -> dict[str, Any]:
    """Forward and backward at each length: graphs compiled so far and seconds per step."""
    counts, seconds = [], []
    for length in lengths:
        ids = torch.randint(0, 128, (2, length), device=device)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        seconds.append(round(time.perf_counter() - start, 3))
        counts.append(graphs())
    seen_again = [
        counts[i] - counts[i - 1] for i in range(1, len(lengths)) if lengths[i] in lengths[:i]
    ]
    return {
        "graphs_after_each_step": counts,
        "graphs": counts[-1],
        "graphs_at_lengths_seen_before": sum(seen_again),
        "step_s": seconds,
    }


def main() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    from unitscale.transforms import compile, unit_scale
    from unitscale.transforms._compile import CompilePass

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--lengths", default="16,32,24,64,16,48")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    state = machine_state()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    reference = torch.compile(build(args.model, args.device), backend=counter)
    theirs = steps(reference, lambda: counter.frame_count, lengths, args.device)
    print("torch.compile(model)", theirs, flush=True)

    torch._dynamo.reset()
    compiled = [0]
    compile_graph = CompilePass.compile_graph

    def counting(self: CompilePass, *rest: Any) -> Any:
        compiled[0] += 1
        return compile_graph(self, *rest)

    CompilePass.compile_graph = counting  # type: ignore[method-assign]
    try:
        fast = compile(unit_scale(build(args.model, args.device)))
        ours = steps(fast, lambda: compiled[0], lengths, args.device)
    finally:
        CompilePass.compile_graph = compile_graph  # type: ignore[method-assign]
    print("compile(unit_scale(model))", ours, flush=True)

    append_run(
        args.output,
        {
            **state,
            "device": args.device,
            "model_name": args.model,
            "model": MODELS[args.model],
            "lengths": lengths,
            "torch_compile": theirs,
            "unitscale_compile_unit_scale": ours,
            "target": "graphs <= torch.compile's; none at a length seen before",
            "meets_target": ours["graphs"] <= theirs["graphs"]
            and ours["graphs_at_lengths_seen_before"] == 0,
        },
    )


if __name__ == "__main__":
    main()
