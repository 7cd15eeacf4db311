"""Unit-scaled modules: thin wrappers around :mod:`unitscale.functional`.

Each module holds parameters and configuration and calls one functional op in ``forward``
(its docstring names it). Also exported at top level (``unitscale.Linear``...). A facade over
``_layers`` (layers, activations, dropout, loss), ``_transformer`` (transformer blocks) and
``_depth`` (depth-aware containers).
"""

from ._depth import DepthModuleList, DepthSequential
from ._layers import (
    GELU,
    Conv1d,
    CrossEntropyLoss,
    Dropout,
    Embedding,
    LayerNorm,
    Linear,
    LinearReadout,
    RMSNorm,
    SiLU,
    Softmax,
)
from ._transformer import MHSA, MLP, TransformerDecoder, TransformerLayer

__all__ = [  # noqa: RUF022 (grouped by kind)
    # layers
    "Conv1d",
    "Embedding",
    "LayerNorm",
    "Linear",
    "LinearReadout",
    "RMSNorm",
    # activations and regularisation
    "Dropout",
    "GELU",
    "SiLU",
    "Softmax",
    # losses
    "CrossEntropyLoss",
    # blocks and models
    "MHSA",
    "MLP",
    "TransformerDecoder",
    "TransformerLayer",
    # depth-aware containers (u-muP: they set mup_scaling_depth)
    "DepthModuleList",
    "DepthSequential",
]
