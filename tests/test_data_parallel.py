"""The data-parallel size and gradient accumulation that unit-scaled ops scale gradients by.

Single-process checks (the multi-rank ones are in ``tests/distributed``): the factor of every
shared tensor at a local batch of 1, gradient accumulation against the whole batch, the
settings' validation and compiled graphs following the settings.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

import unitscale as us
import unitscale.functional as U
from unitscale.data_parallel import (
    data_parallel_size,
    gradient_accumulation,
    gradient_accumulation_steps,
    set_data_parallel,
    set_gradient_accumulation,
)
from unitscale.errors import UnitScaleError
from unitscale.models import GPTConfig, plain_gpt, unit_scaled_gpt
from unitscale.transforms import unit_scale

CONFIG = GPTConfig(vocab_size=64, hidden_size=32, depth=1, heads=2, seq_len=8, aligned_labels=True)


@pytest.fixture(autouse=True)
def _restore_settings() -> Iterator[None]:
    yield
    set_data_parallel()
    set_gradient_accumulation()


def _grads(
    model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor
) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(ids, labels=labels).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("local_batch", [1, 2])
def test_every_shared_gradient_takes_the_same_factor(local_batch: int) -> None:
    """With ids (1, 8), the embedding's factor was 1.0 where a linear's was
    2.0 under ``set_data_parallel(size=4)``. Now every count-scaled parameter gradient (token
    embedding, linears, norms) takes ``size / sqrt(size)`` = 2 and the position embedding,
    whose gradient is summed over the batch by the add's true (to_output_scale) gradient,
    takes ``size`` = 4, whatever the local batch (before: 1.0 and 1.0 at a local batch of 1)."""
    torch.manual_seed(0)
    model = unit_scaled_gpt(CONFIG, seed=0)
    ids = torch.randint(0, CONFIG.vocab_size, (local_batch, CONFIG.seq_len + 1))
    one = _grads(model, ids[:, :-1], ids[:, 1:])
    set_data_parallel(size=4)
    four = _grads(model, ids[:, :-1], ids[:, 1:])
    ratios = {name: float(four[name].norm() / one[name].norm()) for name in one}
    expected = {name: 4.0 if name == "position_embedding.weight" else 2.0 for name in one}
    assert len(ratios) > 5
    assert ratios == pytest.approx(expected, rel=1e-5)


def test_broadcast_add_at_local_batch_one_is_shared() -> None:
    """A ``(T, D)`` tensor added to ``(1, T, D)`` activations is broadcast along the batch
    (size 1 locally, ``size`` globally): its gradient takes the data-parallel size (the add's
    default constraint gives true gradients: factor ``size``), the activation's does not."""
    x = torch.randn(1, 8, 4, requires_grad=True)
    pos = torch.randn(8, 4, requires_grad=True)
    grad = torch.randn(1, 8, 4)
    U.add(x, pos).backward(grad)
    one_x, one_pos = x.grad.clone(), pos.grad.clone()
    x.grad = pos.grad = None
    set_data_parallel(size=4)
    U.add(x, pos).backward(grad)
    torch.testing.assert_close(x.grad, one_x)
    torch.testing.assert_close(pos.grad, 4 * one_pos)


@pytest.mark.parametrize("build", ["modules", "unit_scale"])
def test_accumulated_gradients_equal_the_whole_batch(build: str) -> None:
    """4 micro-batches under ``set_gradient_accumulation(4)``, loss not
    divided, give the whole batch's gradients (within float32 tolerance, so also its scale);
    without the setting they come out sqrt(4) = 2 times too large."""
    torch.manual_seed(0)
    model = (
        unit_scaled_gpt(CONFIG, seed=0)
        if build == "modules"
        else unit_scale(plain_gpt(CONFIG, seed=0), trainable_norms=True)
    )
    ids = torch.randint(
        0, CONFIG.vocab_size, (8, CONFIG.seq_len + 1), generator=torch.Generator().manual_seed(1)
    )
    inputs, labels = ids[:, :-1], ids[:, 1:]
    whole = _grads(model, inputs, labels)

    def accumulate() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        for micro in range(4):
            rows = slice(2 * micro, 2 * micro + 2)
            model(inputs[rows], labels=labels[rows]).backward()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    with gradient_accumulation(4):
        accumulated = accumulate()
    naive = accumulate()
    assert sorted(accumulated) == sorted(whole)
    for name, value in whole.items():
        error = float((accumulated[name] - value).norm() / value.norm())
        assert error < 1e-5, (name, error)
    # Without it: count-scaled gradients sqrt(4) = 2 times the whole batch's (the position
    # embedding's, summed by the add's true gradient, is right either way).
    ratios = {n: float(naive[n].norm() / whole[n].norm()) for n in whole}
    expected = {n: 1.0 if n.startswith("position_embedding") else 2.0 for n in whole}
    assert ratios == pytest.approx(expected, rel=1e-5)


def test_process_group_alone_applies_no_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The size comes from explicit state, not from ``torch.distributed`` being initialised:
    a world of 4 with no DDP forward running and no ``set_data_parallel`` gives 1."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 4)
    assert data_parallel_size() == 1
    set_data_parallel(size=4)
    assert data_parallel_size() == 4


def test_compiled_module_follows_the_setting() -> None:
    """Under Dynamo's eager backend (as ``track_scales`` and ``unit_scale`` run their graphs)
    the unit-scaled ops read the setting when called: a module compiled at size 1 follows
    a change of size and of accumulation (weight gradient x size / sqrt(size * steps))."""
    torch.manual_seed(0)
    layer = us.Linear(16, 8)
    compiled = torch.compile(copy.deepcopy(layer), backend="eager", fullgraph=True)
    x = torch.randn(4, 16)
    compiled(x).sum().backward()
    at_one = compiled.weight.grad.clone()
    compiled.weight.grad = None
    set_data_parallel(size=4)
    compiled(x).sum().backward()
    assert float(compiled.weight.grad.norm() / at_one.norm()) == pytest.approx(2.0, rel=1e-6)
    compiled.weight.grad = None
    set_data_parallel()
    set_gradient_accumulation(4)
    compiled(x).sum().backward()
    assert float(compiled.weight.grad.norm() / at_one.norm()) == pytest.approx(0.5, rel=1e-6)


@pytest.mark.slow  # three Inductor compiles
def test_compiling_backend_follows_the_size_in_modules_and_bakes_it_in_bare_ops() -> None:
    """Inductor folds the factor into the compiled backward. A unitscale module reads the
    setting in its forward, where Dynamo guards on it: a change of size compiles it again.
    The documented limit: a compiled function calling a unit-scaled op directly (one opaque
    node for Dynamo, so no guard) keeps the first call's factor until
    ``torch.compiler.reset()``."""
    torch.manual_seed(0)
    layer = us.Linear(16, 8)
    x = torch.randn(4, 16)
    compiled = torch.compile(copy.deepcopy(layer), fullgraph=True)
    weight = layer.weight.detach().clone().requires_grad_()
    bare = torch.compile(lambda t, w: U.linear(t, w), fullgraph=True)
    compiled(x).sum().backward()
    bare(x, weight).sum().backward()
    at_one, bare_at_one = compiled.weight.grad.clone(), weight.grad.clone()
    compiled.weight.grad = weight.grad = None
    set_data_parallel(size=4)
    compiled(x).sum().backward()
    bare(x, weight).sum().backward()
    assert float(compiled.weight.grad.norm() / at_one.norm()) == pytest.approx(2.0, rel=1e-6)
    assert torch.equal(weight.grad, bare_at_one)
    weight.grad = None
    torch.compiler.reset()
    bare(x, weight).sum().backward()
    assert float(weight.grad.norm() / bare_at_one.norm()) == pytest.approx(2.0, rel=1e-6)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_settings_are_clear_errors(bad: object) -> None:
    with pytest.raises(UnitScaleError, match=r"set_gradient_accumulation: steps=.* positive int"):
        set_gradient_accumulation(bad)  # type: ignore[arg-type]
    with pytest.raises(UnitScaleError, match=r"set_data_parallel: size=.* positive int"):
        set_data_parallel(size=bad)  # type: ignore[arg-type]
    assert gradient_accumulation_steps() == 1 and data_parallel_size() == 1
