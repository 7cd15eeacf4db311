"""A transformed module behaves like the module it wraps: containers stay containers, valid
code that changes a tensor in place runs, and a user's own error comes first."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch import Tensor, nn

from unitscale.transforms import simulate_fp8, track_scales, unit_scale


def test_a_transformed_sequential_indexes_iterates_and_has_a_length() -> None:
    sequential = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    scaled = unit_scale(sequential, mup=False)
    assert len(scaled) == 3
    assert scaled[0] is scaled.module[0] and isinstance(scaled[0], nn.Linear)
    assert isinstance(scaled[-1], nn.Linear) and scaled[-1].out_features == 4
    assert [type(m) for m in scaled] == [nn.Linear, nn.ReLU, nn.Linear]
    assert scaled[0] in list(scaled)
    assert len(scaled[0:2]) == 2
    assert bool(unit_scale(nn.Sequential(), mup=False))  # a module is true, even when empty


def test_a_transformed_module_list_and_dict_are_containers() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

        def forward(self, x: Tensor) -> Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    tracked = track_scales(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    assert len(tracked) == 2 and [m.in_features for m in tracked] == [4, 4]
    by_name = track_scales(nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.ReLU()}))
    assert "a" in by_name and "c" not in by_name
    assert isinstance(by_name["b"], nn.ReLU) and list(by_name) == ["a", "b"]
    assert len(by_name) == 2
    # A module that is no container says so, as the module itself does.
    holder = unit_scale(Holder(), mup=False)
    with pytest.raises(TypeError, match="Holder"):
        len(holder)
    with pytest.raises(TypeError, match="Holder"):
        holder[0]


class InPlaceResidual(nn.Module):
    """Valid code that changes the residual stream in place: ``skip`` is the same tensor as
    ``x``, so it sees ``+= 1`` and ``*= 2`` too."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        x = self.a(x)
        skip = x
        x += 1
        x.mul_(2)
        return self.b(x) + skip


class OutOfPlaceResidual(InPlaceResidual):
    def forward(self, x: Tensor) -> Tensor:
        x = (self.a(x) + 1) * 2
        return self.b(x) + x


def test_unit_scale_runs_in_place_changes_of_the_residual_stream() -> None:
    plain = InPlaceResidual()
    x = torch.randn(8, 16)
    twin = OutOfPlaceResidual()
    twin.load_state_dict(plain.state_dict())
    assert torch.equal(plain(x), twin(x))  # the out-of-place twin computes the same values
    scaled, scaled_twin = unit_scale(plain, mup=False), unit_scale(twin, mup=False)
    scaled_twin.load_state_dict(scaled.state_dict())
    inputs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    out, expected = scaled(inputs[0]), scaled_twin(inputs[1])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not torch.allclose(out, plain(x))  # unit-scaled, not run as written
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(inputs[0].grad, inputs[1].grad, rtol=0, atol=0)
    for (name, p), q in zip(scaled.named_parameters(), scaled_twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_in_place_changes_of_an_input_stay_in_place() -> None:
    class AddsToInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            x += 1
            return self.a(x)

    x = torch.zeros(2, 4)
    unit_scale(AddsToInput(), mup=False)(x)
    assert torch.equal(x, torch.ones(2, 4))  # the caller sees the change, as in plain torch


def test_unit_scale_after_simulate_fp8_is_refused_with_the_order_and_the_reason() -> None:
    from unitscale.errors import CaptureError
    from unitscale.transforms import simulate_fp8

    model = nn.Sequential(nn.Linear(4, 4))
    reason = r"the other order has no meaning, as unit_scale would replace the ops"
    with pytest.raises(CaptureError, match=rf"simulate_fp8\(unit_scale\(model\)\); {reason}"):
        unit_scale(simulate_fp8(model))
    outer = nn.Sequential(simulate_fp8(nn.Linear(4, 4)))
    with pytest.raises(CaptureError, match=rf"submodule '0'.*{reason}"):
        unit_scale(outer)


class WrongShape(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x.view(3, 5))  # the user's own mistake


@pytest.mark.parametrize("transform", [unit_scale, track_scales])
def test_a_users_own_error_comes_first_and_alone(transform: object) -> None:
    import traceback

    model = transform(WrongShape())  # type: ignore[operator]
    with pytest.raises(RuntimeError, match=r"shape '\[3, 5\]' is invalid") as caught:
        model(torch.randn(8, 16))
    error = caught.value
    from unitscale.errors import CaptureError

    assert not isinstance(error, CaptureError)
    assert error.__cause__ is None and error.__suppress_context__
    text = "".join(traceback.format_exception(error))
    assert "_dynamo" not in text and "fake" not in text.lower()
    assert "x.view(3, 5)" in text  # the user's source line, last in the traceback
    assert text.rstrip().splitlines()[-1].startswith(("RuntimeError", "(raised by WrongShape"))


def test_torch_compile_of_a_transformed_module_matches_eager() -> None:
    # torch.compile traces the transformed module's forward (whose signature is the wrapped
    # module's, for code that reads it): it must trace it as a plain bound method.
    torch.manual_seed(0)
    model = simulate_fp8(unit_scale(nn.Sequential(nn.Linear(16, 32), nn.GELU())))
    x = torch.randn(4, 16)
    torch.testing.assert_close(torch.compile(model)(x), model(x), rtol=0, atol=0)


class WrongMatmul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x))  # the user's mistake: b takes 8 features, a gives 4


@pytest.mark.parametrize("transform", [unit_scale, track_scales, simulate_fp8])
def test_a_users_shape_error_logs_nothing_of_torchs_internals(
    transform: object, capfd: pytest.CaptureFixture[str]
) -> None:
    # torch logged an ERROR with a 20-line traceback from torch._subclasses.fake_tensor
    # ("failed while attempting to run meta for aten.mm.default") before the user's error.
    import logging

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    records: list[logging.LogRecord] = []
    names = ("torch._subclasses.fake_tensor", "torch._dynamo", "torch._dynamo.convert_frame")
    collect = Collect(logging.DEBUG)
    for name in names:
        logging.getLogger(name).addHandler(collect)
    try:
        model = transform(WrongMatmul())  # type: ignore[operator]
        capfd.readouterr()
        with pytest.raises(RuntimeError, match=r"cannot be multiplied \(2x4 and 8x4\)"):
            model(torch.randn(2, 8))
        err = capfd.readouterr().err
        assert "fake_tensor" not in err and "Traceback" not in err, err
        assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
        # Outside a capture, torch's loggers still log.
        logging.getLogger("torch._subclasses.fake_tensor").error("a log line of torch's own")
        assert [r.getMessage() for r in records] == ["a log line of torch's own"]
    finally:
        for name in names:
            logging.getLogger(name).removeHandler(collect)


class _Predictor(nn.Module):
    """A model whose own methods call it: ``self(...)`` and ``self.forward(...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.linear(x)) + x

    def predict(self, x: Tensor) -> Tensor:
        return self(x)

    def forward_twice(self, x: Tensor) -> Tensor:
        return self.forward(self.predict(x))

    def width(self) -> int:
        return self.linear.in_features


@pytest.mark.parametrize("transform", [unit_scale, simulate_fp8, track_scales])
def test_a_models_own_methods_call_the_transformed_forward(transform: object) -> None:
    # Methods of the wrapped module (transformers' generate(), a user's predict()) are looked up
    # on it: what they call of the module itself must run transformed, not as the copy was.
    torch.manual_seed(0)
    model = transform(_Predictor())  # type: ignore[operator]
    x = torch.randn(4, 8) * 3
    with torch.no_grad():
        transformed = model(x)
        if transform is not track_scales:  # tracking keeps the outputs: its calls are counted
            assert not torch.equal(transformed, model.module(x))  # else this shows nothing
        calls = model.capture.calls
        torch.testing.assert_close(model.predict(x), transformed, rtol=0, atol=0)
        torch.testing.assert_close(model.forward_twice(x), model(model(x)), rtol=0, atol=0)
        assert model.capture.calls == calls + 1 + 2 + 2
    assert model.width() == 8 and model.predict.__name__ == "predict"
    assert "forward" not in model.module.__dict__  # the route is gone after the call


def test_an_instance_forward_of_the_wrapped_module_is_kept_through_a_method() -> None:
    # A forward set on the instance (as accelerate's hooks do) is what the transform runs,
    # during a method call as outside one, and it is there again after.
    torch.manual_seed(0)
    model = track_scales(_Predictor())
    inner = model.module
    calls: list[int] = []
    original = inner.forward

    def forward(x: Tensor) -> Tensor:
        calls.append(1)
        return original(x)

    inner.forward = forward
    x = torch.randn(2, 8)
    model.predict(x)
    assert calls and inner.__dict__["forward"] is forward
    assert len(model.scales_graph().nodes) > 0  # the call was tracked


class _Overlapping(_Predictor):
    """``predict`` of two threads at once: the first returns while the second is inside
    (class attributes: the transforms copy the instance, and locks do not copy)."""

    inside = threading.Barrier(2)
    first_done = threading.Event()

    def predict_in_turn(self, x: Tensor, first: bool) -> Tensor:
        self.inside.wait(timeout=30)
        if first:
            return x
        self.first_done.wait(timeout=30)  # the first call has returned: its state is gone
        return self(x)


def test_two_threads_run_a_transformed_models_method_at_once() -> None:
    torch.manual_seed(0)
    model = unit_scale(_Overlapping())
    x = torch.randn(4, 8) * 3
    with torch.no_grad():
        expected = model(x)
        assert not torch.equal(expected, model.module(x))
        results: dict[bool, Tensor] = {}

        def run(first: bool) -> None:
            results[first] = model.predict_in_turn(x, first)
            if first:
                _Overlapping.first_done.set()

        threads = [threading.Thread(target=run, args=(first,)) for first in (True, False)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
    torch.testing.assert_close(results[False], expected, rtol=0, atol=0)
    assert "forward" not in model.module.__dict__


def test_a_method_that_keeps_self_forward_keeps_the_transformed_forward() -> None:
    class Keeping(_Predictor):
        def keep(self) -> None:
            self.kept = self.forward  # as a hook or a cache of a library may

    torch.manual_seed(0)
    model = unit_scale(Keeping())
    x = torch.randn(4, 8) * 3
    model.keep()
    inner = model.module
    assert "forward" not in inner.__dict__  # nothing was set on the module for the call
    with torch.no_grad():
        torch.testing.assert_close(inner.kept(x), model(x), rtol=0, atol=0)
    assert "forward" not in inner.__dict__  # and calling what was kept sets nothing either
    assert model.predict(x).shape == x.shape and isinstance(model.module, Keeping)
    replaced = Keeping()  # a wrapped module set anew: its methods see the new one
    model.module = replaced
    assert model.width() == 8 and model.module is replaced
    model.keep()
    assert "kept" in replaced.__dict__ and "forward" not in replaced.__dict__


def test_generate_of_a_transformers_model_runs_the_transformed_forward() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    model = unit_scale(transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
        greedy = ids
        for _ in range(4):  # greedy decoding through the transformed forward
            next_id = model(greedy).logits[:, -1].argmax(-1, keepdim=True)
            greedy = torch.cat([greedy, next_id], dim=1)
        copy = model.module.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
        calls = model.capture.calls
        model.generate(ids, max_new_tokens=4, do_sample=False)  # with a key-value cache
    assert generated.tolist() == greedy.tolist()
    assert model.capture.calls == calls + 4  # every step ran the unit-scaled model
    assert copy.tolist() != greedy.tolist()  # the untransformed copy decodes otherwise


_AFTER_AN_LSTM = textwrap.dedent(
    """
    import warnings
    import torch
    from torch import nn
    from unitscale.transforms import unit_scale

    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    if {plain_first}:  # the user's own torch.compile of a module Dynamo gives up on
        torch.compile(nn.LSTM(8, 8), backend="eager")(torch.randn(2, 3, 8))
    else:
        unit_scale(nn.LSTM(8, 8), mup=False)(torch.randn(2, 3, 8))  # said: nothing captured
    mlp = unit_scale(nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 32)), mup=False)
    out = mlp(torch.randn(64, 32))
    graphs = []
    torch.compile(nn.Sequential(nn.Linear(4, 4)), backend=lambda gm, _: graphs.append(gm) or gm)(
        torch.randn(2, 4)
    )
    print(len(mlp.capture.pieces), round(out.std().item(), 1), len(graphs))
    """
)


@pytest.mark.parametrize("plain_first", [False, True])
def test_a_module_dynamo_gives_up_on_leaves_later_transforms_whole(plain_first: bool) -> None:
    # torch.compile runs every torch.nn-class module through one shared wrapper function, and
    # Dynamo marks its code to be skipped when it captures nothing at the top (an nn.LSTM):
    # every torch.nn module compiled after that ran eagerly, so unit_scale of an MLP did
    # nothing. Each transform has a top frame of its own: neither an LSTM it transformed nor
    # one the user compiled stops later transforms (nor the user's own torch.compile, after
    # an LSTM unitscale transformed). A fresh process: the user's compile marks torch's code.
    script = _AFTER_AN_LSTM.format(plain_first=plain_first)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    pieces, std, user_graphs = result.stdout.split()
    assert int(pieces) == 1 and float(std) == 1.0
    if not plain_first:
        assert int(user_graphs) == 1


# torch.compile of a transformed model, traced whole or behind its boundary: see
# test_torch_compile_inline.py.


def test_every_summary_accepts_what_torch_compile_returns() -> None:
    from unitscale.tracking import tracking_coverage
    from unitscale.transforms import fp8_summary, scaling_cost, unit_scale_summary

    torch.manual_seed(0)
    x = torch.randn(4, 8)
    fp8 = simulate_fp8(unit_scale(_Predictor()), scaling="tensorwise")
    fp8(x)
    compiled = torch.compile(fp8, backend="eager")
    assert fp8_summary(compiled) == fp8_summary(fp8)
    assert unit_scale_summary(compiled) == unit_scale_summary(fp8)
    assert scaling_cost(compiled) == scaling_cost(fp8)
    tracked = track_scales(_Predictor())
    tracked(x)
    assert tracking_coverage(torch.compile(tracked)) == tracking_coverage(tracked)
