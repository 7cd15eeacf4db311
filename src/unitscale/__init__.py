"""unitscale: unit scaling for PyTorch, and the tools to see why it works.

Design constraint: the names below are imported on first use (PEP 562), so that
``import unitscale`` and the ``unitscale`` command's ``--help`` do not pay for importing
torch; ``unitscale.Linear`` or ``from unitscale import Linear`` work as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import UnitScaleError

if TYPE_CHECKING:
    from . import (
        constraints,
        data,
        data_parallel,
        formats,
        functional,
        models,
        modules,
        optim,
        parameter,
        scale,
        transforms,
    )
    from .modules import (
        GELU,
        MHSA,
        MLP,
        Conv1d,
        CrossEntropyLoss,
        DepthModuleList,
        DepthSequential,
        Dropout,
        Embedding,
        LayerNorm,
        Linear,
        LinearReadout,
        RMSNorm,
        SiLU,
        Softmax,
        TransformerDecoder,
        TransformerLayer,
    )
    from .parameter import Parameter
    from .tracking import ScaleMonitor

_SUBMODULES = frozenset(
    ("constraints", "data", "data_parallel", "formats", "functional", "models", "modules",
     "optim", "parameter", "scale", "transforms")
)  # fmt: skip
_OWNERS = {"Parameter": "parameter", "ScaleMonitor": "tracking"}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    elif name in __all__ and name not in ("UnitScaleError", "__version__"):
        owner = importlib.import_module(f".{_OWNERS.get(name, 'modules')}", __name__)
        value = getattr(owner, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [  # noqa: RUF022 (grouped by kind)
    # package
    "UnitScaleError",
    "__version__",
    # submodules (analysis, utils and cli import matplotlib/pandas: import them explicitly)
    "constraints",
    "data",
    "data_parallel",
    "formats",
    "functional",
    "models",
    "modules",
    "optim",
    "parameter",
    "scale",
    "transforms",
    # unit-scaled layers
    "Conv1d",
    "Embedding",
    "LayerNorm",
    "Linear",
    "LinearReadout",
    "RMSNorm",
    # unit-scaled activations, dropout, loss
    "CrossEntropyLoss",
    "Dropout",
    "GELU",
    "SiLU",
    "Softmax",
    # unit-scaled transformer blocks
    "MHSA",
    "MLP",
    "TransformerDecoder",
    "TransformerLayer",
    # u-muP: tagged parameters and depth-aware containers (optimisers in unitscale.optim)
    "DepthModuleList",
    "DepthSequential",
    "Parameter",
    # watching scales during training
    "ScaleMonitor",
]
