"""Shared test fixtures: every test starts from a fixed random seed."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def seed() -> int:
    """Seed torch's global generator before each test (returned, for tests that re-seed)."""
    torch.manual_seed(0)
    return 0
