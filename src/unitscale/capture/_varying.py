"""The input sizes that vary between calls of a transformed module, marked dynamic for Dynamo
so that one graph serves every size (per transformed module, not process-wide).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


class _VaryingSizes:
    """The input sizes that changed between calls of one transformed module.

    Dynamo compiles a static graph per input shape; a model fed batches of varying length
    would get one graph (and, for tracking, one set of graph copies) per length, without
    bound. Once an input's size in some dimension differs from its first call's, that
    dimension is marked dynamic (``torch._dynamo.maybe_mark_dynamic``: Dynamo may still
    specialise it where the code needs a concrete size) on every later call, so one more
    graph serves every length. The mark is put on an alias of the caller's tensor (same
    storage, same autograd history), never on the tensor itself; an alias the forward
    returns is handed back as the caller's tensor.
    """

    def __init__(self) -> None:
        # Keyed by an input's name or a piece output's (piece place, output index).
        self.first: dict[str | tuple[int, int], tuple[int, ...]] = {}
        self.dynamic: dict[str | tuple[int, int], set[int]] = {}

    def mark(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], dict[int, Tensor]]:
        """``args``/``kwargs`` with the varying tensors replaced by marked aliases, and
        ``id(alias) -> caller's tensor``."""
        marked: dict[int, Tensor] = {}
        aliases: dict[int, Tensor] = {}  # one alias per caller's tensor, however often passed
        args = tuple(self._mark(f"args[{i}]", a, marked, aliases) for i, a in enumerate(args))
        kwargs = {key: self._mark(key, value, marked, aliases) for key, value in kwargs.items()}
        return args, kwargs, marked

    def _mark(
        self, key: str, value: Any, marked: dict[int, Tensor], aliases: dict[int, Tensor]
    ) -> Any:
        if not isinstance(value, Tensor) or type(value) is not Tensor:
            return value
        dims = self._varied(key, value)
        if not dims:
            return value
        import torch._dynamo

        alias = aliases.get(id(value))
        if alias is None:
            alias = value.view_as(value) if value.requires_grad else value.detach()
            aliases[id(value)] = alias
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(alias, dim)
        marked[id(alias)] = value
        return alias

    def mark_output(self, key: tuple[int, int], value: Tensor) -> None:
        """Mark the sizes of a piece's output (``key``: the piece's place in the call, the
        output's index) that differ from its first call's, as for inputs. Such a tensor is
        the piece's own result; where it crosses a graph break, the mark makes the resume
        function's graph serve every size rather than be recompiled per size."""
        if type(value) is not Tensor:
            return
        dims = self._varied(key, value)
        if dims:
            import torch._dynamo

            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(value, dim)

    def _varied(self, key: str | tuple[int, int], value: Tensor) -> set[int]:
        """The dimensions in which ``value``'s size has differed from the first call's for
        ``key`` (an input's name, or a piece output's place); none for a different rank,
        which Dynamo recompiles whatever is marked."""
        shape = tuple(value.shape)
        first = self.first.setdefault(key, shape)
        if len(first) != len(shape):
            return set()
        dims = self.dynamic.setdefault(key, set())
        dims.update(d for d, (a, b) in enumerate(zip(first, shape, strict=True)) if a != b)
        return dims

    @staticmethod
    def unmark(output: Any, marked: dict[int, Tensor]) -> Any:
        if isinstance(output, Tensor):
            return marked.get(id(output), output)
        if type(output) in (tuple, list):
            return type(output)(_VaryingSizes.unmark(v, marked) for v in output)
        return output
