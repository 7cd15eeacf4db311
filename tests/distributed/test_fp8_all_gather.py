"""FSDP2 float8 all-gather of ``to_fp8``'s weights, on 2 gloo ranks: the same training, bit
for bit, as gathering the weights in FP32, and one process within FP32 reduction order.

One spawn runs every check (``_fp8_gather_worker.py``): unitscale's u-muP
``TransformerDecoder`` and a ``unit_scale``'d transformers Llama (random config), 3 AdamW
steps each. Measured: the gradients of FSDP2 against one process differ by a relative L2
error of ~2e-8 at most (the order of FP32 sums); with ``scaling="tensorwise"`` each rank
scales its activations by their own amax (torchao's default), so only the comparison with
FSDP2 without float8 all-gather is exact there.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from unitscale.transforms.lowp._gemm import float8_device_error

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        float8_device_error("cpu") is not None, reason="to_fp8 needs a float8 GEMM on the CPU"
    ),
]

CHECKS = ["decoder:none", "llama:none", "decoder:tensorwise"]
TORCHAO = "torchao:tensorwise"
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def results(
    tmp_path_factory: pytest.TempPathFactory, spawn_ranks: Callable[..., list[dict[str, Any]]]
) -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    out: Path = tmp_path_factory.mktemp("fp8_gather")
    checks = [*CHECKS, TORCHAO] if importlib.util.find_spec("torchao") else CHECKS
    checks = [*checks, "fsdp-averages"]
    return spawn_ranks("_fp8_gather_worker.py", [",".join(checks)], out)


def _check(results: list[dict[str, Any]], rank: int, name: str) -> dict[str, Any]:
    check = results[rank][name]
    assert "error" not in check, check.get("error")
    return check


@pytest.mark.parametrize("name", CHECKS)
def test_float8_all_gather_trains_bit_for_bit_as_without(
    results: list[dict[str, Any]], name: str
) -> None:
    for rank in range(len(results)):
        check = _check(results, rank, name)
        assert check["arrived"] == ["Float8Weight"]  # the GEMMs got the gathered float8
        assert check["arrived_plain"] == ["Parameter"]
        assert check["losses_equal"] and check["grads_equal"], check


@pytest.mark.parametrize("name", ["decoder:none", "llama:none"])
def test_float8_all_gather_equals_one_process(
    results: list[dict[str, Any]],
    name: str,
    skip_unless_fsdp_averages: Callable[[list[dict[str, Any]]], None],
) -> None:
    skip_unless_fsdp_averages(results)  # torch 2.8's FSDP2 sums gradients over gloo
    for rank in range(len(results)):
        check = _check(results, rank, name)
        assert check["grad_names"]
        assert max(check["loss_errors"]) < TOLERANCE, check["loss_errors"]
        assert max(check["grad_errors"]) < TOLERANCE, check["grad_errors"]


@pytest.mark.parametrize("name", CHECKS)
def test_every_linear_weight_gathers_in_float8(results: list[dict[str, Any]], name: str) -> None:
    check = _check(results, 0, name)
    assert sorted(check["float8_all_gather"]) == sorted(
        f"{module}.weight" for module in check["linear_weights"]
    )
    assert check["high_precision_gather"] == []
    reasons = {reason for _, reason in check["plain_summary"]}
    assert reasons == {"fsdp_float8_all_gather=False"}


@pytest.mark.parametrize("name", CHECKS)
def test_gathered_bytes_and_scale_equal_casting_the_whole_weight(
    results: list[dict[str, Any]], name: str
) -> None:
    """Each float8 weight a GEMM received (after 3 steps: the tensorwise scales follow the
    optimiser) equals the whole FP32 weight cast by the GEMM's own cast (for "tensorwise":
    scale 448 / amax of the whole weight), byte for byte."""
    for rank in range(len(results)):
        hand = _check(results, rank, name)["hand_cast"]
        assert hand["received"] > 0
        assert hand["matched"] == hand["received"]


@pytest.mark.parametrize("name", CHECKS)
def test_state_dict_keeps_the_fp32_weights(results: list[dict[str, Any]], name: str) -> None:
    check = _check(results, 0, name)
    assert check["state_dtype"] == "torch.float32"
    assert check["state_type"] == "Tensor"
    assert check["state_local_type"] == "Tensor"  # not the float8-gathering wrapper
    assert check["state_equals_param"]


def test_tensorwise_equals_torchaos_float8_all_gather(results: list[dict[str, Any]]) -> None:
    """torchao's float8 all-gather (``Float8Linear``, ``precompute_float8_dynamic_scale_for_fsdp``
    after each step) and ``to_fp8(scaling="tensorwise")``'s, on 2 ranks: the same outputs and
    gradients, bit for bit, at each of 3 AdamW steps."""
    if TORCHAO not in results[0]:
        pytest.skip("needs torchao")
    for rank in range(len(results)):
        check = _check(results, rank, TORCHAO)
        assert check["equal"] == [True, True, True]
        assert check["float8_all_gather"] == ["0.weight", "2.weight"]
