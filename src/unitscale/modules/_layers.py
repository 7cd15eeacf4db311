"""Unit-scaled layers, activations and losses: thin wrappers around :mod:`unitscale.functional`.

Each module holds parameters and configuration and calls one functional op in ``forward``
(its docstring names it); the scaling rules live with the ops. Where ``torch.nn`` has a
twin, the module subclasses it and takes the same constructor arguments (so ``state_dict``
keys, ``repr`` and ``.to()`` behave the same), plus ``constraint=`` where the op has one.
Weights are initialised to unit variance (``N(0, 1)``; norm weights to 1) and biases to 0,
which is what the ops' scaling rules assume. Every parameter is a u-μP-tagged
:class:`unitscale.Parameter` (weights ``"weight"``, biases ``"bias"``, norm scales
``"norm"``, the readout weight ``"output"``). Arguments the ops do not support are rejected
when the module is built, not on the first call.

Design constraints: no data-dependent Python control flow, so that every module compiles
to one graph with ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .. import functional as U
from ..constraints import apply_constraint
from ..data_parallel import data_parallel_size, gradient_accumulation_steps
from ..errors import UnsupportedArgumentError
from ..functional import Constraint, check_mult
from ..parameter import tag_module, tag_parameter


def _read_batch_counts() -> None:
    """Read the data-parallel size and gradient accumulation in the forward of each module
    whose op scales a shared tensor's gradient by them (see :mod:`unitscale.data_parallel`).

    The functional ops are opaque to TorchDynamo and Inductor folds their factors into the
    compiled backward; read here, in code Dynamo traces, they are guarded, so that a
    ``torch.compile``'d model compiles again when either changes instead of keeping the
    factors of its first call.
    """
    if data_parallel_size() * gradient_accumulation_steps() < 1:  # the comparison is the guard
        raise AssertionError("the data-parallel size and accumulation steps are positive")


def _check_constraint(constraint: Constraint, scales: int) -> Constraint:
    """Fail at construction for an unknown constraint (or one that does not fit the op)."""
    apply_constraint(constraint, *([1.0] * scales))
    return constraint


def _mult_repr(mult: float, name: str = "mult") -> str:
    return "" if mult == 1.0 else f", {name}={mult:.4g}"


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
        tag_module(self)

    def reset_parameters(self) -> None:
        """Weight ``N(0, 1)``, bias 0."""
        nn.init.normal_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        _read_batch_counts()
        return U.linear(input, self.weight, self.bias, self.constraint)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, constraint={self.constraint!r}"


class LinearReadout(Linear):
    """Readout layer, u-μP's by default; ``forward`` calls
    :func:`unitscale.functional.linear_readout`.

    ``mup=True`` (default): u-μP's readout (output multiplier ``1/fan_in``), its weight
    tagged ``mup_type="output"`` (learning rate ``lr`` in :mod:`unitscale.optim`).
    ``mup=False``: plain unit scaling (multiplier ``1/sqrt(fan_in)``, ``constraint``
    applies). Its weight is then applied exactly as a hidden weight is, so it is tagged
    ``"weight"``, its true role: :mod:`unitscale.optim` gives it the hidden-weight rule
    ``lr / sqrt(fan_in)``, never the u-μP readout's ``lr``, which would make the logits'
    update grow like ``sqrt(fan_in)``. Such a model is not u-μP (no transfer is claimed).

    Args:
        in_features, out_features, bias, device, dtype: as for ``nn.Linear``.
        constraint: default ``to_grad_input_scale`` (see ``linear_readout``); used only
            with ``mup=False``.
        mup: u-μP's readout scaling (see ``linear_readout``); False for plain unit scaling.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> head = LinearReadout(64, 1024, bias=False)
        >>> round(head(torch.randn(512, 64)).std().item() * 8, 1), head.weight.mup_type
        (1.0, 'output')
        >>> plain = LinearReadout(64, 1024, bias=False, mup=False)
        >>> round(plain(torch.randn(512, 64)).std().item(), 2), plain.weight.mup_type
        (0.25, 'weight')
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Any = None,
        dtype: torch.dtype | None = None,
        constraint: Constraint = "to_grad_input_scale",
        mup: bool = True,
    ) -> None:
        super().__init__(in_features, out_features, bias, device, dtype, constraint)
        self.mup = mup
        tag_parameter(self.weight, "output" if mup else "weight")  # type: ignore[arg-type]

    def forward(self, input: Tensor) -> Tensor:
        _read_batch_counts()
        return U.linear_readout(input, self.weight, self.bias, self.constraint, mup=self.mup)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mup={self.mup}"


class Conv1d(nn.Conv1d):
    """Unit-scaled ``nn.Conv1d``; ``forward`` calls :func:`unitscale.functional.conv1d`.

    Args:
        in_channels: as for ``nn.Conv1d``, and so are ``out_channels``, ``kernel_size``,
            ``stride``, ``padding``, ``dilation``, ``groups``, ``bias``, ``device``, ``dtype``.
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
        tag_module(self)

    def reset_parameters(self) -> None:
        """Weight ``N(0, 1)``, bias 0."""
        nn.init.normal_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, input: Tensor) -> Tensor:
        _read_batch_counts()
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


class _TorchArgsTagged(nn.Module):
    """Base of the wrappers that take their torch class's own arguments unchanged (the norms):
    the torch class builds the parameters, then :func:`~unitscale.parameter.tag_module` tags
    them with their u-muP roles. Listed before the torch class in the bases."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        tag_module(self)


class LayerNorm(_TorchArgsTagged, nn.LayerNorm):
    """Unit-scaled ``nn.LayerNorm``; ``forward`` calls :func:`unitscale.functional.layer_norm`.

    Same arguments as ``nn.LayerNorm`` (weight 1, bias 0). No constraint (none applies).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(LayerNorm(256)(5 * torch.randn(64, 256)).std().item(), 2)
        1.0
    """

    def forward(self, input: Tensor) -> Tensor:
        return U.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(_TorchArgsTagged, nn.RMSNorm):
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
        tag_module(self)

    def forward(self, input: Tensor) -> Tensor:
        _read_batch_counts()
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
        mult: u-μP multiplier of the input (see :func:`~unitscale.functional.gelu`).

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(GELU()(torch.randn(1000, 1000)).std().item(), 2)
        1.0
    """

    def __init__(
        self,
        approximate: str = "none",
        constraint: Constraint = "to_output_scale",
        mult: float = 1.0,
    ) -> None:
        super().__init__(approximate)
        self.constraint = _check_constraint(constraint, 2)
        self.mult = check_mult("GELU", mult)

    def forward(self, input: Tensor) -> Tensor:
        return U.gelu(input, self.approximate, self.constraint, mult=self.mult)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, constraint={self.constraint!r}{_mult_repr(self.mult)}"


class SiLU(nn.SiLU):
    """Unit-scaled ``nn.SiLU``; ``forward`` calls :func:`unitscale.functional.silu`.

    Args:
        inplace: must be False.
        constraint: see :func:`~unitscale.functional.silu`.
        mult: u-μP multiplier of the input (see :func:`~unitscale.functional.silu`).

    Raises:
        UnsupportedArgumentError: ``inplace=True``.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(SiLU()(torch.randn(1000, 1000)).std().item(), 2)
        1.0
    """

    def __init__(
        self, inplace: bool = False, constraint: Constraint = "to_output_scale", mult: float = 1.0
    ) -> None:
        _reject("SiLU", "inplace", inplace, False, "use inplace=False")
        super().__init__(inplace)
        self.constraint = _check_constraint(constraint, 2)
        self.mult = check_mult("SiLU", mult)

    def forward(self, input: Tensor) -> Tensor:
        return U.silu(input, constraint=self.constraint, mult=self.mult)

    def extra_repr(self) -> str:
        return f"constraint={self.constraint!r}{_mult_repr(self.mult)}"


class Softmax(nn.Softmax):
    """Unit-scaled ``nn.Softmax``; ``forward`` calls :func:`unitscale.functional.softmax`.

    Args:
        dim: the dimension to normalise over; required.
        constraint: see :func:`~unitscale.functional.softmax`.
        mult: u-μP multiplier of the logits (see :func:`~unitscale.functional.softmax`).

    Raises:
        UnsupportedArgumentError: ``dim`` is None.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> round(Softmax(dim=-1)(torch.randn(1000, 128)).std().item(), 1)
        1.0
    """

    def __init__(
        self, dim: int | None = None, constraint: Constraint = "to_output_scale", mult: float = 1.0
    ) -> None:
        if dim is None:
            raise UnsupportedArgumentError(
                "Softmax", "dim", None, "pass the dimension to normalise over, e.g. dim=-1"
            )
        super().__init__(dim)
        self.constraint = _check_constraint(constraint, 2)
        self.mult = check_mult("Softmax", mult)

    def forward(self, input: Tensor) -> Tensor:
        return U.softmax(input, self.dim, constraint=self.constraint, mult=self.mult)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, constraint={self.constraint!r}{_mult_repr(self.mult)}"


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """Cross-entropy with a unit-scaled gradient; calls
    :func:`unitscale.functional.cross_entropy` (the loss value itself is not scaled).

    Args:
        weight, size_average, reduce: not supported; must be None.
        ignore_index, reduction, label_smoothing: as for ``nn.CrossEntropyLoss``.
        mult: u-μP multiplier of the logits (see :func:`~unitscale.functional.cross_entropy`).

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
        mult: float = 1.0,
    ) -> None:
        _reject("CrossEntropyLoss", "weight", weight, None, "class weights are not supported")
        _reject("CrossEntropyLoss", "size_average", size_average, None, "use reduction=")
        _reject("CrossEntropyLoss", "reduce", reduce, None, "use reduction=")
        super().__init__(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing
        )
        self.mult = check_mult("CrossEntropyLoss", mult)

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return U.cross_entropy(
            input,
            target,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
            mult=self.mult,
        )
