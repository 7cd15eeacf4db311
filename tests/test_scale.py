"""unitscale.scale: the forward/backward scaling primitive."""

from __future__ import annotations

import pytest
import torch

from unitscale.scale import scale_bwd, scale_fwd, scale_fwd_bwd


def _grad(y: torch.Tensor, x: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(y, x, upstream)
    return grad


@pytest.mark.parametrize(("fwd", "bwd"), [(2.0, 0.5), (0.25, 3.0), (1.0, 0.125), (8.0, 1.0)])
def test_scale_fwd_bwd_is_exact(fwd: float, bwd: float) -> None:
    x = torch.randn(5, 7, requires_grad=True)
    upstream = torch.randn(5, 7)
    y = scale_fwd_bwd(x, fwd, bwd)
    assert torch.equal(y, x * fwd)
    assert torch.equal(_grad(y, x, upstream), upstream * bwd)


def test_scale_fwd_and_scale_bwd() -> None:
    x = torch.randn(6, requires_grad=True)
    upstream = torch.randn(6)
    y = scale_fwd(x, 3.0)
    assert torch.equal(y, x * 3.0)
    assert torch.equal(_grad(y, x, upstream), upstream)
    y = scale_bwd(x, 0.5)
    assert torch.equal(y, x)
    assert torch.equal(_grad(y, x, upstream), upstream * 0.5)


def test_unit_scales_cost_nothing() -> None:
    x = torch.randn(3, requires_grad=True)
    assert scale_fwd_bwd(x, 1.0, 1.0) is x


def test_equal_scales_are_a_plain_multiplication() -> None:
    x = torch.randn(3, requires_grad=True)
    y = scale_fwd_bwd(x, 0.5, 0.5)
    assert y.grad_fn is not None and y.grad_fn.name() == "MulBackward0"
    assert torch.equal(_grad(y, x, torch.ones(3)), torch.full((3,), 0.5))


def test_without_grad_only_the_forward_scale_applies() -> None:
    x = torch.randn(4)
    assert torch.equal(scale_fwd_bwd(x, 2.0, 5.0), 2.0 * x)
    assert scale_bwd(x, 5.0) is x
    with torch.no_grad():
        assert torch.equal(scale_fwd_bwd(x.requires_grad_(), 2.0, 5.0), 2.0 * x)


def test_input_is_not_mutated() -> None:
    x = torch.randn(4, requires_grad=True)
    before = x.detach().clone()
    scale_fwd_bwd(x, 3.0, 0.5).sum().backward()
    assert torch.equal(x.detach(), before)


def test_tensor_scale_is_rejected() -> None:
    with pytest.raises(TypeError, match="fwd_scale must be a Python number"):
        scale_fwd_bwd(torch.ones(2), torch.tensor(2.0), 1.0)  # type: ignore[arg-type]


def test_compiles_to_one_graph_with_the_same_gradient() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(
        lambda t: scale_fwd_bwd(t, 2.0, 0.25) * t, backend=counter, fullgraph=True
    )
    x = torch.randn(8, requires_grad=True)
    y = compiled(x)
    (grad,) = torch.autograd.grad(y.sum(), x)
    # d/dx [s(x) * x] with s scaling forward by 2 and backward by 0.25: 0.25 x + 2 x
    assert counter.frame_count == 1
    assert torch.allclose(y, 2.0 * x * x)
    assert torch.allclose(grad, 2.25 * x)
    torch._dynamo.reset()


def test_inplace_scales_an_owned_result_without_a_copy() -> None:
    x = torch.randn(4, requires_grad=True)
    fresh = x * 3.0  # an op's own result
    y = scale_fwd_bwd(fresh, 0.5, 0.5, inplace=True)
    assert y is fresh
    assert torch.allclose(y, 1.5 * x)
    assert torch.equal(_grad(y, x, torch.ones(4)), torch.full((4,), 1.5))
    # unequal scales still go through the autograd function, out of place
    fresh = x * 3.0
    assert scale_fwd_bwd(fresh, 0.5, 2.0, inplace=True) is not fresh


# -- torch.func -----------------------------------------------------------------------------


@pytest.mark.parametrize(("fwd", "bwd"), [(2.0, 0.5), (1.0, 3.0), (0.25, 1.0)])
def test_torch_func_grad_gives_the_scaled_gradient(fwd: float, bwd: float) -> None:
    x = torch.randn(5)
    weights = torch.arange(5.0)
    got = torch.func.grad(lambda t: (scale_fwd_bwd(t, fwd, bwd) * weights).sum())(x)
    leaf = x.clone().requires_grad_()
    (scale_fwd_bwd(leaf, fwd, bwd) * weights).sum().backward()
    assert leaf.grad is not None
    assert torch.equal(got, leaf.grad)
    assert torch.equal(got, weights * bwd)


def test_per_sample_gradients_under_vmap_match_a_loop() -> None:
    x = torch.randn(4, 3)
    weights = torch.tensor([1.0, -2.0, 3.0])

    def loss(row: torch.Tensor) -> torch.Tensor:
        return (scale_fwd_bwd(row.square(), 2.0, 0.5) * weights).sum()

    batched = torch.vmap(torch.func.grad(loss))(x)
    for i in range(4):
        assert torch.equal(batched[i], torch.func.grad(loss)(x[i]))
    assert torch.equal(batched, 2 * x * weights * 0.5)


def test_torch_func_forward_mode_differentiates_the_forward_computation() -> None:
    """Under ``torch.func.jvp``/``jacfwd`` no input needs a gradient, so the scaling is the
    plain multiplication: a tangent is scaled by the forward scale. Reverse mode gives the
    backward scale."""
    x, tangent = torch.randn(4), torch.randn(4)
    _, out = torch.func.jvp(lambda t: scale_fwd_bwd(t, 3.0, 0.5), (x,), (tangent,))
    assert torch.equal(out, tangent * 3.0)
    jacfwd = torch.func.jacfwd(lambda t: scale_fwd_bwd(t, 3.0, 0.5))(x)
    jacrev = torch.func.jacrev(lambda t: scale_fwd_bwd(t, 3.0, 0.5))(x)
    assert torch.equal(jacfwd, torch.eye(4) * 3.0)
    assert torch.equal(jacrev, torch.eye(4) * 0.5)
