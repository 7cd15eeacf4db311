"""u-μP's residual scaling rule: the ``tau`` of each residual branch of a transformer.

Source: Blake et al., "u-μP: The Unit-Scaled Maximal Update Parametrization" (ICLR 2025,
arXiv 2407.17465), Appendix G (the residual scheme, after depth-μP), with its two
hyperparameters ``α_res`` (``residual_mult``) and ``α_res-attn-ratio``
(``residual_attn_ratio``). The values mean what they mean in the paper and its code: a mult
swept there is the same mult here.

Derivation. Write the (unnormalised) residual stream of a pre-norm transformer with ``L``
residual branches (``L/2`` layers; attention at even indices, MLP at odd ones) as
``h = e + Σ_k β_k f_k``, with ``e`` the embedding and every branch output ``f_k`` unit-scaled
and independent at initialisation. The paper's rule:

* every attention branch has the same weight, and so does every MLP branch;
* ``residual_attn_ratio`` (α_ratio) is the ratio of an attention branch's weight to an MLP
  branch's, as standard deviations: ``β_attn / β_mlp = α_ratio``;
* ``residual_mult`` (α_res) sets the *average* of the attention branches' and the MLP
  branches' total contributions against the embedding's:
  ``(Σ_attn β² + Σ_mlp β²) / 2 = α_res²`` (the embedding's is 1), so at the defaults
  (both 1) the embedding, all attention branches together and all MLP branches together
  each make up one third of the final stream's variance;
* each branch's weight falls like ``1/sqrt(L/2)`` (depth-μP), so the sum of the ``L``
  branch updates, which are correlated during training, stays O(1) as the model gets
  deeper, and the embedding's share does not depend on depth.

These give ``β_attn² = α_res² · 2 α_ratio² / (1 + α_ratio²) / (L/2)`` and
``β_mlp² = α_res² · 2 / (1 + α_ratio²) / (L/2)`` (both ``2 α_res² / L`` at ratio 1). The
paper writes each residual add with the std ratio of branch to skip,
``β_k / sqrt(S_{k-1})``, and that std ratio is the ``tau`` this rule returns, as the
reference library's rule does: ``residual_add(r, s, tau=rule(k, n))`` weights branch ``k``
as the paper does. The same add written with the branch's share of the variance is
``residual_add(r, s, share=tau² / (1 + tau²))``, which is how unitscale's modules call it.

Unit scaling keeps the stream unit after every branch: with ``S_k = 1 + Σ_{j<=k} β_j²`` the
variance of the unnormalised stream after ``k + 1`` branches, the unit stream is
``x_k = h_k / sqrt(S_k) = sqrt(S_{k-1}/S_k) x_{k-1} + (β_k / sqrt(S_k)) f_k``, which is
:func:`~unitscale.functional.residual_add` with ``share_k = β_k² / S_k`` (then
``1 - share_k = S_{k-1} / S_k``), or equally ``tau_k = β_k / sqrt(S_{k-1})`` (then
``tau_k² / (1 + tau_k²) = β_k² / S_k``).

The weights are what the rule sets, not what a model's stream holds: at initialisation the
built-in decoder's attention branches hold more than their third of the final stream's
variance, because attention's output is correlated across positions; docs/guide/umup.rst
gives the measured shares (``benchmarks/residual_shares.py``). The final stream is
``(e + Σ β_k f_k) / sqrt(1 + 2 α_res²)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..errors import UnsupportedArgumentError

__all__ = ["transformer_residual_scaling_rule"]


#: The depth rules: depth-μP (branch multipliers ``1/sqrt(L)``, the u-μP paper's) and
#: CompleteP (``1/L``, Dey et al. 2025, arXiv 2505.01618).
DEPTH_RULES = ("depth-mup", "completep")


def check_depth_rule(where: str, depth_rule: str) -> None:
    """Refuse an unknown ``depth_rule`` with an error naming ``where``."""
    if depth_rule not in DEPTH_RULES:
        raise UnsupportedArgumentError(where, "depth_rule", depth_rule, f"use one of {DEPTH_RULES}")


def depth_divisor(layers: float, depth_rule: str = "depth-mup") -> float:
    """What a branch's ``β²`` is divided by at ``layers`` transformer layers (base: one
    layer): ``layers`` (depth-μP, multiplier ``L^-1/2``) or ``layers²`` (CompleteP,
    multiplier ``L^-1``, its ``α = 1``)."""
    return layers if depth_rule == "depth-mup" else layers * layers


def branch_weights(
    layers: int,
    residual_mult: float,
    residual_attn_ratio: float,
    depth_rule: str = "depth-mup",
) -> list[float]:
    """``β_k²`` for ``k = 0 .. layers - 1`` (attention branches at even ``k``); Appendix G,
    divided by ``depth_rule``'s :func:`depth_divisor`."""
    ratio_sq = residual_attn_ratio * residual_attn_ratio
    divisor = depth_divisor(layers / 2.0, depth_rule)  # layers/2 attention + MLP pairs
    attn = residual_mult**2 * 2.0 * ratio_sq / (1.0 + ratio_sq) / divisor
    mlp = residual_mult**2 * 2.0 / (1.0 + ratio_sq) / divisor
    return [attn if k % 2 == 0 else mlp for k in range(layers)]


def rule_shares(
    layers: int,
    residual_mult: float = 1.0,
    residual_attn_ratio: float = 1.0,
    depth_rule: str = "depth-mup",
) -> list[float]:
    """Each branch's share of the variance, ``β_k² / (1 + Σ_{j<=k} β_j²)``, for ``layers``
    branches (what :func:`transformer_residual_scaling_rule`'s taus mean, as shares);
    ``depth_rule`` as :func:`branch_weights`."""
    weights = branch_weights(layers, residual_mult, residual_attn_ratio, depth_rule)
    return [weights[k] / (1.0 + sum(weights[: k + 1])) for k in range(layers)]


def transformer_residual_scaling_rule(
    residual_mult: float = 1.0, residual_attn_ratio: float = 1.0, depth_rule: str = "depth-mup"
) -> Callable[[int, int], float]:
    """u-μP's residual rule for a transformer (paper, Appendix G): returns ``tau(index, layers)``.

    ``layers`` is the number of residual *branches* (twice the number of transformer
    layers; attention branches have even ``index``, MLP branches odd); ``tau`` is the
    reference's: branch ``index``'s standard deviation over the skip's, the ``tau`` of
    :func:`~unitscale.functional.residual_add` (``residual_add(r, s, tau=rule(k, n))``; its
    share of the variance is ``tau² / (1 + tau²)``). Rule (derived in this module's
    docstring): branch ``k`` has weight ``β_k² = α_res² · 2 r_k / (1 + α_ratio²) / (layers /
    2)`` with ``r_k = α_ratio²`` for attention and 1 for MLP, and
    ``tau_k = β_k / sqrt(1 + Σ_{j<k} β_j²)``. So the stream stays unit after every branch;
    at the default mults the rule weights the embedding, the attention branches and the MLP
    branches a third each in the final stream, at any depth (a weight: the shares measured
    at initialisation differ, see docs/guide/umup.rst); each branch's multiplier falls like
    ``1/sqrt(layers / 2)`` (depth-μP); an attention branch contributes ``α_ratio`` times
    what an MLP branch does (in std).

    ``depth_rule="completep"``: CompleteP's depth rule (Dey et al. 2025, "Don't be lazy:
    CompleteP enables compute-efficient deep transformers", arXiv 2505.01618, the
    parametrisation with ``α = 1``): each branch's multiplier falls like ``1 / (layers / 2)``
    instead, ``β_k² = α_res² · 2 r_k / (1 + α_ratio²) / (layers / 2)²`` (the same at one
    layer, the base depth).

    Args:
        residual_mult: α_res, the mean of the attention and MLP branches' total
            contributions against the embedding's (in std) at one layer (at any depth with
            depth-μP).
        residual_attn_ratio: α_ratio, attention over MLP contribution (in std).
        depth_rule: ``"depth-mup"`` (default) or ``"completep"``.

    Returns:
        ``tau(index, layers) -> float``, positive.

    Raises:
        UnsupportedArgumentError: a multiplier is not positive, an unknown ``depth_rule``,
            or (from ``tau``) ``index`` is outside ``[0, layers)``.

    Example:
        >>> tau = transformer_residual_scaling_rule()
        >>> [round(tau(k, 4), 4) for k in range(4)]  # β² = 1/2 each: sqrt(0.5 / (1 + k/2))
        [0.7071, 0.5774, 0.5, 0.4472]
        >>> [round(t * t / (1 + t * t), 4) for t in (tau(k, 4) for k in range(4))]  # shares
        [0.3333, 0.25, 0.2, 0.1667]
    """
    for name, value in (
        ("residual_mult", residual_mult),
        ("residual_attn_ratio", residual_attn_ratio),
    ):
        if not value > 0.0:
            raise UnsupportedArgumentError(
                "transformer_residual_scaling_rule", name, value, "use a positive number"
            )
    check_depth_rule("transformer_residual_scaling_rule", depth_rule)

    def tau(index: int, layers: int) -> float:
        if not 0 <= index < layers:
            raise UnsupportedArgumentError(
                "transformer_residual_scaling_rule",
                "index",
                index,
                f"use 0 <= index < layers={layers}",
            )
        weights = branch_weights(layers, residual_mult, residual_attn_ratio, depth_rule)
        return math.sqrt(weights[index] / (1.0 + sum(weights[:index])))

    return tau
