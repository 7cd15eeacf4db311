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
