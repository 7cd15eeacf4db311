"""Shared test fixtures: every test starts from a fixed random seed.

Scale tracking computes CPU statistics with a small native kernel (built by ``pip install``)
or, with ``UNITSCALE_STATS=eager`` or where the install built none, with the PyTorch kernel
that accelerators compile; the suite runs on the default and ``tests/tracking/test_metrics*.py``
and ``test_stats_paths.py`` check both, compiled and not, against float64 arithmetic and
against each other.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

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
    """Clear Dynamo's caches, without the noise of its weakref callbacks at shutdown.

    torch 2.13's Dynamo raises a KeyError from a weakref callback
    (``torch/_dynamo/utils.py``) when its caches are torn down; it is harmless and printed
    after the test summary, so it is dropped here and only here.
    """
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        tb = unraisable.exc_traceback
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        in_dynamo = tb is not None and tb.tb_frame.f_code.co_filename.endswith(
            os.path.join("torch", "_dynamo", "utils.py")
        )
        if not (in_dynamo and isinstance(unraisable.exc_value, KeyError)):
            previous(unraisable)

    sys.unraisablehook = hook
    torch._dynamo.reset()
    gc.collect()
