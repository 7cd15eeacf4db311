"""The data-parallel size and gradient accumulation that unit-scaled ops scale gradients by.

Under data parallelism each rank runs a shard of the global batch and
``DistributedDataParallel`` (or FSDP2's reduce-scatter) *averages* the ranks' parameter
gradients; under gradient accumulation a step's batch is split into micro-batches whose
gradients are *summed*. A unit-scaled op scales the gradient of a tensor shared by the whole
batch (a weight, a bias, a broadcast operand) by a factor that depends on how many terms it
sums (``1/sqrt(batch)`` for a linear layer's weight). So that the optimiser sees the gradient
that one process computes on the whole batch of a step, each op counts the *global* batch
(``size x steps x local``) in that factor and multiplies the shared tensor's gradient by the
data-parallel ``size``, which the average divides out again (the accumulation's sum needs no
multiplier). Activation gradients are per example and unchanged, so every micro-batch's
gradients stay at unit scale.

The data-parallel size is decided from explicit state, read each time an op runs (never
from tensor shapes, never from the mere existence of a process group), first match wins:

1. :func:`set_data_parallel` (a ``size``, or a ``group`` whose size is read);
2. inside the forward of a :func:`unitscale.data_parallel.fully_shard` module: its mesh's size;
3. inside the forward of a ``torch.nn.parallel.DistributedDataParallel``: its process group's
   size (DDP declares its running module, ``DistributedDataParallel._get_active_ddp_module()``);
4. otherwise 1: a process group alone (ranks training separate models, evaluation, torch's
   own ``fully_shard``) applies no factor.

Since the decision is made when the op runs, a model transformed or tracked (or compiled
with Dynamo's ``"eager"`` backend) before ``init_process_group`` gets the right size once it
runs inside DDP. A compiling backend (Inductor, ``torch.compile``'s default) folds the size
and accumulation into the compiled backward, so a compiled model is compiled again when they
change: :func:`unitscale.transforms.compile` keys its compiled graphs on both, and the
modules of :mod:`unitscale.modules` read both in their ``forward``, where ``torch.compile``
guards on them. A hand-written function that calls :mod:`unitscale.functional` ops directly
(each op is one opaque node for Dynamo) and is ``torch.compile``'d keeps the values of its
first compiled call: call ``torch.compiler.reset()`` after changing them. Gradient
accumulation is only ever what :func:`set_gradient_accumulation` says (default 1).

Which tensors are shared: dimension 0 of an op's batched operand is the sharded dimension,
whatever its size (a local batch of 1 included): the rows of a linear layer's or norm's input
(any input with a batch dimension), the batch of a conv1d's ``(N, C, L)`` input, dimension 0
of 2-D or larger token ids of an embedding, and dimension 0 of the output of ``add`` /
``matmul`` when it has 2 or more dimensions. An operand of ``add``/``matmul`` with fewer
dimensions than the output, or of size 1 along dimension 0 where the output is larger, is
broadcast along the batch and shared by the ranks. Two cases cannot be read from shapes: with
a local batch of 1, a shared tensor that keeps a leading batch dimension of 1 (a ``(1, T, D)``
position parameter added to ``(1, T, D)`` activations) looks like an example, and position
ids of shape ``(1, T)`` (as Hugging Face models make them) look like token ids.
:func:`~unitscale.transforms.unit_scale` resolves both from the captured graph (a value
computed without the model's inputs is shared by every example); a hand-written model that
calls :mod:`unitscale.functional` directly should give such tensors no leading dimension
(``torch.arange(T)``, as :mod:`unitscale.models` does).

Other rules:

- FSDP2's ``fully_shard`` replaces each parameter by a new sharded one and drops its u-μP
  tags; :func:`fully_shard` here is torch's, keeping them and declaring the mesh size.
- Gradients must be *averaged* over exactly those ranks (DDP's and FSDP2's default) and
  summed over micro-batches (the loss *not* divided by the number of micro-batches: see
  :func:`set_gradient_accumulation`). A plain ``torch`` op left in a model whose loss is
  unit-scaled is not corrected: its parameter gradient is ``1/N`` of one process's
  (``unit_scale`` maps the ops it knows).

Design constraints: the size is a host int read per op call (no collective); traced code
folds it into a constant, so compiled graphs stay whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .errors import UnitScaleError
from .parameter import has_mup_tags

__all__ = [  # noqa: RUF022 (grouped by kind)
    # the data-parallel size
    "data_parallel_group",
    "data_parallel_size",
    "data_parallel_set",
    "set_data_parallel",
    # gradient accumulation
    "gradient_accumulation",
    "gradient_accumulation_steps",
    "set_gradient_accumulation",
    # FSDP2
    "fully_shard",
    # errors
    "DataParallelError",
]

_settings: dict[str, Any] = {"group": None, "size": None, "steps": 1}
#: (size, group) of the :func:`fully_shard` forwards in progress, innermost last.
_sharded_forwards: list[tuple[int, Any]] = []


class DataParallelError(UnitScaleError, ValueError):
    """A data-parallel or gradient-accumulation setting is not valid."""


def _positive_int(where: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DataParallelError(
            f"unitscale.data_parallel.{where}: {name}={value!r} must be a positive int"
        )
    return value


def set_data_parallel(group: Any = None, *, size: int | None = None) -> None:
    """Set the data-parallel group or size that unit-scaled ops scale gradients by.

    It overrides what DDP or :func:`fully_shard` declare (see the module docstring). With no
    arguments, go back to those: the size of the ``DistributedDataParallel`` or
    :func:`fully_shard` module whose forward is running, else 1.

    Args:
        group: a ``torch.distributed`` process group whose ranks share one parameter copy
            and see different examples (its size is read when an op runs).
        size: the data-parallel size as an int (instead of ``group``).

    Raises:
        DataParallelError: both are given, or ``size`` is not a positive int.

    Example:
        >>> set_data_parallel(size=4)
        >>> data_parallel_size()
        4
        >>> set_data_parallel()
        >>> data_parallel_size()
        1
    """
    if group is not None and size is not None:
        raise DataParallelError(
            "unitscale.data_parallel.set_data_parallel: give a group or a size, not both"
        )
    if size is not None:
        _positive_int("set_data_parallel", "size", size)
    _settings["group"] = group
    _settings["size"] = size


def data_parallel_set() -> bool:
    """Whether :func:`set_data_parallel` holds a size or group now (else DDP, :func:`fully_shard`
    or 1 decide). Reading a tracked graph follows such a setting; without one it reduces
    over the group its recorded call ran in.

    Example:
        >>> data_parallel_set()
        False
        >>> set_data_parallel(size=1)
        >>> data_parallel_set()
        True
        >>> set_data_parallel()
    """
    return _settings["size"] is not None or _settings["group"] is not None


def set_gradient_accumulation(steps: int = 1) -> None:
    """Declare that each optimiser step accumulates the gradients of ``steps`` micro-batches.

    Unit-scaled ops then count the whole step's batch (``steps`` micro-batches, times the
    data-parallel size) in the gradient factors of shared tensors, so the *sum* of the
    micro-batches' gradients equals the gradient of one call on the whole batch (without it,
    weight gradients come out ``sqrt(steps)`` times too large), and each micro-batch's
    activation gradients stay unit. Do not divide the loss by ``steps``: that would shrink
    every gradient to ``1/steps`` of unit. Call it with 1 (or no argument) to stop.

    Args:
        steps: micro-batches per optimiser step (1: no accumulation).

    Raises:
        DataParallelError: ``steps`` is not a positive int.

    Example:
        >>> set_gradient_accumulation(4)
        >>> gradient_accumulation_steps()
        4
        >>> set_gradient_accumulation()
        >>> gradient_accumulation_steps()
        1
    """
    _settings["steps"] = _positive_int("set_gradient_accumulation", "steps", steps)


def gradient_accumulation_steps() -> int:
    """The micro-batches per optimiser step given to :func:`set_gradient_accumulation` (1).

    Example:
        >>> gradient_accumulation_steps()
        1
    """
    return int(_settings["steps"])


@contextmanager
def gradient_accumulation(steps: int) -> Iterator[None]:
    """:func:`set_gradient_accumulation` for the block, restoring the setting after it.

    Example:
        >>> with gradient_accumulation(4):
        ...     gradient_accumulation_steps()
        4
        >>> gradient_accumulation_steps()
        1
    """
    previous = gradient_accumulation_steps()
    set_gradient_accumulation(steps)
    try:
        yield
    finally:
        set_gradient_accumulation(previous)


def _group_size(group: Any) -> int:
    distributed = torch.distributed
    return int(
        distributed.get_world_size(group) if group is not None else distributed.get_world_size()
    )


def _active_ddp() -> Any:
    """The ``DistributedDataParallel`` whose forward is running, or None."""
    from torch.nn.parallel import DistributedDataParallel

    # The class attribute, not ``_get_active_ddp_module()``: Dynamo guards an attribute it
    # reads, so a compiled graph recompiles when DDP's forward starts or ends.
    return DistributedDataParallel._active_ddp_module


def data_parallel_size() -> int:
    """The data-parallel size unit-scaled ops use now (see the module docstring).

    Returns:
        The size given to :func:`set_data_parallel`, else the size of its group, else the
        mesh size of the :func:`fully_shard` module or the group size of the
        ``DistributedDataParallel`` whose forward is running, else 1.

    Example:
        >>> data_parallel_size()  # no setting, no DDP forward running
        1
    """
    size = _settings["size"]
    if size is not None:
        return int(size)
    group = _settings["group"]
    if group is not None:
        return _group_size(group)
    if _sharded_forwards:
        return _sharded_forwards[-1][0]
    ddp = _active_ddp()
    if ddp is not None:
        return _group_size(ddp.process_group)
    return 1


def data_parallel_group() -> Any:
    """The process group that gradients are averaged over now, or None (the world).

    The group given to :func:`set_data_parallel`, else that of the running
    :func:`fully_shard` or ``DistributedDataParallel`` forward. Scale tracking reduces
    statistics over it (see :mod:`unitscale.tracking`).

    Example:
        >>> data_parallel_group() is None
        True
    """
    if _settings["group"] is not None or _settings["size"] is not None:
        return _settings["group"]
    if _sharded_forwards:
        return _sharded_forwards[-1][1]
    ddp = _active_ddp()
    return None if ddp is None else ddp.process_group


def _mesh_size_and_group(kwargs: dict[str, Any]) -> tuple[int, Any]:
    """The data-parallel size and group of a ``fully_shard`` call's mesh (default: world)."""
    mesh = kwargs.get("mesh")
    if mesh is None:
        return _group_size(None), None
    if mesh.ndim == 1:
        return int(mesh.size()), mesh.get_group()
    return int(mesh.size()), None  # HSDP: every dimension of the mesh is data-parallel


def fully_shard(module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """FSDP2's ``torch.distributed.fsdp.fully_shard(module, **kwargs)``, keeping u-μP tags.

    ``fully_shard`` replaces each parameter by a sharded ``DTensor`` parameter, which does
    not carry the original's attributes; this copies ``mup_type``, ``mup_scaling_depth``
    (and ``fan_in_dim``/``mup_depth_rule`` where set) onto the new parameters by name, so
    ``unitscale.optim`` works on the sharded model (fan-ins are read from the global shape).
    It also declares the data-parallel size (the mesh's) to unit-scaled ops while the
    module's forward runs; FSDP2's reduce-scatter then averages gradients, as they expect.
    Torch's own ``fully_shard`` declares nothing: with it, call :func:`set_data_parallel`.

    Args:
        module: the module to shard (call it on sub-modules first, as with torch's).
        **kwargs: passed to torch's ``fully_shard`` (``mesh``, ``reshard_after_forward``...).

    Returns:
        ``module``, sharded in place (as torch's ``fully_shard`` returns it).
    """
    try:
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
    except ImportError:  # pragma: no cover - torch < 2.6 kept it private
        from torch.distributed._composable.fsdp import fully_shard as torch_fully_shard
    tags = {
        name: (
            param.mup_type,  # type: ignore[attr-defined]
            param.mup_scaling_depth,  # type: ignore[attr-defined]
            {
                k: param.__dict__[k]
                for k in ("fan_in_dim", "mup_depth_rule", "mup_embedding")
                if k in param.__dict__
            },
        )
        for name, param in module.named_parameters()
        if has_mup_tags(param)
    }
    sharded: Any = torch_fully_shard(module, **kwargs)
    for name, param in module.named_parameters():
        if name in tags:
            param.mup_type, param.mup_scaling_depth, extra = tags[name]  # type: ignore[attr-defined]
            for key, value in extra.items():
                setattr(param, key, value)
    declared = _mesh_size_and_group(kwargs)

    def enter(*_: Any) -> None:
        _sharded_forwards.append(declared)

    def leave(*_: Any) -> None:
        if _sharded_forwards:
            _sharded_forwards.pop()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    return sharded
