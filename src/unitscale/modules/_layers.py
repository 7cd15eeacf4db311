"""Unit-scaled modules: thin wrappers around :mod:`unitscale.functional`.

Each module holds parameters and configuration and calls one functional op in ``forward``
(its docstring names it); the scaling rules live with the ops. Where ``torch.nn`` has a
twin, the module subclasses it and takes the same constructor arguments (so ``state_dict``
keys, ``repr`` and ``.to()`` behave the same), plus ``constraint=`` where the op has one.
Weights are initialised to unit variance (``N(0, 1)``; norm weights to 1) and biases to 0,
which is what the ops' scaling rules assume. Arguments the ops do not support are rejected
when the module is built, not on the first call.

Design constraints: no data-dependent Python control flow, so that every module compiles
to one graph with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from . import functional as U
from .constraints import apply_constraint
from .errors import UnsupportedArgumentError

__all__ = [  # noqa: RUF022 (grouped by kind, see STYLE.md)
    # layers
    "Conv1d",
    "Embedding",
    "LayerNorm",
    "Linear",
    "LinearReadout",
    "RMSNorm",
    # activations and regularisation
    "Dropout",
    "GELU",
    "SiLU",
    "Softmax",
    # losses
    "CrossEntropyLoss",
    # blocks and models
    "MHSA",
    "MLP",
    "TransformerDecoder",
    "TransformerLayer",
]

Constraint = str | None


def _check_constraint(constraint: Constraint, scales: int) -> Constraint:
    """Fail at construction for an unknown constraint (or one that does not fit the op)."""
    apply_constraint(constraint, *([1.0] * scales))
    return constraint


def _reject(module: str, argument: str, value: object, default: object, fix: str) -> None:
    if value is not default and value != default:
        raise UnsupportedArgumentError(module, argument, value, fix)


# --------------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------------


class Linear(nn.Linear):
    """Unit-scaled ``nn.Linear``; ``forward`` calls :func:`unitscale.functional.linear`.

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        constraint: see :func:`~unitscale.functional.linear` (default ``to_output_scale``).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> layer = Linear(1024, 256)
        >>> round(layer(torch.randn(512, 1024)).std().item(), 1), layer.bias.abs().max().item()
        (1.0, 0.0)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        constraint: Constraint = "to_output_scale",
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        self.constraint = _check_constraint(constraint, 2)

    def reset_parameters(self) -> None:
        """Weight ``N(0, 1)``, bias 0."""
        nn.init.normal_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        return U.linear(input, self.weight, self.bias, self.constraint)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, constraint={self.constraint!r}"


class LinearReadout(Linear):
    """Unit-scaled readout layer; ``forward`` calls :func:`unitscale.functional.linear_readout`.

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        constraint: default ``to_grad_input_scale`` (see ``linear_readout``).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> head = LinearReadout(64, 1024, bias=False)
        >>> round(head(torch.randn(512, 64)).std().item(), 2)  # sqrt(64 / 1024)
        0.25
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        constraint: Constraint = "to_grad_input_scale",
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype, constraint)

    def forward(self, input: Tensor) -> Tensor:
        return U.linear_readout(input, self.weight, self.bias, self.constraint)


class Conv1d(nn.Conv1d):
    """Unit-scaled ``nn.Conv1d``; ``forward`` calls :func:`unitscale.functional.conv1d`.

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
            device, dtype: as for ``nn.Conv1d``.
        padding_mode: only ``"zeros"`` is supported.
        constraint: see :func:`~unitscale.functional.conv1d`.

    Raises:
        UnsupportedArgumentError: ``padding_mode`` is not ``"zeros"``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> conv = Conv1d(64, 32, 3, padding=1)
        >>> y = conv(torch.randn(8, 64, 128))
        >>> y.shape, round(y.std().item(), 1)
        (torch.Size([8, 32, 128]), 1.0)
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int],
        stride: int | tuple[int] = 1,
        padding: int | str | tuple[int] = 0,
        dilation: int | tuple[int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: Any = None,
        dtype: torch.dtype | None = None,
        constraint: Constraint = "to_output_scale",
    ) -> None:
        _reject("Conv1d", "padding_mode", padding_mode, "zeros", 'use padding_mode="zeros"')
        super().__init__(
            in_channels,
            out_channels,
            kernel_size,
            stride,
            padding,
            dilation,
            groups,
            bias,
            "zeros",
            device,
            dtype,
        )
        self.constraint = _check_constraint(constraint, 2)

    def reset_parameters(self) -> None:
        """Weight ``N(0, 1)``, bias 0."""
        nn.init.normal_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        return U.conv1d(
            input,
            self.weight,
            self.bias,
            self.stride,
            self.padding,
            self.dilation,
            self.groups,
            self.constraint,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, constraint={self.constraint!r}"


class LayerNorm(nn.LayerNorm):
    """Unit-scaled ``nn.LayerNorm``; ``forward`` calls :func:`unitscale.functional.layer_norm`.

    Same arguments as ``nn.LayerNorm`` (weight 1, bias 0). No constraint (none applies).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(LayerNorm(256)(5 * torch.randn(64, 256)).std().item(), 2)
        1.0
    """

    def forward(self, input: Tensor) -> Tensor:
        return U.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """Unit-scaled ``nn.RMSNorm``; ``forward`` calls :func:`unitscale.functional.rms_norm`.

    Same arguments as ``nn.RMSNorm`` (weight 1). No constraint (none applies).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(RMSNorm(256)(0.2 * torch.randn(64, 256)).std().item(), 2)
        1.0
    """

    def forward(self, input: Tensor) -> Tensor:
        return U.rms_norm(input, self.normalized_shape, self.weight, self.eps)


class Embedding(nn.Embedding):
    """Unit-scaled ``nn.Embedding``; ``forward`` calls :func:`unitscale.functional.embedding`.

    Same arguments as ``nn.Embedding`` (weight ``N(0, 1)``, padding row 0); ``max_norm``,
    ``norm_type != 2``, ``scale_grad_by_freq`` and ``sparse`` are not supported.

    Raises:
        UnsupportedArgumentError: an unsupported argument is given.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> emb = Embedding(1000, 64)
        >>> emb(torch.randint(0, 1000, (8, 128))).shape
        torch.Size([8, 128, 64])
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Tensor | None = None,
        _freeze: bool = False,
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        _reject("Embedding", "max_norm", max_norm, None, "renormalise the weight yourself")
        _reject("Embedding", "norm_type", norm_type, 2.0, "norm_type only applies with max_norm")
        _reject(
            "Embedding", "scale_grad_by_freq", scale_grad_by_freq, False, "unit scaling sets it"
        )
        _reject("Embedding", "sparse", sparse, False, "use dense gradients (sparse=False)")
        super().__init__(
            num_embeddings,
            embedding_dim,
            padding_idx,
            max_norm,
            norm_type,
            scale_grad_by_freq,
            sparse,
            _weight,
            _freeze,
            device,
            dtype,
        )

    def forward(self, input: Tensor) -> Tensor:
        return U.embedding(input, self.weight, self.padding_idx)


# --------------------------------------------------------------------------------------------
# activations, dropout, softmax, loss
# --------------------------------------------------------------------------------------------


class Dropout(nn.Dropout):
    """Unit-scaled ``nn.Dropout``; ``forward`` calls :func:`unitscale.functional.dropout`.

    Args:
        p: drop probability.
        inplace: must be False.

    Raises:
        UnsupportedArgumentError: ``inplace=True``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(Dropout(0.5)(torch.randn(1000, 1000)).std().item(), 2)
        1.0
    """

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        _reject("Dropout", "inplace", inplace, False, "use inplace=False")
        super().__init__(p, inplace)

    def forward(self, input: Tensor) -> Tensor:
        return U.dropout(input, self.p, self.training)


class GELU(nn.GELU):
    """Unit-scaled ``nn.GELU``; ``forward`` calls :func:`unitscale.functional.gelu`.

    Args:
        approximate: ``"none"`` or ``"tanh"``.
        constraint: see :func:`~unitscale.functional.gelu`.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(GELU()(torch.randn(1000, 1000)).std().item(), 2)
        1.0
    """

    def __init__(
        self, approximate: str = "none", constraint: Constraint = "to_output_scale"
    ) -> None:
        super().__init__(approximate)
        self.constraint = _check_constraint(constraint, 2)

    def forward(self, input: Tensor) -> Tensor:
        return U.gelu(input, self.approximate, self.constraint)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, constraint={self.constraint!r}"


class SiLU(nn.SiLU):
    """Unit-scaled ``nn.SiLU``; ``forward`` calls :func:`unitscale.functional.silu`.

    Args:
        inplace: must be False.
        constraint: see :func:`~unitscale.functional.silu`.

    Raises:
        UnsupportedArgumentError: ``inplace=True``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(SiLU()(torch.randn(1000, 1000)).std().item(), 2)
        1.0
    """

    def __init__(self, inplace: bool = False, constraint: Constraint = "to_output_scale") -> None:
        _reject("SiLU", "inplace", inplace, False, "use inplace=False")
        super().__init__(inplace)
        self.constraint = _check_constraint(constraint, 2)

    def forward(self, input: Tensor) -> Tensor:
        return U.silu(input, constraint=self.constraint)

    def extra_repr(self) -> str:
        return f"constraint={self.constraint!r}"


class Softmax(nn.Softmax):
    """Unit-scaled ``nn.Softmax``; ``forward`` calls :func:`unitscale.functional.softmax`.

    Args:
        dim: the dimension to normalise over; required.
        constraint: see :func:`~unitscale.functional.softmax`.

    Raises:
        UnsupportedArgumentError: ``dim`` is None.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(Softmax(dim=-1)(torch.randn(1000, 128)).std().item(), 1)
        1.0
    """

    def __init__(self, dim: int | None = None, constraint: Constraint = "to_output_scale") -> None:
        if dim is None:
            raise UnsupportedArgumentError(
                "Softmax", "dim", None, "pass the dimension to normalise over, e.g. dim=-1"
            )
        super().__init__(dim)
        self.constraint = _check_constraint(constraint, 2)

    def forward(self, input: Tensor) -> Tensor:
        return U.softmax(input, self.dim, constraint=self.constraint)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, constraint={self.constraint!r}"


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """Cross-entropy with a unit-scaled gradient; calls
    :func:`unitscale.functional.cross_entropy` (the loss value itself is not scaled).

    Args:
        weight, size_average, reduce: not supported; must be None.
        ignore_index, reduction, label_smoothing: as for ``nn.CrossEntropyLoss``.

    Raises:
        UnsupportedArgumentError: an unsupported argument is given.

    Example:
        >>> loss = CrossEntropyLoss()(torch.zeros(4, 10), torch.tensor([1, 2, 3, 4]))
        >>> round(loss.item(), 4)  # log(10)
        2.3026
    """

    def __init__(
        self,
        weight: Tensor | None = None,
        size_average: bool | None = None,
        ignore_index: int = -100,
        reduce: bool | None = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> None:
        _reject("CrossEntropyLoss", "weight", weight, None, "class weights are not supported")
        _reject("CrossEntropyLoss", "size_average", size_average, None, "use reduction=")
        _reject("CrossEntropyLoss", "reduce", reduce, None, "use reduction=")
        super().__init__(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
        )

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return U.cross_entropy(
            input,
            target,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
        )


# --------------------------------------------------------------------------------------------
# transformer blocks
# --------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """Unit-scaled transformer MLP: ``Linear`` up, ``GELU``, ``Linear`` down.

    Calls :func:`~unitscale.functional.linear`, :func:`~unitscale.functional.gelu`,
    :func:`~unitscale.functional.linear` (through the modules). Each op is unit-scaled, but
    the GELU's output, unit in std, keeps a mean of ``0.2821 / 0.5879 = 0.48``, and a linear
    layer's output scales with its input's rms, so the block's output std is
    ``sqrt(1 + 0.48^2) = 1.11`` for a unit input.

    Args:
        hidden_size: input and output width.
        expansion_factor: the inner width is ``expansion_factor * hidden_size``.
        bias: give the two linear layers biases.
        constraint: passed to every op (``None``: every tensor unit-scaled, gradients
            scaled; default ``to_output_scale``: true gradients within the block).
        device, dtype: for the parameters.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(MLP(128)(torch.randn(64, 32, 128)).std().item(), 2)
        1.11
    """

    def __init__(
        self,
        hidden_size: int,
        expansion_factor: int = 4,
        bias: bool = False,
        constraint: Constraint = "to_output_scale",
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        inner = expansion_factor * hidden_size
        self.up = Linear(hidden_size, inner, bias, device, dtype, constraint)
        self.act = GELU(constraint=constraint)
        self.down = Linear(inner, hidden_size, bias, device, dtype, constraint)

    def forward(self, input: Tensor) -> Tensor:
        return self.down(self.act(self.up(input)))


class MHSA(nn.Module):
    """Unit-scaled multi-head self-attention (causal by default).

    Calls :func:`~unitscale.functional.linear` (fused query/key/value projection),
    :func:`~unitscale.functional.scaled_dot_product_attention` and
    :func:`~unitscale.functional.linear` (output projection).

    Args:
        hidden_size: model width; must be divisible by ``heads``.
        heads: number of attention heads.
        dropout_p: attention-probability dropout (training only).
        is_causal: causal mask.
        bias: give the projections biases.
        constraint: passed to every op.
        device, dtype: for the parameters.

    Raises:
        UnsupportedArgumentError: ``hidden_size`` is not divisible by ``heads``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> y = MHSA(128, heads=4)(torch.randn(8, 64, 128))
        >>> y.shape, round(y.std().item(), 1)
        (torch.Size([8, 64, 128]), 1.0)
    """

    def __init__(
        self,
        hidden_size: int,
        heads: int,
        dropout_p: float = 0.0,
        is_causal: bool = True,
        bias: bool = False,
        constraint: Constraint = "to_output_scale",
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if heads < 1 or hidden_size % heads:
            raise UnsupportedArgumentError(
                "MHSA", "heads", heads, f"use a divisor of hidden_size={hidden_size}"
            )
        self.heads = heads
        self.dropout_p = dropout_p
        self.is_causal = is_causal
        self.constraint = _check_constraint(constraint, 4)
        self.qkv = Linear(hidden_size, 3 * hidden_size, bias, device, dtype, constraint)
        self.out = Linear(hidden_size, hidden_size, bias, device, dtype, constraint)

    def forward(self, input: Tensor) -> Tensor:
        hidden = input.shape[-1]
        qkv = self.qkv(input).unflatten(-1, (3, self.heads, hidden // self.heads))
        q, k, v = qkv.movedim(-3, 0).transpose(-2, -3).unbind(0)  # each (..., heads, seq, dim)
        attended = U.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=self.is_causal,
            constraint=self.constraint,
        )
        return self.out(attended.transpose(-2, -3).flatten(-2))

    def extra_repr(self) -> str:
        return (
            f"heads={self.heads}, dropout_p={self.dropout_p}, is_causal={self.is_causal}, "
            f"constraint={self.constraint!r}"
        )


class TransformerLayer(nn.Module):
    """Unit-scaled pre-norm transformer layer: attention then MLP, each in a residual block.

    Each block is ``r, s = residual_split(x, tau)``; ``r = Dropout(Branch(LayerNorm(r)))``;
    ``x = residual_add(r, s, tau)``, with :func:`~unitscale.functional.residual_split`,
    :func:`~unitscale.functional.residual_add`, :class:`LayerNorm`, :class:`MHSA` /
    :class:`MLP` and :class:`Dropout`. ``tau`` is the branch's share of the output variance.

    Args:
        hidden_size: model width.
        heads: attention heads.
        mlp_expansion_factor: MLP inner width over ``hidden_size``.
        dropout_p: dropout on attention probabilities and on each branch's output.
        is_causal: causal attention.
        attn_tau: ``tau`` of the attention block, ``0 < tau < 1``.
        mlp_tau: ``tau`` of the MLP block, ``0 < tau < 1``.
        bias: give the linear layers biases.
        constraint: passed to every op.
        device, dtype: for the parameters.

    Raises:
        UnsupportedArgumentError: a ``tau`` outside (0, 1), or bad ``heads``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> layer = TransformerLayer(128, heads=4, attn_tau=0.2, mlp_tau=0.2)
        >>> round(layer(torch.randn(8, 64, 128)).std().item(), 1)
        1.0
    """

    def __init__(
        self,
        hidden_size: int,
        heads: int,
        mlp_expansion_factor: int = 4,
        dropout_p: float = 0.0,
        is_causal: bool = True,
        attn_tau: float = 0.5,
        mlp_tau: float = 0.5,
        bias: bool = False,
        constraint: Constraint = "to_output_scale",
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, tau in (("attn_tau", attn_tau), ("mlp_tau", mlp_tau)):
            if not 0.0 < tau < 1.0:
                raise UnsupportedArgumentError(
                    "TransformerLayer", name, tau, "tau is a share of the variance: 0 < tau < 1"
                )
        self.attn_tau = attn_tau
        self.mlp_tau = mlp_tau
        self.attn_norm = LayerNorm(hidden_size, device=device, dtype=dtype)
        self.attn = MHSA(hidden_size, heads, dropout_p, is_causal, bias, constraint, device, dtype)
        self.attn_dropout = Dropout(dropout_p)
        self.mlp_norm = LayerNorm(hidden_size, device=device, dtype=dtype)
        self.mlp = MLP(hidden_size, mlp_expansion_factor, bias, constraint, device, dtype)
        self.mlp_dropout = Dropout(dropout_p)

    def forward(self, input: Tensor) -> Tensor:
        residual, skip = U.residual_split(input, self.attn_tau)
        residual = self.attn_dropout(self.attn(self.attn_norm(residual)))
        x = U.residual_add(residual, skip, self.attn_tau)
        residual, skip = U.residual_split(x, self.mlp_tau)
        residual = self.mlp_dropout(self.mlp(self.mlp_norm(residual)))
        return U.residual_add(residual, skip, self.mlp_tau)

    def extra_repr(self) -> str:
        return f"attn_tau={self.attn_tau:.4g}, mlp_tau={self.mlp_tau:.4g}"


class TransformerDecoder(nn.Module):
    """Unit-scaled GPT-style decoder: embedding, causal layers, final norm, readout, loss.

    ``Embedding`` → ``depth`` × :class:`TransformerLayer` → :class:`LayerNorm` →
    :class:`LinearReadout` (no bias), and :func:`~unitscale.functional.cross_entropy` when
    labels are given. There is no positional embedding: causal attention lets each position
    infer its place (a "NoPE" decoder).

    Residual weights: with ``attn_tau``/``mlp_tau`` None (default) the ``k``-th residual
    block (``k = 1 .. 2 depth``, attention and MLP blocks alternating) uses
    ``tau_k = 1 / (k + 1)``, which makes the output the equally weighted, unit-scaled sum of
    the embedding and every branch (a running mean). Give floats to use the same ``tau`` in
    every layer.

    Args:
        hidden_size: model width.
        depth: number of layers.
        heads: attention heads per layer.
        vocab_size: number of tokens.
        dropout_p: dropout in every layer.
        mlp_expansion_factor: MLP inner width over ``hidden_size``.
        attn_tau, mlp_tau: fixed residual shares, or None for the running-mean schedule.
        bias: give the layers' linear layers biases.
        constraint: passed to every op of the layers (the readout keeps its own default).
        device, dtype: for the parameters.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> model = TransformerDecoder(64, depth=2, heads=4, vocab_size=100)
        >>> ids = torch.randint(0, 100, (2, 16))
        >>> model(ids).shape
        torch.Size([2, 16, 100])
        >>> labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
        >>> model(ids, labels).shape  # a scalar loss
        torch.Size([])
    """

    def __init__(
        self,
        hidden_size: int,
        depth: int,
        heads: int,
        vocab_size: int,
        dropout_p: float = 0.0,
        mlp_expansion_factor: int = 4,
        attn_tau: float | None = None,
        mlp_tau: float | None = None,
        bias: bool = False,
        constraint: Constraint = "to_output_scale",
        device: Any = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.embedding = Embedding(vocab_size, hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            TransformerLayer(
                hidden_size,
                heads,
                mlp_expansion_factor,
                dropout_p,
                True,
                1.0 / (2 * i + 2) if attn_tau is None else attn_tau,
                1.0 / (2 * i + 3) if mlp_tau is None else mlp_tau,
                bias,
                constraint,
                device,
                dtype,
            )
            for i in range(depth)
        )
        self.final_norm = LayerNorm(hidden_size, device=device, dtype=dtype)
        self.readout = LinearReadout(hidden_size, vocab_size, False, device, dtype)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None) -> Tensor:
        """Logits, or the mean cross-entropy loss when ``labels`` are given.

        Args:
            input_ids: token ids ``(batch, seq)``.
            labels: next-token targets aligned with ``input_ids``: ``labels[b, t]`` is the
                token that should follow ``input_ids[b, :t + 1]`` (for a batch of text,
                ``input_ids = tokens[:, :-1]`` and ``labels = tokens[:, 1:]``); the value
                -100 is ignored. No shifting happens inside.

        Returns:
            Logits ``(batch, seq, vocab_size)`` if ``labels`` is None, else the scalar loss.
        """
        x = self.embedding(input_ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.readout(self.final_norm(x))
        if labels is None:
            return logits
        return U.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100)
