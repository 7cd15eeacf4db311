"""unitscale: unit scaling for PyTorch, and the tools to see why it works."""

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
from ._version import __version__
from .errors import UnitScaleError
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

__all__ = [  # noqa: RUF022 (grouped by kind, see STYLE.md)
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
