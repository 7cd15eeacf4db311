"""Residual shares at initialisation: what the rule weights, and what the stream holds.

u-μP's residual rule (:func:`unitscale.functional.transformer_residual_scaling_rule`) weights
the embedding, the attention branches and the MLP branches a third each in the final
residual stream (default mults). Those are weights, exact for independent unit branch
outputs. This script measures, for the built-in :class:`unitscale.TransformerDecoder` at
initialisation, the share of the final stream's second moment each part holds.

Method. The decoder's final stream (before the final norm) is, with ``share_k`` the
``k``-th residual add's variance share and ``f_k`` the branch's output,
``x = c_e e + Σ_k c_k f_k``, ``c_k = sqrt(share_k) Π_{j>k} sqrt(1 - share_j)`` and
``c_e = Π_j sqrt(1 - share_j)``. The script runs each layer's branches by hand on one batch
of the bundled text (bytes, vocabulary 256), sums each part (embedding, all attention
branches, all MLP branches) and reports ``mean(part²) / mean(x²)``, over every element
(batch, position, feature): the *measured* share, beside the *weight* ``Σ c_k²``. The
measured shares need not sum to 1: the parts are correlated (their cross terms are the
remainder). Width 128, 4 heads, batch 8; depths 2, 4, 8; sequence lengths 32 to 256;
``rope=True`` (the default) and ``rope=False`` (``unitscale transfer``'s model); 3 seeds;
and, for ``rope=False``, uniformly random token ids instead of text. Why attention holds
more: its output at a position averages the values of the positions before it, and the
unit-scaled attention rescales that average as if the values were independent; the text's
bytes repeat (a few dozen distinct tokens), so the values are correlated across positions,
the average shrinks less than assumed and the attention branch's output has rms above 1,
growing with the sequence (1.1 at 32 tokens, 2.0 at 256, width 128, 2 layers, seed 0;
1.1 at both with random ids).

Run: ``python benchmarks/residual_shares.py`` (about a minute on one CPU core); writes
``benchmarks/results/residual_shares.json``.
"""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any

import torch

import unitscale as us
from unitscale.data import example_batch

RESULTS = Path(__file__).parent / "results"
WIDTH, HEADS, BATCH = 128, 4, 8
DEPTHS = [2, 4, 8]
SEQS = [32, 64, 128, 256]
SEEDS = [0, 1, 2]


def parts_of_the_stream(
    model: us.TransformerDecoder, ids: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """The final stream and its embedding, attention and MLP parts (see the module
    docstring), and each part's weight ``Σ c_k²``."""
    x = model.embedding(ids)
    parts = {"embedding": x.clone(), "attention": torch.zeros_like(x), "mlp": torch.zeros_like(x)}
    weights = {"embedding": 1.0, "attention": 0.0, "mlp": 0.0}
    for layer in model.layers:
        for kind, norm, branch, share in (
            ("attention", layer.attn_norm, layer.attn, layer.attn_share),
            ("mlp", layer.mlp_norm, layer.mlp, layer.mlp_share),
        ):
            out = branch(norm(x))
            x = math.sqrt(share) * out + math.sqrt(1.0 - share) * x
            for name in parts:
                parts[name] = parts[name] * math.sqrt(1.0 - share)
                weights[name] *= 1.0 - share
            parts[kind] = parts[kind] + math.sqrt(share) * out
            weights[kind] += share
    return x, parts, weights


def measure(depth: int, seq: int, rope: bool, seed: int, data: str = "text") -> dict[str, Any]:
    torch.manual_seed(seed)
    model = us.TransformerDecoder(WIDTH, depth=depth, heads=HEADS, vocab_size=256, rope=rope)
    if data == "text":
        ids = example_batch(BATCH, seq, seed=seed).input_ids
    else:  # independent uniform tokens: no token repeats more than chance
        ids = torch.randint(0, 256, (BATCH, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        x, parts, weights = parts_of_the_stream(model, ids)
        # the by-hand stream is the model's own: its logits match the forward
        logits = model.readout(model.final_norm(x))
        assert torch.allclose(logits, model(ids), atol=1e-5)
    total = x.square().mean().item()
    measured = {name: part.square().mean().item() / total for name, part in parts.items()}
    return {
        "depth": depth,
        "seq": seq,
        "rope": rope,
        "data": data,
        "seed": seed,
        "weight": {k: round(v, 4) for k, v in weights.items()},
        "measured": {k: round(v, 4) for k, v in measured.items()},
        "cross_terms": round(1.0 - sum(measured.values()), 4),
    }


def summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for rope, data in ((True, "text"), (False, "text"), (False, "random")):
        rows = [r for r in records if r["rope"] is rope and r["data"] == data]
        out[f"rope={rope}, {data}"] = {
            name: [
                min(r["measured"][name] for r in rows),
                max(r["measured"][name] for r in rows),
            ]
            for name in ("embedding", "attention", "mlp")
        }
    return out


def main() -> None:
    torch.set_num_threads(1)
    records = [
        measure(depth, seq, rope, seed, data)
        for rope, data in ((True, "text"), (False, "text"), (False, "random"))
        for depth in DEPTHS
        for seq in SEQS
        for seed in SEEDS
    ]
    report = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "model": f"TransformerDecoder({WIDTH}, heads={HEADS}, vocab_size=256), init",
        "batch": BATCH,
        "method": __doc__.split("Method. ")[1].split("\n\nRun:")[0].replace("\n", " "),
        "measured_share_min_max": summary(records),
        "records": records,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "residual_shares.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["measured_share_min_max"], indent=1))


if __name__ == "__main__":
    main()
