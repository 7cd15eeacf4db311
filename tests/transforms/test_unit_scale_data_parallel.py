"""``unit_scale`` tells the data-parallel factor what shapes cannot.

Hugging Face's GPT-2 embeds ``(1, T)`` position ids and adds the ``(1, T, D)`` result to the
``(B, T, D)`` token embeddings. At a local batch of 1 its shapes look like one example's;
at 2 the ids look like a batch. ``unit_scale`` reads from the captured graph which values
carry the model's inputs, so under ``set_data_parallel(size=4)`` every count-scaled gradient
takes ``size / sqrt(size)`` = 2 and the position embedding (summed over the batch by the
add's true gradient) ``size`` = 4, at a local batch of 1 and of 2 (measured before: 1.0 for
the position embedding at 1, 8.0 at 2 with the shape rule alone).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from unitscale.data_parallel import set_data_parallel
from unitscale.transforms import unit_scale

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    yield
    set_data_parallel()


@pytest.mark.parametrize("local_batch", [1, 2])
def test_hf_position_ids_are_shared_at_any_local_batch(local_batch: int) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = unit_scale(transformers.GPT2LMHeadModel(config), trainable_norms=True)
    ids = torch.randint(0, 64, (local_batch, 16), generator=torch.Generator().manual_seed(1))
    grads = {}
    for size in (1, 4):
        set_data_parallel(size=size)
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        grads[size] = {n: p.grad.clone() for n, p in model.named_parameters()}
    ratios = {n: float(grads[4][n].norm() / grads[1][n].norm()) for n in grads[1]}
    expected = {n: 4.0 if n == "transformer.wpe.weight" else 2.0 for n in ratios}
    assert len(ratios) > 10
    assert ratios == pytest.approx(expected, rel=1e-4)
