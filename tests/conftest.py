"""Shared test fixtures: every test starts from a fixed random seed."""

from __future__ import annotations

from collections.abc import Iterator

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
