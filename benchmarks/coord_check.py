"""Coordinate-check plot: u-μP vs the standard parametrisation, across width and depth.

Collects :func:`unitscale.coord_check.coord_data` for three setups, each trained a few steps
at one learning rate for every size, on one fixed batch (4 x 32 tokens, vocabulary 256):

* ``u-muP``: ``unitscale.TransformerDecoder()`` (u-μP by default) +
  ``unitscale.optim.AdamW(lr=0.3, weight_decay=0)``;
* ``unit-scaled + torch AdamW``: the unit-scaled decoder without u-μP
  (``TransformerDecoder(mup=False)``) + ``torch.optim.AdamW(lr=0.01)``;
* ``SP``: the standard parametrisation, :class:`unitscale.models.PlainGPT` (GPT-2 init) +
  ``torch.optim.AdamW(lr=0.01)``;

at widths 64..512 (depth 2), and u-μP also at depths 2..8 (width 64). Writes the records to
``benchmarks/results/coord_check.json`` and the plot (rows: setups; columns: layers; x:
step; y: rms change of the layer's output since initialisation; one curve per width, or per
depth in the last row) to ``benchmarks/results/coord_check.png``. Collection and plotting
are separate functions (``collect`` / ``plot``); ``--plot-only`` redraws from the JSON.

Run: ``python benchmarks/coord_check.py [--steps N] [--plot-only]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import Any

import torch

import unitscale as us
from unitscale.experiments.coord_check import coord_data, decoder_layers
from unitscale.models import GPTConfig, PlainGPT

RESULTS = Path(__file__).parent / "results"
VOCAB, BATCH, SEQ = 256, 4, 32
WIDTHS = [64, 128, 256, 512]
DEPTHS = [2, 4, 8]
# Column titles and, per setup, the module names of the same four coordinates.
COLUMNS = ["embedding", "first block", "last block", "logits"]


def _layers(setup: str, depth: int) -> list[str]:
    if setup == "SP":
        return ["token_embedding", "blocks.0", f"blocks.{depth - 1}", "lm_head"]
    names = decoder_layers(depth)
    return [names[0], names[1], names[-2], names[-1]]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def collect(steps: int) -> list[dict[str, Any]]:
    """Coordinate-check records of every setup, each tagged with ``setup`` and ``column``."""
    setups: dict[str, tuple[Any, Any, Any]] = {
        "u-muP": (
            lambda w, d: us.TransformerDecoder(w, d, w // 32, VOCAB),
            lambda m: us.optim.AdamW(m.parameters(), lr=0.3, weight_decay=0.0),
            lambda m, b: m(*b),
        ),
        "unit-scaled + torch AdamW": (
            lambda w, d: us.TransformerDecoder(w, d, w // 32, VOCAB, mup=False),
            lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
            lambda m, b: m(*b),
        ),
        "SP": (
            lambda w, d: PlainGPT(GPTConfig(VOCAB, w, d, w // 32, SEQ, aligned_labels=True)),
            lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
            lambda m, b: m(b[0], labels=b[1]),
        ),
    }
    records: list[dict[str, Any]] = []
    sweeps = [(name, WIDTHS, [2], "width") for name in setups]
    sweeps.append(("u-muP", [64], DEPTHS, "depth"))
    for name, widths, depths, sweep in sweeps:
        make_model, make_optimiser, loss_fn = setups[name]
        found = coord_data(
            make_model,
            make_optimiser,
            loss_fn,
            _batch(),
            widths,
            depths,
            lambda d, name=name: _layers(name, d),
            steps=steps,
        )
        for record in found:
            column = _layers(name, record["depth"]).index(record["layer"])
            records.append({**record, "setup": name, "sweep": sweep, "column": COLUMNS[column]})
        print(f"collected {name} across {sweep}")
    return records


def _panel_rows(records: list[dict[str, Any]]) -> list[tuple[str, str]]:
    rows = []
    for record in records:
        row = (record["setup"], record["sweep"])
        if row not in rows:
            rows.append(row)
    return rows


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """One panel per (setup, sweep) row and layer column; one curve per width (or depth)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _panel_rows(records)
    fig, axes = plt.subplots(
        len(rows), len(COLUMNS), figsize=(3.2 * len(COLUMNS), 2.6 * len(rows)), squeeze=False
    )
    for i, (setup, sweep) in enumerate(rows):
        chosen = [r for r in records if r["setup"] == setup and r["sweep"] == sweep]
        sizes = sorted({r[sweep] for r in chosen})
        colours = plt.get_cmap("viridis")([k / max(len(sizes) - 1, 1) for k in range(len(sizes))])
        for j, column in enumerate(COLUMNS):
            ax = axes[i][j]
            for size, colour in zip(sizes, colours, strict=True):
                points = sorted(
                    (r["step"], r["change"])
                    for r in chosen
                    if r["column"] == column and r[sweep] == size and r["step"] > 0
                )
                ax.plot(
                    *zip(*points, strict=True), marker="o", color=colour, label=f"{sweep} {size}"
                )
            ax.set_yscale("log")
            ax.set_title(
                f"{setup}: {column}" if sweep == "width" else f"{setup} (depth): {column}",
                fontsize=8,
            )
            ax.tick_params(labelsize=7)
            if j == 0:
                ax.set_ylabel("rms change of output", fontsize=8)
            if i == len(rows) - 1:
                ax.set_xlabel("step", fontsize=8)
        axes[i][-1].legend(fontsize=6, loc="lower right")
    fig.suptitle(
        "Coordinate check: change of each layer's output vs step (flat across sizes = transfer)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(records: list[dict[str, Any]], steps: int) -> dict[str, dict[str, float]]:
    """Per setup and column: change at the largest size over change at the smallest."""
    out: dict[str, dict[str, float]] = {}
    for setup, sweep in _panel_rows(records):
        key = f"{setup} across {sweep}"
        out[key] = {}
        for column in COLUMNS:
            last = sorted(
                (r[sweep], r["change"])
                for r in records
                if r["setup"] == setup
                and r["sweep"] == sweep
                and r["column"] == column
                and r["step"] == steps
            )
            out[key][column] = round(last[-1][1] / last[0][1], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    data_path, plot_path = RESULTS / "coord_check.json", RESULTS / "coord_check.png"
    if args.plot_only:
        report = json.loads(data_path.read_text())
    else:
        load_before = os.getloadavg()
        records = collect(args.steps)
        report = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "load_average_before": [round(v, 2) for v in load_before],
            "load_average_after": [round(v, 2) for v in os.getloadavg()],
            "steps": args.steps,
            "vocab": VOCAB,
            "batch": [BATCH, SEQ],
            "summary_change_ratio_largest_over_smallest": summary(records, args.steps),
            "records": records,
        }
        data_path.write_text(json.dumps(report, indent=1) + "\n")
    plot(report["records"], plot_path)
    print(json.dumps(report["summary_change_ratio_largest_over_smallest"], indent=2))


if __name__ == "__main__":
    main()
