"""README.md's figures come from committed results: the generated table must be current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_performance_table_is_generated_from_committed_results() -> None:
    script = ROOT / "benchmarks" / "readme_tables.py"
    result = subprocess.run(
        [sys.executable, str(script), "--check"],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stderr


def test_a_cuda_run_adds_its_rows_and_leaves_the_cpu_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """benchmarks/device_check.sh appends CUDA runs to the same histories: the README's CPU
    rows still come from the newest CPU runs, and the CUDA runs get rows of their own."""
    import json
    import shutil

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_tables
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    results = tmp_path / "results"
    shutil.copytree(readme_tables.RESULTS, results)
    monkeypatch.setattr(readme_tables.paths, "RESULTS", results)
    before = readme_tables.performance_table().splitlines()
    assert not [row for row in before if "CUDA" in row]
    for name in ("formats.json", "tracking.json"):
        document = json.loads((results / name).read_text())
        gpu_run = {
            **document["runs"][-1],
            "device": "cuda",
            "gpu": "Some GPU",
            "date": "2030-01-01",
        }
        document["runs"].append(gpu_run)
        (results / name).write_text(json.dumps(document))
    after = readme_tables.performance_table().splitlines()
    added = [row for row in after if row not in before]
    assert after[: len(before)] == before  # CPU rows unchanged, in place
    assert added and all("2030-01-01, Some GPU" in row for row in added)
    assert any("vs `x.clone()`" in row and "CUDA" in row for row in added)
    assert any("step vs untracked" in row and ", CUDA" in row for row in added)


@pytest.mark.parametrize("name", ["TRANSFER", "TRANSFER_DEPTH", "TRANSFER_LLAMA"])
def test_transfer_table_marks_the_best_point_as_the_library_does(name: str) -> None:
    """The README's transfer table (benchmarks/readme_tables.py) bolds, in each row, the run
    that ``unitscale.experiments.transfer.best_points`` picks from the same JSON."""
    import json
    import math

    import pandas as pd

    from unitscale.experiments.transfer import best_points

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_tables
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    path = getattr(readme_tables, name)
    document = json.loads(path.read_text())
    runs = pd.DataFrame(document["runs"]).rename(columns={"final_heldout_loss": "heldout_loss"})
    runs["heldout_loss"] = runs["heldout_loss"].astype(float)
    best = best_points(runs)
    rows = [
        line for line in readme_tables.transfer_table(path).splitlines() if line.startswith("| ")
    ]
    steps = document["config"]["lr_steps"]
    assert len(rows) == 1 + len(best)  # the header, then one row per parametrisation and size
    for row, (_, point) in zip(rows[1:], best.iterrows(), strict=True):
        cells = [c.strip() for c in row.strip("|").split("|")]
        bold = [i for i, c in enumerate(cells[2 : 2 + len(steps)]) if c.startswith("**")]
        if math.isnan(point["lr_step"]):
            assert bold == []
        else:
            assert [steps[i] for i in bold] == [int(point["lr_step"])]
            assert cells[2 + bold[0]] == f"**{point['heldout_loss']:.4f}**"


def test_the_coordinate_check_table_states_every_ratio_of_the_committed_json() -> None:
    """README's coordinate-check figures come from ``coord_check.json``, every layer of every
    setup included (the embedding's 0.36x under u-muP was once left out of a hand-written
    "0.84-1.0x")."""
    import json

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_tables
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    summary = json.loads(readme_tables.COORD_CHECK.read_text())[
        "summary_change_ratio_largest_over_smallest"
    ]
    table = readme_tables.coord_table()
    rows = {
        line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")
    }
    for setup, ratios in summary.items():
        cells = [c.strip() for c in rows[setup].strip("|").split("|")[1:]]
        assert cells == [f"{value:.2f}x" for value in ratios.values()], setup
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert table in readme


def test_the_readme_stands_on_its_own() -> None:
    """A clone has no ../shared/: the README links only to files in the repository, and
    every relative link resolves."""
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "../shared" not in readme
    for target in re.findall(r"\]\(([^)#]+)\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), target


def test_fp8_table_and_claim_come_from_the_train_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's FP8 table has the tensorwise (and delayed) baselines with their
    scales, every FP8 gap against its own family's FP32 run of the same summary, and the
    claim sets the unit-scaled model with no scales against the scaled plain runs."""
    from unitscale.experiments.training import RunResult, TrainConfig, summary_text

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_tables
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    losses = {
        "plain-fp32": 2.0,
        "plain-fp8": 3.0,
        "plain-fp8-tensorwise": 2.04,
        "plain-fp8-delayed": 2.06,
        "unit-scaled-fp32": 1.5,
        "unit-scaled-fp8": 1.515,
    }
    results = {n: RunResult(n, 0.5, [v], {1: v}, v, v) for n, v in losses.items()}
    folder = tmp_path / "train" / "hardware-recipe-seed0"
    folder.mkdir(parents=True)
    (folder / "summary.txt").write_text(summary_text(results, TrainConfig(steps=1)))
    monkeypatch.setattr(readme_tables.paths, "TRAIN", tmp_path / "train")
    monkeypatch.setattr(readme_tables.paths, "ROOT", tmp_path)
    rows = {
        cells[2]: cells
        for line in readme_tables.fp8_table().splitlines()[2:]
        for cells in [[c.strip() for c in line.split("|")]]
    }
    assert list(rows) == list(losses)
    assert rows["plain-fp8-tensorwise"][3] == "tensorwise"
    assert rows["plain-fp8-tensorwise"][9] == "+2.00%"  # against plain-fp32, not unit-scaled
    assert (
        rows["plain-fp8-delayed"][3:4] == ["delayed"] and rows["plain-fp8-delayed"][9] == "+3.00%"
    )
    assert rows["plain-fp8"][3] == "no scaling" and rows["unit-scaled-fp8"][9] == "+1.00%"
    assert rows["plain-fp32"][3] == "" and rows["plain-fp32"][9] == ""
    # A one-seed summary says its seed and its scope (recorded with every matmul rounded).
    assert rows["plain-fp8"][4:6] == ["all matmuls", "0"]
    claims = readme_tables.fp8_claims()
    assert "no per-tensor scales ends +1.00% from its FP32 held-out loss" in claims
    assert "`plain-fp8-tensorwise` +2.00% (train +2.00%); `plain-fp8-delayed` +3.00%" in claims
    assert "one seed" in claims and "wider scope than torchao's recipe" in claims
    assert "1.00 points closer to its FP32 run than the plain model with tensorwise" in claims
    assert "2.00 points closer to its FP32 run than the plain model with delayed" in claims
    cost = readme_tables.latest_run(readme_tables.RESULTS / "fp8_scaling.json")["results"]
    amax = cost["per_step_counts"]["tensorwise"]["amax_reductions"]
    assert f"tensorwise scaling does {amax} amax reductions" in claims


def test_fp8_table_and_claim_come_from_the_multi_seed_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a multi-seed result is committed, the FP8 table and claim come from it: each
    run's seeds, mean and spread of both losses, each FP8 run against its own FP32 run of
    the same seed; the one-seed hardware run it replaces is not shown."""
    import json

    from unitscale.experiments.training import RunResult, TrainConfig, seeds_document

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_tables
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    # (held-out, train) per seed: unit-scaled FP8 +1% / +2% held-out, tensorwise +3% / +5%.
    losses = {
        "plain-fp32": [(2.0, 1.0), (2.0, 1.0)],
        "plain-fp8": [(3.0, 3.0), (3.0, 3.0)],
        "plain-fp8-tensorwise": [(2.06, 1.01), (2.1, 1.03)],
        "unit-scaled-fp32": [(1.0, 1.0), (2.0, 2.0)],
        "unit-scaled-fp8": [(1.01, 1.02), (2.04, 2.0)],
    }
    by_seed = {
        seed: {n: RunResult(n, 0.5, [], {}, v[i][1], v[i][0]) for n, v in losses.items()}
        for i, seed in enumerate((0, 7))
    }
    folder = tmp_path / "train" / readme_tables.SEEDS_FOLDER
    folder.mkdir(parents=True)
    document = seeds_document(by_seed, TrainConfig(steps=1, runs=tuple(losses)))
    (folder / "results.json").write_text(json.dumps(document))
    old = tmp_path / "train" / "hardware-recipe-seed0"
    old.mkdir()
    (old / "summary.txt").write_text("")
    monkeypatch.setattr(readme_tables.paths, "TRAIN", tmp_path / "train")
    monkeypatch.setattr(readme_tables.paths, "ROOT", tmp_path)
    rows = {
        cells[2]: cells
        for line in readme_tables.fp8_table().splitlines()[2:]
        for cells in [[c.strip() for c in line.split("|")]]
    }
    assert list(rows) == list(losses)  # the one-seed hardware folder is replaced
    fp8 = rows["unit-scaled-fp8"]
    assert fp8[4:6] == ["linear", "0, 7"]
    assert fp8[9] == "+1.50% ± 0.71% [+1.00%, +2.00%]"  # held-out, each seed vs its own FP32
    assert fp8[10] == "+1.00% ± 1.41% [+0.00%, +2.00%]"  # final training loss
    assert fp8[8] == "1.5250 ± 0.7283"
    claims = readme_tables.fp8_claims()
    assert "held-out +1.50% ± 0.71% [+1.00%, +2.00%] (per seed +1.00%, +2.00%; " in claims
    # what holds on every seed: the worst seed's gap, never only the mean's +1.50%
    assert "on every seed within 2.00% of FP32, worst seed 7 +2.00%, spread +1.00% to" in claims
    assert "`plain-fp8-tensorwise` held-out +4.00% ± 1.41% [+3.00%, +5.00%]" in claims
    assert "over seeds 0, 7" in claims and "linear ops of both models" in claims


def test_block_format_table_and_claims_come_from_the_multi_seed_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's block-format table: FP32 runs first, then per format
    the plain and the unit-scaled run, each gap against its own family's FP32 run of the same
    seed, the transform as ``unitscale train`` applies it, and the claim's worst seed."""
    import json

    from unitscale.experiments._train_config import BLOCK_RUNS
    from unitscale.experiments.training import RunResult, TrainConfig, seeds_document

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import readme_tables
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert readme_tables.block_table().startswith(("| format |", "No block-format result"))
    # (held-out, train) per seed, in unitscale train's run order
    losses = {
        "plain-fp32": [(2.0, 1.0), (2.0, 1.0)],
        "unit-scaled-fp32": [(1.0, 1.0), (2.0, 2.0)],
        "plain-mxfp8": [(2.02, 1.0), (2.0, 1.0)],
        "unit-scaled-mxfp8": [(1.01, 1.0), (2.06, 2.0)],
        "plain-nvfp4": [(2.2, 1.1), (2.1, 1.1)],
        "unit-scaled-nvfp4": [(1.05, 1.1), (2.0, 2.2)],
    }
    by_seed = {
        seed: {n: RunResult(n, 0.5, [], {}, v[i][1], v[i][0]) for n, v in losses.items()}
        for i, seed in enumerate((0, 3))
    }
    folder = tmp_path / "train" / readme_tables.BLOCK_FOLDER
    folder.mkdir(parents=True)
    document = seeds_document(by_seed, TrainConfig(steps=7, runs=tuple(losses)))
    (folder / "results.json").write_text(json.dumps(document))
    monkeypatch.setattr(readme_tables.paths, "TRAIN", tmp_path / "train")
    monkeypatch.setattr(readme_tables.paths, "ROOT", tmp_path)
    rows = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in readme_tables.block_table().splitlines()[2:]
    ]
    assert [row[1] for row in rows] == [
        "plain-fp32", "unit-scaled-fp32", "plain-mxfp8", "unit-scaled-mxfp8", "plain-nvfp4",
        "unit-scaled-nvfp4",
    ]  # fmt: skip
    by_run = {row[1]: row for row in rows}
    assert by_run["unit-scaled-mxfp8"][0] == "MXFP8" and by_run["plain-fp32"][0] == "(FP32)"
    assert by_run["unit-scaled-mxfp8"][6] == "+2.00% ± 1.41% [+1.00%, +3.00%]"
    assert by_run["plain-mxfp8"][6] == "+0.50% ± 0.71% [+0.00%, +1.00%]"  # vs plain-fp32
    assert by_run["unit-scaled-nvfp4"][7] == "+10.00% ± 0.00% [+10.00%, +10.00%]"
    assert by_run["plain-nvfp4"][8] == f"`{BLOCK_RUNS['nvfp4']!r}`"
    assert by_run["plain-fp32"][6:9] == ["", "", ""]
    claims = readme_tables.block_claims()
    assert "- **MXFP8**: the u-μP model against its own FP32 run: held-out +2.00%" in claims
    assert "on every seed within 3.00% of FP32, worst seed 3 +3.00%" in claims
    assert "**MXFP4**" not in claims  # no MXFP4 runs in this result
    assert "over seeds 0, 3" in claims and "7 steps" in claims
