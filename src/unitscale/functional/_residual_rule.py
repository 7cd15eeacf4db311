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
``β_k / sqrt(S_{k-1})``; here ``tau`` is the branch's share of the variance, the same
add written differently.

Unit scaling keeps the stream unit after every branch: with ``S_k = 1 + Σ_{j<=k} β_j²`` the
variance of the unnormalised stream after ``k + 1`` branches, the unit stream is
``x_k = h_k / sqrt(S_k) = sqrt(S_{k-1}/S_k) x_{k-1} + (β_k / sqrt(S_k)) f_k``, which is
:func:`~unitscale.functional.residual_add` with ``tau_k = β_k² / S_k`` (then
``1 - tau_k = S_{k-1} / S_k``). The final stream is ``(e + Σ β_k f_k) / sqrt(1 + 2 α_res²)``.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import UnsupportedArgumentError

__all__ = ["transformer_residual_scaling_rule"]


def _branch_weights(layers: int, residual_mult: float, residual_attn_ratio: float) -> list[float]:
    """``β_k²`` for ``k = 0 .. layers - 1`` (attention branches at even ``k``); Appendix G."""
    ratio_sq = residual_attn_ratio * residual_attn_ratio
    pairs = layers / 2.0  # the number of transformer layers (attention + MLP pairs)
    attn = residual_mult**2 * 2.0 * ratio_sq / (1.0 + ratio_sq) / pairs
    mlp = residual_mult**2 * 2.0 / (1.0 + ratio_sq) / pairs
    return [attn if k % 2 == 0 else mlp for k in range(layers)]


def transformer_residual_scaling_rule(
    residual_mult: float = 1.0, residual_attn_ratio: float = 1.0
) -> Callable[[int, int], float]:
    """u-μP's residual rule for a transformer (paper, Appendix G): returns ``tau(index, layers)``.

    ``layers`` is the number of residual *branches* (twice the number of transformer
    layers; attention branches have even ``index``, MLP branches odd); ``tau`` is the share
    of the stream's variance that :func:`~unitscale.functional.residual_add` gives branch
    ``index``. Rule (derived in this module's docstring): branch ``k`` has weight
    ``β_k² = α_res² · 2 r_k / (1 + α_ratio²) / (layers / 2)`` with ``r_k = α_ratio²`` for
    attention and 1 for MLP, and ``tau_k = β_k² / (1 + Σ_{j<=k} β_j²)``. So the stream stays
    unit after every branch; at the default mults the embedding, the attention branches and
    the MLP branches each make up a third of the final stream at any depth; each branch's
    multiplier falls like ``1/sqrt(layers / 2)`` (depth-μP); an attention branch contributes
    ``α_ratio`` times what an MLP branch does (in std).

    Args:
        residual_mult: α_res, the mean of the attention and MLP branches' total
            contributions against the embedding's (in std).
        residual_attn_ratio: α_ratio, attention over MLP contribution (in std).

    Returns:
        ``tau(index, layers) -> float`` in (0, 1).

    Raises:
        UnsupportedArgumentError: a multiplier is not positive, or (from ``tau``) ``index``
            is outside ``[0, layers)``.

    Example:
        >>> tau = transformer_residual_scaling_rule()
        >>> [round(tau(k, 4), 4) for k in range(4)]  # β² = 1/2 each: 0.5 / (1 + (k+1)/2)
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

    def tau(index: int, layers: int) -> float:
        if not 0 <= index < layers:
            raise UnsupportedArgumentError(
                "transformer_residual_scaling_rule",
                "index",
                index,
                f"use 0 <= index < layers={layers}",
            )
        weights = _branch_weights(layers, residual_mult, residual_attn_ratio)
        return weights[index] / (1.0 + sum(weights[: index + 1]))

    return tau
