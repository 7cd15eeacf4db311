"""simulate_fp8's per-tensor scaling: tensorwise (against torchao itself) and delayed."""

from __future__ import annotations

import copy
import io
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import unitscale
import unitscale.functional as U
from unitscale.formats import FormatError
from unitscale.transforms import (
    compile,
    scaling_cost,
    simulate_format,
    simulate_fp8,
    track_scales,
    unit_scale,
)
from unitscale.transforms.lowp._quantise import fp8_scale


def _torchao(module: str) -> Any:
    """A torchao module, or a skip: torchao (the ``test`` extra) is the reference
    implementation, and supports recent torch releases only."""
    reason = "torchao (the test extra) is the reference implementation of tensorwise scaling"
    try:
        return pytest.importorskip(module, reason=reason)
    except pytest.skip.Exception:
        raise
    except Exception as error:  # e.g. an older torch than this torchao supports
        pytest.skip(f"{reason}, and it does not import with torch {torch.__version__}: {error}")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))


def _step(model: nn.Module, x: Tensor, grad: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """One forward and backward; the output and every gradient (the input's included)."""
    x = x.clone().requires_grad_()
    out = model(x)
    out.backward(grad)
    inner = getattr(model, "module", model)
    grads = {n: p.grad.clone() for n, p in inner.named_parameters() if p.grad is not None}
    assert x.grad is not None
    grads["x"] = x.grad.clone()
    for p in inner.parameters():
        p.grad = None
    return out.detach(), grads


def _far_from_unit() -> tuple[Tensor, Tensor]:
    torch.manual_seed(1)
    return torch.randn(16, 64) * 300, torch.randn(16, 32) * 1e-5


def _assert_close(ours: Tensor, reference: Tensor, what: str, rtol: float = 2e-6) -> None:
    error = ((ours - reference).norm() / reference.norm()).item()
    assert error <= rtol, f"{what}: relative error {error:.3g}"


def test_tensorwise_equals_torchao_float8_training_default_config() -> None:
    """Inputs at scale 300 and incoming gradients at 1e-5: torchao's tensorwise scaling puts
    both at E4M3's/E5M2's max, and so must ours, forward and backward."""
    float8 = _torchao("torchao.float8")
    mlp = _mlp()
    x, grad = _far_from_unit()
    reference_out, reference = _step(float8.convert_to_float8_training(copy.deepcopy(mlp)), x, grad)
    out, grads = _step(simulate_fp8(mlp, scaling="tensorwise"), x, grad)
    _assert_close(out, reference_out, "output")
    assert set(grads) == set(reference) == {"x", "0.weight", "0.bias", "2.weight", "2.bias"}
    for name, expected in reference.items():
        _assert_close(grads[name], expected, name)  # accumulation order only
    # Without scales the same model loses most of its gradients (it is not unit-scaled).
    _, unscaled = _step(simulate_fp8(mlp), x, grad)
    assert (unscaled["0.weight"] - reference["0.weight"]).norm() > 0.5 * reference[
        "0.weight"
    ].norm()


def test_tensorwise_scale_follows_torchao_rules() -> None:
    """scale = float32(fmax / clamp(float64(amax), 1e-12)), not rounded to a power of two;
    a zero tensor gets a finite scale and stays zero."""
    float8_utils = _torchao("torchao.float8.float8_utils")
    for values in ([0.3, -3.7], [0.0, 0.0], [1e-30, 2e-30], [6e4, 1.0]):
        x = torch.tensor(values)
        for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            fmax = torch.finfo(dtype).max
            expected = float8_utils.tensor_to_scale(x, dtype)
            assert torch.equal(fp8_scale(x, fmax), expected)
    zero = simulate_fp8(nn.Linear(4, 2, bias=False), scaling="tensorwise")
    assert torch.equal(zero(torch.zeros(3, 4)), torch.zeros(3, 2))


def test_delayed_equals_tensorwise_once_the_history_holds_the_current_amax() -> None:
    mlp = _mlp()
    x, grad = _far_from_unit()
    delayed = simulate_fp8(mlp, scaling="delayed")
    tensorwise_out, tensorwise = _step(simulate_fp8(mlp, scaling="tensorwise"), x, grad)
    first_out, first = _step(delayed, x, grad)  # first step: the current amax (stated rule)
    second_out, second = _step(delayed, x, grad)  # history = this amax (same step again)
    for out, grads in ((first_out, first), (second_out, second)):
        assert torch.equal(out, tensorwise_out)
        for name, expected in tensorwise.items():
            assert torch.equal(grads[name], expected), name
    # A step 4x larger is scaled from the history (saturating), not from its own amax.
    third_out, _ = _step(delayed, 4 * x, grad)
    tensorwise_big, _ = _step(simulate_fp8(mlp, scaling="tensorwise"), 4 * x, grad)
    assert not torch.equal(third_out, tensorwise_big)
    history = delayed.state_dict()["fp8_amax_history_0_input"]
    assert history.shape == (16,)  # the default length (torchao's former history_len)
    amax = x.abs().max()
    assert history[:3].tolist() == [4 * amax.item(), amax.item(), amax.item()]
    assert not history[3:].any()


def test_delayed_first_step_uses_the_current_amax_and_evaluation_does_not_record() -> None:
    lin = nn.Linear(4, 1, bias=False)
    model = simulate_fp8(lin, scaling="delayed", history_len=3)
    x = torch.tensor([[2.0, -1.0, 0.5, 0.25]])
    with torch.no_grad():
        model(x)  # evaluation: reads the (empty) history, so scales as tensorwise, records nothing
    assert not model.state_dict()["fp8_amax_history_input"].any()
    model(x).sum().backward()
    state = model.state_dict()
    assert state["fp8_amax_history_input"].tolist() == [2.0, 0.0, 0.0]
    assert state["fp8_amax_history_weight"][0] == lin.weight.abs().max()
    assert state["fp8_amax_history_grad_output"].tolist() == [1.0, 0.0, 0.0]


def test_delayed_history_is_checkpointed_and_restored_into_a_fresh_model() -> None:
    mlp = _mlp()
    x, grad = _far_from_unit()
    trained = simulate_fp8(mlp, scaling="delayed")
    _step(trained, x, grad)
    _step(trained, 2 * x, grad)
    buffer = io.BytesIO()
    torch.save(trained.state_dict(), buffer)
    buffer.seek(0)
    restored = simulate_fp8(mlp, scaling="delayed")  # never called: histories not built yet
    restored.load_state_dict(torch.load(buffer))
    assert restored.state_dict().keys() == trained.state_dict().keys()
    for key, value in trained.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key
    # The next step of both scales from the same history.
    small = x / 8
    assert torch.equal(_step(restored, small, grad)[0], _step(trained, small, grad)[0])
    fresh_out = _step(simulate_fp8(mlp, scaling="delayed"), small, grad)[0]
    assert not torch.equal(fresh_out, _step(trained, small, grad)[0])
    # The original model's own checkpoint still loads (histories simply start empty).
    again = simulate_fp8(mlp, scaling="delayed")
    again.load_state_dict(mlp.state_dict())


class _BrokenPair(nn.Module):
    """Two linears on either side of a graph break; the second sees inputs ~250x smaller."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.big = nn.Linear(64, 64)
        self.small = nn.Linear(64, 32)
        with torch.no_grad():
            self.big.weight.mul_(1e-3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.big(x)
        torch._dynamo.graph_break()
        return self.small(x)


class _BrokenBlock(nn.Module):
    """A layer with a graph break inside: Dynamo reuses its graph for every such layer."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        with torch.no_grad():
            self.fc.weight.mul_(gain)

    def forward(self, x: Tensor) -> Tensor:
        x = self.fc(x)
        torch._dynamo.graph_break()
        return torch.relu(x)


class _BrokenStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.blocks = nn.ModuleList(_BrokenBlock(gain) for gain in (1e-3, 1.0, 30.0))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _transform(name: str) -> Any:
    if name == "simulate_fp8":
        return lambda module, scaling: simulate_fp8(module, scaling=scaling, ops="linear")
    from unitscale.transforms import to_fp8
    from unitscale.transforms.lowp import _gemm

    if _gemm.float8_device_error("cpu") is not None:
        pytest.skip(f"no float8 GEMM on this CPU: {_gemm.float8_device_error('cpu')}")
    return lambda module, scaling: to_fp8(module, scaling=scaling)


@pytest.mark.parametrize("transform", ["simulate_fp8", "to_fp8"])
@pytest.mark.parametrize("model", [_BrokenPair, _BrokenStack])
def test_delayed_keeps_one_history_per_op_across_graph_pieces(transform: str, model: Any) -> None:
    """Each op keeps its own amax histories, wherever Dynamo cuts the graph: two linears on
    either side of a graph break (their inputs at scales ~300 and ~1), and layers whose
    graph Dynamo captures once and reuses. Repeating a step, delayed scaling then equals
    tensorwise bit for bit; a history shared with a larger tensor scales the smaller one
    toward underflow."""
    make = _transform(transform)
    module = model()
    torch.manual_seed(4)
    x, grad = torch.randn(16, 64) * 300, torch.randn(16, module(torch.ones(1, 64)).shape[-1])
    delayed = make(module, "delayed")
    reference_out, reference = _step(make(module, "tensorwise"), x, grad)
    _step(delayed, x, grad)
    out, grads = _step(delayed, x, grad)  # every history now holds its own tensor's amax
    assert torch.equal(out, reference_out)
    for name, expected in reference.items():
        assert torch.equal(grads[name], expected), name
    histories = {k for k in delayed.state_dict() if k.startswith("fp8_amax_history_")}
    linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    roles = ("input", "weight", "grad_output")
    expected = {f"fp8_amax_history_{n.replace('.', '_')}_{r}" for n in linears for r in roles}
    assert histories == expected


def test_delayed_histories_survive_recaptures_for_new_shapes() -> None:
    """A graph Dynamo captures again for other input shapes finds its ops' histories."""
    model = simulate_fp8(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), scaling="delayed")
    for shape in [(3, 4), (5, 4), (2, 3, 4)]:
        model(torch.randn(*shape) * 100).sum().backward()
    assert model.capture is not None and len(model.capture.pieces) >= 2  # recaptured
    histories = {k: v for k, v in model.state_dict().items() if "amax_history" in k}
    assert len(histories) == 6
    assert all(int(v.count_nonzero()) == 3 for v in histories.values())  # 3 steps each


class _FunctionalUnitScaled(nn.Module):
    """A plain module that calls unitscale's functional linear: unit-scaled all the same."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 4))

    def forward(self, x: Tensor) -> Tensor:
        return U.linear(x, self.weight)


def _fp8_warnings(make: Any, module: nn.Module, **options: Any) -> list[str]:
    model = make(module, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # warned once per model
            model(torch.randn(3, 4)).sum().backward()
    return [str(w.message) for w in caught if "unit scaling" in str(w.message)]


@pytest.mark.parametrize("transform", ["simulate_fp8", "to_fp8"])
def test_fp8_without_scales_on_a_model_without_unit_scaling_warns(transform: str) -> None:
    """scaling="none" (the default) on a plain model saturates and flushes to zero: said once,
    naming both ways out. Not said for a unit_scale'd model, one built from unitscale's
    modules or functions, or with scales."""
    make = _transform(transform)
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    [message] = _fp8_warnings(make, plain, scaling="none")
    assert message.startswith(f"{transform}: Sequential has no unit scaling (none of its 2 op")
    assert f"{transform}(unitscale.transforms.unit_scale(model))" in message
    assert f"{transform}(model, scaling='tensorwise')" in message
    assert not _fp8_warnings(make, plain, scaling="tensorwise")
    assert not _fp8_warnings(make, unit_scale(plain), scaling="none")
    built = nn.Sequential(unitscale.Linear(4, 8), unitscale.Linear(8, 2))
    assert not _fp8_warnings(make, built, scaling="none")
    assert not _fp8_warnings(make, _FunctionalUnitScaled(), scaling="none")


def test_scaling_cost_counts_each_scaled_rounding() -> None:
    mlp = _mlp()
    x, grad = _far_from_unit()
    for scaling, forward, backward in (("none", 0, 0), ("tensorwise", 4, 2), ("delayed", 4, 2)):
        model = simulate_fp8(mlp, scaling=scaling)  # type: ignore[arg-type]
        _step(model, x, grad)
        cost = scaling_cost(model)
        assert (cost.forward, cost.backward) == (forward, backward)
        assert cost.amax_reductions == cost.scale_computations == forward + backward
    all_operands = simulate_fp8(mlp, recipe="all-operands", scaling="tensorwise")
    _step(all_operands, x, grad)
    assert (scaling_cost(all_operands).forward, scaling_cost(all_operands).backward) == (4, 4)
    with pytest.raises(Exception, match="has not been called yet"):
        scaling_cost(simulate_fp8(mlp, scaling="tensorwise"))
    with pytest.raises(Exception, match="does not simulate a number format"):
        scaling_cost(mlp)


def test_scaling_composes_with_unit_scale_track_scales_and_compile() -> None:
    unit_scaled = unit_scale(_mlp())  # re-initialises weights: one copy for every chain
    x, grad = _far_from_unit()
    for scaling in ("tensorwise", "delayed"):
        eager = simulate_fp8(unit_scaled, scaling=scaling)  # type: ignore[arg-type]
        out, grads = _step(eager, x, grad)
        tracked = track_scales(simulate_fp8(unit_scaled, scaling=scaling))  # type: ignore[arg-type]
        tracked_out, tracked_grads = _step(tracked, x, grad)
        assert torch.equal(tracked_out, out)
        # Each forward scale is a node of its own, with the scale as its statistics.
        nodes = {n.meta.get("clean_name"): n for n in tracked.scales_graph().nodes}
        assert {"input_scale", "_0_weight_scale", "_2_weight_scale"} <= set(nodes), set(nodes)
        expected_scale = 448.0 / x.abs().max().item()
        metrics = nodes["input_scale"].meta["metrics"]
        assert metrics.fwd.abs_max == pytest.approx(expected_scale, rel=1e-6)
        weight = unit_scaled.module[0].weight
        metrics = nodes["_0_weight_scale"].meta["metrics"]
        assert metrics.fwd.abs_max == pytest.approx(448.0 / weight.abs().max().item(), rel=1e-6)
        compiled = compile(simulate_fp8(unit_scaled, scaling=scaling))  # type: ignore[arg-type]
        compiled_out, compiled_grads = _step(compiled, x, grad)
        _assert_close(compiled_out, out, f"compiled {scaling} output", rtol=1e-5)
        for name, expected in grads.items():
            _assert_close(compiled_grads[name], expected, f"compiled {scaling} {name}", rtol=1e-5)
            assert torch.equal(tracked_grads[name], expected)
        # The compiled graphs update the same histories, forward and backward.
        histories = {k: v for k, v in eager.state_dict().items() if "amax_history" in k}
        assert len(histories) == (6 if scaling == "delayed" else 0)
        for key, value in histories.items():
            assert value.any(), key
            torch.testing.assert_close(compiled.state_dict()[key], value, rtol=1e-6, atol=0)
            assert torch.equal(tracked.state_dict()[key], value)


def test_scaling_arguments_are_validated() -> None:
    with pytest.raises(FormatError, match=r"argument 'scaling'='dynamic' is not supported"):
        simulate_fp8(nn.Linear(2, 2), scaling="dynamic")  # type: ignore[arg-type]
    with pytest.raises(FormatError, match=r"argument 'history_len'=0 must be a positive int"):
        simulate_format(nn.Linear(2, 2), "e4m3", "e5m2", scaling="delayed", history_len=0)


def test_delayed_histories_are_not_advanced_by_a_scale_monitor_replay() -> None:
    """ScaleMonitor replays a step with track_scales on when it finds a NaN: the replay must
    leave the histories as the step left them (as for any buffer the forward updates)."""
    from unitscale.tracking import ScaleMonitor

    torch.manual_seed(0)
    model = simulate_fp8(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)), scaling="delayed")
    twin = copy.deepcopy(model)  # the same steps, unmonitored
    monitor = ScaleMonitor(model, every=None, on_non_finite="ignore")
    inputs = [torch.rand(3, 4) + 0.5 for _ in range(3)]
    inputs[1][0, 0] = float("nan")  # a NaN reaches the output: step 1 is replayed
    for step, x in enumerate(inputs):
        monitor.module(x).mean().backward()
        report = monitor.step()
        twin(x).mean().backward()
        assert (report is not None) == (step == 1)
        histories = {k: v for k, v in model.state_dict().items() if "amax_history" in k}
        assert len(histories) == 6
        for key, value in twin.state_dict().items():
            torch.testing.assert_close(
                model.state_dict()[key], value, rtol=0, atol=0, equal_nan=True
            )


def test_delayed_histories_travel_with_deepcopy_pickle_and_to() -> None:
    import pickle

    model = simulate_fp8(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), scaling="delayed")
    model(torch.randn(3, 4) * 50).sum().backward()
    x = torch.randn(3, 4)
    with torch.no_grad():  # reads the histories without recording
        for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert torch.equal(copied(x), model(x))  # same histories: same scales
        wide = copy.deepcopy(model).to(torch.float64)
        assert wide.state_dict()["fp8_amax_history_0_input"].dtype == torch.float64
        assert torch.allclose(wide(x.double()).float(), model(x))


@pytest.mark.slow
def test_plain_fp8_tensorwise_run_is_torchaos_recipe_on_the_builtin_gpt() -> None:
    """``unitscale train``'s baseline: the same ops rounded as torchao's
    ``convert_to_float8_training`` (its Float8Linear modules, the linear ops only: attention
    stays in FP32) and the same loss and gradients."""
    float8 = _torchao("torchao.float8")
    from unitscale.data import example_batch
    from unitscale.experiments.training import TrainConfig, build_run_model
    from unitscale.transforms import fp8_summary

    config = TrainConfig(hidden_size=32, heads=2, depth=2, seq_len=16, seed=0)
    ours = build_run_model("plain-fp8-tensorwise", config)
    reference = float8.convert_to_float8_training(copy.deepcopy(ours.module))
    torchao_linears = sorted(
        name
        for name, m in reference.named_modules()
        if isinstance(m, float8.float8_linear.Float8Linear)
    )
    batch = example_batch(4, 16)
    ids = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    loss = ours(**ids)
    loss.backward()
    reference_loss = reference(**ids)
    reference_loss.backward()
    summary = fp8_summary(ours)
    assert sorted(op.split(":")[0] for op in summary.converted) == torchao_linears
    assert len(torchao_linears) == 9  # 4 per block and the readout
    assert {reason for _, reason in summary.not_converted} == {"outside ops='linear'"}
    rounded = sum(len(i.piece.data["simulate_format"]) for i in ours.capture.last_trace)
    assert rounded == 2 * len(torchao_linears)  # each linear's input and weight
    _assert_close(loss.detach(), reference_loss.detach(), "loss")
    expected = dict(reference.named_parameters())
    for name, parameter in ours.module.named_parameters():
        assert parameter.grad is not None, name
        _assert_close(parameter.grad, expected[name].grad, name, rtol=1e-5)
