"""simulate_format / simulate_fp8: exactly the operands of matmul-like ops are quantised."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unitscale import UnitScaleError
from unitscale.errors import CaptureError
from unitscale.formats import E4M3, E5M2, FormatError, FPFormat
from unitscale.transforms import simulate_format, simulate_fp8, track_scales
from unitscale.transforms.lowp._operands import matmul_operands
from unitscale.transforms.lowp._pass import SimulateFormatPass
from unitscale.transforms.lowp._quantise import quantise_operand

# FP8 mechanics on plain models without scales, on purpose: the warning that says so
# (tested in test_simulate_scaling.py) is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:.* has no unit scaling:UserWarning")

E4M3_NEAREST = dataclasses.replace(E4M3, rounding="nearest")
E5M2_NEAREST = dataclasses.replace(E5M2, rounding="nearest")


def _identity(x: Tensor) -> Tensor:
    return x


class Ops(nn.Module):
    """Every kind of matmul-like op, with non-matmul ops around them.

    ``q`` is applied by hand to exactly the tensors simulate_format should quantise, so that
    ``Ops(q=quantiser)`` run eagerly is the reference for ``simulate_format(Ops())``.
    """

    def __init__(self, q: Callable[[Tensor], Tensor] = _identity) -> None:
        super().__init__()
        self.q = q
        self.norm = nn.LayerNorm(16)
        self.lin = nn.Linear(16, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.v = nn.Parameter(torch.randn(16) / 4)

    def forward(self, x: Tensor) -> Tensor:
        q = self.q
        h = self.norm(x)  # (4, 8, 16); not matmul-like: not quantised
        h = F.linear(q(h), q(self.lin.weight), self.lin.bias)  # bias not quantised
        h = F.gelu(h) + self.v  # elementwise: not quantised
        s = q(h) @ q(h.transpose(-1, -2))  # operator.matmul
        h = h + torch.bmm(q(s.softmax(-1)), q(h))
        h = h + F.scaled_dot_product_attention(q(h), q(h), q(h), is_causal=True)
        c = F.conv1d(q(h.transpose(1, 2)), q(self.conv.weight), self.conv.bias, padding=1)
        h = h + c.transpose(1, 2)
        flat = h.reshape(-1, 16)
        h = torch.addmm(self.v, q(flat), q(self.w)).view_as(h)
        return torch.einsum("bij,jk->bik", q(h), q(self.w)) + q(h).matmul(q(self.w))


class OpsSimulated(Ops):
    """The same forward, written without ``q``: what users write."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        h = self.lin(h)
        h = F.gelu(h) + self.v
        s = h @ h.transpose(-1, -2)
        h = h + torch.bmm(s.softmax(-1), h)
        h = h + F.scaled_dot_product_attention(h, h, h, is_causal=True)
        c = self.conv(h.transpose(1, 2))
        h = h + c.transpose(1, 2)
        flat = h.reshape(-1, 16)
        h = torch.addmm(self.v, flat, self.w).view_as(h)
        return torch.einsum("bij,jk->bik", h, self.w) + h.matmul(self.w)


# Quantised operand slots in Ops: linear 2, @ 2, bmm 2, attention 3 (one node, h, in three
# slots), conv 2, addmm 2, einsum 2, Tensor.matmul 2.
EXPECTED_QUANTISED = 2 + 2 + 2 + 3 + 2 + 2 + 2 + 2


def run(model: nn.Module, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    out = model(x)
    out.backward(torch.linspace(-3, 3, out.numel()).view_as(out))
    inner = getattr(model, "module", model)  # a transformed module wraps a copy
    grads = {n: p.grad.clone() for n, p in inner.named_parameters() if p.grad is not None}
    assert x.grad is not None
    grads["x"] = x.grad.clone()
    return out.detach(), grads


def representable(t: Tensor, dtype: torch.dtype) -> bool:
    return bool(torch.equal(t.to(dtype).to(t.dtype), t))


def test_simulate_fp8_matches_hand_quantised_reference_bit_for_bit() -> None:
    torch.manual_seed(0)
    plain = OpsSimulated()
    reference = Ops(q=lambda t: quantise_operand(t, E4M3_NEAREST, E5M2_NEAREST))
    reference.load_state_dict(plain.state_dict())
    x = torch.randn(4, 8, 16)

    simulated = simulate_fp8(plain, recipe="all-operands")
    out, grads = run(simulated, x.clone().requires_grad_())
    ref_out, ref_grads = run(reference, x.clone().requires_grad_())
    assert torch.equal(out, ref_out)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert torch.equal(grads[name], ref_grads[name]), name

    # Quantisation happened, and only changed values by about FP8's precision.
    exact, exact_grads = run(plain, x.clone().requires_grad_())
    assert not torch.equal(out, exact)
    assert (out - exact).norm() / exact.norm() < 0.15
    assert (grads["x"] - exact_grads["x"]).norm() / exact_grads["x"].norm() < 0.15


def test_gradients_of_quantised_operands_are_e5m2_and_others_are_not() -> None:
    torch.manual_seed(0)
    model = simulate_fp8(OpsSimulated(), recipe="all-operands")
    _, grads = run(model, torch.randn(4, 8, 16, requires_grad=True))
    # Weights feeding a single matmul-like op get their gradient quantised to E5M2 ...
    for name in ("lin.weight", "conv.weight"):
        assert representable(grads[name], torch.float8_e5m2), name
    # ... others are not forced to be (the biases and norm parameters, the input of a norm).
    for name in ("lin.bias", "conv.bias", "norm.weight", "x"):
        assert not representable(grads[name], torch.float8_e5m2), name


def test_tracked_graph_shows_exactly_the_quantised_operands() -> None:
    torch.manual_seed(0)
    model = track_scales(simulate_fp8(OpsSimulated(), recipe="all-operands"))
    model(torch.randn(4, 8, 16)).sum().backward()
    graph = model.scales_graph()
    quantised = [n for n in graph.nodes if n.target is quantise_operand]
    assert len(quantised) == EXPECTED_QUANTISED
    for node in graph.nodes:
        slots = matmul_operands(node)
        if node.op == "call_function" and node.target is torch.einsum:
            operands = list(node.args[1:])
        else:
            operands = [node.args[i] for i, _ in slots if i < len(node.args)]
        for operand in operands:
            if isinstance(operand, torch.fx.Node) and operand.meta["outputs_float_tensor"]:
                assert operand.target is quantise_operand, (node.name, operand.name)
    for node in quantised:
        # Feeds only matmul-like ops, records FP8 values, and its gradient is tracked.
        assert all(matmul_operands(u) or u.target is torch.einsum for u in node.users)
        metrics = node.meta["metrics"]
        assert metrics.fwd.underflow["e4m3"] == 0.0 and metrics.fwd.overflow["e4m3"] == 0.0
        assert metrics.bwd is not None
    names = {n.meta["clean_name"] for n in quantised}
    assert {"lin_weight_quantised", "conv_weight_quantised", "w_quantised"} <= names
    paths = {n.meta["clean_name"]: n.meta["module_path"] for n in quantised}
    assert paths["lin_weight_quantised"] == "lin" and paths["conv_weight_quantised"] == "conv"


def test_simulate_format_with_any_format_and_preset_keys() -> None:
    torch.manual_seed(0)
    fwd = FPFormat(3, 2, rounding="nearest")
    bwd = FPFormat(4, 1, rounding="nearest")
    lin = nn.Linear(32, 8)
    x = torch.randn(16, 32, requires_grad=True)
    out = simulate_format(lin, fwd, bwd)(x)
    expected = F.linear(fwd.quantise(x), fwd.quantise(lin.weight), lin.bias)
    assert torch.equal(out, expected)
    out.backward(torch.randn_like(out))
    assert x.grad is not None and torch.equal(bwd.quantise(x.grad), x.grad)
    assert not torch.equal(fwd.quantise(x.grad), x.grad)

    # Stochastic rounding when asked for: still representable.
    stochastic_formats = [dataclasses.replace(f, rounding="stochastic") for f in (E4M3, E5M2)]
    stochastic = simulate_format(lin, *stochastic_formats)
    graph_pass = stochastic.passes[-1]
    assert isinstance(graph_pass, SimulateFormatPass)
    assert graph_pass.fwd_format.rounding == "stochastic"
    y = stochastic(x.detach())
    y.backward(torch.randn_like(y))
    assert representable(stochastic.weight.grad, torch.float8_e5m2)
    assert (y - lin(x)).norm() / y.norm() < 0.15


def test_format_names_round_to_nearest_as_simulate_fp8_does() -> None:
    """simulate_format(m, "e4m3", "e5m2") means what the names mean in
    simulate_fp8 (round to nearest, bit-identical to PyTorch's casts), equal to the
    all-operands recipe; only an FPFormat with rounding="stochastic" rounds stochastically."""
    torch.manual_seed(0)
    lin = nn.Linear(32, 8)
    x = torch.randn(16, 32)
    grad = torch.randn(16, 8) * 1e-2
    results = []
    for model in (
        simulate_format(lin, "e4m3", "e5m2"),
        simulate_format(lin, torch.float8_e4m3fn, torch.float8_e5m2),  # type: ignore[arg-type]
        # The presets mean the same as their names: one default (nearest) for both.
        simulate_format(lin, E4M3, E5M2),
        simulate_fp8(lin, recipe="all-operands"),
    ):
        xg = x.clone().requires_grad_()
        out = model(xg)
        out.backward(grad)
        results.append((out.detach(), xg.grad, model.weight.grad))
    cast = F.linear(
        x.to(torch.float8_e4m3fn).float(), lin.weight.to(torch.float8_e4m3fn).float(), lin.bias
    )
    for out, x_grad, w_grad in results:
        assert torch.equal(out, cast)
        assert x_grad is not None and w_grad is not None
        for ours, ref in zip((x_grad, w_grad), results[-1][1:], strict=True):
            assert torch.equal(ours, ref)
    exact_grad = grad @ lin.weight.to(torch.float8_e4m3fn).float()
    assert torch.equal(results[0][1], exact_grad.to(torch.float8_e5m2).float())


def test_non_float_operands_and_other_ops_are_left_alone() -> None:
    emb = nn.Embedding(10, 4)
    model = track_scales(simulate_fp8(emb))
    model(torch.arange(10)).sum().backward()
    graph = model.scales_graph()
    assert not any(n.target is quantise_operand for n in graph.nodes)
    assert torch.equal(simulate_fp8(emb)(torch.arange(10)), emb(torch.arange(10)))


def test_format_errors_name_the_argument() -> None:
    with pytest.raises(FormatError, match="exponent_bits"):
        FPFormat(0, 3)
    with pytest.raises(FormatError, match="mantissa_bits"):
        FPFormat(4, 40)
    with pytest.raises(FormatError, match=r"argument 'fwd_format'='e9m9' is not a format"):
        simulate_format(nn.Linear(2, 2), "e9m9", E5M2)
    with pytest.raises(FormatError, match=r"argument 'bwd_format'=3 is not a format"):
        simulate_format(nn.Linear(2, 2), E4M3, 3)  # type: ignore[arg-type]
    with pytest.raises(UnitScaleError, match=r"expected a torch\.nn\.Module"):
        simulate_fp8("model")  # type: ignore[arg-type]
    with pytest.raises(CaptureError, match=r"apply track_scales last"):
        simulate_fp8(track_scales(nn.Linear(2, 2)))
