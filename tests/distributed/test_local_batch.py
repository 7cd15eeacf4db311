"""Data parallelism at any local batch size, and what decides the data-parallel size.

At one sequence per rank the embedding's gradient was once 1/sqrt(N) of one
process's; the factor applied whenever a process group existed; a model captured before
``init_process_group`` kept size 1. Spawns of 2 and 4 gloo ranks (``_worker.py``); every
parameter gradient and the mean loss must equal one process's on the concatenated batch
(relative L2 error 1e-5, as ``test_gradients.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5
LOCAL = {
    2: ["modules-decoder", "modules-gpt", "unit_scale", "track_scales"],
    4: ["modules-gpt", "unit_scale"],
}
BEFORE_INIT = ["unit_scale", "track_scales", "compiled"]


def _checks(world: int) -> list[str]:
    checks = [f"local{b}:{m}" for b in (1, 2) for m in LOCAL[world]]
    if world == 2:
        checks += [f"before-init:{m}" for m in BEFORE_INIT] + ["unit_scale:group-only"]
    return checks


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def ranks(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    spawn_ranks: Callable[..., list[dict[str, Any]]],
) -> tuple[int, list[dict[str, Any]]]:
    world: int = request.param
    out: Path = tmp_path_factory.mktemp(f"local-batch-{world}")
    return world, spawn_ranks("_worker.py", [",".join(_checks(world))], out, world=world)


def _assert_equal_to_one_process(results: list[dict[str, Any]], check_name: str) -> None:
    for rank, measured in enumerate(results):
        check = measured[check_name]
        assert "error" not in check, check.get("error")
        assert check["grad_names"], f"rank {rank}: gradients missing for {check['missing']}"
        assert check["loss_error"] < TOLERANCE, (rank, check)
        assert check["max_grad_error"] < TOLERANCE, (rank, check)


@pytest.mark.parametrize("local_batch", [1, 2])
def test_any_local_batch_equals_one_process(
    ranks: tuple[int, list[dict[str, Any]]], local_batch: int
) -> None:
    """DDP on 1 or 2 sequences per rank, 2 and 4 ranks: every parameter gradient (token and
    position embeddings included) equals one process's on the concatenated batch."""
    world, results = ranks
    for model in LOCAL[world]:
        _assert_equal_to_one_process(results, f"local{local_batch}:{model}")


@pytest.mark.parametrize("model", BEFORE_INIT)
def test_model_captured_before_init_gets_the_size_after(
    ranks: tuple[int, list[dict[str, Any]]], model: str
) -> None:
    """Transformed, tracked or compiled and run once (on the local shape) before
    ``init_process_group``: inside DDP afterwards its gradients equal one process's (the size
    is read when ops run, and compiled graphs are guarded on it)."""
    world, results = ranks
    if world != 2:
        pytest.skip("run in the 2-rank spawn")
    _assert_equal_to_one_process(results, f"before-init:{model}")


def test_process_group_without_ddp_applies_no_factor(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    """A process group with no DDP forward running and no ``set_data_parallel``: the ops use
    the scales of one process, so averaging the gradients by hand gives 1/sqrt(2) of one
    process's count-scaled gradients (the factor is not applied behind the user's back)."""
    world, results = ranks
    if world != 2:
        pytest.skip("run in the 2-rank spawn")
    for measured in results:
        check = measured["unit_scale:group-only"]
        assert "error" not in check, check.get("error")
        assert check["loss_error"] < TOLERANCE
        assert check["min_grad_error"] > 1 - 1 / math.sqrt(2) - 1e-3
