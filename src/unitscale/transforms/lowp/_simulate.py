"""``simulate_format`` and ``simulate_fp8``: run matmul-like ops on low-precision operands.

Both return a copy of a module whose captured graphs are rewritten by
:class:`~unitscale.transforms.lowp._pass.SimulateFormatPass`: every floating-point
operand of a matmul-like op (:mod:`unitscale.transforms.lowp._operands`) is rounded to a
format in the forward pass and, optionally, the gradients around the op in the backward pass
(:mod:`unitscale.transforms.lowp._quantise`). This module holds the user-facing
functions, the checks of their arguments, the FP8 recipes and the count of scaling work.

Which tensors an FP8 run rounds is an :class:`FP8Recipe`. The default, ``"hardware"``, is
what FP8 training recipes on current accelerators do: the matmul's inputs (weights included)
in E4M3 and the gradient arriving at its output in E5M2, so the gradients it produces for
its inputs, and the weight gradient in particular, come out of a higher-precision
accumulation and are not rounded. ``"all-operands"`` rounds the gradient with respect to
every operand (weights included) to E5M2 instead: an earlier, harsher simulation.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

import torch  # noqa: F401 (the examples use it)
from torch import nn

from ...capture import Invocation, TransformedModule, transformed
from ...errors import UnitScaleError
from ...formats import (
    BLOCK_PRESETS,
    E4M3,
    E5M2,
    PRESETS,
    BlockFormat,
    FormatError,
    FPFormat,
    get_format,
)
from ._blocks import BlockFormatPass, check_block_formats
from ._ops import OPS_SCOPES, OpsScope
from ._pass import SimulateFormatPass
from ._scaling import DEFAULT_HISTORY_LEN, ROWWISE_SCALINGS, SCALINGS, Scaling, keep_histories
from ._skip import Skip, resolve_skip

__all__ = [
    "FP8_RECIPES",
    "FP8Recipe",
    "ScalingCost",
    "scaling_cost",
    "simulate_format",
    "simulate_fp8",
]


def _check_format(argument: str, value: Any) -> FPFormat:
    if isinstance(value, FPFormat):
        return value
    try:
        # A name means its preset, which rounds to nearest as hardware casts do.
        return get_format(value)
    except FormatError as error:
        raise FormatError(
            f"unitscale.transforms.simulate_format: argument {argument!r}={value!r} is not a "
            "format; pass a unitscale.formats.FPFormat (e.g. unitscale.formats.E4M3, or "
            "FPFormat(exponent_bits, mantissa_bits)) or a preset key such as 'e4m3'"
        ) from error


def _block_format(value: Any) -> Any:
    """``value`` as a :class:`~unitscale.formats.BlockFormat` where it names one (else as is)."""
    if isinstance(value, str) and value.lower() in BLOCK_PRESETS:
        return get_format(value)
    return value


def _check_ops(op: str, ops: Any) -> None:
    if not isinstance(ops, str) or ops not in OPS_SCOPES:
        raise FormatError(
            f"unitscale.transforms.{op}: argument 'ops'={ops!r} is not supported; use "
            "'linear' (ops with a weight parameter: the scope of real FP8 training) or "
            "'matmuls' (every matmul-like op, attention's included)"
        )


def _check_scaling(op: str, scaling: Any, history_len: Any) -> None:
    if not isinstance(scaling, str) or scaling not in SCALINGS:
        raise FormatError(
            f"unitscale.transforms.{op}: argument 'scaling'={scaling!r} is not supported; "
            f"use one of {SCALINGS}"
        )
    if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
        raise FormatError(
            f"unitscale.transforms.{op}: argument 'history_len'={history_len!r} must be a "
            f"positive int (the number of earlier steps scaling='delayed' keeps; default "
            f"{DEFAULT_HISTORY_LEN})"
        )


def _transformed(op: str, module: nn.Module, graph_pass: SimulateFormatPass) -> TransformedModule:
    result = transformed(module, graph_pass, op)
    if graph_pass.scaling == "delayed":
        keep_histories(result.module)
    return result


def simulate_format(
    module: nn.Module,
    fwd_format: FPFormat | BlockFormat | str,
    bwd_format: FPFormat | BlockFormat | str,
    scaling: Scaling = "none",
    history_len: int = DEFAULT_HISTORY_LEN,
    ops: OpsScope = "matmuls",
    skip: Skip = None,
) -> TransformedModule:
    """Return a copy of ``module`` whose matmul-like ops see operands in low precision.

    Every floating-point operand of a matmul-like op (``F.linear`` input and weight,
    ``matmul``/``bmm``/``@``, ``addmm``, ``einsum``, convolutions, the query, key and value
    of ``F.scaled_dot_product_attention``, and their :mod:`unitscale.functional`
    equivalents) is rounded to ``fwd_format`` in the forward pass, and the gradient with
    respect to it is rounded to ``bwd_format`` in the backward pass. Nothing else changes:
    the arithmetic inside each op, and every other op, runs in the model's own dtype.

    A format rounds to nearest, as PyTorch's casts do (bit-identical to them), whether it is
    given by name (``"e4m3"``) or as a preset (``unitscale.formats.E4M3``): that is every
    :class:`~unitscale.formats.FPFormat`'s default. Pass one with
    ``rounding="stochastic"`` for stochastic rounding.

    Block-scaled formats (:class:`~unitscale.formats.BlockFormat`: ``"mxfp8_e4m3"``,
    ``"mxfp8_e5m2"``, ``"mxfp6_e3m2"``, ``"mxfp6_e2m3"``, ``"mxfp4_e2m1"``, ``"nvfp4"``,
    both formats block-scaled) run each linear op (and, with ``ops="matmuls"``, each
    two-operand ``matmul``/``mm``/``bmm``/``@``) as block-scaled GEMMs: forward ``x`` and
    ``W`` blocked along the reduction dimension ``K``, the input-gradient GEMM ``grad_y``
    and ``W`` along ``N``, the weight-gradient GEMM ``grad_y`` and ``x`` along the tokens
    ``M``, as Transformer Engine and torchao's MX training do (``fwd_format`` for ``x`` and
    ``W``, ``bwd_format`` for ``grad_y``; ``get_format("nvfp4", rounding="stochastic")``
    for stochastically rounded gradients). Other matmul-like ops, and ops with a GEMM
    dimension that is not a multiple of the block size, run unrounded and are listed with
    the reason by :func:`fp8_summary` (see docs/guide/formats.rst). ``scaling`` must be
    ``"none"``: the block scales are the scaling.

    Args:
        module: any ``torch.nn.Module`` (or an already transformed one, e.g.
            ``unit_scale(m)``) that TorchDynamo can capture.
        fwd_format: format of forward operands: an :class:`~unitscale.formats.FPFormat`
            or a preset key (``"e4m3"``, ``"e5m2"``, ``"fp16"``, ``"bf16"``), which rounds
            to nearest; or a block-scaled format or its name.
        bwd_format: format of the gradients, likewise.
        scaling: ``"none"`` (default), ``"tensorwise"`` or ``"delayed"``: how each rounded
            tensor is scaled (see :func:`simulate_fp8`; its rowwise recipes fix their own
            formats, so ``simulate_format`` refuses them).
        history_len: amax-history length for ``scaling="delayed"``.
        ops: which ops are rounded: ``"matmuls"`` (default: every matmul-like op) or
            ``"linear"`` (ops with a weight parameter), as for :func:`simulate_fp8`.
        skip: modules kept in high precision, as for :func:`simulate_fp8`.

    Returns:
        The transformed copy (``module`` is not touched).

    Raises:
        FormatError: a format argument is neither an ``FPFormat``, a ``BlockFormat`` nor a
            preset key, a block-scaled format is paired with a per-tensor one or with
            ``scaling``, or ``scaling``/``history_len``/``ops`` is not supported.
        CaptureError: ``module`` is not a module, is already compiled (see
            :func:`~unitscale.transforms.compile`) or tracked (apply ``track_scales``
            last), or holds a submodule that is (the error names it); or TorchDynamo
            cannot capture it (at the first call).

    Example:
        >>> from unitscale.formats import FPFormat
        >>> tiny = FPFormat(2, 1, rounding="nearest")  # values 0, 0.5, 1, 1.5, 2, 3
        >>> model = simulate_format(nn.Linear(4, 1, bias=False), tiny, tiny)
        >>> with torch.no_grad():
        ...     _ = model.weight.copy_(torch.tensor([[0.3, 1.1, 1.6, 5.0]]))
        >>> model(torch.ones(1, 4)).item()  # weights round to 0.5, 1, 1.5, 3
        6.0
    """
    fwd_any, bwd_any = _block_format(fwd_format), _block_format(bwd_format)
    if isinstance(fwd_any, BlockFormat) or isinstance(bwd_any, BlockFormat):
        _check_ops("simulate_format", ops)
        blocks = check_block_formats(fwd_any, bwd_any, scaling)
        skipped = resolve_skip("simulate_format", module, skip)
        block_pass = BlockFormatPass(*blocks, ops=ops, skip=skipped)
        return transformed(module, block_pass, "simulate_format")
    fwd = _check_format("fwd_format", fwd_format)
    bwd = _check_format("bwd_format", bwd_format)
    _check_scaling("simulate_format", scaling, history_len)
    if scaling in ROWWISE_SCALINGS:
        raise FormatError(
            f"unitscale.transforms.simulate_format: scaling={scaling!r} is torchao's recipe of "
            "that name, which fixes its formats; use unitscale.transforms.simulate_fp8(model, "
            f"scaling={scaling!r}) (or to_fp8 for real FP8)"
        )
    _check_ops("simulate_format", ops)
    graph_pass = SimulateFormatPass(
        fwd,
        bwd,
        scaling=scaling,
        history_len=history_len,
        ops=ops,
        transform="simulate_format",
        skip=resolve_skip("simulate_format", module, skip),
    )
    return _transformed("simulate_format", module, graph_pass)


def _short(fmt: FPFormat | None) -> str:
    """``e4m3/nearest`` for a preset with any rounding; the full repr otherwise."""
    if fmt is None:
        return "None"
    for key, preset in PRESETS.items():
        if dataclasses.replace(preset, rounding=fmt.rounding) == fmt:
            return f"{key}/{fmt.rounding}"
    return repr(fmt)


@dataclasses.dataclass(frozen=True)
class FP8Recipe:
    """Which tensors around each matmul-like op :func:`simulate_fp8` rounds, and to what.

    Every operand of a matmul-like op (weights included) is rounded to ``operands`` in the
    forward pass. In the backward pass, ``output_grad`` rounds the gradient arriving at the
    op's output (what an FP8 matmul's backward reads), and ``operand_grads`` rounds the
    gradients the op produces for its operands (the weight gradient included). Named presets
    are in :data:`FP8_RECIPES`: ``"hardware"`` (the default of :func:`simulate_fp8`) and
    ``"all-operands"``. ``ops`` says which ops the recipe covers.

    Attributes:
        operands: format of the operands in the forward pass.
        output_grad: format of the gradient with respect to the op's output, or None.
        operand_grads: format of the gradients with respect to the operands, or None.
        ops: ``"matmuls"`` (default: every matmul-like op, attention's batched matmuls,
            convolutions and mixture-of-experts grouped matmuls included) or ``"linear"``
            (only ops with a weight parameter: ``nn.Linear``/``F.linear``, the unit-scaled
            linears and readout, transformers' ``Conv1D``; the scope of real FP8 training).

    Raises:
        FormatError: a field is not an :class:`~unitscale.formats.FPFormat` (or None where
            allowed), neither gradient is rounded, or ``ops`` is unknown.

    Example:
        >>> FP8_RECIPES["hardware"]  # doctest: +NORMALIZE_WHITESPACE
        FP8Recipe(operands=e4m3/nearest, output_grad=e5m2/nearest, operand_grads=None,
                  ops='matmuls')
        >>> dataclasses.replace(FP8_RECIPES["hardware"], ops="linear").ops
        'linear'
    """

    operands: FPFormat
    output_grad: FPFormat | None
    operand_grads: FPFormat | None = None
    ops: OpsScope = "matmuls"

    def __post_init__(self) -> None:
        if not isinstance(self.operands, FPFormat):
            raise FormatError(
                f"FP8Recipe: operands={self.operands!r} is not an FPFormat; pass e.g. "
                "dataclasses.replace(unitscale.formats.E4M3, rounding='nearest')"
            )
        for name in ("output_grad", "operand_grads"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, FPFormat):
                raise FormatError(f"FP8Recipe: {name}={value!r} is neither an FPFormat nor None")
        if self.output_grad is None and self.operand_grads is None:
            raise FormatError(
                "FP8Recipe: neither output_grad nor operand_grads is set, so no gradient "
                "would be rounded; set one (FP8 recipes round the output gradient to E5M2)"
            )
        if not isinstance(self.ops, str) or self.ops not in OPS_SCOPES:
            raise FormatError(
                f"FP8Recipe: ops={self.ops!r}; use 'linear' (ops with a weight parameter) or "
                "'matmuls' (every matmul-like op)"
            )

    def __repr__(self) -> str:
        return (
            f"FP8Recipe(operands={_short(self.operands)}, "
            f"output_grad={_short(self.output_grad)}, "
            f"operand_grads={_short(self.operand_grads)}, ops={self.ops!r})"
        )


_E4M3_NEAREST = dataclasses.replace(E4M3, rounding="nearest")
_E5M2_NEAREST = dataclasses.replace(E5M2, rounding="nearest")

FP8_RECIPES: MappingProxyType[str, FP8Recipe] = MappingProxyType(
    {
        "hardware": FP8Recipe(operands=_E4M3_NEAREST, output_grad=_E5M2_NEAREST),
        "all-operands": FP8Recipe(
            operands=_E4M3_NEAREST, output_grad=None, operand_grads=_E5M2_NEAREST
        ),
    }
)
"""Named :class:`FP8Recipe` presets, all rounding to nearest (as hardware casts do).

- ``"hardware"``: matmul inputs (weights included) in E4M3, the gradient of the matmul's
  output in E5M2; the input and weight gradients the matmul computes are not rounded (they
  are accumulated in higher precision, as FP8 training recipes on current hardware do).
- ``"all-operands"``: matmul inputs in E4M3, and the gradient with respect to every input,
  the weight's included, in E5M2 (this library's behaviour before the hardware recipe).
"""


def _check_rowwise(recipe: Any, chosen: FP8Recipe, scaling: str, ops: Any) -> OpsScope:
    """The ops a rowwise recipe covers (linear ops: torchao's recipes are for linear layers),
    refusing a recipe or scope that contradicts it."""
    if chosen != FP8_RECIPES["hardware"]:
        raise FormatError(
            f"unitscale.transforms.simulate_fp8: scaling={scaling!r} is torchao's recipe of "
            f"that name, which fixes its formats (E4M3 for every tensor, gradients included) "
            f"and which GEMMs run in FP8; recipe={recipe!r} cannot be combined with it: leave "
            "recipe at 'hardware' (the default)"
        )
    if ops is not None and ops != "linear":
        raise FormatError(
            f"unitscale.transforms.simulate_fp8: scaling={scaling!r} covers linear ops only "
            f"(torchao's recipe), not ops={ops!r}; pass ops='linear' or leave ops out"
        )
    return "linear"


def _check_recipe(recipe: Any) -> FP8Recipe:
    if isinstance(recipe, FP8Recipe):
        return recipe
    if isinstance(_block_format(recipe), BlockFormat):
        raise FormatError(
            f"unitscale.transforms.simulate_fp8: recipe={recipe!r} is a block-scaled format, "
            "not an FP8 recipe; simulate it with unitscale.transforms.simulate_format(model, "
            "fwd_format, bwd_format), e.g. simulate_format(model, 'mxfp8_e4m3', 'mxfp8_e4m3')"
        )
    if isinstance(recipe, str) and recipe in FP8_RECIPES:
        return FP8_RECIPES[recipe]
    raise FormatError(
        f"unitscale.transforms.simulate_fp8: recipe={recipe!r} is not an FP8 recipe; pass an "
        f"FP8Recipe or one of {sorted(FP8_RECIPES)}"
    )


def simulate_fp8(
    module: nn.Module,
    recipe: FP8Recipe | str = "hardware",
    scaling: Scaling = "none",
    history_len: int = DEFAULT_HISTORY_LEN,
    ops: OpsScope | None = None,
    skip: Skip = None,
) -> TransformedModule:
    """Return a copy of ``module`` whose matmul-like ops run on FP8 operands.

    With the default ``recipe="hardware"``: every operand of a matmul-like op (weights
    included) is rounded to OCP FP8 E4M3 in the forward pass and the gradient arriving at
    the op's output to OCP FP8 E5M2 in the backward pass, both round-to-nearest-even as
    hardware casts do; the gradients the op computes for its operands (the weight gradient
    included) are not rounded, as in FP8 recipes where the matmul accumulates in higher
    precision. ``recipe="all-operands"`` rounds the gradient with respect to every operand
    to E5M2 instead (what ``simulate_format(module, "e4m3", "e5m2")`` does).
    Values beyond a format's range saturate to its largest value (an ``FPFormat`` with
    ``overflow="inf"`` in a custom recipe makes them ``±inf`` instead). For stochastic
    rounding or other formats, pass an :class:`FP8Recipe` or call :func:`simulate_format`.

    ``scaling`` says how each tensor the recipe rounds is scaled (rules and their sources in
    :mod:`unitscale.transforms.lowp._scaling`):

    - ``"none"`` (default): not at all, what a unit-scaled model needs;
    - ``"tensorwise"``: multiplied by ``format_max / amax(tensor)`` before rounding and
      divided after, forward and backward, the amax taken when the tensor is rounded: the
      numerics of torchao's float8 training with its default config (tested against
      ``torchao.float8.convert_to_float8_training``); amax is not reduced over
      data-parallel ranks, as in torchao's default;
    - ``"rowwise"`` and ``"rowwise_with_gw_hp"``: torchao's recipes of those names
      (``Float8LinearConfig.from_recipe_name``), bit for bit on the CPU: linear ops only
      (``ops`` defaults to ``"linear"``), each operand of each of the three GEMMs scaled
      per row or column along that GEMM's reduction dimension with power-of-two scales, E4M3
      for every tensor (gradients included), each GEMM's output written in bfloat16 for a
      float32 model; ``"rowwise_with_gw_hp"`` computes the weight gradient in the model's
      precision and casts the weight for the input gradient with one scale (rules in
      :mod:`unitscale.transforms.lowp._simulated_rowwise`);
    - ``"delayed"``: the same with ``amax`` the maximum of the tensor's amax history over the
      ``history_len`` earlier training steps (the first step uses the current amax); the
      histories are buffers of the returned module (``fp8_amax_history_<module>_<role>``
      in ``state_dict()``, one set per op however TorchDynamo cuts the graph, created at
      the first call).

    ``ops`` says which ops are rounded:

    - ``"matmuls"`` (the default): every matmul-like op: linear layers, attention's
      ``scaled_dot_product_attention`` and batched matmuls, ``einsum``, convolutions and the
      grouped matmuls of mixture-of-experts layers (``torch.nn.functional.grouped_mm``,
      ``torch._grouped_mm``, transformers' ``grouped_mm_fallback``);
    - ``"linear"``: only the ops with a weight parameter (``nn.Linear``/``F.linear``, the
      unit-scaled linears and readout, transformers' ``Conv1D``): the scope of real FP8
      training (torchao's ``convert_to_float8_training``, Transformer Engine's FP8 linears),
      where attention runs in the input's precision. ``simulate_fp8(model, ops="linear",
      scaling="tensorwise")`` is torchao's recipe (tested against it on the built-in GPT).

    The default is ``"matmuls"``, the stricter test: a model that trains with every matmul
    in FP8 trains with its linear layers alone in FP8, and FP8 attention kernels exist; it is
    also what this function did before ``ops`` existed, so results recorded without it keep
    their meaning. To predict a real FP8 run of linear layers, pass ``ops="linear"``.
    :func:`fp8_summary` lists the ops rounded and the matmul-like ops that were not (and
    why), also logged once per captured graph at INFO on the ``"unitscale"`` logger; an op
    named like a matmul that no table recognises is warned about.

    ``skip`` keeps chosen layers in high precision, as practitioners keep the first and
    last layers or the small ones: qualified module names (``"readout"``,
    ``["layers.0.attn", "layers.3"]``: each module and everything inside it), or a predicate
    ``skip(name, module) -> bool`` called on every module (torchao's ``module_filter_fn``
    with the opposite sense: True keeps the module out of FP8). Their ops are listed in
    :func:`fp8_summary` as ``"skipped by skip="``; a name that matches no module is an error
    naming the closest ones.

    :func:`scaling_cost` counts the amax reductions and scale computations of a step.

    Args:
        module: any ``torch.nn.Module`` (or a transformed one) that TorchDynamo can capture.
        recipe: an :class:`FP8Recipe` or the key of a preset in :data:`FP8_RECIPES`.
        scaling: ``"none"``, ``"tensorwise"``, ``"delayed"``, ``"rowwise"`` or
            ``"rowwise_with_gw_hp"``.
        history_len: amax-history length for ``scaling="delayed"`` (default 16, torchao's
            former delayed-scaling default).
        ops: ``"matmuls"`` or ``"linear"``; None (default) takes the recipe's
            (:attr:`FP8Recipe.ops`, ``"matmuls"`` for the presets).
        skip: modules kept in high precision: qualified names, or a predicate
            ``(name, module) -> bool``; None (default) keeps none.

    Returns:
        The transformed copy (``module`` is not touched).

    Raises:
        FormatError: ``recipe`` is neither an ``FP8Recipe`` nor a preset key,
            ``scaling``/``history_len``/``ops`` is not supported, or ``skip`` names no
            module.
        CaptureError: as for :func:`simulate_format`.

    Example:
        >>> import warnings
        >>> model = simulate_fp8(nn.Linear(2, 1, bias=False))
        >>> with torch.no_grad():
        ...     _ = model.weight.copy_(torch.tensor([[1000.0, 0.3]]))
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     model(torch.ones(1, 2)).item()  # 448 (E4M3's max) + 0.3125
        448.3125
        >>> str(caught[0].message)[:41]  # not unit-scaled, and no scale: it says so
        'simulate_fp8: Linear has no unit scaling '
        >>> scaled = simulate_fp8(model.module, scaling="tensorwise")  # 1000 -> 448 -> 1000
        >>> scaled(torch.ones(1, 2)).item()  # 0.3 * 0.448 rounds to 0.140625, / 0.448
        1000.3138427734375
    """
    chosen = _check_recipe(recipe)
    _check_scaling("simulate_fp8", scaling, history_len)
    scope = chosen.ops if ops is None else ops
    _check_ops("simulate_fp8", scope)
    if scaling in ROWWISE_SCALINGS:
        scope = _check_rowwise(recipe, chosen, scaling, ops)
    graph_pass = SimulateFormatPass(
        chosen.operands,
        chosen.operand_grads,
        chosen.output_grad,
        scaling=scaling,
        history_len=history_len,
        ops=scope,
        transform="simulate_fp8",
        skip=resolve_skip("simulate_fp8", module, skip),
    )
    return _transformed("simulate_fp8", module, graph_pass)


@dataclasses.dataclass(frozen=True)
class ScalingCost:
    """What the per-tensor scales of a simulated-FP8 model cost in one training step.

    Counted from the rewritten graphs that ran in the last call (one count per scaled
    rounding), not estimated: each scaled rounding reduces its tensor to an amax (the
    forward ones when the forward runs, the gradient ones in the backward) and computes one
    scale from it (``"delayed"`` also reduces and updates a history of ``history_len``
    values per rounding, not counted as a tensor reduction).

    Attributes:
        scaling: the module's ``scaling``.
        forward: scaled roundings in the forward pass (operands, weights included).
        backward: scaled roundings in the backward pass (gradients).
    """

    scaling: str
    forward: int
    backward: int

    @property
    def amax_reductions(self) -> int:
        """Full-tensor ``max(abs(x))`` reductions per training step."""
        return self.forward + self.backward

    @property
    def scale_computations(self) -> int:
        """Scales computed per training step (one per amax)."""
        return self.forward + self.backward


def scaling_cost(module: nn.Module) -> ScalingCost:
    """Count the amax reductions and scale computations of one training step of ``module``.

    Args:
        module: a model returned by :func:`simulate_fp8` or :func:`simulate_format` (or a
            chain containing one), called at least once.

    Returns:
        The counts of the last call (forward, and the backward that follows it).

    Raises:
        UnitScaleError: ``module`` does not simulate a format, or has not been called.

    Example:
        >>> model = simulate_fp8(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
        ...                      scaling="tensorwise")
        >>> _ = model(torch.ones(3, 4))
        >>> cost = scaling_cost(model)  # 2 linears: 2 operands each, 1 output gradient each
        >>> cost.forward, cost.backward, cost.amax_reductions
        (4, 2, 6)
    """
    graph_pass = None
    if isinstance(module, TransformedModule):
        # simulate_fp8's pass, or to_fp8's (which counts its scales the same way)
        graph_pass = next(
            (
                p
                for p in module.passes
                if isinstance(p, SimulateFormatPass) or getattr(p, "counts_fp8_scaling", False)
            ),
            None,
        )
    if not isinstance(module, TransformedModule) or graph_pass is None:
        raise UnitScaleError(
            f"scaling_cost: {type(module).__name__} does not simulate a number format; pass "
            "a model returned by unitscale.transforms.simulate_fp8, simulate_format or to_fp8"
        )
    capture = module.capture
    trace: list[Invocation] = capture.last_trace if capture is not None else []
    if not trace:
        raise UnitScaleError(
            "scaling_cost: the model has not been called yet; call it once (a training "
            "step's forward) first, since the counts come from the graphs that ran"
        )
    forward = backward = 0
    for invocation in trace:
        _, fwd, bwd = invocation.piece.data.get("fp8_scaling", ("none", 0, 0))
        forward += fwd
        backward += bwd
    return ScalingCost(graph_pass.scaling, forward, backward)  # type: ignore[attr-defined]
