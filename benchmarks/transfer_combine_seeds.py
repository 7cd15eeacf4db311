"""Combine ``unitscale transfer`` outputs of other seeds into one sweep, as if run with all.

    python benchmarks/transfer_combine_seeds.py DIR_A DIR_B --out DIR [--rerun-fp8]
    python benchmarks/transfer_combine_seeds.py DIR --out DIR   # one folder: re-render it

Each DIR is a folder ``unitscale transfer`` wrote (its ``transfer.json`` and
``transfer.csv``); the sweeps must have the same settings and disjoint seeds. The combined
``transfer.csv``, ``transfer.json``, ``transfer.png``, ``report.html`` and ``summary.txt``
go to ``--out``, the claims judged on the mean over all seeds and on every seed.

Each sweep ran its FP8 runs at the learning rate best on its own mean over seeds; where the
combined mean's best differs, the summary lists the FP8 runs that are not at it and claim (4)
reads "not evaluated" (not comparable). ``--rerun-fp8`` trains exactly those FP8 runs
(``unitscale.experiments.transfer.train_one``, on each seed's data) before writing.
"""

from __future__ import annotations

import argparse
import sys

from unitscale.experiments.transfer import (
    combine_results,
    final_frame,
    fp8_not_at_best,
    load_transfer,
    rerun_fp8,
    runs_frame,
    write_transfer_outputs,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="folders unitscale transfer wrote")
    parser.add_argument("--out", required=True, help="folder for the combined outputs")
    parser.add_argument(
        "--rerun-fp8",
        action="store_true",
        help="train the FP8 runs not at the combined mean's best learning rate",
    )
    args = parser.parse_args(argv)
    results = [load_transfer(folder) for folder in args.folders]
    result = results[0] if len(results) == 1 else combine_results(*results)
    note = ""
    if len(results) > 1:
        note = f"combined by benchmarks/transfer_combine_seeds.py from {', '.join(args.folders)}"
    if args.rerun_fp8:
        result, done = rerun_fp8(result, progress=print)
        if done:
            points = ", ".join(f"seed {s} width {w} depth {d} k={k:+d}" for s, w, d, k in done)
            note += f"{'; ' if note else ''}FP8 re-run at the combined best: {points}"
    stale = fp8_not_at_best(final_frame(runs_frame(result.runs)))
    written = write_transfer_outputs(result, args.out, note)
    print((written[-1]).read_text(encoding="utf-8"), end="")
    if stale:
        print(f"{len(stale)} FP8 run(s) not at the combined best: --rerun-fp8", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
