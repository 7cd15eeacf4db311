"""The monitor and its presentation do not import each other (issue 30's import circle).

``tracking/`` collects; the heatmap and the TensorBoard export in ``analysis/`` present the
monitor's table. They share ``MonitorError`` through :mod:`unitscale.errors`, so no module of
``analysis/`` imports ``tracking/monitor.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import unitscale.analysis
import unitscale.errors
import unitscale.tracking
import unitscale.tracking.monitor

ANALYSIS = Path(unitscale.analysis.__file__).parent


def _runtime_imports(path: Path) -> set[str]:
    """Modules ``path`` imports when it runs (not those under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(child) for child in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add("." * node.level + node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def test_no_analysis_module_imports_the_monitor() -> None:
    for path in sorted(ANALYSIS.glob("*.py")):
        imports = _runtime_imports(path)
        assert not {m for m in imports if m.endswith("tracking.monitor")}, path.name


def test_monitor_error_lives_with_the_other_errors_and_is_re_exported() -> None:
    error = unitscale.errors.MonitorError
    assert issubclass(error, unitscale.errors.UnitScaleError)
    assert unitscale.tracking.MonitorError is error
    assert unitscale.tracking.monitor.MonitorError is error
