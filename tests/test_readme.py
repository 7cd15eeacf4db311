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
