"""Step time, peak memory and converted FLOP share of real FP8 training, variant by variant.

The built-in plain GPT (``unitscale.models.plain_gpt``) at about 125M parameters (width 768,
depth 12, 12 heads, vocabulary 32000) and sequence 2048 is trained with AdamW in bfloat16,
each variant compiled, on the same batches. The variants, in the order they run (the most
telling first, so that a run cut short by the time budget still answers the question):

- ``bf16-plain``: the plain model, ``torch.compile``;
- ``to_fp8-none-unit_scale``: ``compile(to_fp8(unit_scale(model)))``: float8 GEMMs with
  scale 1, no amax anywhere;
- ``torchao-tensorwise-plain`` / ``to_fp8-tensorwise-plain``: torchao's default recipe and
  ``to_fp8(scaling="tensorwise")``, both on the plain model (the cost of amax scaling,
  without unit scaling's extra ops mixed in);
- ``torchao-rowwise-plain`` / ``to_fp8-rowwise-plain``: the rowwise recipe, both ways;
- ``bf16-unit_scale``: ``compile(unit_scale(model))`` (what unit scaling alone costs);
- ``to_fp8-none-umup_decoder``: ``compile(to_fp8(TransformerDecoder(...)))``, the built-in
  u-muP decoder at the same width and depth.

A step is forward, backward, ``optimiser.step()`` and ``zero_grad``, ending with the loss
read back. After ``--warmup`` steps (compilation), ``--steps`` steps are timed; tokens/s is
their tokens over their wall time, peak memory ``torch.cuda.max_memory_allocated`` over them.
For ``to_fp8`` variants the converted FLOP share (``fp8_summary``) is recorded, for torchao's
the share of ``nn.Linear`` modules it swapped, so that a silent fallback is not timed as FP8.
Each variant is appended to the JSON history (``--output``) as soon as it is measured; where
torchao does not import its variants are recorded as ``"absent"``; a variant that fails
records its error and the others still run; once ``--budget-s`` seconds have passed the
remaining variants are recorded as skipped.

``--device cpu`` runs a tiny model (width 64, sequence 64) eagerly as a dry run of this
script: CPU figures say nothing about FP8 speed (``_scaled_mm`` is slower than an FP32
matmul there).

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

from unitscale import TransformerDecoder
from unitscale.errors import UnitScaleError
from unitscale.models import GPTConfig, plain_gpt
from unitscale.transforms import compile as compile_module
from unitscale.transforms import fp8_summary, to_fp8, unit_scale

RESULTS = Path(__file__).parent / "results" / "fp8_step.json"
FULL = GPTConfig(vocab_size=32000, hidden_size=768, depth=12, heads=12, seq_len=2048)
TINY = GPTConfig(vocab_size=256, hidden_size=64, depth=2, heads=4, seq_len=64)


def _torchao(recipe: str) -> Callable[[nn.Module], nn.Module]:
    def convert(model: nn.Module) -> nn.Module:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        return convert_to_float8_training(model, config=config)

    return convert


def variants(config: GPTConfig, compiled: bool) -> dict[str, Callable[[], nn.Module]]:
    """Builders of the variants, in the order they run (same seed, same weights)."""

    def base() -> nn.Module:
        return plain_gpt(config, seed=0)

    def decoder() -> nn.Module:
        torch.manual_seed(0)
        heads, width = config.heads, config.hidden_size
        return TransformerDecoder(width, config.depth, heads, config.vocab_size)

    def ours(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        return lambda: compile_module(build()) if compiled else build()

    def theirs(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        return lambda: torch.compile(build()) if compiled else build()  # type: ignore[return-value]

    return {
        "bf16-plain": theirs(base),
        "to_fp8-none-unit_scale": ours(lambda: to_fp8(unit_scale(base()))),
        "torchao-tensorwise-plain": theirs(lambda: _torchao("tensorwise")(base())),
        "to_fp8-tensorwise-plain": ours(lambda: to_fp8(base(), scaling="tensorwise")),
        "torchao-rowwise-plain": theirs(lambda: _torchao("rowwise")(base())),
        "to_fp8-rowwise-plain": ours(lambda: to_fp8(base(), scaling="rowwise")),
        "bf16-unit_scale": ours(lambda: unit_scale(base())),
        "to_fp8-none-umup_decoder": ours(lambda: to_fp8(decoder())),
    }


def converted(model: nn.Module) -> dict[str, Any]:
    """What of ``model`` runs in FP8: to_fp8's converted FLOP share, or the share of
    ``nn.Linear`` modules torchao swapped for its ``Float8Linear``."""
    try:
        summary = fp8_summary(model, "to_fp8")
        return {"converted_flop_share": summary.converted_flop_share}
    except UnitScaleError:
        pass
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    swapped = [m for m in linears if type(m).__name__ == "Float8Linear"]
    return {"float8_linear_share": round(len(swapped) / max(len(linears), 1), 3)}


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
    result.update(converted(model))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=None, help="8 on cuda, 2 on cpu")
    parser.add_argument("--steps", type=int, default=None, help="10 on cuda, 1 on cpu")
    parser.add_argument("--warmup", type=int, default=None, help="3 on cuda, 1 on cpu")
    parser.add_argument("--no-compile", action="store_true", help="(default on cpu)")
    parser.add_argument("--only", default=None, help="comma-separated variants to run")
    parser.add_argument("--budget-s", type=float, default=255.0)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    config = FULL if cuda else TINY
    batch = args.batch or (8 if cuda else 2)
    steps = args.steps or (10 if cuda else 1)
    warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    compiled = cuda and not args.no_compile
    generator = torch.Generator().manual_seed(0)
    shape = (batch, config.seq_len + 1)
    batches = [
        torch.randint(0, config.vocab_size, shape, generator=generator).to(device)
        for _ in range(warmup + steps)
    ]
    try:
        import torchao.float8  # noqa: F401
    except Exception as error:  # absent, or built for another torch
        torchao_error: str | None = f"absent: {type(error).__name__}: {error}"[:300]
    else:
        torchao_error = None
    common = {
        **machine_state(),
        "device": args.device,
        "torch": torch.__version__,
        "compiled": compiled,
        "model": {
            "family": "plain (bf16 parameters)",
            "hidden_size": config.hidden_size,
            "depth": config.depth,
            "heads": config.heads,
            "vocab_size": config.vocab_size,
            "seq_len": config.seq_len,
            "batch_size": batch,
        },
        "steps": steps,
    }
    builders = variants(config, compiled)
    chosen = args.only.split(",") if args.only else list(builders)
    for name in chosen:
        if name.startswith("torchao") and torchao_error is not None:
            result: dict[str, Any] = {"status": torchao_error}
        elif time.perf_counter() - started > args.budget_s:
            result = {"status": f"skipped: over the {args.budget_s:.0f} s budget"}
        else:
            try:
                result = run(builders[name], copy.copy(batches), device, warmup)
            except Exception as error:  # reported per variant: the others still run
                result = {"error": f"{type(error).__name__}: {error}"[:1000]}
        print(name, result, flush=True)
        append_run(args.output, {**common, "variant": name, "result": result})
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
