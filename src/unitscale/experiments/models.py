"""Built-in demo models: a small GPT-style decoder in plain PyTorch and its unit-scaled twin.

Design constraints:

- both models share one frozen :class:`GPTConfig` and one calling convention,
  ``forward(input_ids, attention_mask=None, labels=None)``, returning the mean next-token
  cross-entropy when ``labels`` are passed and the logits otherwise; ``labels`` are
  unshifted, as transformers causal LMs take them and ``model(**example_batch(...))`` passes
  them (the model shifts), or, with ``GPTConfig(aligned_labels=True)``, next-token targets
  already aligned with ``input_ids`` (``Batch.targets``, what the experiments train on);
- the plain model is written the way people write GPTs (pre-norm blocks, residual adds as
  ``x = x + ...`` in ``forward``, GPT-2's N(0, 0.02) initialisation) so that scale tracking and
  ``unit_scale`` see ordinary code;
- the default size runs a forward+backward step on a 2-core CPU in well under a second;
- construction is deterministic under a seed and leaves the global RNG untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import functional as U
from .. import modules as us
from .._lazy_dynamo import disable
from ..errors import UnitScaleError

__all__ = [  # noqa: RUF022 (grouped by kind)
    # configuration
    "GPTConfig",
    "ModelConfigError",
    # plain PyTorch model
    "PlainGPT",
    "plain_gpt",
    # unit-scaled twin
    "UnitScaledGPT",
    "unit_scaled_gpt",
]


class ModelConfigError(UnitScaleError, ValueError):
    """A built-in model configuration or input is invalid."""


@dataclass(frozen=True)
class GPTConfig:
    """Size of the built-in GPT-style decoder.

    Attributes:
        vocab_size: number of token ids (256: byte-level text).
        hidden_size: width of the residual stream; a multiple of ``heads``.
        depth: number of transformer blocks.
        heads: attention heads per block.
        seq_len: the longest sequence the position embedding supports.
        mlp_ratio: MLP hidden width as a multiple of ``hidden_size``.
        dropout: dropout probability after attention and MLP (0 keeps steps deterministic).
        residual_tau: the unit-scaled twin's residual weight in every block as a share of
            the variance (``residual_add(..., share=residual_tau)``, see
            :func:`unitscale.functional.residual_add`), or None (default) for
            :class:`unitscale.TransformerDecoder`'s running-mean schedule
            ``share_k = 1 / (k + 1)`` over the ``k``-th residual block; unused by the plain
            model.
        position_embedding: give the plain model a learned position embedding (default);
            False builds it without one ("NoPE", causal attention alone tells positions
            apart), the layout of :class:`unitscale.TransformerDecoder`. Unused by the twin.
        aligned_labels: what ``forward``'s ``labels`` are. False (default): the input ids,
            shifted inside the model as transformers causal LMs do (position ``t`` scored
            against ``labels[:, t + 1]``; ``model(**batch)`` of a
            :class:`~unitscale.data.Batch`). True: next-token targets aligned with
            ``input_ids`` (``labels[:, t]`` follows ``input_ids[:, t]``; ``Batch.targets``),
            as :class:`unitscale.TransformerDecoder` takes them.

    Example:
        >>> GPTConfig(hidden_size=64).head_size
        16
    """

    vocab_size: int = 256
    hidden_size: int = 128
    depth: int = 2
    heads: int = 4
    seq_len: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    residual_tau: float | None = None
    position_embedding: bool = True
    aligned_labels: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "depth", "heads", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelConfigError(f"GPTConfig: {name}={value!r} must be a positive integer")
        if self.hidden_size % self.heads:
            raise ModelConfigError(
                f"GPTConfig: hidden_size={self.hidden_size} must be a multiple of "
                f"heads={self.heads}; change one of them"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ModelConfigError(f"GPTConfig: dropout={self.dropout!r} must be in [0, 1)")
        if self.residual_tau is not None and not 0.0 < self.residual_tau < 1.0:
            raise ModelConfigError(
                f"GPTConfig: residual_tau={self.residual_tau!r} must be in (0, 1)"
            )

    @property
    def head_size(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.heads

    @property
    def mlp_size(self) -> int:
        """Hidden width of the MLP."""
        return self.hidden_size * self.mlp_ratio


def _check_inputs(model: str, input_ids: Tensor, config: GPTConfig) -> None:
    if input_ids.dim() != 2:
        raise ModelConfigError(
            f"{model}: input_ids must have shape (batch, seq_len), got {tuple(input_ids.shape)}"
        )
    if input_ids.shape[1] > config.seq_len:
        raise ModelConfigError(
            f"{model}: sequence length {input_ids.shape[1]} exceeds config.seq_len="
            f"{config.seq_len}; build the model with a larger GPTConfig(seq_len=...)"
        )


def _next_token_pairs(logits: Tensor, labels: Tensor, config: GPTConfig) -> tuple[Tensor, Tensor]:
    """``(batch * positions, vocab)`` logits and their targets, from ``labels`` as
    :attr:`GPTConfig.aligned_labels` says they are (unshifted: one shift here)."""
    if not config.aligned_labels:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return logits.flatten(0, 1), labels.flatten()


def _attention_mask(attention_mask: Tensor | None, seq_len: int, device: torch.device) -> Tensor:
    """Boolean ``(batch or 1, 1, seq, seq)`` mask: causal, minus padded keys, diagonal kept."""
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    if attention_mask is None:
        return causal[None, None]
    keys = attention_mask.to(torch.bool)[:, None, None, :]
    # Keeping the diagonal means a padded query still attends to itself: no all-masked row,
    # hence no NaN, and its output is ignored by the loss anyway.
    diagonal = torch.eye(seq_len, dtype=torch.bool, device=device)
    return (causal & keys) | diagonal


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.out = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        batch, seq, width = x.shape
        qkv = self.qkv(x)
        q, k, v = qkv.split(width, dim=-1)
        q = q.view(batch, seq, self.heads, -1).transpose(1, 2)
        k = k.view(batch, seq, self.heads, -1).transpose(1, 2)
        v = v.view(batch, seq, self.heads, -1).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        attn = attn.transpose(1, 2).reshape(batch, seq, width)
        return self.dropout(self.out(attn))


class MLP(nn.Module):
    """Two-layer GELU MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.mlp_size)
        self.down = nn.Linear(config.mlp_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.up(x))
        return self.dropout(self.down(h))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(config.hidden_size)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), mask)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class PlainGPT(nn.Module):
    """A small GPT-style decoder in plain PyTorch (GPT-2 layout and initialisation).

    Token and position embeddings, ``config.depth`` pre-norm blocks, a final LayerNorm and a
    linear LM head. Build it with :func:`plain_gpt` for a seeded initialisation.

    Args:
        config: the model size.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = (
            nn.Embedding(config.seq_len, config.hidden_size) if config.position_embedding else None
        )
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.depth)])
        self.final_norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2: N(0, 0.02) weights, zero biases, output projections scaled by 1/sqrt(2 depth).
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif "norm" in name:
                nn.init.ones_(param)
            elif name.endswith(("attn.out.weight", "down.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * self.config.depth))
            else:
                nn.init.normal_(param, std=0.02)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> Tensor:
        """Return the loss when ``labels`` are given, the ``(batch, seq, vocab)`` logits otherwise.

        Args:
            input_ids: ``(batch, seq)`` token ids.
            attention_mask: optional ``(batch, seq)``, 1 for real tokens, 0 for padding.
            labels: optional ``(batch, seq)`` labels, unshifted (the input ids) or aligned
                next-token targets as ``config.aligned_labels`` says; -100 marks ignored
                positions.
        """
        _check_inputs("PlainGPT", input_ids, self.config)
        seq = input_ids.shape[1]
        positions = torch.arange(seq, device=input_ids.device)
        mask = _attention_mask(attention_mask, seq, input_ids.device)
        x = self.token_embedding(input_ids)
        if self.position_embedding is not None:
            x = x + self.position_embedding(positions)
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x, mask)
        x = self.final_norm(x)
        logits = self.lm_head(x)
        if labels is None:
            return logits
        flat_logits, targets = _next_token_pairs(logits, labels, self.config)
        return F.cross_entropy(flat_logits, targets, ignore_index=-100)


def plain_gpt(config: GPTConfig | None = None, seed: int = 0) -> PlainGPT:
    """Build the plain-PyTorch GPT with a deterministic initialisation.

    Args:
        config: model size (default :class:`GPTConfig()`).
        seed: initialisation seed; the global RNG is left as it was.

    Returns:
        A :class:`PlainGPT` in training mode.

    Example:
        >>> from unitscale.data import example_batch
        >>> model = plain_gpt(GPTConfig(hidden_size=32, depth=1), seed=0)
        >>> batch = example_batch(2, 16)
        >>> loss = model(**batch)  # about log(256) = 5.55 at initialisation
        >>> abs(loss.item() - math.log(256)) < 0.1
        True
    """
    config = GPTConfig() if config is None else config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return PlainGPT(config)


class UnitScaledGPT(nn.Module):
    """The unit-scaled twin of :class:`PlainGPT`, built from unitscale's modules.

    Same layout and parameter names as :class:`PlainGPT`: :class:`unitscale.Embedding` for
    tokens and positions combined by :func:`unitscale.functional.add`, ``config.depth``
    :class:`unitscale.TransformerLayer` blocks (pre-norm, causal :class:`unitscale.MHSA`,
    :class:`unitscale.MLP`, ``residual_split``/``residual_add`` with the share of
    ``config.residual_tau``), a final :class:`unitscale.LayerNorm` and a
    :class:`unitscale.LinearReadout` head; the loss is
    :func:`unitscale.functional.cross_entropy`. Weights are N(0, 1) and every op keeps its
    output and gradients near unit scale at initialisation. Build it with
    :func:`unit_scaled_gpt` for a seeded initialisation.

    Attention is causal only: an ``attention_mask`` with zeros (padding) is rejected, since
    the unit-scaled attention does not take arbitrary masks.

    Args:
        config: the model size.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        depth = config.depth
        self.token_embedding = us.Embedding(config.vocab_size, config.hidden_size)
        self.position_embedding = us.Embedding(config.seq_len, config.hidden_size)
        self.dropout = us.Dropout(config.dropout)
        tau = config.residual_tau
        self.blocks = nn.ModuleList(
            us.TransformerLayer(
                config.hidden_size,
                config.heads,
                mlp_expansion_factor=config.mlp_ratio,
                dropout_p=config.dropout,
                is_causal=True,
                # As unitscale.TransformerDecoder: the k-th residual block gets 1 / (k + 1).
                attn_share=1.0 / (2 * i + 2) if tau is None else tau,
                mlp_share=1.0 / (2 * i + 3) if tau is None else tau,
                bias=True,
                mup=False,  # plain unit scaling, the twin of PlainGPT (not u-muP)
                trainable_norms=True,
                block="gpt",  # PlainGPT's LayerNorm and GELU MLP
            )
            for i in range(depth)
        )
        self.final_norm = us.LayerNorm(config.hidden_size)
        self.lm_head = us.LinearReadout(
            config.hidden_size, config.vocab_size, bias=False, mup=False
        )

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
    ) -> Tensor:
        """Return the loss when ``labels`` are given, the ``(batch, seq, vocab)`` logits otherwise.

        Args:
            input_ids: ``(batch, seq)`` token ids.
            attention_mask: optional ``(batch, seq)`` of ones (padding is not supported).
            labels: optional ``(batch, seq)`` labels, unshifted (the input ids) or aligned
                next-token targets as ``config.aligned_labels`` says; -100 marks ignored
                positions.

        Raises:
            ModelConfigError: for a sequence longer than ``config.seq_len`` or a padding mask.
        """
        _check_inputs("UnitScaledGPT", input_ids, self.config)
        if attention_mask is not None:
            _refuse_padding(attention_mask)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = U.add(self.token_embedding(input_ids), self.position_embedding(positions))
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        logits = self.lm_head(x)
        if labels is None:
            return logits
        flat_logits, targets = _next_token_pairs(logits, labels, self.config)
        return U.cross_entropy(flat_logits, targets, ignore_index=-100)


@disable
def _refuse_padding(attention_mask: Tensor) -> None:
    """Raise for a padding mask, also while being compiled (where this runs eagerly, after a
    graph break: the check reads the mask's values, which a graph cannot branch on)."""
    if not bool(attention_mask.all()):
        raise ModelConfigError(
            "UnitScaledGPT: attention_mask has zeros (padding), but the unit-scaled "
            "attention is causal only; pass unpadded sequences or attention_mask=None"
        )


def unit_scaled_gpt(config: GPTConfig | None = None, seed: int = 0) -> UnitScaledGPT:
    """Build the unit-scaled twin of :func:`plain_gpt` from unitscale's modules.

    Same configuration, calling convention and parameter names as :class:`PlainGPT`.

    Args:
        config: model size (default :class:`GPTConfig()`).
        seed: initialisation seed; the global RNG is left as it was.

    Returns:
        A :class:`UnitScaledGPT` in training mode.

    Example:
        >>> from unitscale.data import example_batch
        >>> model = unit_scaled_gpt(GPTConfig(hidden_size=64, depth=1), seed=0)
        >>> logits = model(example_batch(4, 32).input_ids)
        >>> logits.shape
        torch.Size([4, 32, 256])
    """
    config = GPTConfig() if config is None else config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return UnitScaledGPT(config)
