"""The time limit of every test that runs a command in a subprocess.

The limit is a hang guard only: it stops a stuck command from blocking the suite, and is
generous enough for a shared machine at load 10 (a ``transfer --quick --model hf:llama`` that
takes 30 s alone took over 300 s on a loaded machine). How fast a command runs is measured
in ``benchmarks/``, never by a test's limit.
"""

from __future__ import annotations

#: Seconds a subprocess of the suite may run before the test fails as hung.
HANG_GUARD_S = 1800
