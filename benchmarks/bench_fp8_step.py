"""Step time and peak memory of real FP8 training: bf16, torchao tensorwise, unit-scaled to_fp8.

The built-in plain GPT (``unitscale.models.plain_gpt``) at about 125M parameters (width 768,
depth 12, 12 heads, vocabulary 32000) and sequence 2048 is trained with AdamW in bfloat16
three ways, each compiled, on the same batches:

- ``bf16``: the model as it is, ``torch.compile``;
- ``torchao-tensorwise``: ``torchao.float8.convert_to_float8_training`` (default config:
  dynamic tensorwise scales, an amax reduction per operand), ``torch.compile``;
- ``to_fp8-unit``: ``unitscale.transforms.compile(to_fp8(unit_scale(model)))``: float8
  GEMMs with scale 1, no amax anywhere.

A step is forward, backward, ``optimiser.step()`` and ``zero_grad``, ending with the loss
read back. After ``--warmup`` steps (compilation), ``--steps`` steps are timed; tokens/s is
their tokens over their wall time, peak memory ``torch.cuda.max_memory_allocated`` over them.
The goal on an H100: ``to_fp8-unit`` at least 1.1x ``torchao-tensorwise``'s tokens/s. Not
measured until a GPU run is committed (``benchmarks/device_check.sh``).

``--device cpu`` runs a tiny model (width 64, sequence 64) as a smoke test of this script:
CPU figures say nothing about FP8 speed (``_scaled_mm`` is slower than an FP32 matmul there).

Each run is appended to ``benchmarks/results/fp8_step.json`` with the date and load.

Run: ``python benchmarks/bench_fp8_step.py --device cuda [--steps 10] [--batch 8]``
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _history import append_run, machine_state
from torch import nn

from unitscale.models import GPTConfig, plain_gpt
from unitscale.transforms import compile as compile_module
from unitscale.transforms import to_fp8, unit_scale

RESULTS = Path(__file__).parent / "results" / "fp8_step.json"
FULL = GPTConfig(vocab_size=32000, hidden_size=768, depth=12, heads=12, seq_len=2048)
TINY = GPTConfig(vocab_size=256, hidden_size=64, depth=2, heads=4, seq_len=64)


def variants(config: GPTConfig, compiled: bool) -> dict[str, Callable[[], nn.Module]]:
    """Builders of the three models (same seed, same weights before any change)."""

    def base() -> nn.Module:
        return plain_gpt(config, seed=0)

    def torch_compile(model: nn.Module) -> nn.Module:
        return torch.compile(model) if compiled else model  # type: ignore[return-value]

    def torchao() -> nn.Module:
        from torchao.float8 import convert_to_float8_training

        return torch_compile(convert_to_float8_training(base()))

    def unit_fp8() -> nn.Module:
        model = to_fp8(unit_scale(base()))
        return compile_module(model) if compiled else model

    return {
        "bf16": lambda: torch_compile(base()),
        "torchao-tensorwise": torchao,
        "to_fp8-unit": unit_fp8,
    }


def run(
    build: Callable[[], nn.Module],
    batches: list[torch.Tensor],
    device: torch.device,
    warmup: int,
) -> dict[str, Any]:
    model = build().to(device=device, dtype=torch.bfloat16)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(ids: torch.Tensor) -> float:
        loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()
        optimiser.step()
        optimiser.zero_grad(set_to_none=True)
        return float(loss.detach())

    start = time.perf_counter()
    for ids in batches[:warmup]:
        step(ids)
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    timed = batches[warmup:]
    start = time.perf_counter()
    losses = [step(ids) for ids in timed]
    elapsed = time.perf_counter() - start
    tokens = sum(ids[:, :-1].numel() for ids in timed)
    result: dict[str, Any] = {
        "warmup_s": round(warmup_s, 2),
        "step_ms": round(elapsed / len(timed) * 1e3, 2),
        "tokens_per_s": round(tokens / elapsed, 1),
        "losses": [round(v, 4) for v in losses],
    }
    if device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=None, help="8 on cuda, 2 on cpu")
    parser.add_argument("--steps", type=int, default=None, help="10 on cuda, 2 on cpu")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated variants to run")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = FULL if device.type == "cuda" else TINY
    batch = args.batch or (8 if device.type == "cuda" else 2)
    steps = args.steps or (10 if device.type == "cuda" else 2)
    generator = torch.Generator().manual_seed(0)
    shape = (batch, config.seq_len + 1)
    batches = [
        torch.randint(0, config.vocab_size, shape, generator=generator).to(device)
        for _ in range(args.warmup + steps)
    ]
    state = machine_state()
    results: dict[str, Any] = {}
    builders = variants(config, compiled=not args.no_compile)
    chosen = args.only.split(",") if args.only else list(builders)
    for name in chosen:
        try:
            results[name] = run(builders[name], copy.copy(batches), device, args.warmup)
        except Exception as error:  # reported per variant: the others still run
            results[name] = {"error": f"{type(error).__name__}: {error}"[:1000]}
        print(name, results[name], flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    fp8, torchao = results.get("to_fp8-unit", {}), results.get("torchao-tensorwise", {})
    if "tokens_per_s" in fp8 and "tokens_per_s" in torchao:
        results["to_fp8_vs_torchao_tokens_per_s"] = round(
            fp8["tokens_per_s"] / torchao["tokens_per_s"], 3
        )
    append_run(
        args.output,
        {
            **state,
            "device": args.device,
            "compiled": not args.no_compile,
            "model": {
                "family": "plain (bf16 parameters)",
                "hidden_size": config.hidden_size,
                "depth": config.depth,
                "heads": config.heads,
                "vocab_size": config.vocab_size,
                "seq_len": config.seq_len,
                "batch_size": batch,
                "parameters": sum(p.numel() for p in plain_gpt(config, seed=0).parameters()),
            },
            "steps": steps,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
