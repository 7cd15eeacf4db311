"""Shared test fixtures: every test starts from a fixed random seed.

Scale tracking computes its statistics with a kernel compiled by ``torch.compile``; the
suite uses the eager version of the same kernel (``UNITSCALE_STATS=eager``) to avoid paying
compile time in every process. ``tests/test_tracking_metrics.py`` checks that the compiled
kernel gives the same statistics and runs a tracked model with it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

os.environ.setdefault("UNITSCALE_STATS", "eager")

import pytest
import torch


@pytest.fixture(autouse=True)
def seed() -> int:
    """Seed torch's global generator before each test (returned, for tests that re-seed)."""
    torch.manual_seed(0)
    return 0


@pytest.fixture
def single_thread() -> Iterator[None]:
    """Run a test on one intra-op thread (restored afterwards). Small-tensor tests are then
    much faster on a busy machine, where every multi-threaded op waits for a free core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Clear Dynamo's caches before interpreter shutdown (avoids noisy weakref callbacks)."""
    torch._dynamo.reset()
