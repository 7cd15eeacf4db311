"""How ``unit_scale`` weights residual branches: :class:`ResidualTau`.

A residual add of :func:`~unitscale.transforms.unit_scale` is ``residual_add(branch, skip,
share=share)``: ``sqrt(share) * branch + sqrt(1 - share) * skip``, ``share`` the branch's
share of the stream's variance (the reference's ``tau``, the branch's std over the skip's,
is ``sqrt(share / (1 - share))``). Two rules give the shares of a whole model:

* ``"paper"`` (default): u-μP's residual rule (Blake et al., "u-μP: The Unit-Scaled Maximal
  Update Parametrization", ICLR 2025, Appendix G), derived in
  ``functional/_residual_rule.py``
  (:func:`~unitscale.functional.transformer_residual_scaling_rule`): with ``n`` the number
  of residual branches, every attention branch has the weight
  ``β_attn² = α_res² · 2 α_ratio² / (1 + α_ratio²) / (n / 2)``, every MLP branch
  ``β_mlp² = α_res² · 2 / (1 + α_ratio²) / (n / 2)``, and the ``k``-th add has
  ``share_k = β_k² / (1 + Σ_{j<=k} β_j²)``. Here the kind of each branch is the one the
  transform detected (not its parity), so a model whose adds do not alternate gets the
  rule's weights all the same. At the default mults the rule weights the embedding, all
  attention branches and all MLP branches a third each in the final stream, at any depth
  (depth-μP; weights, not the shares a model's stream holds at initialisation, see
  docs/guide/umup.rst). ``depth_rule="completep"``: the ``β²`` fall like ``1 / (n/2)²``
  instead (CompleteP, arXiv 2505.01618, ``α = 1``).
* ``"equal_shares"``: the ``k``-th add has ``share = 1 / (k + 1)``: the stream entering the
  first block and every branch hold equal shares ``1 / (n + 1)`` of the final stream (the
  embedding's share falls with depth, so the model is not depth-μP).

Design constraints: a frozen dataclass of configuration (it pickles with the pass); the
taus are pure functions of the add's kind, its index and the adds before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ...errors import UnitScaleError
from ...functional import DEPTH_RULES, depth_divisor, share_to_tau
from ...parameter import DEPTH_RULE

__all__ = ["ResidualTau", "mark_depth_rule", "residual_stack_length"]

_RULES = ("paper", "equal_shares")


@dataclass(frozen=True)
class ResidualTau:
    """How :func:`unit_scale` weights residual branches: a rule, or a fixed share per kind.

    A residual add becomes ``sqrt(share) * branch + sqrt(1 - share) * skip`` (and its split
    the matching gradient weights), ``share`` the branch's share of the stream's variance;
    :meth:`share` gives it, :meth:`tau` the same weight as the reference's ``tau`` (the
    branch's std over the skip's, ``sqrt(share / (1 - share))``). ``attention`` and ``mlp``
    are shares. Where ``attention``/``mlp`` is None (the default), the ``rule`` gives the
    share:

    * ``"paper"`` (default): u-μP's rule (Blake et al., ICLR 2025, Appendix G; see
      :func:`~unitscale.functional.transformer_residual_scaling_rule`), with ``n`` residual
      branches (:func:`unit_scale` takes ``n`` as twice the length of the model's residual
      stack, the ``nn.ModuleList`` of layers, else the number of residual adds captured):
      attention branches weigh ``β_attn² = α_res² 2 α_ratio² / (1 + α_ratio²) / (n/2)``,
      MLP branches ``β_mlp² = α_res² 2 / (1 + α_ratio²) / (n/2)``, and the ``k``-th add
      has ``share = β_k² / (1 + Σ_{j<=k} β_j²)``. At the default mults the rule weights
      the embedding, the attention branches and the MLP branches a third each in the final
      stream at any depth. ``depth_rule="completep"`` divides the ``β²`` by ``(n/2)²``
      instead of ``n/2`` (CompleteP, arXiv 2505.01618: multipliers ``1/L``).
    * ``"equal_shares"``: the ``k``-th add (``k = 1, 2, ...``, in execution order) has
      ``share = 1 / (k + 1)``: the stream entering the first block and every branch hold
      ``1 / (n + 1)`` of the final stream each, as in an ordinary pre-norm transformer at
      initialisation; the embedding's share falls with depth.

    Attributes:
        attention: the share of attention branches (those containing attention or a
            softmax), in (0, 1), or None for the rule.
        mlp: the share of every other branch, in (0, 1), or None for the rule.
        rule: ``"paper"`` or ``"equal_shares"``.
        residual_mult: α_res of the paper's rule (the mean of the attention and MLP
            branches' total contributions against the embedding's, in std).
        residual_attn_ratio: α_ratio of the paper's rule (an attention branch's weight over
            an MLP branch's, in std).
        depth_rule: ``"depth-mup"`` (default) or ``"completep"`` (the paper's rule only).

    Example:
        >>> ResidualTau().share("attention", 1, layers=4)  # β² = 1/2: 0.5 / (1 + 0.5)
        0.3333333333333333
        >>> round(ResidualTau().tau("attention", 1, layers=4), 4)  # sqrt(0.5 / 1)
        0.7071
        >>> ResidualTau(rule="equal_shares").share("attention", 3)  # the third add: 1 / (3 + 1)
        0.25
        >>> ResidualTau(attention=0.2).share("attention", 3, layers=4)
        0.2
    """

    attention: float | None = None
    mlp: float | None = None
    rule: str = "paper"
    residual_mult: float = 1.0
    residual_attn_ratio: float = 1.0
    depth_rule: str = "depth-mup"

    def __post_init__(self) -> None:
        for name in ("attention", "mlp"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UnitScaleError(
                    f"unitscale.unit_scale: ResidualTau({name}={value!r}) must be a number "
                    "in (0, 1) or None"
                )
            if not 0.0 < value < 1.0:
                raise UnitScaleError(
                    f"unitscale.unit_scale: ResidualTau({name}={value!r}) is outside (0, 1); "
                    "it is the branch's share of the variance"
                )
        if self.depth_rule not in DEPTH_RULES:
            raise UnitScaleError(
                f"unitscale.unit_scale: depth_rule={self.depth_rule!r}; use one of {DEPTH_RULES}"
            )
        if self.rule not in _RULES:
            raise UnitScaleError(
                f"unitscale.unit_scale: ResidualTau(rule={self.rule!r}); use one of {_RULES}"
            )
        for name in ("residual_mult", "residual_attn_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise UnitScaleError(
                    f"unitscale.unit_scale: ResidualTau({name}={value!r}) must be a positive "
                    "number (a multiplier of u-μP's residual rule)"
                )

    def branch_weight(self, kind: str, layers: int) -> float:
        """``β²`` of a ``kind`` branch under the paper's rule with ``layers`` branches."""
        ratio_sq = float(self.residual_attn_ratio) ** 2
        share = 2.0 * (ratio_sq if kind == "attention" else 1.0) / (1.0 + ratio_sq)
        return float(self.residual_mult) ** 2 * share / depth_divisor(layers / 2.0, self.depth_rule)

    def tau(
        self,
        kind: str,
        index: int,
        layers: int | None = None,
        attention_before: int | None = None,
    ) -> float:
        """:meth:`share` as the reference's ``tau``: the branch's std over the skip's,
        ``sqrt(share / (1 - share))`` (what ``residual_add(tau=...)`` takes)."""
        return share_to_tau(self.share(kind, index, layers, attention_before))

    def share(
        self,
        kind: str,
        index: int,
        layers: int | None = None,
        attention_before: int | None = None,
    ) -> float:
        """The share of the variance of the ``index``-th residual add (from 1), a ``kind`` branch.

        Args:
            kind: ``"attention"`` or ``"mlp"``.
            index: the add's place in the forward pass, from 1.
            layers: the number of residual branches (the paper's rule needs it).
            attention_before: how many of the ``index - 1`` adds before were attention
                branches (None: they alternate, attention first).

        Raises:
            UnitScaleError: the paper's rule without ``layers``.
        """
        fixed = self.attention if kind == "attention" else self.mlp
        if fixed is not None:
            return float(fixed)
        if self.rule == "equal_shares":
            return 1.0 / (index + 1)
        if not layers:
            raise UnitScaleError(
                "unitscale.unit_scale: ResidualTau(rule='paper') needs the number of residual "
                "branches (layers=); pass it, or use rule='equal_shares'"
            )
        before = index - 1
        attention = (before + 1) // 2 if attention_before is None else attention_before
        total = (
            1.0
            + attention * self.branch_weight("attention", layers)
            + (before - attention) * self.branch_weight("mlp", layers)
        )
        weight = self.branch_weight(kind, layers)
        return weight / (total + weight)


def residual_stack_length(module: nn.Module) -> int | None:
    """The number of layers of ``module``'s residual stack, or None if it has none.

    The stack is the longest ``nn.ModuleList`` or ``nn.Sequential`` of two or more blocks of
    one class, each with submodules of its own (transformers' ``model.layers``, GPT-2's
    ``h``; an ``nn.Sequential`` of plain linears is not one), as
    :func:`unitscale.parameter.tag_model` finds it for the depth factors of
    :mod:`unitscale.optim`. Read from the module, not the graph, so that every captured
    graph of a call (graph breaks included) sees the same number.
    """
    best: int | None = None
    for sub in module.modules():
        if type(sub) not in (nn.ModuleList, nn.Sequential):
            continue
        blocks = list(sub.children())
        if len(blocks) < 2 or len({type(block) for block in blocks}) != 1:
            continue
        if not any(True for _ in blocks[0].children()):
            continue
        best = max(best or 0, len(blocks))
    return best


def mark_depth_rule(module: nn.Module, depth_rule: str) -> None:
    """Tell :mod:`unitscale.optim` the depth rule of ``module``'s residual stack: every
    parameter with a ``mup_scaling_depth`` gets ``mup_depth_rule = depth_rule`` (left unset
    for the default ``"depth-mup"``)."""
    if depth_rule == "depth-mup":
        return
    for param in module.parameters():
        if getattr(param, "mup_scaling_depth", None):
            setattr(param, DEPTH_RULE, depth_rule)
