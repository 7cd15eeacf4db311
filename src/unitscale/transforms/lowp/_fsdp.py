"""FSDP2 float8 all-gather: the weights of ``to_fp8``'s GEMMs travel as E4M3 bytes.

FSDP2 all-gathers each sharded parameter before the forward (and again before the backward
where it resharded after the forward). A parameter whose local shard defines
``fsdp_pre_all_gather`` and ``fsdp_post_all_gather`` decides what travels and what the
gathered parameter is (torch's ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``;
torchao's ``torchao/float8/fsdp_utils.py`` ``WeightWithDynamicFloat8CastTensor`` uses the
same two hooks). Here:

- :class:`Float8GatherWeight` wraps a weight's high-precision shard. Before the gather it
  casts the shard to E4M3 exactly as :class:`~._gemm.Float8Matmul` casts the whole weight
  (first to FSDP2's ``param_dtype`` where a mixed-precision policy sets one, then saturated
  to E4M3; ``"tensorwise"`` multiplies by ``448 / amax`` of the *whole* weight), and hands
  FSDP2 its bytes as ``uint8``: gloo has no float8 dtype (a group of float8 inputs only
  fails over gloo with "Invalid scalar type" on torch 2.13), and FSDP2 sends a group of
  mixed dtypes as ``uint8`` anyway (``_fsdp_collectives.py``). With ``scaling="none"`` the scale is
  1, known to every rank without talking; with ``"tensorwise"`` the amax of every weight of
  the mesh is all-reduced once (:class:`_AmaxGroup`) after the weights change, which is what
  torchao's ``precompute_float8_dynamic_scale_for_fsdp`` does once per step.
- :class:`Float8Weight` is the gathered weight: its float8 data and inverse scale, with the
  shape and (high-precision) dtype of the parameter, so that TorchDynamo traces the model as
  before. The float8 GEMMs use its data as their weight operand, without casting again
  (:func:`float8_weight`); any other op sees the dequantised weight.

Since every element is cast on its own and the scale is the whole weight's, casting a shard
and gathering gives the bytes that casting the gathered weight gives: training is the same,
bit for bit (docs/guide/distributed.rst).

Which weights: :func:`mark_weights` (called by ``to_fp8``) marks the weight of each
``nn.Linear`` whose weight is used by that module alone; the ``fully_shard`` of
:mod:`unitscale.data_parallel` wraps the marked weights it shards before torch's shards them.
The ``to_fp8`` graph pass checks that each gathered float8 weight feeds float8 GEMMs only
(:func:`record_gathers`), and :func:`~unitscale.transforms.fp8_summary` lists them.

Every rank must change the weights alike (optimiser steps, ``load_state_dict``), as FSDP2
itself requires: a write to a wrapped weight is what makes the next ``"tensorwise"`` gather
all-reduce the amaxes, a collective every rank must enter.

Design constraints: the sharded wrapper behaves as its shard for every op (FSDP2 pads,
copies and slices it; optimisers update it in place), so the optimiser's updates and
``state_dict()`` hold the high-precision weight; the float8 copy exists only between a
gather and the reshard.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ...formats import FormatError
from ._scaling import amax_scale, saturate_to, scaled_cast, tensor_amax

__all__ = [
    "GATHER_ATTR",
    "GATHER_KEY",
    "Float8GatherWeight",
    "Float8Weight",
    "GatherMark",
    "check_not_sharded",
    "float8_weight",
    "mark_weights",
    "record_gathers",
]

#: Parameter attribute set by :func:`mark_weights`: a callable that wraps the weight's tensor
#: for FSDP2 (read by :func:`unitscale.data_parallel.fully_shard` under this name).
GATHER_ATTR = "_unitscale_fsdp_wrap"

_E4M3: Any = getattr(torch, "float8_e4m3fn", None)

# Ops that keep a sharded weight wrapped (FSDP2 pads, copies, slices and views the shard):
# torchao's ``_ops_to_preserve_subclass``.
_aten = torch.ops.aten
_PRESERVE = {
    _aten.empty_like.default,
    _aten.new_zeros.default,
    _aten.slice.Tensor,
    _aten.copy_.default,
    _aten.view.default,
    _aten.as_strided.default,
    _aten._to_copy.default,
    _aten._pin_memory.default,
    _aten.split.Tensor,
    _aten.clone.default,
}
# Ops that keep a gathered float8 weight float8 (FSDP2 views it to the parameter's shape and
# makes a Parameter of it; autograd detaches it).
_VIEWS = {
    _aten.detach.default,
    _aten.alias.default,
    _aten.view.default,
    _aten.as_strided.default,
}


def _saturate(x: Tensor, scale: Tensor | None) -> Tensor:
    """``x`` (times ``scale``, in float32) cast to E4M3 with saturation: the one scaled cast
    (:func:`~._scaling.scaled_cast`), as ``_gemm._cast`` does it."""
    fmax = torch.finfo(_E4M3).max
    saturate = functools.partial(saturate_to, dtype=_E4M3, fmax=fmax)
    scaling = "none" if scale is None else "tensorwise"
    return scaled_cast(x, saturate, fmax, scaling, scale=scale)[0]


#: Counts the in-place ops on wrapped weights (an optimiser step, ``load_state_dict``): the
#: cached ``"tensorwise"`` scales are recomputed after it moves. (The wrapped tensors' own
#: version counters do not move under ``__torch_dispatch__``.)
_WRITES = [0]


class _AmaxGroup:
    """The ``"tensorwise"`` weights gathered over one process group: one all-reduce (MAX) of
    all their shard amaxes whenever any of them was written (:data:`_WRITES`), once per
    optimiser step, not at the backward's gathers; every rank then holds each weight's scale
    (torchao's ``precompute_float8_dynamic_scale_for_fsdp``, without the call)."""

    def __init__(self) -> None:
        self.members: list[weakref.ref[Float8GatherWeight]] = []
        self.writes = -1
        self.scales: dict[int, Tensor] = {}

    def add(self, weight: Float8GatherWeight) -> None:
        self.members.append(weakref.ref(weight))
        self.writes = -1

    def scale(self, weight: Float8GatherWeight, mesh: Any, dtype: Any) -> Tensor:
        live = [w for w in (ref() for ref in self.members) if w is not None]
        if self.writes != _WRITES[0] or id(weight) not in self.scales:
            amaxes = torch.stack([tensor_amax(w._shard(dtype)) for w in live])
            if mesh.size() > 1:
                torch.distributed.all_reduce(
                    amaxes, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group()
                )
            fmax = torch.finfo(_E4M3).max
            self.scales = {id(w): amax_scale(a, fmax) for w, a in zip(live, amaxes, strict=True)}
            self.writes = _WRITES[0]
        return self.scales[id(weight)]


#: One :class:`_AmaxGroup` per process group (by its id).
_GROUPS: dict[int, _AmaxGroup] = {}


class Float8GatherWeight(Tensor):
    """A weight's high-precision (sharded) tensor that FSDP2 all-gathers as E4M3 bytes.

    Every op sees the wrapped tensor (``_tensor``); FSDP2's pad, copy and slice ops keep the
    wrapper. ``scaling``: ``"none"`` (scale 1) or ``"tensorwise"``.
    """

    _tensor: Tensor
    _scaling: str
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, tensor: Tensor, scaling: str) -> Float8GatherWeight:
        return Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: Tensor, scaling: str) -> None:
        self._tensor = tensor
        self._scaling = scaling

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Float8GatherWeight({self._tensor!r}, scaling={self._scaling!r})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        scaling = next(
            a._scaling for a in pytree.tree_leaves(args) if isinstance(a, Float8GatherWeight)
        )
        args, kwargs = pytree.tree_map_only(
            Float8GatherWeight, lambda t: t._tensor, (args, kwargs or {})
        )
        out = func(*args, **kwargs)
        if func._schema.is_mutable:
            _WRITES[0] += 1
        if func is _aten.detach.default or func in _PRESERVE:
            return pytree.tree_map_only(Tensor, lambda t: Float8GatherWeight(t, scaling), out)
        return out

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_tensor"], self._scaling

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, Tensor], scaling: Any, outer_size: Any, outer_stride: Any
    ) -> Float8GatherWeight:
        return Float8GatherWeight(inner["_tensor"], scaling)

    def unwrapped(self) -> Tensor:
        """The wrapped high-precision tensor (what ``state_dict()`` saves)."""
        return self._tensor

    def _shard(self, dtype: Any) -> Tensor:
        return self._tensor if dtype is None else self._tensor.to(dtype)

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[Tensor, ...], Any]:
        """The shard cast to E4M3 (in FSDP2's ``param_dtype`` first), as ``uint8`` bytes
        padded to FSDP2's padded shard rows; metadata: the inverse scale (None: scale 1)."""
        dtype = getattr(mp_policy, "param_dtype", None)
        shard = self._shard(dtype)
        if self._scaling == "none":
            scale = inverse = None
        else:
            group = _GROUPS.setdefault(id(mesh.get_group()), _AmaxGroup())
            if not any(ref() is self for ref in group.members):
                group.add(self)
            scale = group.scale(self, mesh, dtype)
            inverse = scale.reciprocal()
        data = _saturate(shard, scale)
        rows = -(-int(outer_size[0]) // mesh.size())
        if data.shape[0] < rows:  # FSDP2 pads the last ranks' shards with zero rows
            data = torch.cat([data, data.new_zeros(rows - data.shape[0], *data.shape[1:])])
        return (data.view(torch.uint8),), (inverse,)

    def fsdp_post_all_gather(
        self,
        outputs: tuple[Tensor, ...],
        metadata: Any,
        param_dtype: Any,
        *,
        out: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        """The gathered bytes as a :class:`Float8Weight` (``out``: the one to refill)."""
        (data,) = outputs
        (inverse,) = metadata
        if out is not None:
            target = getattr(out, "_local_tensor", out)
            target._inverse = inverse  # type: ignore[union-attr]
            return None
        return Float8Weight(data.view(_E4M3), inverse, param_dtype), (data,)


class Float8Weight(Tensor):
    """A gathered weight in E4M3: ``_data`` (float8) and ``_inverse`` (its inverse scale,
    None for 1), shaped and typed as the high-precision parameter. Float8 GEMMs take
    ``_data`` as it is; every other op sees ``_data * _inverse`` in the parameter's dtype."""

    _data: Tensor
    _inverse: Tensor | None
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, data: Tensor, inverse: Tensor | None, dtype: Any) -> Float8Weight:
        return Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=dtype,
            device=data.device,
            requires_grad=False,
        )

    def __init__(self, data: Tensor, inverse: Tensor | None, dtype: Any) -> None:
        self._data = data
        self._inverse = inverse

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Float8Weight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def dequantise(self) -> Tensor:
        """The weight in its dtype: ``_data`` times the inverse scale."""
        values = self._data.to(self.dtype)
        return values if self._inverse is None else (values * self._inverse).to(self.dtype)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _VIEWS and isinstance(args[0], Float8Weight):
            first = args[0]
            data = func(first._data, *args[1:], **kwargs)
            return Float8Weight(data, first._inverse, first.dtype)
        args, kwargs = pytree.tree_map_only(Float8Weight, lambda t: t.dequantise(), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        names = ["_data"] if self._inverse is None else ["_data", "_inverse"]
        return names, self.dtype

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, Tensor], dtype: Any, outer_size: Any, outer_stride: Any
    ) -> Float8Weight:
        return Float8Weight(inner["_data"], inner.get("_inverse"), dtype)


def float8_weight(weight: Tensor) -> tuple[Tensor, Tensor | None] | None:
    """The E4M3 data and inverse scale of a gathered :class:`Float8Weight` (None for any
    other tensor): what a float8 GEMM uses instead of casting ``weight``."""
    if type(weight) is Float8Weight or isinstance(weight, Float8Weight):
        return weight._data, weight._inverse
    return None


def _shared_weights(module: nn.Module) -> set[int]:
    """``id`` of the parameters reachable under more than one name (tied weights)."""
    seen: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def mark_weights(module: nn.Module, scaling: str) -> dict[str, str | None]:
    """Mark the weight of each ``nn.Linear`` of ``module`` to be all-gathered in float8 with
    ``scaling``; return each such weight by name: None where marked, else the reason."""
    shared = _shared_weights(module)
    # a tied weight by its first name, as named_parameters() and the graph name it
    canonical = {id(param): name for name, param in module.named_parameters()}
    refused: dict[str, str | None] = {}
    for path, sub in module.named_modules():
        if not isinstance(sub, nn.Linear) or not isinstance(sub.weight, nn.Parameter):
            continue
        name = canonical.get(id(sub.weight), f"{path}.weight" if path else "weight")
        if scaling not in ("none", "tensorwise"):
            refused[name] = f"scaling={scaling!r} (float8 all-gather takes 'none' or 'tensorwise')"
        elif id(sub.weight) in shared:
            refused[name] = "shared with another module (tied weights)"
        elif sub.weight.dim() != 2 or not sub.weight.is_floating_point():
            refused[name] = "not a 2-D floating-point weight"
        else:
            setattr(sub.weight, GATHER_ATTR, GatherMark(scaling))
            refused[name] = None
    return refused


class GatherMark:
    """What :func:`mark_weights` puts on a weight: called on its tensor by
    :func:`unitscale.data_parallel.fully_shard`, it returns the :class:`Float8GatherWeight`."""

    def __init__(self, scaling: str) -> None:
        self.scaling = scaling

    def __repr__(self) -> str:
        return f"GatherMark({self.scaling!r})"

    def __call__(self, tensor: Tensor) -> Tensor:
        return Float8GatherWeight(tensor, self.scaling)


#: ``piece.data`` key of what :func:`record_gathers` found.
GATHER_KEY = "fp8_all_gather"


def _plain_reason(name: str, marks: dict[str, str | None] | None) -> str:
    if marks is None:
        return "fsdp_float8_all_gather=False"
    if name not in marks:
        return "not the weight of an nn.Linear"
    return marks[name] or "not sharded by unitscale.data_parallel.fully_shard (FSDP2)"


def record_gathers(
    piece: Any,
    gm: fx.GraphModule,
    names: dict[fx.Node, str],
    weights: dict[fx.Node, list[str]],
    marks: dict[str, str | None] | None,
    owner: nn.Module | None,
) -> None:
    """Store in ``piece.data`` which weights of the converted GEMMs arrive gathered in
    float8 and which in their own precision (with the reason); refuse a float8 weight that
    an op other than a float8 GEMM reads.

    ``weights``: the weight operand of each converted op -> the ops' labels; ``names``: the
    parameter name of each parameter placeholder; ``marks``: what :func:`mark_weights`
    returned (None: ``fsdp_float8_all_gather=False``); ``owner``: the transformed model (a
    model that FSDP2 shards nowhere gets no list of weights gathered in their precision).
    """
    float8: list[str] = []
    plain: list[tuple[str, str]] = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" or node not in names:
            continue
        gathered = isinstance(node.meta.get("example_value"), Float8Weight)
        name = names[node]
        if gathered:
            others = [u for u in node.users if u not in _gemm_users(node, weights)]
            if others:
                raise FormatError(
                    f"unitscale.transforms.to_fp8: FSDP2 gathers {name} in float8, but "
                    f"{', '.join(str(u.target) for u in others)} reads it outside a float8 "
                    "GEMM (it would see the float8-rounded weight); pass "
                    "to_fp8(..., fsdp_float8_all_gather=False)"
                )
            float8.append(name)
        elif node in weights:
            plain.append((name, _plain_reason(name, marks)))
    piece.data[GATHER_KEY] = (float8, plain if float8 or _under_fsdp(owner) else [])


def check_not_sharded(module: Any) -> None:
    """Refuse a module FSDP2 already shards: ``to_fp8`` copies its module, which FSDP2 does
    not allow, and its weights must be marked before they are sharded."""
    if isinstance(module, nn.Module) and _under_fsdp(module):
        raise FormatError(
            f"unitscale.transforms.to_fp8: {type(module).__name__} is already sharded by "
            "FSDP2 (fully_shard), whose modules cannot be copied; apply to_fp8 first, then "
            "unitscale.data_parallel.fully_shard"
        )


def _under_fsdp(owner: nn.Module | None) -> bool:
    """Whether FSDP2's ``fully_shard`` was applied to ``owner`` or one of its modules."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6 kept it private
        return False
    return owner is not None and any(isinstance(m, FSDPModule) for m in owner.modules())


def _gemm_users(node: fx.Node, weights: dict[fx.Node, list[str]]) -> set[fx.Node]:
    """The users of ``node`` that are converted GEMMs taking it as their weight."""
    if node not in weights:
        return set()
    return {u for u in node.users if u.kwargs.get("weight") is node}
