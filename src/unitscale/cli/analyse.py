"""``unitscale analyse``: track one training step of a model and its unit-scaled twin.

The work is done by library functions (:mod:`unitscale.models`, :mod:`unitscale.data`,
:func:`unitscale.transforms.track_scales`, :mod:`unitscale.analysis`); this module parses
options, shows progress on stderr and prints the summary on stdout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from ..analysis import RiskSummary

from ._args import positive_int
from ._memory import BUILTIN_GPT, check_memory
from ._output import (
    Progress,
    check_out_folder,
    refuse_earlier_outputs,
    require_analysis_extra,
    slug,
)

__all__ = ["HELP", "add_parser", "conclusion", "run"]

DEFAULT_OUT = "unitscale-report"
#: The files ``unitscale analyse`` writes (``glob`` patterns): a folder that holds one of
#: them is refused unless ``--overwrite`` is given.
OUTPUTS: tuple[str, ...] = ("scales.csv", "scales_*.png", "report.html", "summary.txt")
#: The one-line summary ``unitscale --help`` lists.
HELP = "track the scales of a model and its unit-scaled twin; write plots, a report, a CSV"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``analyse`` (alias ``analyze``) and its options."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "analyse",
        aliases=["analyze"],
        help=HELP,
        description=(
            "Run one forward and backward step of a model on a batch of text, record the scale "
            "of every tensor and gradient, do the same for its unit-scaled twin, and write a "
            "plot per model (PNG), an interactive HTML report and a CSV table. With no "
            "options: the built-in GPT on CPython's bundled documentation text."
        ),
    )
    parser.add_argument(
        "--model",
        default="builtin",
        metavar="SPEC",
        help="builtin (default) | hf:<model_type>: a small randomly initialised transformers "
        "model (no download) trained with its family's objective: decoder-only (gpt2, "
        "llama, ...) as a causal LM, encoder-only (bert, roberta, ...) as a masked LM (15%% "
        "of bytes masked), encoder-decoder (t5, bart, ...) as seq2seq (first half of each "
        "sequence in, second half out) | path/to/file.py:factory: a function of no arguments "
        "returning a torch.nn.Module, called with the arguments its forward names among "
        "input_ids, attention_mask, labels (else input_ids alone): (batch, seq) int64 "
        "bytes, labels the next bytes (already shifted); it returns a scalar loss, an "
        "output with .loss, or (batch, seq, vocab) logits, whose cross-entropy is then "
        "computed inside the model (unit-scaled in the twin)",
    )
    parser.add_argument(
        "--batch-size",
        type=positive_int,
        default=8,
        metavar="N",
        help="sequences in the batch (default 8)",
    )
    parser.add_argument(
        "--seq-len",
        type=positive_int,
        default=128,
        metavar="N",
        help="bytes per sequence (default 128)",
    )
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    parser.add_argument(
        "--forward-only", action="store_true", help="track the forward pass only (no gradients)"
    )
    parser.add_argument(
        "--text", default=None, metavar="FILE", help="a text file instead of the bundled corpus"
    )
    parser.add_argument(
        "--block-formats",
        default=None,
        metavar="NAMES",
        type=_block_format_names,
        help="comma-separated block-scaled formats (mxfp8_e4m3, mxfp8_e5m2, mxfp6_e3m2, "
        "mxfp6_e2m3, mxfp4_e2m1, nvfp4) whose metrics every tensor also gets, blocked along "
        "its last dimension: the fraction of values flushed to zero inside their block, of "
        "blocks whose scale is clipped, and the relative rounding error (CSV columns, the "
        "report, a summary line per model and format; slower: computed for every tensor)",
    )
    parser.add_argument(
        "--out", default=DEFAULT_OUT, metavar="DIR", help=f"output folder (default {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the outputs of an earlier run in --out (without it, a folder that "
        "holds them is refused)",
    )
    parser.set_defaults(run=run)
    return parser


def _block_format_names(text: str) -> tuple[str, ...]:
    """``--block-formats``: known block-scaled preset names, comma-separated."""
    from ..formats import BLOCK_PRESETS

    names = tuple(n.strip().lower() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in BLOCK_PRESETS]
    if unknown or not names:
        shown = ", ".join(unknown) if unknown else repr(text)
        raise argparse.ArgumentTypeError(
            f"unknown block-scaled format(s) {shown}; choose from {', '.join(BLOCK_PRESETS)}"
        )
    return names


def run(args: argparse.Namespace) -> int:
    """Run ``unitscale analyse`` with parsed options; return the exit status."""
    if args.model == "builtin":  # from the options alone, before torch loads
        check_memory("analyse", args.batch_size, args.seq_len, *BUILTIN_GPT)
    progress = Progress()
    require_analysis_extra("analyse")
    from ..data import example_batch
    from ._models import quiet_transformers

    out = check_out_folder(args.out)
    refuse_earlier_outputs(out, OUTPUTS, args.overwrite)
    batch = example_batch(args.batch_size, args.seq_len, seed=args.seed, path=args.text)
    source = args.text or "bundled CPython documentation text"
    progress(f"batch: {args.batch_size} x {args.seq_len} bytes of {source}")
    progress(f"building {args.model} model(s)")
    with quiet_transformers(enabled=args.model != "builtin"):
        tables = _track_models(args, batch, progress)
    written = _write_tables_and_figures(args, out, tables, progress)
    lines, summaries = _summary_lines(args, tables)
    written.append(out / "summary.txt")
    lines += ["", f"wrote {len(written)} files to {out}/: " + ", ".join(p.name for p in written)]
    lines.append(conclusion(summaries))
    text = "\n".join(lines) + "\n"
    written[-1].write_text(text, encoding="utf-8")
    sys.stdout.write(text)
    progress("done")
    return 0


def _write_tables_and_figures(
    args: argparse.Namespace, out: Path, tables: list[Any], progress: Progress
) -> list[Path]:
    """Write the CSV of every table, a figure per model, the side-by-side image and the HTML
    report into ``out``; return the files written."""
    import pandas as pd

    from ..analysis import plot, write_report

    graphs = {entry.name: graph for entry, _, _, graph, _ in tables}
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    csv_path = out / "scales.csv"
    pd.concat([t for _, _, t, _, _ in tables], ignore_index=True).to_csv(
        csv_path, index=False, lineterminator="\n"
    )
    written.append(csv_path)
    images = []
    for entry, _, _, graph, _ in tables:
        progress(f"{entry.name}: plotting")
        figure = cast("Figure", plot(graph, title=entry.name).figure)
        png = out / f"scales_{slug(entry.name, 'model')}.png"
        # Rendered once: the same pixels go to this file and to the side-by-side image.
        images.append(_render(figure, png))
        written.append(png)
    written.append(_side_by_side(images, out / "scales_side_by_side.png"))
    progress("writing the HTML report")
    title = f"unitscale analyse: {args.model}"
    noise = {entry.name: structural for entry, _, _, _, structural in tables}
    written.append(write_report(graphs, out / "report.html", title=title, structural_zeros=noise))
    return written


def _summary_lines(
    args: argparse.Namespace, tables: list[Any]
) -> tuple[list[str], list[tuple[str, Any]]]:
    """The summary's lines (a row of format risks per model, the worst tensors) and each
    model's risk summary."""
    from ..analysis import graph_to_dataframe, risk_summary
    from ..transforms import prune_same_scale_tensors

    lines = [
        f"unitscale analyse --model {args.model}: batch {args.batch_size} x {args.seq_len}, "
        f"seed {args.seed}, {'forward' if args.forward_only else 'forward and backward'}",
        "",
        f"{'model':<28}{'loss':>8}{'tensors':>9}{'E4M3 under':>12}{'E4M3 over':>11}"
        f"{'E5M2 under':>12}{'E5M2 over':>11}",
    ]
    summaries = []
    for entry, loss_value, _, graph, structural in tables:
        kept = graph_to_dataframe(prune_same_scale_tensors(graph))
        summary = risk_summary(kept, structural_zeros=structural)
        summaries.append((entry.name, summary))
        e4, e5 = summary.formats["e4m3"], summary.formats["e5m2"]
        lines.append(
            f"{entry.name[:27]:<28}{loss_value:>8.3f}{summary.tensors:>9}{e4.underflow:>12}"
            f"{e4.overflow:>11}{e5.underflow:>12}{e5.overflow:>11}"
        )
    lines += [
        "",
        "tensors: the values and gradients tracked (an op's output and its gradient count "
        "as two), leaving out ops whose one float input has the same scale both ways (views, "
        "copies, casts); 'under' counts those with more than 1% of values flushed to zero "
        "(not counting structural zeros: parameter-gradient elements at rounding noise, "
        "|g| <= 2**-20 rms(g)), 'over' those with any value beyond the format's range.",
    ]
    lines += _block_lines(args, tables)
    for name, summary in summaries:
        for key in ("e4m3", "e5m2"):
            worst = summary.worst[key]
            if worst:
                lines.append(f"worst in {key.upper()}, {name}:")
                lines += [f"  {w}" for w in worst]
    return lines, summaries


def _block_lines(args: argparse.Namespace, tables: list[Any]) -> list[str]:
    """Per model and block-scaled format of ``--block-formats``: the median and largest
    rounding error over the tensors that block, and how many flush or clip."""
    if not args.block_formats:
        return []
    lines = [
        "",
        "block formats (blocks along each tensor's last dimension; tensors whose last "
        "dimension is not a multiple of the block size left out): median and largest "
        "relative error ||q(x) - x|| / ||x||; tensors with over 1% of values flushed to "
        "zero inside their block; tensors with any block scale clipped by the scale range",
    ]
    for entry, _, table, _, _ in tables:
        for fmt in args.block_formats:
            error = table[f"block_error_{fmt}"].dropna()
            flushed = int((table[f"block_flushed_{fmt}"] > 0.01).sum())
            clipped = int((table[f"block_scale_clipped_{fmt}"] > 0).sum())
            if error.empty:
                lines.append(f"  {entry.name}, {fmt}: no tensor blocks")
                continue
            lines.append(
                f"  {entry.name}, {fmt}: error median {error.median():.3g}, max "
                f"{error.max():.3g} ({len(error)} tensors); flushed >1%: {flushed}; "
                f"scale clipped: {clipped}"
            )
    return lines


def _track_models(args: argparse.Namespace, batch: Any, progress: Progress) -> list[Any]:
    """Build the models and track one step of each: ``(entry, loss, table, graph)`` each."""
    import torch

    from ..analysis import graph_to_dataframe, structural_zeros
    from ..transforms import track_scales
    from ._models import call_model, resolve_models

    models = resolve_models(args.model, args.seq_len, args.seed)
    tables = []
    step = "forward" if args.forward_only else "forward and backward"
    for entry in models:
        progress(f"{entry.name}: tracking a {step} step")
        tracked = track_scales(entry.model, block_formats=args.block_formats)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)  # dropout, if any, is the same on every run
            loss = call_model(entry, tracked, batch)
            if not args.forward_only:
                loss.backward()
        graph = tracked.scales_graph()
        table = graph_to_dataframe(graph)
        table.insert(0, "model", entry.name)
        structural = {} if args.forward_only else structural_zeros(tracked)
        tables.append((entry, float(loss.detach()), table, graph, structural))
    return tables


def conclusion(summaries: list[tuple[str, RiskSummary]]) -> str:
    """The summary's last line: which model has the fewest tensors at risk in E4M3
    (:func:`unitscale.analysis.risk_conclusion`, which the report shows too).

    Example:
        >>> from unitscale.analysis import FormatRisk, RiskSummary
        >>> def risk(n, under): return RiskSummary(n, {"e4m3": FormatRisk("e4m3", under, 0)}, {})
        >>> print(conclusion([("plain", risk(120, 77)), ("unit-scaled", risk(136, 3))]))
        conclusion: in E4M3, unit-scaled has the fewest tensors at risk (3 of 136; plain
        77 of 120).
    """
    from ..analysis import risk_conclusion

    return risk_conclusion(summaries)


def _render(figure: Figure, path: Path, dpi: int = 100) -> Any:
    """Draw ``figure`` at ``dpi``, write it to ``path`` as a PNG (as ``savefig`` would, with
    no version stamp) and return its RGBA pixels."""
    import numpy as np
    from matplotlib.image import imsave

    figure.set_dpi(dpi)
    figure.canvas.draw()
    pixels = np.array(figure.canvas.buffer_rgba())  # type: ignore[attr-defined]
    no_software: Any = {"Software": None}
    imsave(path, pixels, metadata=no_software)
    return pixels


def _side_by_side(images: list[Any], path: Path) -> Path:
    """Write the models' rendered plots (RGBA pixels, see :func:`_render`) next to each
    other, at the same scale, as one PNG: left to right on white, top-aligned, unchanged."""
    import numpy as np
    from matplotlib.image import imsave

    rgb = [image[..., :3] for image in images]
    height = max(image.shape[0] for image in rgb)
    gap = np.full((height, 20, 3), 255, dtype=np.uint8)
    columns = []
    for i, image in enumerate(rgb):
        padded = np.full((height, image.shape[1], 3), 255, dtype=np.uint8)
        padded[: image.shape[0]] = image
        columns += [gap, padded] if i else [padded]
    no_software: Any = {"Software": None}  # as savefig: no version stamp in the file
    imsave(path, np.concatenate(columns, axis=1), metadata=no_software)
    return path
