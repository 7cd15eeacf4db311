"""Unit-scaled transformer blocks built from the layers: MLP, MHSA, TransformerLayer,
TransformerDecoder."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .. import functional as U
from ..errors import UnsupportedArgumentError
from ..functional import (
    Constraint,
    check_depth_rule,
    check_mult,
    residual_share,
    rule_shares,
    share_to_tau,
)
from ..parameter import DEPTH_RULE
from ._depth import DepthModuleList
from ._layers import (
    GELU,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    LinearReadout,
    RMSNorm,
    _check_constraint,
    _mult_repr,
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
        activation_mult: u-μP multiplier of the GELU's (or the SiLU gate's) input.
        gated: SwiGLU instead (Llama's MLP): ``up`` makes a value and a gate of the inner
            width each, combined by :func:`~unitscale.functional.silu_glu` (unit-scaled:
            the block's output std is 1 for a unit input).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(MLP(128)(torch.randn(64, 32, 128)).std().item(), 2)
        1.11
        >>> round(MLP(128, gated=True)(torch.randn(64, 32, 128)).std().item(), 1)
        1.0
    """

    def __init__(
        self,
        hidden_size: int,
        expansion_factor: int = 4,
        bias: bool = False,
        constraint: Constraint = "to_output_scale",
        device: Any = None,
        dtype: torch.dtype | None = None,
        activation_mult: float = 1.0,
        gated: bool = False,
    ) -> None:
        super().__init__()
        inner = expansion_factor * hidden_size
        self.gated = gated
        self.constraint = constraint
        self.activation_mult = activation_mult
        self.up = Linear(hidden_size, (2 if gated else 1) * inner, bias, device, dtype, constraint)
        self.act = GELU(constraint=constraint, mult=activation_mult)
        self.down = Linear(inner, hidden_size, bias, device, dtype, constraint)

    def forward(self, input: Tensor) -> Tensor:
        hidden = self.up(input)
        if self.gated:
            value, gate = hidden.chunk(2, dim=-1)
            return self.down(
                U.silu_glu(value, gate, constraint=self.constraint, mult=self.activation_mult)
            )
        return self.down(self.act(hidden))


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
        attn_mult: u-μP multiplier of the attention scores (see
            :func:`~unitscale.functional.scaled_dot_product_attention`).
        mup: μP's attention logits (default): scores ``attn_mult * q.k / d_head``, as μP
            and u-μP prescribe (the u-μP paper's rules, Section 4; μP: Yang et al.
            2022): once training has aligned queries with keys, ``q.k`` grows like
            ``d_head``, not ``sqrt(d_head)``, so only ``1/d_head`` keeps the logits' change
            independent of the head size. False: torch's ``attn_mult * q.k / sqrt(d_head)``.
            The unit-scaled attention integrates its scales at whichever logit scale is
            used, so the output is unit either way.
        rope: rotate queries and keys by their position before the scores (RoPE as in
            Llama, the architecture of the u-μP paper's experiments;
            :func:`~unitscale.functional.rotary_embedding`). Default False: attention
            without positional information of its own.

    Raises:
        UnsupportedArgumentError: ``hidden_size`` is not divisible by ``heads``, or ``rope``
            with an odd head size.

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
        attn_mult: float = 1.0,
        mup: bool = True,
        rope: bool = False,
    ) -> None:
        super().__init__()
        if heads < 1 or hidden_size % heads:
            raise UnsupportedArgumentError(
                "MHSA", "heads", heads, f"use a divisor of hidden_size={hidden_size}"
            )
        if rope and (hidden_size // heads) % 2:
            raise UnsupportedArgumentError(
                "MHSA",
                "rope",
                rope,
                f"RoPE rotates pairs of a head's features: the head size "
                f"hidden_size/heads={hidden_size // heads} must be even",
            )
        self.rope = rope
        self.heads = heads
        self.dropout_p = dropout_p
        self.is_causal = is_causal
        self.constraint = _check_constraint(constraint, 4)
        self.attn_mult = check_mult("MHSA", attn_mult)
        self.mup = mup
        self.qkv = Linear(hidden_size, 3 * hidden_size, bias, device, dtype, constraint)
        self.out = Linear(hidden_size, hidden_size, bias, device, dtype, constraint)

    def forward(self, input: Tensor) -> Tensor:
        hidden = input.shape[-1]
        qkv = self.qkv(input).unflatten(-1, (3, self.heads, hidden // self.heads))
        q, k, v = qkv.movedim(-3, 0).transpose(-2, -3).unbind(0)  # each (..., heads, seq, dim)
        if self.rope:
            q, k = U.rotary_embedding(q), U.rotary_embedding(k)
        attended = U.scaled_dot_product_attention(
            q,
            k,
            v,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=self.is_causal,
            scale=1.0 / (hidden // self.heads) if self.mup else None,
            constraint=self.constraint,
            mult=self.attn_mult,
        )
        return self.out(attended.transpose(-2, -3).flatten(-2))

    def extra_repr(self) -> str:
        return (
            f"heads={self.heads}, dropout_p={self.dropout_p}, is_causal={self.is_causal}, "
            f"constraint={self.constraint!r}{_mult_repr(self.attn_mult, 'attn_mult')}, "
            f"mup={self.mup}{', rope=True' if self.rope else ''}"
        )


_BLOCKS = ("gpt", "llama")


def _check_block(where: str, block: str) -> None:
    if block not in _BLOCKS:
        raise UnsupportedArgumentError(where, "block", block, f"use one of {_BLOCKS}")


def _check_multiple_of(module: str, multiple_of: Any) -> None:
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        fix = "use a positive int (1: no rounding)"
        raise UnsupportedArgumentError(module, "mlp_multiple_of", multiple_of, fix)


def _swiglu(
    hidden_size: int,
    expansion_factor: int,
    bias: bool,
    constraint: Constraint,
    device: Any,
    dtype: torch.dtype | None,
    activation_mult: float,
    multiple_of: int = 1,
) -> MLP:
    """Llama's SwiGLU MLP: inner width 2/3 of the GELU MLP's, rounded up to ``multiple_of``."""
    mlp = MLP(hidden_size, 1, bias, constraint, device, dtype, activation_mult, gated=True)
    inner = max(1, 2 * expansion_factor * hidden_size // 3)
    inner = -(-inner // multiple_of) * multiple_of
    mlp.up = Linear(hidden_size, 2 * inner, bias, device, dtype, constraint)
    mlp.down = Linear(inner, hidden_size, bias, device, dtype, constraint)
    return mlp


class TransformerLayer(nn.Module):
    """Unit-scaled pre-norm transformer layer: attention then MLP, each in a residual block.

    Each block is ``r, s = residual_split(x, share=share)``; ``r = Dropout(Branch(Norm(r)))``;
    ``x = residual_add(r, s, share=share)``, with :func:`~unitscale.functional.residual_split`,
    :func:`~unitscale.functional.residual_add`, :class:`RMSNorm` (``block="gpt"``:
    :class:`LayerNorm`), :class:`MHSA` / :class:`MLP` and :class:`Dropout`. Each block's
    weight is given either as ``tau`` (the branch's std over the skip's, the reference
    library's meaning, as in :func:`~unitscale.functional.residual_add`) or as ``share``
    (the branch's share of the output variance, ``tau² / (1 + tau²)``); neither: share 0.5.
    The attributes ``attn_share``/``mlp_share`` hold the shares, ``attn_tau``/``mlp_tau``
    the same weights as taus.

    Args:
        hidden_size: model width.
        heads: attention heads.
        mlp_expansion_factor: MLP inner width over ``hidden_size``.
        dropout_p: dropout on attention probabilities and on each branch's output.
        is_causal: causal attention.
        attn_tau: the attention block's ``tau`` (std ratio, ``> 0``), or None.
        mlp_tau: the MLP block's ``tau`` (std ratio, ``> 0``), or None.
        bias: give the linear layers biases.
        constraint: passed to every op.
        device, dtype: for the parameters.
        attn_mult, activation_mult: u-μP multipliers of the attention scores and of the
            MLP's activation input.
        mup: μP's ``1/d_head`` attention logits (see :class:`MHSA`); False: torch's
            ``1/sqrt(d_head)``.
        trainable_norms: give the two norms a trainable weight (tagged ``"norm"``; a
            LayerNorm a bias too, tagged ``"bias"``). Default False: norms without
            trainable parameters, u-μP's recommended scheme (see :class:`TransformerDecoder`).
        rope: rotary position embedding of queries and keys (see :class:`MHSA`).
        block: ``"llama"`` (default, as :class:`TransformerDecoder`'s): the Llama-style
            block of the u-μP paper's experiments, :class:`RMSNorm` and the SwiGLU MLP
            (``MLP(gated=True)``) of inner width ``2/3 * mlp_expansion_factor *
            hidden_size`` (Llama's rule: as many parameters as the GELU MLP), rounded down
            to a whole number; ``"gpt"``: :class:`LayerNorm` and the GELU :class:`MLP`.
        attn_share: the attention block's share of the variance, ``0 < share < 1``, or
            None (keyword only; not with ``attn_tau``).
        mlp_share: the MLP block's share of the variance, or None (likewise).
        mlp_multiple_of: round the SwiGLU inner width up to a multiple of this (keyword only;
            Llama's ``multiple_of``; default 64: no float8 GEMM padded; 1: unrounded).

    Raises:
        UnsupportedArgumentError: a ``tau <= 0``, a ``share`` outside (0, 1), both given
            for one block, bad ``heads``, ``block`` or ``mlp_multiple_of``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> layer = TransformerLayer(128, heads=4, attn_share=0.2, mlp_tau=0.5)
        >>> layer.attn_tau, layer.mlp_share  # sqrt(0.2 / 0.8); 0.25 / 1.25
        (0.5, 0.2)
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
        attn_tau: float | None = None,
        mlp_tau: float | None = None,
        bias: bool = False,
        constraint: Constraint = "to_output_scale",
        device: Any = None,
        dtype: torch.dtype | None = None,
        attn_mult: float = 1.0,
        activation_mult: float = 1.0,
        mup: bool = True,
        trainable_norms: bool = False,
        rope: bool = False,
        block: str = "llama",
        *,
        attn_share: float | None = None,
        mlp_share: float | None = None,
        mlp_multiple_of: int = 64,
    ) -> None:
        super().__init__()
        _check_block("TransformerLayer", block)
        _check_multiple_of("TransformerLayer", mlp_multiple_of)
        self.attn_share = _block_share("attn", attn_tau, attn_share)
        self.mlp_share = _block_share("mlp", mlp_tau, mlp_share)
        norm = {"elementwise_affine": trainable_norms, "device": device, "dtype": dtype}
        norm_class = RMSNorm if block == "llama" else LayerNorm
        self.attn_norm = norm_class(hidden_size, **norm)
        self.attn = MHSA(
            hidden_size,
            heads,
            dropout_p,
            is_causal,
            bias,
            constraint,
            device,
            dtype,
            attn_mult,
            mup,
            rope,
        )
        self.attn_dropout = Dropout(dropout_p)
        self.mlp_norm = norm_class(hidden_size, **norm)
        if block == "llama":
            mlp = (hidden_size, mlp_expansion_factor, bias, constraint, device, dtype)
            self.mlp = _swiglu(*mlp, activation_mult, mlp_multiple_of)
        else:
            self.mlp = MLP(
                hidden_size, mlp_expansion_factor, bias, constraint, device, dtype, activation_mult
            )
        self.mlp_dropout = Dropout(dropout_p)

    @property
    def attn_tau(self) -> float:
        """The attention block's weight as the reference's ``tau`` (branch std over skip's)."""
        return share_to_tau(self.attn_share)

    @property
    def mlp_tau(self) -> float:
        """The MLP block's weight as the reference's ``tau`` (branch std over skip's)."""
        return share_to_tau(self.mlp_share)

    def forward(self, input: Tensor) -> Tensor:
        residual, skip = U.residual_split(input, share=self.attn_share)
        residual = self.attn_dropout(self.attn(self.attn_norm(residual)))
        x = U.residual_add(residual, skip, share=self.attn_share)
        residual, skip = U.residual_split(x, share=self.mlp_share)
        residual = self.mlp_dropout(self.mlp(self.mlp_norm(residual)))
        return U.residual_add(residual, skip, share=self.mlp_share)

    def extra_repr(self) -> str:
        return f"attn_share={self.attn_share:.4g}, mlp_share={self.mlp_share:.4g}"


def _block_share(kind: str, tau: float | None, share: float | None) -> float:
    """A block's variance share from its ``{kind}_tau`` or ``{kind}_share`` (errors name the
    module's argument)."""
    try:
        return residual_share("TransformerLayer", tau, share)
    except UnsupportedArgumentError as error:
        name = f"{kind}_tau" if tau is not None else f"{kind}_share"
        value = tau if tau is not None else share
        raise UnsupportedArgumentError(
            "TransformerLayer", name, value, str(error).split("; ", 1)[-1]
        ) from None


def _decoder_shares(
    depth: int,
    mup: bool,
    residual_mult: float | None,
    residual_attn_ratio: float | None,
    depth_rule: str,
) -> list[float]:
    """Each residual branch's variance share in a :class:`TransformerDecoder`: u-μP's rule
    (with ``mup`` or a mult given), else the running mean ``1 / (k + 1)``."""
    if not (mup or residual_mult is not None or residual_attn_ratio is not None):
        return [1.0 / (k + 2) for k in range(2 * depth)]  # the running mean
    mult = 1.0 if residual_mult is None else residual_mult
    ratio = 1.0 if residual_attn_ratio is None else residual_attn_ratio
    U.transformer_residual_scaling_rule(mult, ratio)  # checks the mults
    return rule_shares(2 * depth, mult, ratio, depth_rule)


class TransformerDecoder(nn.Module):
    """Llama-style decoder, u-μP by default: embedding, causal layers, final norm, readout, loss.

    ``Embedding`` → ``depth`` × :class:`TransformerLayer` → :class:`RMSNorm` →
    :class:`LinearReadout` (no bias), and :func:`~unitscale.functional.cross_entropy` when
    labels are given. Positions enter through rotary embeddings of queries and keys in every
    layer (RoPE, as in the Llama architecture of the u-μP paper's experiments;
    :func:`~unitscale.functional.rotary_embedding`); ``rope=False`` builds a decoder without
    positional information of its own (causal attention alone lets each position infer its
    place, a "NoPE" decoder). On the bundled text, 1000 steps at width 128 (``unitscale train``'s
    setting), the NoPE decoder ended at a held-out loss 0.5 nats above the plain GPT with
    learned positions; that gap was the missing positions, not u-μP (the plain GPT without
    positions ended as high).

    u-μP (default, ``mup=True``; Blake et al., ICLR 2025, arXiv 2407.17465): every tensor
    unit-scaled at initialisation, plus

    * the residual rule :func:`~unitscale.functional.transformer_residual_scaling_rule`
      (paper, Appendix G; ``residual_mult``, ``residual_attn_ratio``): it weights the
      embedding, the attention branches and the MLP branches a third each in the final
      stream at the default mults (weights: at initialisation the attention branches hold
      more of the stream's variance, 0.52-0.95 measured at 2-8 layers and 32-256 tokens,
      see docs/guide/umup.rst);
    * attention logits ``attn_mult * q.k / d_head`` (μP's ``1/d_head``, :class:`MHSA`);
    * the u-μP readout (``LinearReadout(mup=True)``: output multiplier ``1/fan_in``);
    * the paper's recommended scheme: the Llama-style block of its experiments (RMSNorm, a
      SwiGLU MLP; ``block="llama"``, see :class:`TransformerLayer`), no biases and norms
      without trainable parameters (an RMSNorm without weight). The paper's point is that
      the norms have no trainable parameters: then no parameter outside the weights needs a
      learning-rate rule of its own, and the optimal learning rate stops depending on them
      (with trainable LayerNorms and biases our transfer run's optimum, GPT-style block,
      sat at 0.125-0.25 instead of 0.5).
    * layers held in a :class:`~unitscale.DepthModuleList`, so every layer parameter has
      ``mup_scaling_depth = depth``; train with :mod:`unitscale.optim`.

    Options: ``bias=True`` gives the linear layers biases (tagged ``"bias"``: learning
    rate ``lr / sqrt(depth)`` in :mod:`unitscale.optim`), ``trainable_norms=True`` gives the
    norms a weight and bias (tagged ``"norm"`` and ``"bias"``: ``lr / sqrt(depth)`` inside the
    layers, ``lr`` for the final norm); both are changes of u-μP's sound scheme whose
    transfer is not measured. ``mup=False`` builds plain unit scaling: the running-mean
    residual weights (the ``k``-th residual block, ``k = 1 .. 2 depth``, uses
    ``share_k = 1 / (k + 1)``, so the output is the equally weighted, unit-scaled sum of the
    embedding and every branch), torch's ``1/sqrt(d_head)`` logits and a unit-scaled
    readout (its weight tagged ``"weight"``); ``residual_mult``/``residual_attn_ratio``
    given still select the u-μP rule. ``attn_tau``/``mlp_tau`` (std ratios, the reference's
    ``tau``) or ``attn_share``/``mlp_share`` (variance shares) fix the same weight in every
    layer. ``attn_mult``, ``activation_mult`` and ``loss_mult`` (u-μP's α multipliers)
    apply either way.

    Depth rule, ``depth_rule``: ``"depth-mup"`` (default, the u-μP paper's): each residual
    branch's multiplier falls like ``1/sqrt(depth)`` and a layer parameter's learning rate
    carries the factor ``1/sqrt(depth)`` (:mod:`unitscale.optim`). ``"completep"``
    (CompleteP, Dey et al. 2025, arXiv 2505.01618, ``α = 1``): multipliers ``1/depth``
    (:func:`~unitscale.functional.transformer_residual_scaling_rule`) and no depth factor on
    the learning rate of Adam-style optimisers (the paper's ``η L^(α-1)``, Table 1); the
    layer parameters carry ``mup_depth_rule = "completep"`` for the optimisers to read. The
    two rules agree at one layer (the base depth). Applies to the u-μP rule only (not to
    ``mup=False``'s running mean, nor to fixed ``attn_tau``/``mlp_tau``).

    Args:
        hidden_size: model width.
        depth: number of layers.
        heads: attention heads per layer.
        vocab_size: number of tokens.
        dropout_p: dropout in every layer.
        mlp_expansion_factor: MLP inner width over ``hidden_size``.
        attn_tau, mlp_tau: fixed residual weights as std ratios (the reference's ``tau``),
            or None for the rule (see above).
        bias: give the layers' linear layers biases.
        constraint: passed to every op of the layers (the readout keeps its own default).
        device, dtype: for the parameters.
        residual_mult, residual_attn_ratio: u-μP residual multipliers (None: 1 with ``mup``,
            else the running-mean schedule); ignored where ``attn_tau``/``mlp_tau`` is given.
        attn_mult: multiplier of the attention scores.
        activation_mult: multiplier of the MLP activation's input.
        loss_mult: multiplier of the logits inside the loss.
        mup: u-μP (default); False for plain unit scaling (see above).
        trainable_norms: give every norm a trainable weight (and a LayerNorm a bias);
            default False, the recommended scheme (as ``unit_scale``'s keyword of the same
            name).
        rope: rotary position embedding in every layer (default; see above).
        block: ``"llama"`` (default): the Llama-style block of the paper's experiments,
            RMSNorm and a SwiGLU MLP (:class:`TransformerLayer`), the final norm an RMSNorm
            too (``unitscale transfer``'s u-μP model is this block with ``rope=False``);
            ``"gpt"``: LayerNorm (the final norm too) and the GELU MLP. Learning rates of
            the options as
            above: a trainable norm's weight is tagged ``"norm"`` (``lr / sqrt(depth)`` in
            the layers, ``lr`` for the final norm), biases ``"bias"``
            (``lr / sqrt(depth)``).
        depth_rule: ``"depth-mup"`` (default) or ``"completep"`` (see above).
        attn_share, mlp_share: fixed residual weights as variance shares (keyword only;
            not with ``attn_tau``/``mlp_tau``).
        mlp_multiple_of: as :class:`TransformerLayer`'s (keyword only; default 64).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> model = TransformerDecoder(64, depth=2, heads=4, vocab_size=100)
        >>> ids = torch.randint(0, 100, (2, 16))
        >>> model(ids).shape
        torch.Size([2, 16, 100])
        >>> labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
        >>> model(ids, labels).shape  # a scalar loss
        torch.Size([])
        >>> sorted({p.mup_type for p in model.parameters()})  # no biases, no norm parameters
        ['output', 'weight']
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
        residual_mult: float | None = None,
        residual_attn_ratio: float | None = None,
        attn_mult: float = 1.0,
        activation_mult: float = 1.0,
        loss_mult: float = 1.0,
        mup: bool = True,
        trainable_norms: bool = False,
        rope: bool = True,
        block: str = "llama",
        depth_rule: str = "depth-mup",
        *,
        attn_share: float | None = None,
        mlp_share: float | None = None,
        mlp_multiple_of: int = 64,
    ) -> None:
        super().__init__()
        _check_block("TransformerDecoder", block)
        check_depth_rule("TransformerDecoder", depth_rule)
        _check_multiple_of("TransformerDecoder", mlp_multiple_of)
        self.mup = mup
        self.depth_rule = depth_rule
        self.loss_mult = check_mult("TransformerDecoder", loss_mult)
        shares = _decoder_shares(depth, mup, residual_mult, residual_attn_ratio, depth_rule)
        fixed_attn = attn_tau is not None or attn_share is not None
        fixed_mlp = mlp_tau is not None or mlp_share is not None
        self.embedding = Embedding(vocab_size, hidden_size, device=device, dtype=dtype)
        self.layers = DepthModuleList(
            TransformerLayer(
                hidden_size,
                heads,
                mlp_expansion_factor,
                dropout_p,
                True,
                attn_tau,
                mlp_tau,
                bias,
                constraint,
                device,
                dtype,
                attn_mult,
                activation_mult,
                mup,
                trainable_norms,
                rope,
                block,
                attn_share=attn_share if fixed_attn else shares[2 * i],
                mlp_share=mlp_share if fixed_mlp else shares[2 * i + 1],
                mlp_multiple_of=mlp_multiple_of,
            )
            for i in range(depth)
        )
        if depth_rule != "depth-mup":
            for param in self.layers.parameters():
                setattr(param, DEPTH_RULE, depth_rule)
        self.final_norm = (RMSNorm if block == "llama" else LayerNorm)(
            hidden_size, elementwise_affine=trainable_norms, device=device, dtype=dtype
        )
        self.readout = LinearReadout(hidden_size, vocab_size, False, device, dtype, mup=mup)

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
        return U.cross_entropy(
            logits.flatten(0, -2), labels.flatten(), ignore_index=-100, mult=self.loss_mult
        )
