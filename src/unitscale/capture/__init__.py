"""TorchDynamo capture shared by all unitscale transforms.

A :class:`TransformedModule` runs a copy of a module through TorchDynamo; every graph
Dynamo captures (a :class:`Piece`, one per graph break) goes through the module's chain of
:class:`GraphPass` objects, which :func:`transformed` keeps in :class:`Stage` order. The
:class:`Capture` holds the runtime state passes read; :func:`trace_eagerly` is the fallback
tracer for calls Dynamo cannot capture whole.
"""

from ._compose import check_order, transformed
from ._core import (
    NOT_INTERCEPTED,
    Capture,
    GraphPass,
    Invocation,
    Piece,
    Stage,
    TransformedModule,
    example_value,
    is_float_node,
    iter_tensors,
    warn_user,
)
from ._eager import trace_eagerly
from ._naming import function_name, identifier, module_path_at, module_path_of, readable_name
from ._outside import outside_inputs, received_parameters

__all__ = [  # noqa: RUF022 (grouped by kind)
    # transformed modules and their passes
    "GraphPass",
    "NOT_INTERCEPTED",
    "Stage",
    "TransformedModule",
    "check_order",
    "transformed",
    # runtime state passes read
    "Capture",
    "Invocation",
    "Piece",
    "outside_inputs",
    "received_parameters",
    "trace_eagerly",
    # helpers for passes
    "example_value",
    "function_name",
    "identifier",
    "is_float_node",
    "iter_tensors",
    "module_path_at",
    "module_path_of",
    "readable_name",
    "warn_user",
]
