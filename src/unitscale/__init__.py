"""unitscale: unit scaling for PyTorch, and the tools to see why it works."""

from . import constraints, scale
from ._version import __version__
from .errors import UnitScaleError

__all__ = [
    # package
    "UnitScaleError",
    "__version__",
    # submodules
    "constraints",
    "scale",
]
