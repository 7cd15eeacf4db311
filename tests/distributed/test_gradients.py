"""Unit-scaled gradients under data parallelism equal one process on the concatenated batch.

One spawn of 2 gloo ranks runs every check (``_worker.py``); each test asserts on what the
ranks measured. Tolerance: relative L2 error 1e-5 per parameter gradient and on the mean loss
(float32 sums in another order; measured ~3e-7).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from unitscale.transforms.lowp._gemm import float8_device_error

pytestmark = pytest.mark.slow

MODELS = [
    "modules-decoder",
    "modules-gpt",
    "unit_scale",
    "simulate_fp8",
    "track_scales",
    "to_fp8",
]
WRAPPERS = ["ddp", "fsdp"]
CHECKS = [f"{m}:{w}" for w in WRAPPERS for m in MODELS] + [
    "unit_scale:ddp-uncorrected",
    "compile",
    "fsdp-averages",
    "fp8-scaling",
]
TOLERANCE = 1e-5


def _skip_without_float8(model: str) -> None:
    """to_fp8 needs float8 GEMMs on the CPU (torch._scaled_mm has a CPU kernel since 2.7)."""
    reason = float8_device_error("cpu") if model == "to_fp8" else None
    if reason is not None:
        pytest.skip(f"to_fp8 needs a float8 GEMM on the CPU: {reason}")


@pytest.fixture(scope="module")
def results(
    tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Callable[..., list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("gradients")
    return spawn_ranks("_worker.py", [",".join(CHECKS)], out)


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("model", MODELS)
def test_loss_and_gradients_equal_one_process(
    results: list[dict[str, Any]],
    model: str,
    wrapper: str,
    skip_unless_fsdp_averages: Callable[[list[dict[str, Any]]], None],
) -> None:
    _skip_without_float8(model)
    if wrapper == "fsdp":
        skip_unless_fsdp_averages(results)
    for rank, measured in enumerate(results):
        check = measured[f"{model}:{wrapper}"]
        assert "error" not in check, check.get("error")
        assert check["grad_names"], f"rank {rank}: gradients missing for {check['missing']}"
        assert check["loss_error"] < TOLERANCE, (rank, check)
        assert check["max_grad_error"] < TOLERANCE, (rank, check)


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("model", MODELS)
def test_names_tags_and_state_dict_survive(
    results: list[dict[str, Any]], model: str, wrapper: str
) -> None:
    _skip_without_float8(model)
    check = results[0][f"{model}:{wrapper}"]
    assert "error" not in check, check.get("error")
    assert check["names"] and check["state_dict_keys"]
    assert check["any_tags"] and check["tags"]


def test_one_process_scales_would_be_wrong(results: list[dict[str, Any]]) -> None:
    """With the scales of one process, every gradient is off: the check above can fail.
    Count-scaled weights come out 1/sqrt(2) of the truth, the true-gradient broadcast add of
    the position embedding 1/2."""
    check = results[0]["unit_scale:ddp-uncorrected"]
    assert "error" not in check, check.get("error")
    assert check["min_grad_error"] > 1 - 1 / math.sqrt(2) - 1e-3
    assert check["max_grad_error"] == pytest.approx(0.5, abs=1e-3)
    assert check["loss_error"] < TOLERANCE


def test_compiled_module_sees_the_world_size(results: list[dict[str, Any]]) -> None:
    """torch.compile(fullgraph=True) of us.Linear inside DDP on 2 ranks: the same local
    gradient as eager, sqrt(2) times one process's (the factor DDP's average divides by 2)."""
    for measured in results:
        check = measured["compile"]
        assert "error" not in check, check.get("error")
        assert check["compiled_vs_eager"] < 1e-6
        assert check["ratio_to_one_process"] == pytest.approx(math.sqrt(2), rel=1e-6)


def test_tensorwise_fp8_amax_is_each_ranks_own(results: list[dict[str, Any]]) -> None:
    """The decision for simulate_fp8(scaling="tensorwise") under DDP: amax is not reduced
    over ranks (torchao's default), so gradients are the mean of per-rank runs, and differ
    from one process on the whole batch when the ranks' amaxes differ."""
    for rank, measured in enumerate(results):
        check = measured["fp8-scaling"]
        assert "error" not in check, check.get("error")
        assert check["ddp_vs_per_rank"] < TOLERANCE, (rank, check)
        assert check["ddp_vs_one_process"] > 100 * TOLERANCE, (rank, check)
