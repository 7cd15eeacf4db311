"""FSDP2 float8 all-gather on one gloo rank, in-process: which weights gather in float8,
the fallbacks ``fp8_summary`` reports, checkpoints, mixed precision and refusals. (World size 1
runs the same hooks: cast, gather, the GEMM taking the gathered float8 weight.)"""

from __future__ import annotations

import copy
import io
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from unitscale.data_parallel import _WRAP_ATTR, fully_shard
from unitscale.formats import FormatError
from unitscale.transforms import fp8_summary, to_fp8
from unitscale.transforms.lowp import _fsdp, _gemm

pytestmark = pytest.mark.skipif(
    _gemm.float8_device_error("cpu") is not None, reason="to_fp8 needs a float8 GEMM on the CPU"
)


@pytest.fixture
def one_rank() -> Iterator[Any]:
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group yet")
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def arrivals(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The type of each weight the float8 GEMMs receive."""
    seen: list[str] = []

    def spy(weight: torch.Tensor) -> Any:
        seen.append(type(weight).__name__)
        return _fsdp.float8_weight(weight)

    monkeypatch.setattr(_gemm, "float8_weight", spy)
    return seen


def _mlp(bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=bias), nn.ReLU(), nn.Linear(32, 8, bias=bias))


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    out = model(x)
    out.square().sum().backward()
    grads = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in model.parameters()]
    return out.detach(), grads


def test_the_attribute_names_agree() -> None:
    assert _WRAP_ATTR == _fsdp.GATHER_ATTR


@pytest.mark.parametrize("bias", [True, False])  # without: every parameter gathers as bytes
@pytest.mark.parametrize("scaling", ["none", "tensorwise"])
def test_gemms_take_the_gathered_float8_weights(
    one_rank: Any, arrivals: list[str], scaling: str, bias: bool
) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    reference = to_fp8(_mlp(bias), scaling=scaling)  # type: ignore[arg-type]
    model = fully_shard(to_fp8(_mlp(bias), scaling=scaling), mesh=one_rank)  # type: ignore[arg-type]
    out, grads = _step(model, x)
    assert arrivals == ["Float8Weight", "Float8Weight"]
    ref_out, ref_grads = _step(reference, x)
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    summary = fp8_summary(model)
    assert summary.float8_all_gather == ("0.weight", "2.weight")
    assert summary.high_precision_gather == ()
    assert "FSDP2 gathers 2 weight(s) in float8" in str(summary)


def _reasons(model: nn.Module) -> dict[str, str]:
    return dict(fp8_summary(model).high_precision_gather)


def test_turned_off_delayed_ignored_and_unsharded_weights_gather_as_before(
    one_rank: Any, arrivals: list[str]
) -> None:
    x = torch.randn(4, 16)
    off = fully_shard(to_fp8(_mlp(), fsdp_float8_all_gather=False), mesh=one_rank)
    delayed = fully_shard(to_fp8(_mlp(), scaling="delayed"), mesh=one_rank)
    partial = to_fp8(_mlp())
    fully_shard(partial, mesh=one_rank, ignored_params={partial.module[2].weight})
    unsharded = to_fp8(_mlp())
    for model in (off, delayed, partial, unsharded):
        _step(model, x)
    assert arrivals.count("Float8Weight") == 1  # partial's first layer only
    assert _reasons(off) == dict.fromkeys(["0.weight", "2.weight"], "fsdp_float8_all_gather=False")
    assert set(_reasons(delayed).values()) == {
        "scaling='delayed' (float8 all-gather takes 'none' or 'tensorwise')"
    }
    assert fp8_summary(partial).float8_all_gather == ("0.weight",)
    assert _reasons(partial) == {
        "2.weight": "not sharded by unitscale.data_parallel.fully_shard (FSDP2)"
    }
    assert fp8_summary(unsharded).float8_all_gather == ()
    assert fp8_summary(unsharded).high_precision_gather == ()  # no FSDP2: no list
    assert "FSDP2" not in str(fp8_summary(unsharded))  # nothing gathered: not mentioned


class _Tied(nn.Module):
    """An embedding and a readout sharing one weight, and a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.hidden = nn.Linear(16, 16)
        self.readout = nn.Linear(16, 32, bias=False)
        self.readout.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.readout(self.hidden(self.embed(ids)))


def test_tied_weights_gather_in_their_precision(one_rank: Any, arrivals: list[str]) -> None:
    torch.manual_seed(0)
    model = fully_shard(to_fp8(_Tied()), mesh=one_rank)
    model(torch.arange(8).view(2, 4)).sum().backward()
    summary = fp8_summary(model)
    assert summary.float8_all_gather == ("hidden.weight",)
    assert dict(summary.high_precision_gather) == {
        "embed.weight": "shared with another module (tied weights)"
    }
    assert sorted(arrivals) == ["Float8Weight", "Parameter"]


class _Penalised(nn.Module):
    """A linear layer whose weight is also read by another op (a penalty)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).sum() + self.fc.weight.square().sum()


def test_a_float8_weight_read_outside_a_gemm_is_refused(one_rank: Any) -> None:
    model = fully_shard(to_fp8(_Penalised()), mesh=one_rank)
    with pytest.raises(FormatError, match=r"fc\.weight.*fsdp_float8_all_gather=False"):
        model(torch.ones(2, 8))
    plain = fully_shard(to_fp8(_Penalised(), fsdp_float8_all_gather=False), mesh=one_rank)
    plain(torch.ones(2, 8)).backward()


def test_checkpoints_hold_plain_fp32_weights_and_loading_rescales(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``state_dict()`` saves the FP32 weights as plain tensors (a ``weights_only`` load
    reads them); loading new weights moves the next "tensorwise" scale with them."""
    model = fully_shard(to_fp8(_mlp(), scaling="tensorwise"), mesh=one_rank)
    x = torch.randn(4, 16)
    _step(model, x)
    state = model.state_dict()
    local = state["0.weight"].to_local()
    assert type(local) is torch.Tensor and local.dtype == torch.float32
    buffer = io.BytesIO()
    torch.save({k: v.full_tensor() for k, v in state.items()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert torch.equal(loaded["0.weight"], _mlp()[0].weight.detach())
    inverses: list[torch.Tensor] = []

    def keep(weight: torch.Tensor) -> Any:
        found = _fsdp.float8_weight(weight)
        if found is not None and found[1] is not None:
            inverses.append(found[1])
        return found

    monkeypatch.setattr(_gemm, "float8_weight", keep)
    model(x)
    doubled = {k: v * 2 for k, v in copy.deepcopy(state).items()}
    model.load_state_dict(doubled)
    model(x)
    assert torch.equal(inverses[2], inverses[0] * 2)  # 448 / amax of the doubled weight


def test_mixed_precision_casts_to_bf16_first(one_rank: Any) -> None:
    """With FSDP2's bf16 ``param_dtype`` the shard is cast to bf16, then to E4M3, as the GEMM
    of the bf16 weight does without float8 all-gather: the same outputs and gradients."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    x = torch.randn(4, 16).bfloat16()
    runs = []
    for gather in (True, False):
        model = to_fp8(_mlp(), fsdp_float8_all_gather=gather)
        runs.append(_step(fully_shard(model, mesh=one_rank, mp_policy=policy), x))
    (out, grads), (ref_out, ref_grads) = runs
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref_out)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))


def test_tensorwise_equals_torchaos_float8_all_gather(one_rank: Any, arrivals: list[str]) -> None:
    """torchao's ``Float8Linear`` with ``enable_fsdp_float8_all_gather`` under torch's
    ``fully_shard`` (scales precomputed after each step, as torchtitan does) and
    ``to_fp8(scaling="tensorwise")`` under ours: the same outputs and gradients, bit for bit,
    over 3 AdamW steps."""
    float8 = pytest.importorskip("torchao.float8")
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ours = fully_shard(to_fp8(_mlp(), scaling="tensorwise"), mesh=one_rank)
    config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    theirs = float8.convert_to_float8_training(_mlp(), config=config)
    torch_fully_shard(theirs, mesh=one_rank)
    assert type(theirs[0].weight._local_tensor).__name__ == "WeightWithDynamicFloat8CastTensor"
    optimisers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 16, generator=generator)
        (out, grads), (ref_out, ref_grads) = _step(ours, x), _step(theirs, x)
        assert torch.equal(out, ref_out)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
        for optimiser in optimisers:
            optimiser.step()
            optimiser.zero_grad()
        float8.precompute_float8_dynamic_scale_for_fsdp(theirs)
    assert set(arrivals) == {"Float8Weight"}  # ours gathered in float8 too


def test_to_fp8_of_a_sharded_model_says_the_order(one_rank: Any) -> None:
    model = _mlp()
    fully_shard(model, mesh=one_rank)
    with pytest.raises(FormatError, match=r"apply to_fp8 first, then .*fully_shard"):
        to_fp8(model)
