"""Muon with u-μP: torch's Muon for hidden matrices, u-μP AdamW for the rest, one optimiser."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ..errors import UnitScaleError
from ._groups import _named, parameter_names
from ._optimizers import AdamW, _ScaledOptimizer
from ._rules import is_muon_matrix, lr_scale_func_adam, lr_scale_func_muon

__all__ = ["Muon", "torch_muon_adjustment"]

#: The first torch release with ``torch.optim.Muon``.
MUON_RELEASE = "2.9"


def torch_muon_adjustment(shape: torch.Size | tuple[int, ...]) -> float:
    """The factor torch's Muon puts on the rate itself (its default ``adjust_lr_fn``,
    Keller Jordan's ``sqrt(max(1, rows / cols))``), which :class:`Muon` divides out."""
    rows, cols = shape[:2]
    return math.sqrt(max(1.0, rows / cols))


def _muon_group_scale(param: Tensor) -> float:
    """The ``lr_scale`` of a Muon group: u-μP's factor over torch's own adjustment."""
    return lr_scale_func_muon(param) / torch_muon_adjustment(param.shape)


def _torch_muon() -> Any:
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise UnitScaleError(
            f"unitscale.optim.Muon needs torch.optim.Muon, which torch {MUON_RELEASE} added; "
            f"this is torch {torch.__version__}: upgrade torch, or use unitscale.optim.AdamW"
        )
    return muon


_scaled_muon_class: list[type] = []


def _scaled_muon() -> type:
    """``_ScaledOptimizer`` in front of ``torch.optim.Muon`` (made on first use, so that the
    module imports on torch releases without Muon)."""
    if not _scaled_muon_class:
        torch_muon = _torch_muon()
        _scaled_muon_class.append(
            type(
                "_ScaledMuon",
                (_ScaledOptimizer, torch_muon),
                {"_torch_class": torch_muon, "_rule": staticmethod(_muon_group_scale)},
            )
        )
    return _scaled_muon_class[0]


def _split(groups: list[dict[str, Any]], muon: bool) -> list[dict[str, Any]]:
    """The groups' parameters Muon updates (``muon``) or AdamW does, same options."""
    out = []
    for group in groups:
        pairs = [pair for pair in group["params"] if is_muon_matrix(pair[1]) is muon]
        if pairs:
            out.append({**group, "params": pairs})
    return out


class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices, u-μP AdamW for the rest: one optimiser over a whole model.

    Hidden matrices (tagged ``"weight"``, 2-D, not an ``nn.Embedding``'s table, which
    :func:`~unitscale.parameter.tag_module` marks ``mup_embedding``) are updated by
    ``torch.optim.Muon`` at the rate ``lr * sqrt(fan_out) / sqrt(depth)``, derived for
    unit-scaled weights from the spectral condition for feature learning (Yang, Simon &
    Bernstein 2023; derivation in docs/guide/umup.rst and :func:`lr_scale_func_muon`): Muon's
    orthogonalised update has spectral norm about 1, and the rate makes its change of a
    layer's output entries of size ``lr`` at any width, as u-μP's Adam step's. Every other
    parameter (embedding, readout, biases, norms) is updated by :class:`AdamW` with
    u-μP's rules (:func:`lr_scale_func_adam`). ``lr`` is one base rate for both.

    Groups: each holds ``"algorithm"`` (``"muon"`` or ``"adamw"``), the base rate ``"lr"``
    and the factor ``"lr_scale"`` (for a Muon group u-μP's factor divided by torch's own
    ``sqrt(max(1, rows / cols))``, which torch's step multiplies back), so schedulers and
    ``group["lr"] = ...`` set the base rate of both. Weight decay is independent as in
    :class:`AdamW` (both decoupled). ``state_dict``/``load_state_dict`` are torch's.

    Needs torch 2.9 or later (``torch.optim.Muon``); older releases raise an error naming
    the release.

    Args:
        params: parameters, ``(name, parameter)`` pairs or group dicts, all u-μP-tagged.
        lr: the base learning rate.
        weight_decay: decay per step relative to the schedule (independent; see
            :class:`AdamW`), default 0.
        momentum, nesterov, ns_coefficients, eps, ns_steps: torch's Muon's (its defaults
            where None).
        betas, adam_eps: AdamW's ``betas`` and ``eps`` for the other parameters.
        independent_weight_decay: as :class:`AdamW`'s.
        allow_untagged: give untagged parameters ``lr`` (AdamW) instead of raising.

    Raises:
        UnitScaleError: torch has no ``torch.optim.Muon``.
        UntaggedParameterError: a parameter has no u-μP tags.

    Example (on torch 2.9 or later):
        >>> import torch
        >>> import unitscale as us
        >>> model = us.TransformerDecoder(64, depth=2, heads=4, vocab_size=32)
        >>> if hasattr(torch.optim, "Muon"):
        ...     opt = Muon(model.named_parameters(), lr=0.5)
        ...     ids = torch.randint(0, 32, (2, 9))
        ...     model(ids[:, :-1], ids[:, 1:]).backward()
        ...     opt.step()
        ...     print(sorted({g["algorithm"] for g in opt.param_groups}))
        ... else:
        ...     print(['adamw', 'muon'])  # torch < 2.9: Muon raises UnitScaleError
        ['adamw', 'muon']
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.0,
        momentum: float | None = None,
        nesterov: bool | None = None,
        ns_coefficients: tuple[float, float, float] | None = None,
        eps: float | None = None,
        ns_steps: int | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        adam_eps: float = 1e-8,
        *,
        independent_weight_decay: bool = True,
        allow_untagged: bool = False,
    ) -> None:
        scaled_muon = _scaled_muon()
        groups = _named(params)
        names = parameter_names(groups)
        options = {"independent_weight_decay": independent_weight_decay}
        muon_options = {
            key: value
            for key, value in (
                ("momentum", momentum),
                ("nesterov", nesterov),
                ("ns_coefficients", ns_coefficients),
                ("eps", eps),
                ("ns_steps", ns_steps),
            )
            if value is not None
        }
        self._inner: list[Any] = []
        if muon_groups := _split(groups, True):
            inner = scaled_muon(muon_groups, lr, weight_decay, **muon_options, **options)
            self._inner.append(("muon", inner))
        if adam_groups := _split(groups, False):
            inner = AdamW(adam_groups, lr, betas, adam_eps, weight_decay, **options)
            self._inner.append(("adamw", inner))
        if not self._inner:
            raise ValueError("unitscale.optim.Muon: params is empty")
        for algorithm, inner in self._inner:
            for group in inner.param_groups:
                group["algorithm"] = algorithm
        all_groups = [group for _, inner in self._inner for group in inner.param_groups]
        super().__init__(all_groups, {"lr": lr, "weight_decay": weight_decay})
        self._unitscale_names = names
        self._link()

    def _link(self) -> None:
        """Point the inner optimisers at this one's groups (the same dicts) and state."""
        for algorithm, inner in self._inner:
            inner.param_groups = [g for g in self.param_groups if g["algorithm"] == algorithm]
            inner.state = self.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's for a group the inner optimisers built; any other group's parameters go,
        one group each, hidden matrices to Muon and the rest to AdamW, with their u-μP
        factors (an inner optimiser that does not exist yet is refused)."""
        if "algorithm" in param_group:
            super().add_param_group(param_group)
            return
        groups = _named([param_group])
        inner_of = dict(self._inner)
        for name, param in (pair for group in groups for pair in group["params"]):
            algorithm = "muon" if is_muon_matrix(param) else "adamw"
            if algorithm not in inner_of:
                raise UnitScaleError(
                    f"unitscale.optim.Muon.add_param_group: parameter {name!r} needs the "
                    f"{algorithm} part, which this optimiser was built without; build a new one"
                )
            inner = inner_of[algorithm]
            options = {k: v for k, v in groups[0].items() if k != "params"}
            independent = inner.param_groups[0].get("independent_weight_decay", False)
            inner.add_param_group(
                {
                    **options,
                    "params": [param],
                    "lr_scale": _rule_of(algorithm)(param),
                    "independent_weight_decay": independent,
                    "algorithm": algorithm,
                }
            )
            super().add_param_group(inner.param_groups[-1])
            if not name.startswith("#"):
                self._unitscale_names[id(param)] = name
        self._link()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then the inner optimisers pointed at the loaded groups and state."""
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:
        """One step of each inner optimiser (torch's Muon, u-μP AdamW)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for _, inner in self._inner:
            inner.step()
        return loss


def _rule_of(algorithm: str) -> Callable[[Tensor], float]:
    return _muon_group_scale if algorithm == "muon" else lr_scale_func_adam
