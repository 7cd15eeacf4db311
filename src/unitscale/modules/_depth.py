"""Depth-aware containers: residual stacks that tell their parameters how deep they are.

u-μP scales the learning rate of every parameter inside a stack of ``depth`` residual blocks
by ``1 / sqrt(depth)`` (see :mod:`unitscale.optim`). :class:`DepthModuleList` and
:class:`DepthSequential` hold those blocks and set ``mup_scaling_depth = len(self)`` on every
parameter they hold (tagging untagged ones with :func:`unitscale.parameter.infer_mup_type`),
again whenever a block is added.

Design constraints: drop-in subclasses of ``nn.ModuleList`` / ``nn.Sequential`` (same
``state_dict`` keys and iteration); tags are set in place, so an optimiser built before a
block is added does not see the new depth (build it after the model).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from ..parameter import tag_module

__all__ = ["DepthModuleList", "DepthSequential"]


def _set_depth(container: nn.Module, depth: int) -> None:
    if depth > 0:
        tag_module(container, mup_scaling_depth=depth)


class DepthModuleList(nn.ModuleList):
    """An ``nn.ModuleList`` of residual blocks that sets ``mup_scaling_depth = len(self)``.

    Args:
        modules: the blocks.

    Example:
        >>> import unitscale as us
        >>> layers = DepthModuleList(us.Linear(8, 8) for _ in range(4))
        >>> {p.mup_scaling_depth for p in layers.parameters()}
        {4}
    """

    def __init__(self, modules: Iterable[nn.Module] | None = None) -> None:
        super().__init__(modules)
        _set_depth(self, len(self))

    def append(self, module: nn.Module) -> DepthModuleList:
        super().append(module)
        _set_depth(self, len(self))
        return self

    def extend(self, modules: Iterable[nn.Module]) -> DepthModuleList:
        super().extend(modules)
        _set_depth(self, len(self))
        return self

    def insert(self, index: int, module: nn.Module) -> None:
        super().insert(index, module)
        _set_depth(self, len(self))


class DepthSequential(nn.Sequential):
    """An ``nn.Sequential`` of residual blocks that sets ``mup_scaling_depth = len(self)``.

    Args:
        args: the blocks (or one ``OrderedDict`` of them), as for ``nn.Sequential``.

    Example:
        >>> import unitscale as us
        >>> stack = DepthSequential(us.Linear(8, 8), us.Linear(8, 8))
        >>> {p.mup_scaling_depth for p in stack.parameters()}
        {2}
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        _set_depth(self, len(self))

    def append(self, module: nn.Module) -> DepthSequential:
        super().append(module)
        _set_depth(self, len(self))
        return self

    def extend(self, sequential: Iterable[nn.Module]) -> DepthSequential:
        super().extend(sequential)
        _set_depth(self, len(self))
        return self

    def insert(self, index: int, module: nn.Module) -> DepthSequential:
        super().insert(index, module)
        _set_depth(self, len(self))
        return self
