"""Coordinate check (mup's test of a parametrisation): activation size and change vs width.

Train a model a few steps at one learning rate, for several widths (and depths), and record
for each layer the size of its output and of the output's change since initialisation, on
one fixed batch. Under u-μP both stay flat as the model grows; under the standard
parametrisation the change grows with width (the reason a learning rate tuned on a small
model is too large for a big one).

Design constraints: collection only (records, one dict per model, layer and step); plotting
is separate (``benchmarks/coord_check.py``). Layers are the modules named in ``layers``
(resolved with ``get_submodule``), observed with forward hooks; a hooked module's output
must be a tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["coord_data", "decoder_layers"]


def decoder_layers(depth: int, readout: str = "readout") -> list[str]:
    """The layers a coordinate check watches in a decoder with ``depth`` blocks: the
    embedding, each block's output and the readout (``unitscale.TransformerDecoder`` names;
    ``readout`` is the head's name, e.g. ``"lm_head"`` for :class:`unitscale.models.PlainGPT`).

    Example:
        >>> decoder_layers(2)
        ['embedding', 'layers.0', 'layers.1', 'readout']
    """
    return ["embedding", *(f"layers.{i}" for i in range(depth)), readout]


def _rms(x: Tensor) -> float:
    return float(x.detach().double().pow(2).mean().sqrt())


def coord_data(
    make_model: Callable[[int, int], nn.Module],
    make_optimiser: Callable[[nn.Module], torch.optim.Optimizer],
    loss_fn: Callable[[nn.Module, Any], Tensor],
    batch: Any,
    widths: Iterable[int],
    depths: Iterable[int],
    layers: Callable[[int], Sequence[str]],
    steps: int = 3,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Train each ``(width, depth)`` model ``steps`` steps on ``batch``; record each layer.

    Args:
        make_model: ``(width, depth) -> model``.
        make_optimiser: ``model -> optimiser``.
        loss_fn: ``(model, batch) -> scalar loss``; also the forward the hooks observe.
        batch: one fixed batch, trained on and observed at every step.
        widths, depths: the grid.
        layers: ``depth -> names of the submodules to watch``.
        steps: optimiser steps.
        seed: seeds each model's construction (same seed for every size).

    Returns:
        Records ``{"width", "depth", "layer", "step", "size", "change"}``: ``size`` is the rms
        of the layer's output at that step (before the step's update), ``change`` the rms of
        its difference from step 0's output.

    Example:
        >>> import unitscale as us
        >>> ids = torch.randint(0, 32, (2, 8))
        >>> records = coord_data(
        ...     lambda w, d: us.TransformerDecoder(w, d, 2, 32, mup=True),
        ...     lambda m: us.optim.AdamW(m.parameters(), lr=0.5),
        ...     lambda m, b: m(b, b),
        ...     ids, widths=[16], depths=[1], layers=decoder_layers, steps=2,
        ... )
        >>> sorted({r["layer"] for r in records}), max(r["step"] for r in records)
        (['embedding', 'layers.0', 'readout'], 2)
    """
    records: list[dict[str, Any]] = []
    for depth in depths:
        for width in widths:
            torch.manual_seed(seed)
            model = make_model(width, depth)
            optimiser = make_optimiser(model)
            names = list(layers(depth))
            outputs: dict[str, Tensor] = {}
            handles = [
                model.get_submodule(name).register_forward_hook(
                    lambda _m, _i, out, name=name, seen=outputs: seen.__setitem__(
                        name, out.detach()
                    )
                )
                for name in names
            ]
            first: dict[str, Tensor] = {}
            try:
                for step in range(steps + 1):
                    outputs.clear()
                    loss = loss_fn(model, batch)
                    for name in names:
                        out = outputs[name]
                        first.setdefault(name, out)
                        records.append(
                            {
                                "width": width,
                                "depth": depth,
                                "layer": name,
                                "step": step,
                                "size": _rms(out),
                                "change": _rms(out - first[name]),
                            }
                        )
                    if step < steps:
                        optimiser.zero_grad()
                        loss.backward()
                        optimiser.step()
            finally:
                for handle in handles:
                    handle.remove()
    return records
