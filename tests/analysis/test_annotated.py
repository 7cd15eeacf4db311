"""analyse_module: a module's code annotated with the scales each line computes."""

from __future__ import annotations

import re

import pytest
import torch
from torch import Tensor, nn

from unitscale.analysis import AnalysisError, graph_to_dataframe
from unitscale.models import GPTConfig, plain_gpt
from unitscale.utils import analyse_module


class Known(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        y = x * 4.0
        z = y / 2.0
        return z.neg()


def test_known_module_lines_carry_their_exact_scales() -> None:
    x = torch.full((8, 8), 0.5)
    module = Known()
    code = analyse_module(module, x, backward=torch.full((8, 8), 2.0))
    lines = [re.sub(r"\s+#", "  #", line.strip()) for line in code.splitlines()]
    assert lines[0].startswith("# Known.forward: mean_abs")
    # x = 0.5 -> y = 2 -> z = 1 -> -1; gradients: d(-z) = 2 -> dz = 2 -> dy = 1 -> dx = 4.
    assert "def forward(self, x: Tensor) -> Tensor:  # x (-> 0.5, <- 4)" in lines
    assert "y = x * 4.0  # (-> 2, <- 1)" in lines
    assert "z = y / 2.0  # (-> 1, <- 2)" in lines
    assert "return z.neg()  # (-> 1, <- 2)" in lines
    # The default backward differentiates the sum: every output gradient is 1.
    default = analyse_module(module, x)
    assert re.search(r"z = y / 2.0 +# \(-> 1, <- 1\)", default)
    assert "# (-> 1, <- 1)" in analyse_module(module, (x,), metric="rms")


def test_submodule_calls_are_annotated_with_their_result() -> None:
    from unitscale.transforms import track_scales

    block = plain_gpt(GPTConfig(hidden_size=32, depth=1), seed=0).blocks[0]
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    torch.manual_seed(0)
    x, grad = torch.randn(2, 8, 32), torch.randn(2, 8, 32)
    code = analyse_module(block, (x, mask), backward=grad)
    lines = {line.split("#")[0].strip(): line for line in code.splitlines()}
    # The same numbers as the tracked graph's residual adds (x_1, x_2).
    tracked = track_scales(block)
    tracked(x, mask).backward(grad)
    df = graph_to_dataframe(tracked.scales_graph())
    adds = df[df.op == "add"]
    first, second = adds.node.unique()[:2]

    def scale(node: str, direction: str) -> str:
        v = float(adds[(adds.node == node) & (adds.direction == direction)].mean_abs.iloc[0])
        return f"{v:.3g}"

    attn_line = lines["x = x + self.attn(self.attn_norm(x), mask)"]
    assert attn_line.endswith(f"# (-> {scale(first, 'fwd')}, <- {scale(first, 'bwd')})")
    mlp_line = lines["x = x + self.mlp(self.mlp_norm(x))"]
    assert mlp_line.endswith(f"# (-> {scale(second, 'fwd')}, <- {scale(second, 'bwd')})")
    assert "#" not in lines["return x"]
    # The caller's module and tensors are untouched.
    assert all(p.grad is None for p in block.parameters())
    fresh = torch.randn(2, 8, 32)
    analyse_module(block, (fresh, mask), backward=grad)
    assert fresh.grad is None and not fresh.requires_grad


def test_bad_arguments() -> None:
    with pytest.raises(AnalysisError, match="inputs must be a Tensor, a tuple/list"):
        analyse_module(Known(), 3.0)
    with pytest.raises(AnalysisError, match=r"backward has shape \(2,\) but the output has"):
        analyse_module(Known(), torch.ones(4), backward=torch.ones(2))
    with pytest.raises(AnalysisError, match="metric='median' is not a scalar metric"):
        analyse_module(Known(), torch.ones(4), metric="median")
