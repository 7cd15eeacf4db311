"""Every subprocess the suite runs is bounded by the one hang guard (``tests/_hang_guard.py``).

A test's time limit stops a stuck command; it never measures speed. A limit written as a
number at a call site (300 s once failed a fresh clone on a loaded machine) is refused here.
"""

from __future__ import annotations

import ast
from pathlib import Path

from _hang_guard import HANG_GUARD_S

TESTS = Path(__file__).resolve().parent
#: Calls that wait for a subprocess (``subprocess.run``, ``Popen.communicate``, ...).
WAITS = {"run", "communicate", "check_output", "check_call", "call"}


def _literal_limits(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr not in WAITS:
            continue
        for keyword in node.keywords:
            if keyword.arg == "timeout" and isinstance(keyword.value, ast.Constant):
                found.append(f"{path.relative_to(TESTS)}:{node.lineno}")
    return found


def test_subprocess_limits_are_the_shared_hang_guard() -> None:
    literal = [hit for path in sorted(TESTS.rglob("*.py")) for hit in _literal_limits(path)]
    assert not literal, f"use timeout=HANG_GUARD_S (tests/_hang_guard.py): {literal}"


def test_hang_guard_is_generous_for_a_loaded_machine() -> None:
    # 30 s alone, over 300 s at load 10: the guard leaves room for several times that.
    assert HANG_GUARD_S >= 1200
