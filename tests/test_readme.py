"""README.md's figures come from committed results: the generated table must be current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_performance_table_is_generated_from_committed_results() -> None:
    script = ROOT / "benchmarks" / "readme_tables.py"
    result = subprocess.run(
        [sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=120
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
    monkeypatch.setattr(readme_tables, "RESULTS", results)
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


@pytest.mark.parametrize("name", ["TRANSFER", "TRANSFER_DEPTH"])
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


def _python_block_after(heading: str) -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```", start)]


def test_scale_monitor_snippet_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snippet runs with the ``test`` extra alone (tensorboard is in no extra)."""
    pytest.importorskip("matplotlib")
    import torch

    from unitscale.data import batches
    from unitscale.models import GPTConfig, plain_gpt

    snippet = _python_block_after("### Watching scales while you train")
    config = GPTConfig(hidden_size=16, depth=1, heads=2, seq_len=16)
    stream = batches(2, 16, seed=0)
    data = [dict(next(stream)) for _ in range(3)]
    namespace = {"torch": torch, "model": plain_gpt(config, 0), "data": data}
    monkeypatch.chdir(tmp_path)
    snippet = snippet.replace("every=100", "every=2")  # record steps 0 and 2 of 3
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert namespace["monitor"].recorded_steps == [0, 2]
    assert (tmp_path / "grad_scales.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "scales.csv").stat().st_size > 0
