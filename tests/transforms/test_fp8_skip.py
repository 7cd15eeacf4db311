"""``skip=`` of simulate_format, simulate_fp8 and to_fp8: layers kept in high precision."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from unitscale.formats import FormatError
from unitscale.transforms import fp8_summary, simulate_format, simulate_fp8, to_fp8
from unitscale.transforms.lowp import _gemm

TRANSFORMS = ["simulate_fp8", "to_fp8"]


def _make(name: str) -> Any:
    if name == "to_fp8" and _gemm.float8_device_error("cpu") is not None:
        pytest.skip(f"no float8 GEMM on this CPU: {_gemm.float8_device_error('cpu')}")
    return simulate_fp8 if name == "simulate_fp8" else to_fp8


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))


def _run(model: nn.Module, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    out = model(x)
    out.backward(torch.ones_like(out) * 1e-3)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize(
    "skip", ["2", ["2.0"], lambda name, m: isinstance(m, nn.Linear) and m.out_features == 4]
)
def test_skipped_layers_stay_in_high_precision_and_are_reported(transform: str, skip: Any) -> None:
    """The skipped linear runs exactly as in FP32 (forward and its weight gradient), the
    others in FP8; the summary lists the skipped op with its reason."""
    make = _make(transform)
    mlp = _mlp()
    x = torch.randn(5, 8) * 30
    out, grads = _run(make(mlp, scaling="tensorwise", skip=skip), x)
    # the reference: the first linear in FP8, then the last one as it is, in FP32
    head, tail = make(mlp[:2], scaling="tensorwise"), copy.deepcopy(mlp[2])
    reference = nn.Sequential(head, tail)
    ref_out, ref_grads = _run(reference, x)
    assert torch.equal(out, ref_out)
    assert torch.equal(grads["2.0.weight"], ref_grads["1.0.weight"])
    assert torch.equal(grads["0.weight"], ref_grads["0.0.weight"])
    in_fp8 = make(mlp, scaling="tensorwise")(x)
    assert not torch.equal(in_fp8, out)  # not skipping changes the result


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_summary_lists_skipped_ops_with_the_reason(transform: str) -> None:
    make = _make(transform)
    model = make(_mlp(), scaling="tensorwise", skip="2")
    model(torch.randn(3, 8))
    summary = fp8_summary(model)
    assert summary.converted == ("0: linear (input_1)",)
    assert summary.not_converted == (("2.0: linear (input_3)", "skipped by skip="),)


def test_simulate_format_takes_skip_too() -> None:
    model = simulate_format(_mlp(), "e4m3", "e5m2", skip=["0"])
    model(torch.randn(3, 8))
    assert [op for op, _ in fp8_summary(model).not_converted] == ["0: linear (input_1)"]


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_a_skip_name_that_matches_no_module_is_refused_naming_close_ones(transform: str) -> None:
    make = _make(transform)
    with pytest.raises(FormatError, match=r"skip='2\.1' names no module of Sequential; did you"):
        make(_mlp(), skip="2.1")
    with pytest.raises(FormatError, match=r"did you mean '2\.0'"):
        make(_mlp(), skip=["0", "2.0x"])
    with pytest.raises(FormatError, match=r"neither module names nor a predicate"):
        make(_mlp(), skip=3)
    with pytest.raises(FormatError, match=r"the skip predicate raised on module ''"):
        make(_mlp(), skip=lambda name, m: m.out_features > 2)
