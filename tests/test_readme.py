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
