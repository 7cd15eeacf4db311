"""Global scale statistics under data parallelism: one spawn of 2 gloo ranks (``_worker.py``).

``scales_graph()`` of a tracked ``unit_scale``d GPT inside DDP and FSDP2, and ``ScaleMonitor``
inside DDP, give the statistics of one process on the concatenated batch: every record
present, ``numel`` equal, each metric within a relative error of 1e-5 (``abs_mean`` and
``abs_min`` relative to the tensor's rms, under/overflow fractions absolute; measured
~7e-7), with five collectives per read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

CHECKS = [
    "statistics:ddp",
    "statistics:fsdp",
    "monitor",
    "mismatch",
    "fsdp-averages",
    "parameter-grad-statistics",
]
TOLERANCE = 1e-5
#: Per read: the length check, SUM, MAX, MIN, and the packed gradients of replicated values.
COLLECTIVES = 5


@pytest.fixture(scope="module")
def results(
    tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Callable[..., list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("statistics")
    measured = spawn_ranks("_worker.py", [",".join(CHECKS)], out)
    for rank, result in enumerate(measured):
        result["monitor"]["csv_exists"] = (out / f"monitor-rank{rank}.csv").exists()
    return measured


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_scales_graph_equals_one_process(
    results: list[dict[str, Any]],
    wrapper: str,
    skip_unless_fsdp_averages: Callable[[list[dict[str, Any]]], None],
) -> None:
    if wrapper == "fsdp":
        skip_unless_fsdp_averages(results)
    for rank, measured in enumerate(results):
        check = measured[f"statistics:{wrapper}"]
        assert "error" not in check, check.get("error")
        assert check["missing"] == [] and check["extra"] == 0, (rank, check)
        assert check["records"] > 50
        assert check["numel_equal"], (rank, check["numel_diff"])
        assert check["max_error"] < TOLERANCE, (rank, check["worst"], check["max_error"])


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
def test_collectives_per_read_are_bounded(results: list[dict[str, Any]], wrapper: str) -> None:
    """About a hundred tensors, five collectives (not one per tensor)."""
    for measured in results:
        check = measured[f"statistics:{wrapper}"]
        assert "error" not in check, check.get("error")
        assert check["collectives"] == COLLECTIVES < check["records"]


def test_monitor_table_is_global_and_rank0_writes(results: list[dict[str, Any]]) -> None:
    for rank, measured in enumerate(results):
        check = measured["monitor"]
        assert "error" not in check, check.get("error")
        assert check["rows"] > 100 and check["nan_rows"] == 0
        assert check["max_error"] < TOLERANCE, (rank, check)
        assert check["collectives"] == COLLECTIVES
        assert check["csv_exists"] is (rank == 0)


def test_ranks_reading_different_graphs_get_an_error(results: list[dict[str, Any]]) -> None:
    for measured in results:
        assert "the ranks read 2 to 3 tracked tensors" in measured["mismatch"]["error"]


def test_parameter_gradient_statistics_are_the_same_quantity(
    results: list[dict[str, Any]],
) -> None:
    """A parameter's gradient statistics are those of ``param.grad`` in one
    process and under DDP. One call on the whole batch, 4 accumulated micro-batches in one
    process (before: the last micro-batch's gradient, from a hook) and 2 DDP ranks
    accumulating 2 each give equal statistics of every parameter gradient."""
    for rank, measured in enumerate(results):
        check = measured["parameter-grad-statistics"]
        assert "error" not in check, check.get("error")
        assert check["missing"] == [] and check["bwd_records"] > 10, (rank, check)
        assert check["one_process_error"] < TOLERANCE, (rank, check)
        assert check["ddp_error"] < TOLERANCE, (rank, check)
