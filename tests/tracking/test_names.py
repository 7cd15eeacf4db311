"""Names of ops inside inlined functions (docs/design.rst, "Contracts", Tracking).

They read as the function and its variable (``apply_rotary_pos_emb.q_embed``), in the module
that called the function, never as Dynamo's mangled global names (``G.__import_...``); ops
written in a ``forward`` keep Dynamo's names; every clean name stays unique in its graph.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from unitscale.transforms import track_scales


def _names(graph: torch.fx.Graph) -> dict[str, torch.fx.Node]:
    nodes = [n for n in graph.nodes if n.op != "output"]
    names = [n.meta["clean_name"] for n in nodes]
    assert len(names) == len(set(names)), "clean names must be unique"
    return dict(zip(names, nodes, strict=True))


def scale_and_shift(x: torch.Tensor) -> torch.Tensor:
    shifted = x * 3 + 1
    return shifted


class _WithHelper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        z = scale_and_shift(y) + scale_and_shift(x)
        return z


def test_a_helpers_ops_read_as_function_and_variable() -> None:
    tracked = track_scales(_WithHelper())
    tracked(torch.randn(2, 4)).sum().backward()
    nodes = _names(tracked.scales_graph())
    # Top-level code keeps Dynamo's names.
    assert {"x", "lin.weight", "y", "z"} <= set(nodes)
    # The helper's variable (an add) and the sub-expression on its line (a mul), per call.
    helper = sorted(name for name in nodes if name.startswith("scale_and_shift."))
    assert helper == [
        "scale_and_shift.shifted",
        "scale_and_shift.shifted.mul",
        "scale_and_shift.shifted.mul_1",
        "scale_and_shift.shifted_1",
    ]
    assert nodes["scale_and_shift.shifted"].meta["metrics"].bwd is not None
    assert all(nodes[name].meta["module_path"] == "" for name in helper)


def test_llama_rotary_embedding_names_the_function_not_a_global() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    tracked = track_scales(transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, 64, (1, 8))
    tracked(input_ids=ids, labels=ids).loss.backward()
    nodes = _names(tracked.scales_graph())
    for name, node in nodes.items():
        for text in (name, node.meta["module_path"]):
            assert "__import" not in text and not text.startswith("G."), text
    rotary = {n: node for n, node in nodes.items() if n.startswith("apply_rotary_pos_emb.")}
    assert {"apply_rotary_pos_emb.q_embed", "apply_rotary_pos_emb.k_embed"} <= set(rotary)
    # q * cos, the first sub-expression of q_embed's line, reads as q_embed's mul.
    assert "apply_rotary_pos_emb.q_embed.mul" in rotary
    assert {node.meta["module_path"] for node in rotary.values()} == {"model.layers.0.self_attn"}
