"""TorchDynamo capture shared by all unitscale transforms."""

from ._core import GraphPass, Invocation, Piece, TransformedModule, module_path_of, transformed

__all__ = [
    "GraphPass",
    "Invocation",
    "Piece",
    "TransformedModule",
    "module_path_of",
    "transformed",
]
