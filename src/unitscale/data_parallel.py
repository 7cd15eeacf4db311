"""The data-parallel size that unit-scaled ops scale their weight gradients by.

Under data parallelism each rank runs a shard of the global batch and
``DistributedDataParallel`` (or FSDP2's reduce-scatter) *averages* the ranks' parameter
gradients. A unit-scaled op scales the gradient of a tensor shared by the whole batch (a
weight, a bias, a broadcast operand) by a factor that depends on how many terms it sums
(``1/sqrt(batch)`` for a linear layer's weight). To give the gradient that one process
computes on the concatenated batch, each op uses the *global* count (``world size x
local``) in that factor and multiplies the shared tensor's gradient by the world size, which
the average divides out again. Activation gradients are per-example and unchanged.

The semantics, in full:

- The data-parallel size ``N`` is, by default, ``torch.distributed.get_world_size()`` when
  ``torch.distributed`` is initialised, else 1. Users of other parallelisms (tensor or
  pipeline parallel ranks that see the *same* examples) give the data-parallel group or size
  explicitly with :func:`set_data_parallel`.
- Dimension 0 of an op's batched operand is the sharded (data-parallel) dimension: the
  rows of a linear layer's or norm's input (any input with a batch dimension), the batch
  of a conv1d's ``(N, C, L)`` input, dimension 0 of 2-D or larger token ids of an embedding,
  and dimension 0 of the output of ``add``/``matmul`` when it is larger than 1. An operand
  of ``add``/``matmul`` that is broadcast along it (fewer dimensions, or size 1 there) is
  shared by the ranks. A leading dimension of size 1 is read as broadcast, so with a local
  batch of 1 per rank a shared tensor that a model broadcasts over the batch (e.g. a
  position embedding) cannot be told from an example: keep the local batch at 2 or more.
- FSDP2's ``fully_shard`` replaces each parameter by a new sharded one and drops its u-μP
  tags; :func:`fully_shard` here is torch's, keeping them.
- Gradients must be *averaged* over exactly those ranks (DDP's and FSDP2's default). A
  plain ``torch`` op left in a model whose loss is unit-scaled is not corrected: its
  parameter gradient is ``1/N`` of one process's (``unit_scale`` maps the ops it knows).

Design constraints: the size is a host int read per op call (no collective); Dynamo
folds ``torch.distributed.get_world_size`` and the settings here into constants, so
compiled graphs stay whole (a change of setting recompiles).
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import UnitScaleError
from .parameter import has_mup_tags

__all__ = ["data_parallel_group", "data_parallel_size", "fully_shard", "set_data_parallel"]

_settings: dict[str, Any] = {"group": None, "size": None}


def set_data_parallel(group: Any = None, *, size: int | None = None) -> None:
    """Set the data-parallel group or size that unit-scaled ops scale gradients by.

    With no arguments, restore the default: the world size of ``torch.distributed`` when
    it is initialised, else 1.

    Args:
        group: a ``torch.distributed`` process group whose ranks share one parameter copy
            and see different examples (its size is read when an op runs).
        size: the data-parallel size as an int (instead of ``group``).

    Raises:
        UnitScaleError: both are given, or ``size`` is not a positive int.

    Example:
        >>> set_data_parallel(size=4)
        >>> data_parallel_size()
        4
        >>> set_data_parallel()
        >>> data_parallel_size()
        1
    """
    if group is not None and size is not None:
        raise UnitScaleError(
            "unitscale.data_parallel.set_data_parallel: give a group or a size, not both"
        )
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise UnitScaleError(
            f"unitscale.data_parallel.set_data_parallel: size={size!r} must be a positive int"
        )
    _settings["group"] = group
    _settings["size"] = size


def data_parallel_size() -> int:
    """The data-parallel size unit-scaled ops use (see the module docstring).

    Returns:
        The size given to :func:`set_data_parallel`, else the size of its group, else
        ``torch.distributed``'s world size when it is initialised, else 1.

    Example:
        >>> data_parallel_size()  # one process, torch.distributed not initialised
        1
    """
    size = _settings["size"]
    if size is not None:
        return int(size)
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return 1
    group = _settings["group"]
    return int(
        distributed.get_world_size(group) if group is not None else distributed.get_world_size()
    )


def data_parallel_group() -> Any:
    """The process group given to :func:`set_data_parallel`, or None (the world).

    Scale tracking reduces statistics over it (see :mod:`unitscale.tracking`).

    Example:
        >>> data_parallel_group() is None
        True
    """
    return _settings["group"]


def fully_shard(module: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
    """FSDP2's ``torch.distributed.fsdp.fully_shard(module, **kwargs)``, keeping u-μP tags.

    ``fully_shard`` replaces each parameter by a sharded ``DTensor`` parameter, which does
    not carry the original's attributes; this copies ``mup_type``, ``mup_scaling_depth``
    (and ``fan_in_dim`` where set) onto the new parameters by name, so ``unitscale.optim``
    works on the sharded model (fan-ins are read from the global shape). Gradients need nothing
    more: FSDP2's reduce-scatter averages them, as unit-scaled ops expect.

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
        name: (param.mup_type, param.mup_scaling_depth, getattr(param, "fan_in_dim", None))  # type: ignore[attr-defined]
        for name, param in module.named_parameters()
        if has_mup_tags(param)
    }
    sharded: Any = torch_fully_shard(module, **kwargs)
    for name, param in module.named_parameters():
        if name in tags:
            param.mup_type, param.mup_scaling_depth, fan_in_dim = tags[name]  # type: ignore[attr-defined]
            if fan_in_dim is not None:
                param.fan_in_dim = fan_in_dim  # type: ignore[attr-defined]
    return sharded
