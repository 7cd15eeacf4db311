"""``track_scales``: the public entry point of scale tracking."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..capture import TransformedModule, transformed
from ..formats import BlockFormat
from ..tracking import TrackScalesPass
from ..tracking.blocks import check_block_formats

__all__ = ["track_scales"]


def track_scales(
    module: nn.Module, block_formats: Sequence[str | BlockFormat] | None = None
) -> TransformedModule:
    """Return a tracked copy of ``module`` that records the scale of every tensor.

    The copy has independent parameters; ``module`` is not touched. Call the copy as you
    would the module (the gradient of a float input is tracked through an internal alias: the
    caller's tensors are never made to require grad), optionally call ``backward()``, then
    read ``tracked.scales_graph()``: a
    ``torch.fx.Graph`` of the whole forward pass (every Dynamo graph break joined in order)
    whose nodes carry ``meta["metrics"]`` and the meta listed in docs/guide/tracking.rst.

    Args:
        module: any ``torch.nn.Module`` that runs eagerly. A submodule transformed on its
            own (``model.block = unit_scale(model.block)``) is tracked with the rest, as
            transformed, under its own name.
        block_formats: block-scaled formats (names such as ``"mxfp8_e4m3"``, ``"nvfp4"``, or
            :class:`~unitscale.formats.BlockFormat` objects) whose metrics every tensor and
            gradient also gets, blocked along its last dimension: the fraction of values
            flushed to zero inside their block, of blocks whose scale is clipped, and the
            relative rounding error (columns ``block_flushed_<format>``,
            ``block_scale_clipped_<format>``, ``block_error_<format>``; see
            :mod:`unitscale.tracking.blocks`). Computed eagerly for every tensor: only
            when asked for (default None: none, tracking costs what it did).

    Returns:
        The tracked copy.

    Raises:
        UnitScaleError: ``block_formats`` names something that is not a block-scaled
            format.
        CaptureError: ``module`` is not a module; holds a submodule that is tracked or
            compiled (the error names it: track the whole model instead); or TorchDynamo
            cannot capture it (raised at the first call).

    Example:
        >>> import torch
        >>> tracked = track_scales(torch.nn.Linear(16, 4))
        >>> tracked(torch.randn(8, 16)).sum().backward()
        >>> graph = tracked.scales_graph()
        >>> [n.meta["clean_name"] for n in graph.nodes if n.op != "output"]
        ['weight', 'bias', 'input', 'linear']
    """
    formats = check_block_formats(block_formats, "unitscale.transforms.track_scales")
    return transformed(module, TrackScalesPass(formats), "track_scales")
