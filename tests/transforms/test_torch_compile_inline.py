"""``torch.compile`` of a transformed model: after one eager call, the transformed graph is
traced into the user's compiled graph (no graph break); otherwise the transform runs behind
one graph break. Either way the output and gradients are the eager transformed model's."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import unitscale
from unitscale.transforms import (
    simulate_format,
    simulate_fp8,
    to_fp8,
    track_scales,
    unit_scale,
)
from unitscale.transforms.lowp import _gemm

TRANSFORMS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "unit_scale": unit_scale,
    "simulate_fp8": lambda m: simulate_fp8(unit_scale(m)),
    "simulate_fp8_delayed": lambda m: simulate_fp8(unit_scale(m), scaling="delayed"),
    "mxfp8": lambda m: simulate_format(unit_scale(m), "mxfp8_e4m3", "mxfp8_e5m2"),
    "to_fp8": lambda m: to_fp8(unit_scale(m)),
}


def _mlp() -> tuple[nn.Module, tuple[Tensor, ...]]:
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    return model, (torch.randn(16, 32),)


def _decoder() -> tuple[nn.Module, tuple[Tensor, ...]]:
    model = unitscale.TransformerDecoder(hidden_size=32, depth=1, heads=2, vocab_size=64)
    ids = torch.randint(0, 64, (2, 16))
    return model, (ids, ids)


MODELS = {"mlp": _mlp, "decoder": _decoder}


def _skip_without_float8(name: str) -> None:
    error = _gemm.float8_device_error("cpu")
    if name == "to_fp8" and error is not None:
        pytest.skip(f"no float8 GEMM on this CPU: {error}")


def _inlined(name: str) -> bool:
    """Whether ``TRANSFORMS[name]`` of a CPU model is traced whole: not ``to_fp8`` where
    Inductor cannot compile float8 casts on the CPU (torch 2.8), the GEMMs stay apart."""
    from unitscale.transforms.lowp._scaled_mm import float8_compile_error

    return not name.startswith("to_fp8") or float8_compile_error("cpu") is None


def _step(model: Callable[..., Tensor], inputs: tuple[Tensor, ...], params: list[Tensor]) -> Any:
    """The output of one call and the gradients of its sum (then cleared)."""
    out = model(*inputs)
    out.float().sum().backward()
    grads = [p.grad.clone() if p.grad is not None else None for p in params]
    for p in params:
        p.grad = None
    return out.detach(), grads


def _graph_breaks() -> list[str]:
    from torch._dynamo.utils import counters

    return list(counters["graph_break"])


def _boundary_only(reasons: list[str]) -> bool:
    return bool(reasons) and all("_run_transformed" in r for r in reasons)


def _fresh_dynamo() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("name", list(TRANSFORMS))
def test_torch_compile_after_an_eager_call_traces_the_transformed_graph_whole(
    name: str, model_name: str
) -> None:
    _skip_without_float8(name)
    model, inputs = MODELS[model_name]()
    transformed = TRANSFORMS[name](model)
    params = list(transformed.parameters())
    expected, expected_grads = _step(transformed, inputs, params)
    inlined = _inlined(name)
    assert bool(transformed.capture.inline) is inlined  # type: ignore[union-attr]
    histories = {k: v.clone() for k, v in transformed.named_buffers() if "history" in k}
    _fresh_dynamo()
    compiled = torch.compile(transformed, backend="eager")
    calls = transformed.capture.calls  # type: ignore[union-attr]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # unitscale warns so
        out, grads = _step(compiled, inputs, params)
    if inlined:
        assert _graph_breaks() == [] and transformed.capture.calls == calls  # type: ignore[union-attr]
    else:
        assert _boundary_only(_graph_breaks()), _graph_breaks()
    if histories:  # delayed scaling: the compiled call updated the histories too
        # A second eager step from the same histories gives what the compiled step gave.
        after = {k: v.clone() for k, v in transformed.named_buffers() if "history" in k}
        assert any(not torch.equal(after[k], histories[k]) for k in histories)
        for k, v in transformed.named_buffers():
            if k in histories:
                v.copy_(histories[k])
        expected, expected_grads = _step(transformed, inputs, params)
        for k, v in transformed.named_buffers():
            if k in after:
                torch.testing.assert_close(v, after[k], rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)


def test_the_transformed_graph_compiles_with_inductor_into_the_users_graph() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    model, inputs = _mlp()
    transformed = simulate_fp8(unit_scale(model))
    params = list(transformed.parameters())
    expected, expected_grads = _step(transformed, inputs, params)
    _fresh_dynamo()
    counter = CompileCounterWithBackend("aot_eager")
    out, grads = _step(torch.compile(transformed, backend=counter), inputs, params)
    assert _graph_breaks() == [] and counter.frame_count == 1
    # aot_eager runs the ops torch decomposes them into: float32 rounding of a different order
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_torch_compile_of_to_fp8_with_inductor_runs_the_float8_gemms_in_the_users_graph() -> None:
    _skip_without_float8("to_fp8")
    model, inputs = _mlp()
    transformed = to_fp8(unit_scale(model))
    params = list(transformed.parameters())
    expected, expected_grads = _step(transformed, inputs, params)
    _fresh_dynamo()
    out, grads = _step(torch.compile(transformed), inputs, params)
    if _inlined("to_fp8"):
        assert _graph_breaks() == []
    else:
        assert _boundary_only(_graph_breaks()), _graph_breaks()
    # Inductor fuses the casts and the gradient factors: the output matched bit for bit on
    # torch 2.13's CPU, the gradients within 5e-7 (float32 rounding of another order)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-6)


class _Outer(nn.Module):
    """A user's model holding a transformed submodule between ops of its own."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(32, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.inner(x * 2)))


def test_a_transformed_submodule_joins_its_parents_compiled_graph() -> None:
    model, (x,) = _mlp()
    outer = _Outer(simulate_fp8(unit_scale(model)))
    params = list(outer.parameters())
    expected, expected_grads = _step(outer, (x,), params)
    _fresh_dynamo()
    out, grads = _step(torch.compile(outer, backend="eager"), (x,), params)
    assert _graph_breaks() == []
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["unit_scale", "to_fp8"])
def test_a_first_call_compiled_before_any_eager_one_runs_behind_one_boundary(name: str) -> None:
    """No eager call yet: the transform runs as a capture of its own (Dynamo would otherwise
    inline the wrapped module and drop the passes), behind the one graph break; the output
    is the transformed model's and nothing warns."""
    _skip_without_float8(name)
    model, inputs = _mlp()
    transformed = TRANSFORMS[name](model)
    twin = TRANSFORMS[name](model)
    twin.load_state_dict(transformed.state_dict())
    _fresh_dynamo()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # unitscale warns so
        out = torch.compile(transformed, backend="eager")(*inputs)
    assert _boundary_only(_graph_breaks()), _graph_breaks()
    torch.testing.assert_close(out, twin(*inputs), rtol=0, atol=0)


def test_track_scales_keeps_its_boundary_and_records() -> None:
    model, inputs = _mlp()
    tracked = track_scales(unit_scale(model))
    expected = tracked(*inputs)
    assert not tracked.capture.inline  # type: ignore[union-attr]
    _fresh_dynamo()
    out = torch.compile(tracked, backend="eager")(*inputs)
    assert _boundary_only(_graph_breaks()), _graph_breaks()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert len(list(tracked.scales_graph().nodes)) > 0


@pytest.mark.slow
def test_unitscale_compile_keeps_its_boundary() -> None:
    from unitscale.transforms import compile as unitscale_compile

    model, (x,) = _mlp()
    compiled_graphs = unitscale_compile(unit_scale(model))
    expected = compiled_graphs(x)
    assert not compiled_graphs.capture.inline  # type: ignore[union-attr] # Inductor's code
    _fresh_dynamo()
    out = torch.compile(compiled_graphs, backend="eager")(x)
    assert _boundary_only(_graph_breaks()), _graph_breaks()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


class _Switch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.double = False

    def forward(self, x: Tensor) -> Tensor:
        y = self.fc(x)
        return y * 2 if self.double else y


def test_a_changed_attribute_recompiles_rather_than_reuse_the_inlined_graph() -> None:
    from torch._dynamo.utils import counters

    transformed = simulate_fp8(unit_scale(_Switch()))
    x = torch.randn(4, 32)
    transformed(x)
    _fresh_dynamo()
    compiled = torch.compile(transformed, backend="eager")
    single = compiled(x)
    assert _graph_breaks() == []
    capture = transformed.capture
    assert capture is not None
    calls = capture.calls  # calls run through the capture (behind the boundary)
    transformed.module.double = True  # no eager call in between: the outer graph guards on it
    torch.testing.assert_close(compiled(x), 2 * single, rtol=0, atol=0)
    assert _boundary_only(_graph_breaks()), _graph_breaks()  # no graph for it yet
    assert capture.calls == calls + 1
    # That call captured the new graph, whole: the next compiled call traces it inline.
    assert len(capture.inline) == 2
    counters.clear()
    torch.testing.assert_close(compiled(x), 2 * single, rtol=0, atol=0)
    transformed.module.double = False
    torch.testing.assert_close(compiled(x), single, rtol=0, atol=0)
    assert _graph_breaks() == [] and capture.calls == calls + 1


def test_training_and_evaluation_without_grad_are_both_traced_whole() -> None:
    model, (x,) = _mlp()
    transformed = simulate_fp8(unit_scale(model))
    trained = transformed(x)
    with torch.no_grad():
        evaluated = transformed.eval()(x)
    transformed.train()
    _fresh_dynamo()
    compiled = torch.compile(transformed, backend="eager")
    calls = transformed.capture.calls  # type: ignore[union-attr]
    torch.testing.assert_close(compiled(x), trained, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(compiled.eval()(x), evaluated, rtol=0, atol=0)
    transformed.train()
    torch.testing.assert_close(compiled(x), trained, rtol=0, atol=0)
    assert _graph_breaks() == [] and transformed.capture.calls == calls  # type: ignore[union-attr]


def test_a_graph_captured_again_after_a_reset_keeps_its_plan() -> None:
    model, (x,) = _mlp()
    transformed = simulate_fp8(unit_scale(model))
    expected = transformed(x)
    torch.compiler.reset()  # the capture's graphs are gone too: the next call captures anew
    torch.testing.assert_close(transformed(x), expected, rtol=0, atol=0)
    assert len(transformed.capture.pieces) == 2  # type: ignore[union-attr]
    assert len(transformed.capture.inline) == 1  # type: ignore[union-attr]
    _fresh_dynamo()
    torch.testing.assert_close(torch.compile(transformed, backend="eager")(x), expected)
    assert _graph_breaks() == []


def test_a_graph_break_in_the_model_keeps_the_boundary() -> None:
    class Breaks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(32, 32), nn.Linear(32, 32)

        def forward(self, x: Tensor) -> Tensor:
            y = self.a(x)
            torch._dynamo.graph_break()
            return self.b(y)

    transformed = unit_scale(Breaks())
    x = torch.randn(4, 32)
    expected = transformed(x)
    assert not transformed.capture.inline  # type: ignore[union-attr]
    _fresh_dynamo()
    out = torch.compile(transformed, backend="eager")(x)
    # the boundary, and the user's own break (inside the transform's capture)
    reasons = [r for r in _graph_breaks() if "torch._dynamo.graph_break()" not in r]
    assert _boundary_only(reasons), _graph_breaks()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_new_input_shape_runs_behind_the_boundary() -> None:
    model, (x,) = _mlp()
    transformed = simulate_fp8(unit_scale(model))
    transformed(x)
    _fresh_dynamo()
    wider = torch.randn(8, 32)
    out = torch.compile(transformed, backend="eager")(wider)
    assert _boundary_only(_graph_breaks()), _graph_breaks()
    torch.testing.assert_close(out, transformed(wider), rtol=0, atol=0)


def test_dynamic_shapes_run_behind_the_boundary() -> None:
    # A plan is of the sizes it was captured at; under dynamic=True the traced sizes are
    # symbolic: the transform runs behind its boundary, for every size.
    model, (x,) = _mlp()
    transformed = simulate_fp8(unit_scale(model))
    params = list(transformed.parameters())
    expected, expected_grads = _step(transformed, (x,), params)
    _fresh_dynamo()
    compiled = torch.compile(transformed, backend="eager", dynamic=True)
    out, grads = _step(compiled, (x,), params)
    assert _boundary_only(_graph_breaks()), _graph_breaks()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)


def test_a_hook_on_the_wrapped_module_runs_behind_the_boundary() -> None:
    model, (x,) = _mlp()
    transformed = simulate_fp8(unit_scale(model))
    expected = transformed(x)
    seen: list[int] = []
    transformed.module.register_forward_hook(lambda module, args, out: seen.append(1))
    _fresh_dynamo()
    out = torch.compile(transformed, backend="eager")(x)
    assert _boundary_only(_graph_breaks()), _graph_breaks()
    assert seen == [1]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_a_replaced_submodule_recompiles_rather_than_reuse_the_inlined_graph() -> None:
    model, (x,) = _mlp()
    transformed = simulate_fp8(unit_scale(model))
    transformed(x)
    _fresh_dynamo()
    compiled = torch.compile(transformed, backend="eager")
    compiled(x)
    transformed.module[1] = nn.ReLU()  # the wrapped copy's activation, swapped
    torch.testing.assert_close(compiled(x), transformed(x), rtol=0, atol=0)
