"""simulate_fp8's rowwise recipes against torchao's ``convert_to_float8_training`` with
``Float8LinearConfig.from_recipe_name("rowwise" | "rowwise_with_gw_hp")``, bit for bit."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from unitscale.formats import FormatError
from unitscale.transforms import fp8_summary, scaling_cost, simulate_format, simulate_fp8

RECIPES = ["rowwise", "rowwise_with_gw_hp"]


def _float8() -> Any:
    reason = "torchao (the test extra) is the reference implementation of the rowwise recipes"
    try:
        return pytest.importorskip("torchao.float8", reason=reason)
    except pytest.skip.Exception:
        raise
    except Exception as error:  # e.g. an older torch than this torchao supports
        pytest.skip(f"{reason}, and it does not import with torch {torch.__version__}: {error}")


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32)).to(dtype)


def _step(model: nn.Module, x: Tensor, grad: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    inner = getattr(model, "module", model)
    grads = {n: p.grad.clone() for n, p in inner.named_parameters() if p.grad is not None}
    assert x.grad is not None
    grads["x"] = x.grad.clone()
    return out.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_rowwise_equals_torchao_bit_for_bit(recipe: str, dtype: torch.dtype) -> None:
    """3-D inputs at scale 300 and incoming gradients at 1e-5, rows of very different
    magnitudes: the output and every gradient (the input's included) are torchao's, bit
    for bit."""
    float8 = _float8()
    mlp = _mlp(dtype)
    torch.manual_seed(1)
    x = torch.randn(4, 6, 64) * 300 * torch.logspace(-3, 1, 6).view(1, 6, 1)
    grad = torch.randn(4, 6, 32) * 1e-5
    x, grad = x.to(dtype), grad.to(dtype)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    reference = float8.convert_to_float8_training(copy.deepcopy(mlp), config=config)
    expected_out, expected = _step(reference, x, grad)
    out, grads = _step(simulate_fp8(mlp, scaling=recipe), x, grad)
    assert out.dtype == dtype
    assert torch.equal(out, expected_out)
    assert set(grads) == set(expected) == {"x", "0.weight", "0.bias", "2.weight", "2.bias"}
    for name, value in expected.items():
        assert torch.equal(grads[name], value), name
    # not tensorwise: each row is scaled on its own (and the recipes differ from each other)
    tensorwise = _step(simulate_fp8(mlp, scaling="tensorwise", ops="linear"), x, grad)[0]
    assert not torch.equal(out, tensorwise)


def test_rowwise_covers_linear_ops_counts_its_casts_and_refuses_what_contradicts_it() -> None:
    mlp = _mlp(torch.float32)
    for recipe, backward in (("rowwise", 4), ("rowwise_with_gw_hp", 2)):
        model = simulate_fp8(mlp, scaling=recipe)
        model(torch.randn(3, 64)).sum().backward()
        assert [op.split(":")[0] for op in fp8_summary(model).converted] == ["0", "2"]
        cost = scaling_cost(model)  # per linear: x and W forward; backward as the recipe
        assert (cost.forward, cost.backward) == (4, 2 * backward)
    with pytest.raises(FormatError, match=r"scaling='rowwise' covers linear ops only"):
        simulate_fp8(mlp, scaling="rowwise", ops="matmuls")
    with pytest.raises(FormatError, match=r"recipe='all-operands' cannot be combined"):
        simulate_fp8(mlp, recipe="all-operands", scaling="rowwise")
    with pytest.raises(FormatError, match=r"use unitscale.transforms.simulate_fp8\(model, sc"):
        simulate_format(mlp, "e4m3", "e5m2", scaling="rowwise_with_gw_hp")


@pytest.mark.parametrize(
    ("scaling", "dim"), [("tensorwise", None), ("rowwise", -1), ("rowwise", 0), ("rowwise", None)]
)
def test_one_scaled_cast_serves_the_simulation_and_the_float8_dtypes(
    scaling: str, dim: int | None
) -> None:
    """scaled_cast with the simulation's rounding (E4M3.quantise) and with to_fp8's
    saturating float8 conversion gives the same values and the same inverse scales, per
    tensor, per row and per column."""
    import dataclasses

    from unitscale.formats import E4M3
    from unitscale.transforms.lowp._scaling import scaled_cast

    e4m3 = dataclasses.replace(E4M3, rounding="nearest")
    torch.manual_seed(2)
    x = torch.randn(8, 16) * torch.logspace(-4, 4, 16)
    fmax = e4m3.max_absolute_value

    def to_float8(t: Tensor) -> Tensor:
        return t.clamp(-fmax, fmax).to(torch.float8_e4m3fn)

    rounded, inverse = scaled_cast(x, e4m3.quantise, fmax, scaling, dim=dim)
    cast, inverse8 = scaled_cast(x, to_float8, fmax, scaling, dim=dim)
    assert inverse is not None and inverse8 is not None
    assert torch.equal(inverse, inverse8)
    assert inverse.shape == {None: (), -1: (8, 1), 0: (1, 16)}[dim]
    assert torch.equal(rounded, cast.float())
