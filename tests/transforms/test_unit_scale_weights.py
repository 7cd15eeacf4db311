"""``unit_scale`` treats a parameter used in a matmul (``x @ self.W``) as a weight, scaled and
initialised like ``nn.Linear``'s, not as a second activation."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import unitscale.functional as U
from unitscale.transforms import track_scales, unit_scale


class RawWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(256, 64) * 0.02)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.W


def test_raw_parameter_in_a_matmul_is_a_unit_initialised_weight() -> None:
    model = unit_scale(RawWeight())
    x = torch.randn(512, 256, requires_grad=True)
    out = model(x)
    weight = model.module.W
    assert 0.9 < weight.std().item() < 1.1  # re-initialised to N(0, 1), not left at 0.02
    assert 0.9 < out.std().item() < 1.1
    out.backward(torch.randn_like(out))
    # Weight rule: the weight's gradient is scaled by 1/sqrt(batch), so it is unit (an
    # activation operand would get 1/sqrt(k) shared with the output: std sqrt(512/256)).
    assert weight.grad is not None and 0.85 < weight.grad.std().item() < 1.15
    tracked = track_scales(unit_scale(RawWeight()))
    tracked(torch.randn(8, 256))
    targets = {n.target for n in tracked.scales_graph().nodes}
    assert U.linear in targets and U.matmul not in targets


def test_a_loaded_checkpoint_is_not_reinitialised_at_the_first_call() -> None:
    original = RawWeight()
    model = unit_scale(RawWeight())
    model.load_state_dict(original.state_dict())
    model(torch.randn(4, 256))
    assert torch.equal(model.module.W, original.W)
