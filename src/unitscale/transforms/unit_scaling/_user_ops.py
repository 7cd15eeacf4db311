"""A user's own function as one op of the captured graph, so that ``unit_scale``'s
``replace`` can map it (``replace={my_gelu: U.gelu}``).

TorchDynamo inlines a Python function it meets (its primitive ops enter the graph, the call
does not), so a hand-written GELU would reach the rewrite as ``tanh``, ``mul`` and ``add``
nodes that no ``replace`` key names. ``torch._dynamo.allow_in_graph`` makes Dynamo put the
call itself in the graph instead, as one ``call_function`` node whose target is the user's
function, which the rewrite then replaces like any torch op.

Design constraints:

- ``allow_in_graph`` is process-wide, and would change how every other capture of the
  function goes (``track_scales`` of the plain model, the user's own ``torch.compile``): the
  functions are kept whole only while a call of the unit-scaled model runs
  (:class:`KeptWhole`), and given back to Dynamo's ordinary tracing after it;
- where this torch keeps its allowed functions elsewhere than we expect, they are allowed
  for good, with ``torch._dynamo.allow_in_graph`` (the public API).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["KeptWhole", "is_user_function"]


def is_user_function(fn: Any) -> bool:
    """Whether ``fn`` is a Python function of the user's (not of torch or unitscale), which
    ``unit_scale`` can keep as one op of the graph and replace."""
    if not inspect.isfunction(fn):
        return False
    module = getattr(fn, "__module__", None) or ""
    return module.split(".")[0] not in ("torch", "unitscale")


def _allowed_ids() -> Any:
    """Dynamo's set of the ids of functions it puts in graphs whole, or None where this
    torch keeps them elsewhere."""
    from torch._dynamo import trace_rules

    allowed = getattr(trace_rules, "_allowed_callable_ids", None)
    if allowed is None or not all(hasattr(allowed, m) for m in ("add", "remove", "__contains__")):
        return None
    return allowed


class KeptWhole:
    """Keeps the calls of some functions whole in Dynamo's graphs between :meth:`enter`
    and :meth:`exit` (one call of the transformed model). Holds no state worth pickling."""

    def __init__(self, functions: Iterable[Callable[..., Any]]) -> None:
        self.functions = tuple(functions)
        self._added: list[int] = []

    def enter(self) -> None:
        """Allow the functions in Dynamo's graphs (those not allowed already)."""
        self.exit()  # a call that raised left its functions allowed
        if not self.functions:
            return
        allowed = _allowed_ids()
        if allowed is None:  # pragma: no cover - torch versions without the set
            import torch._dynamo

            for fn in self.functions:
                torch._dynamo.allow_in_graph(fn)
            return
        for fn in self.functions:
            if id(fn) not in allowed:
                allowed.add(id(fn))
                self._added.append(id(fn))

    def exit(self) -> None:
        """Give the functions this object allowed back to Dynamo's ordinary tracing."""
        if not self._added:
            return
        allowed = _allowed_ids()
        for fn_id in self._added:
            allowed.remove(fn_id)
        self._added = []

    def __getstate__(self) -> dict[str, Any]:
        return {"functions": self.functions, "_added": []}
