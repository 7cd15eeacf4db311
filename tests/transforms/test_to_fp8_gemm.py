"""to_fp8's float8 GEMMs as a GPU runs them: CUDA's rules of ``_scaled_mm`` checked on every
device, padding to them (any shape converts), fast accumulation, the capability trial, and
torchao's rowwise recipes (bit for bit against torchao on the CPU)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from unitscale.formats import FormatError
from unitscale.transforms import fp8_summary, to_fp8
from unitscale.transforms.lowp import _gemm
from unitscale.transforms.lowp import _scaled_mm as _mm
from unitscale.transforms.lowp._to_fp8 import ToFP8Pass

pytestmark = pytest.mark.skipif(
    _gemm.float8_device_error("cpu") is not None,
    reason=f"no float8 GEMM on this CPU: {_gemm.float8_device_error('cpu')}",
)

E4, E5 = _mm.E4M3_DTYPE, _mm.E5M2_DTYPE
ONE = torch.ones(())
_NO_ROWWISE = _mm.float8_device_error("cpu", rowwise=True)


def _needs_rowwise(scaling: str | bool) -> None:
    """Skip where this torch's CPU kernel has no rowwise scales (torch 2.8's has not)."""
    if scaling in (True, "rowwise", "rowwise_with_gw_hp") and _NO_ROWWISE is not None:
        pytest.skip(f"no rowwise float8 GEMM on this CPU: {_NO_ROWWISE}")


def test_rowwise_is_refused_with_the_reason_where_the_cpu_has_none() -> None:
    if _NO_ROWWISE is None:
        assert to_fp8(nn.Linear(4, 4), scaling="rowwise") is not None
        return
    with pytest.raises(FormatError, match=r"rowwise scales.*simulate_fp8"):
        to_fp8(nn.Linear(4, 4), scaling="rowwise")


def _f8(rows: int, cols: int, dtype: Any = None, seed: int = 0) -> Tensor:
    torch.manual_seed(seed)
    return torch.randn(rows, cols).to(dtype or E4)


def _col(x: Tensor) -> Tensor:
    return x.t().contiguous().t()


@pytest.mark.parametrize(
    "a, b, scales, out, match",
    [
        (_f8(32, 24), _col(_f8(24, 16)), (ONE, ONE), torch.float32, "inner dimension 24"),
        (_f8(32, 16), _col(_f8(16, 24)), (ONE, ONE), torch.float32, "output columns 24"),
        (_col(_f8(32, 16)), _col(_f8(16, 16)), (ONE, ONE), torch.float32, "not row-major"),
        (_f8(32, 16), _f8(16, 16), (ONE, ONE), torch.float32, "not column-major"),
        (_f8(32, 16, E5), _col(_f8(16, 16, E5)), (ONE, ONE), torch.float32, "both operands"),
        (_f8(32, 16), _col(_f8(16, 16)), (ONE, ONE), torch.float64, "output dtype"),
        (_f8(32, 16), _col(_f8(16, 16)), (ONE.double(), ONE), torch.float32, "float32"),
        (_f8(32, 16), _col(_f8(16, 16)), (ONE[None], ONE), torch.float32, "0-dimensional"),
        (
            _f8(32, 16),
            _col(_f8(16, 16)),
            (torch.ones(32, 1), torch.ones(1, 16)),
            torch.float32,
            "rowwise scales write bfloat16",
        ),
        (
            _f8(32, 16),
            _col(_f8(16, 16)),
            (torch.ones(1, 32), torch.ones(1, 16)),
            torch.bfloat16,
            r"rowwise \(32, 1\)",
        ),
    ],
)
def test_a_gemm_cuda_refuses_is_refused_on_the_cpu_too(
    a: Tensor, b: Tensor, scales: tuple[Tensor, Tensor], out: Any, match: str
) -> None:
    """The CPU kernel would take every one of these; CUDA's ``_scaled_mm`` would not."""
    assert _mm.scaled_mm_error(a, b, *scales, out) is not None
    with pytest.raises(FormatError, match=match):
        _mm.scaled_mm(a, b, *scales, out)


def test_gemms_cuda_takes_pass_the_rules() -> None:
    a, b = _f8(7, 32), _col(_f8(32, 48))  # any number of rows
    assert _mm.scaled_mm_error(a, b, ONE, ONE, torch.float32) is None
    rowwise = (torch.ones(7, 1), torch.ones(1, 48))
    assert _mm.scaled_mm_error(a, b, *rowwise, torch.bfloat16) is None
    assert _mm.scaled_mm_error(_f8(7, 32, E5), b, ONE, ONE, torch.float16) is None


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("shape", [(7, 33, 17), (1, 5, 3), (16, 170, 64)])
def test_padding_is_exact(shape: tuple[int, int, int], rowwise: bool) -> None:
    """Zero-padding K and N to multiples of 16 gives the CPU kernel's unpadded result, bit
    for bit (the unpadded call, which CUDA refuses, made straight to the kernel)."""
    _needs_rowwise(rowwise)
    m, k, n = shape
    a, b = _f8(m, k, seed=1), _f8(n, k, seed=2).t()
    if rowwise:
        sa, sb, out = torch.rand(m, 1) + 0.5, torch.rand(1, n) + 0.5, torch.bfloat16
    else:
        sa, sb, out = torch.tensor(0.3), torch.tensor(0.0767), torch.float32
    expected = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out)
    assert torch.equal(_mm.padded_mm(a, b, sa, sb, out), expected)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Record every ``_scaled_mm`` call (its arguments) and check it against CUDA's rules."""
    calls: list[tuple[Any, ...]] = []
    real = _mm._call
    for rowwise in (False, True):  # the capability trials, before recording
        _mm.float8_device_error("cpu", rowwise=rowwise)

    def call(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, out: Any, fast: bool) -> Tensor:
        assert _mm.scaled_mm_error(a, b, sa, sb, out) is None
        calls.append((tuple(a.shape), tuple(b.shape), out, fast))
        return real(a, b, sa, sb, out, fast)

    monkeypatch.setattr(_mm, "_call", call)
    return calls


@pytest.mark.parametrize("scaling", ["none", "tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_odd_shapes_convert_and_every_gemm_meets_cudas_rules(
    monkeypatch: pytest.MonkeyPatch, scaling: str
) -> None:
    _needs_rowwise(scaling)
    torch.manual_seed(0)
    stack = nn.Sequential(nn.Linear(33, 17), nn.GELU(), nn.Linear(17, 5))
    calls = _spy(monkeypatch)
    model = to_fp8(stack, scaling=scaling)  # type: ignore[arg-type]
    x = torch.randn(3, 7, 33, requires_grad=True)  # 21 rows
    model(x).square().sum().backward()
    assert fp8_summary(model).converted_flop_share == 1.0
    gemms = 3 * 2 if scaling != "rowwise_with_gw_hp" else 2 * 2  # grad_W in high precision
    assert len(calls) == gemms
    assert all(a[1] % 16 == 0 and b[1] % 16 == 0 for a, b, _, _ in calls)


def test_fast_accumulation_is_the_forward_gemms_and_changes_nothing_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    stack = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))
    x = torch.randn(8, 32)
    results = []
    for fast in (True, False):
        calls = _spy(monkeypatch)
        model = to_fp8(copy.deepcopy(stack), scaling="tensorwise", fast_accum=fast)
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.square().sum().backward()
        # forward GEMMs first (two layers), then the backward's four
        assert [c[3] for c in calls] == [fast, fast] + [False] * 4
        results.append([out, xi.grad, *(p.grad for p in model.parameters())])
        monkeypatch.undo()
    for ours, theirs in zip(*results, strict=True):
        assert torch.equal(ours, theirs)
    assert "fast_accum=True" in repr(ToFP8Pass())


def test_the_trial_caches_definite_answers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def out_of_memory(*args: Any) -> Tensor:
        calls.append(1)
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 MiB")

    _mm._TRIALS.clear()
    monkeypatch.setattr(_mm, "_call", out_of_memory)
    try:
        for _ in range(2):
            error = _mm.float8_device_error("cpu")
            assert error is not None and "out of memory" in error
        assert len(calls) == 2  # tried again: a transient failure is not cached
        monkeypatch.undo()
        assert _mm.float8_device_error("cpu") is None  # and the next trial passes
        monkeypatch.setattr(_mm, "_call", out_of_memory)
        assert _mm.float8_device_error("cpu") is None  # a definite answer: cached
        assert len(calls) == 2
    finally:
        _mm._TRIALS.clear()


def _torchao() -> Any:
    try:
        import torchao.float8 as float8
    except Exception as error:  # missing, or too old/new for this torch
        pytest.skip(f"torchao (the reference of the rowwise recipes) does not import: {error}")
    return float8


def _step(model: nn.Module, x: Tensor, grad: Tensor) -> list[Tensor]:
    xi = x.clone().requires_grad_()
    out = model(xi)
    out.backward(grad)
    return [out.detach(), xi.grad, *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("dims", [(32, 64, 16), (33, 17, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_equals_torchao_bit_for_bit(
    recipe: str, dtype: torch.dtype, dims: tuple[int, int, int]
) -> None:
    """The same casts (per row or column, power-of-two scales, E4M3 gradients), the same
    ``_scaled_mm`` calls (bfloat16 results for float32 models, unit scales and a multiply
    after the backward's GEMMs), and for ``_with_gw_hp`` the weight gradient unrounded:
    outputs and every gradient bit for bit, 3-D inputs, odd shapes padded by to_fp8 and not
    by torchao."""
    float8 = _torchao()
    _needs_rowwise(recipe)
    torch.manual_seed(0)
    d_in, hidden, d_out = dims
    stack = nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, d_out))
    stack = stack.to(dtype)
    x = (torch.randn(2, 8, d_in) * 30).to(dtype)
    grad = (torch.randn(2, 8, d_out) * 1e-3).to(dtype)
    config = float8.Float8LinearConfig.from_recipe_name(recipe)
    theirs = _step(float8.convert_to_float8_training(copy.deepcopy(stack), config=config), x, grad)
    ours = _step(to_fp8(copy.deepcopy(stack), scaling=recipe), x, grad)  # type: ignore[arg-type]
    assert ours[0].dtype == dtype
    for mine, reference in zip(ours, theirs, strict=True):
        assert torch.equal(mine, reference)
    # and not tensorwise's numbers
    tensorwise = _step(to_fp8(copy.deepcopy(stack), scaling="tensorwise"), x, grad)
    assert not torch.equal(ours[0], tensorwise[0])


def test_autocast_casts_the_input_and_writes_bf16_as_torchao_does() -> None:
    """Under ``torch.autocast`` (bfloat16) a float32 linear op converts: the input cast to
    bfloat16 then E4M3, the weight cast to E4M3 from float32, the products accumulated in
    FP32 and rounded once to bfloat16 (torchao's ``Float8Linear``, cuBLAS): bit for bit
    against that arithmetic written out; the gradients in the leaves' dtypes."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 48, bias=False)
    x = torch.randn(2, 16, 64, requires_grad=True)
    model = to_fp8(copy.deepcopy(layer))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().sum().backward()
    w8 = layer.weight.detach().to(E4)
    x8 = x.detach().to(torch.bfloat16).to(E4)
    expected = (x8.float() @ w8.float().t()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert x.grad is not None and x.grad.dtype == torch.float32
    weight_grad = next(model.parameters()).grad
    assert weight_grad is not None and weight_grad.dtype == torch.float32
    assert fp8_summary(model).converted_flop_share == 1.0


def _deviation(ours: dict[str, Tensor], theirs: dict[str, Tensor]) -> dict[str, float]:
    return {
        name: ((ours[name].float() - t.float()).norm() / t.float().norm()).item()
        for name, t in theirs.items()
    }


def _loss_and_grads(model: nn.Module, autocast: bool, **kwargs: Any) -> dict[str, Tensor]:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(**kwargs)
    loss = getattr(out, "loss", out)
    loss.float().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), **grads}


def _bf16_models() -> dict[str, Any]:
    import unitscale
    from unitscale.transforms import unit_scale

    def decoder() -> nn.Module:
        torch.manual_seed(0)
        return unitscale.TransformerDecoder(64, depth=1, heads=4, vocab_size=128)

    def llama() -> nn.Module:
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
            vocab_size=128, num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        return unit_scale(transformers.LlamaForCausalLM(config))

    return {"decoder": decoder, "llama": llama}


@pytest.mark.parametrize("name", ["decoder", pytest.param("llama", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["autocast", "bf16"])
def test_bf16_and_autocast_models_convert_every_linear_op_and_track_the_simulation(
    name: str, mode: str
) -> None:
    """A bfloat16 model, and a float32 one under ``torch.autocast(bfloat16)``: every linear
    op runs in FP8 and the result tracks ``simulate_fp8(ops="linear")`` under the same casts.

    Not bit for bit, and why: the simulation multiplies the rounded operands with the CPU's
    bfloat16 matmul, which does not round its FP32 sum once (measured on this CPU: up to 2
    bfloat16 ulps off on a 32 x 64 x 64 GEMM, with or without oneDNN), where the float8
    GEMM accumulates in FP32 and rounds once (as cuBLAS does); ``to_fp8`` also adds the bias
    after the bfloat16 result, as torchao does (autocast's linear adds it before rounding).
    Each one-ulp difference can flip a later E4M3 or E5M2 rounding (E5M2 keeps 2 mantissa
    bits: a flip moves a gradient element by up to a quarter), so the gradients agree
    within 20% of their norm (measured: at most 12%), the loss within 1e-3 relative. The
    exact check of the arithmetic is
    :func:`test_autocast_casts_the_input_and_writes_bf16_as_torchao_does`."""
    from unitscale.transforms import simulate_fp8

    build = _bf16_models()[name]
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    kwargs = {"input_ids": ids, "labels": ids}
    model = build() if mode == "autocast" else build().to(torch.bfloat16)
    fp8_model = to_fp8(model)
    ours = _loss_and_grads(fp8_model, mode == "autocast", **kwargs)
    summary = fp8_summary(fp8_model)
    assert summary.converted_flop_share == 1.0
    assert len(summary.converted) == (5 if name == "decoder" else 8)
    theirs = _loss_and_grads(simulate_fp8(model, ops="linear"), mode == "autocast", **kwargs)
    deviation = _deviation(ours, theirs)
    assert deviation.pop("loss") < 1e-3
    assert max(deviation.values()) < 0.2, deviation
    assert all(ours[n].dtype == theirs[n].dtype for n in theirs)


def test_the_decoders_swiglu_width_can_be_rounded_up_as_llamas_multiple_of() -> None:
    import unitscale
    from unitscale.errors import UnsupportedArgumentError

    widths = {}
    for multiple_of in (1, 64, None):
        options = {} if multiple_of is None else {"mlp_multiple_of": multiple_of}
        model = unitscale.TransformerDecoder(64, depth=1, heads=4, vocab_size=16, **options)
        widths[multiple_of] = model.layers[0].mlp.down.weight.shape[1]
    assert widths == {1: 170, 64: 192, None: 192}  # the default rounds to 64, as Llama's
    layer = unitscale.TransformerLayer(128, heads=4)
    assert layer.mlp.up.weight.shape == (2 * 384, 128)  # 341 rounded up to 384
    with pytest.raises(UnsupportedArgumentError, match="mlp_multiple_of"):
        unitscale.TransformerLayer(64, heads=4, mlp_multiple_of=0)


def test_compiling_is_refused_with_the_reason_where_inductor_cannot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch 2.8's Inductor fails to compile the float8 cast on the CPU (its C++ vector
    type of float8 has no ``blendv``): compile(to_fp8(m)) is refused there, to_fp8 itself
    runs. Simulated on releases whose Inductor compiles it."""
    from unitscale.errors import CaptureError
    from unitscale.transforms import compile

    model = to_fp8(nn.Linear(16, 16))
    assert model(torch.randn(2, 16)).shape == (2, 16)  # eager: always
    if _mm.float8_compile_error("cpu") is None:
        monkeypatch.setitem(_mm._COMPILE_TRIALS, "cpu", "torch 2.8's Inductor cannot compile")
        assert compile(nn.Linear(16, 16)) is not None  # no to_fp8: not concerned
    with pytest.raises(CaptureError, match=r"Inductor cannot compile.*without compile"):
        compile(model)
