"""simulate_fp8's recipes: the hardware recipe (the default) and the all-operands one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unitscale.experiments.training import TrainConfig, TrainConfigError, build_run_model
from unitscale.formats import E4M3, E5M2, FormatError
from unitscale.transforms import FP8_RECIPES, FP8Recipe, simulate_fp8, track_scales
from unitscale.transforms.lowp._quantise import quantise_grad, quantise_operand

# FP8 mechanics on plain models without scales, on purpose: the warning that says so
# (tested in test_simulate_scaling.py) is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.* has no unit scaling:UserWarning")

E4M3_NEAREST = dataclasses.replace(E4M3, rounding="nearest")
E5M2_NEAREST = dataclasses.replace(E5M2, rounding="nearest")


class TwoMatmuls(nn.Module):
    """A linear layer, a norm and a matmul with a raw parameter; ``hand=True`` writes out the
    hardware recipe by hand (E4M3 inputs, E5M2 gradient at each matmul's output)."""

    def __init__(self, hand: bool = False) -> None:
        super().__init__()
        self.hand = hand
        self.lin = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.w = nn.Parameter(torch.randn(32, 8) / 6)

    def forward(self, x: Tensor) -> Tensor:
        def q(t: Tensor) -> Tensor:
            return quantise_operand(t, E4M3_NEAREST, None) if self.hand else t

        def g(t: Tensor) -> Tensor:
            return quantise_grad(t, E5M2_NEAREST) if self.hand else t

        h = g(F.linear(q(x), q(self.lin.weight))) + self.lin.bias  # bias grad not rounded
        h = self.norm(F.gelu(h))
        return g(q(h) @ q(self.w))


def _run(model: nn.Module, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(torch.linspace(-3, 3, out.numel()).view_as(out) * 1e-3)
    inner = getattr(model, "module", model)
    grads = {n: p.grad.clone() for n, p in inner.named_parameters()}
    assert x.grad is not None
    grads["x"] = x.grad.clone()
    return out.detach(), grads


def _representable(t: Tensor, dtype: torch.dtype) -> bool:
    return bool(torch.equal(t.to(dtype).to(t.dtype), t))


def test_default_recipe_is_hardware_and_matches_the_hand_written_recipe_bit_for_bit() -> None:
    torch.manual_seed(0)
    plain, reference = TwoMatmuls(), TwoMatmuls(hand=True)
    reference.load_state_dict(plain.state_dict())
    x = torch.randn(4, 16)
    out, grads = _run(simulate_fp8(plain), x)
    ref_out, ref_grads = _run(reference, x)
    assert torch.equal(out, ref_out)
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), name
    # Same as naming the preset.
    out_named, _ = _run(simulate_fp8(plain, recipe=FP8_RECIPES["hardware"]), x)
    assert torch.equal(out_named, out)


def test_hardware_recipe_keeps_weight_gradients_in_high_precision() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    _, hardware = _run(simulate_fp8(TwoMatmuls()), x)
    _, all_operands = _run(simulate_fp8(TwoMatmuls(), recipe="all-operands"), x)
    for name in ("lin.weight", "w"):
        assert _representable(all_operands[name], torch.float8_e5m2), name
        assert not _representable(hardware[name], torch.float8_e5m2), name


def test_hardware_recipe_rounds_the_gradient_at_each_matmul_output() -> None:
    torch.manual_seed(0)
    model = track_scales(simulate_fp8(TwoMatmuls()))
    model(torch.randn(4, 16)).sum().backward()
    graph = model.scales_graph()
    grad_nodes = [n for n in graph.nodes if n.target is quantise_grad]
    operand_nodes = [n for n in graph.nodes if n.target is quantise_operand]
    assert len(grad_nodes) == 2 and len(operand_nodes) == 4
    for node in operand_nodes:
        assert node.args[2] is None  # operand gradients are not rounded
    for node in grad_nodes:
        assert node.meta["metrics"].bwd is not None


def test_recipe_is_validated_data_with_a_compact_repr() -> None:
    hardware = FP8_RECIPES["hardware"]
    assert repr(hardware) == (
        "FP8Recipe(operands=e4m3/nearest, output_grad=e5m2/nearest, operand_grads=None, "
        "ops='matmuls')"
    )
    assert repr(FP8_RECIPES["all-operands"]) == (
        "FP8Recipe(operands=e4m3/nearest, output_grad=None, operand_grads=e5m2/nearest, "
        "ops='matmuls')"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        hardware.output_grad = None  # type: ignore[misc]
    with pytest.raises(FormatError, match="neither output_grad nor operand_grads"):
        FP8Recipe(operands=E4M3_NEAREST, output_grad=None)
    with pytest.raises(FormatError, match="operands='e4m3' is not an FPFormat"):
        FP8Recipe(operands="e4m3", output_grad=E5M2_NEAREST)  # type: ignore[arg-type]
    with pytest.raises(FormatError, match=r"recipe='e4m3' is not an FP8 recipe.*hardware"):
        simulate_fp8(nn.Linear(2, 2), recipe="e4m3")
    stochastic = FP8Recipe(
        operands=dataclasses.replace(E4M3, rounding="stochastic"), output_grad=E5M2
    )
    assert "e4m3/stochastic" in repr(stochastic) and "e5m2/nearest" in repr(stochastic)
    with pytest.raises(FormatError, match="ops='attention'"):
        FP8Recipe(operands=E4M3, output_grad=E5M2, ops="attention")  # type: ignore[arg-type]
    with pytest.raises(FormatError, match="argument 'ops'='all'"):
        simulate_fp8(nn.Linear(2, 2), ops="all")  # type: ignore[arg-type]


def test_training_runs_choose_the_recipe() -> None:
    assert TrainConfig().fp8_recipe == "hardware"
    with pytest.raises(TrainConfigError, match="fp8_recipe='bf16'"):
        TrainConfig(fp8_recipe="bf16")
    config = TrainConfig(hidden_size=32, heads=2, fp8_recipe="all-operands")
    model = build_run_model("plain-fp8", config)
    (graph_pass,) = model.passes  # type: ignore[union-attr]
    assert graph_pass.bwd_format == E5M2_NEAREST and graph_pass.output_grad_format is None


class InPlaceAfterMatmul(nn.Module):
    """falcon's ``mlp_output += attention_output``: an in-place op on a matmul's output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        y = self.lin(x)
        y += x
        y.mul_(2.0)
        return y


@pytest.mark.parametrize("scaling", ["none", "tensorwise", "delayed"])
@pytest.mark.parametrize("recipe", ["hardware", "all-operands"])
def test_in_place_op_on_a_matmul_output_runs_and_keeps_gradients(recipe: str, scaling: str) -> None:
    """The rounded output must not be a view that the in-place op modifies
    (it raised "Output 0 of _QuantiseBackward is a view and is being modified inplace")."""
    torch.manual_seed(0)
    model = InPlaceAfterMatmul()
    x = torch.randn(4, 8)
    out, grads = _run(simulate_fp8(model, recipe=recipe, scaling=scaling), x)
    reference, ref_grads = _run(model, x)
    assert (out - reference).norm() / reference.norm() < 0.1
    for name, grad in grads.items():
        assert (grad - ref_grads[name]).norm() / ref_grads[name].norm() < 0.2, name
    assert torch.equal(x, x.clone())  # the caller's input is untouched


def test_quantise_bwd_returns_a_tensor_that_may_be_modified_in_place() -> None:
    x = torch.tensor([1.25, 2.5], requires_grad=True)
    y = E5M2_NEAREST.quantise_bwd(x * 1.0)
    y += 1.0
    y.backward(torch.tensor([0.3, 1e6]))
    assert x.grad is not None and x.grad.tolist() == [0.3125, 57344.0]
