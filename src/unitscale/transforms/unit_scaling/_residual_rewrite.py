"""The residual-add rewrite of :func:`~unitscale.transforms.unit_scale`: each residual add
becomes a :func:`~unitscale.functional.residual_split` / :func:`~unitscale.functional.residual_add`
pair weighted by a share of the variance (:class:`ResidualTau`)."""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch.fx as fx

from ...capture import example_value
from .._rewrite import ancestors, insert_call
from ._graph import _as_residual_add, _ResidualAdd
from ._residual_tau import ResidualTau

__all__ = ["rewrite_residual_adds"]


def rewrite_residual_adds(
    graph: fx.Graph,
    params: set[fx.Node],
    before: tuple[int, int],
    in_scope: Callable[[fx.Node], bool],
    residual_tau: ResidualTau,
    residual_layers: int | None,
) -> list[_ResidualAdd]:
    """Rewrite every residual add of ``graph`` in scope (:func:`_as_residual_add`) into
    ``residual_split(skip, share=...)`` feeding the branch and
    ``residual_add(branch, skip, share=...)``, each share from ``residual_tau`` (the add's
    kind, its index after ``before = (adds, attention branches)`` of the call so far, and
    ``residual_layers`` branches, or the adds counted where None). Returns the adds found,
    in graph order."""
    from ... import functional as U

    adds_before, attention_before = before
    layers = residual_layers
    if layers is None:  # no residual stack known: the adds of the call so far and here
        layers = adds_before + sum(
            1 for n in graph.nodes if in_scope(n) and _as_residual_add(n, params)
        )
    found: list[_ResidualAdd] = []
    for node in list(graph.nodes):
        if not in_scope(node):
            continue
        residual = _as_residual_add(node, params)
        if residual is None:
            continue
        share = residual_tau.share(
            residual.kind,
            adds_before + len(found) + 1,
            layers=max(layers, adds_before + len(found) + 1),
            attention_before=attention_before + sum(1 for r in found if r.kind == "attention"),
        )
        skip, branch = residual.skip, residual.branch
        branch_side = ancestors(branch) | {branch}
        value = example_value(skip)
        with graph.inserting_after(skip):
            split = insert_call(
                graph,
                U.residual_split,
                (skip,),
                name=f"{skip.name}_split",
                value=(value, value),
                meta_from=node,
            )
            split.kwargs = {"share": share}
        with graph.inserting_after(split):
            into_branch = insert_call(
                graph,
                operator.getitem,
                (split, 0),
                name=f"{skip.name}_residual",
                value=value,
                meta_from=node,
            )
        with graph.inserting_after(into_branch):
            skipped = insert_call(
                graph,
                operator.getitem,
                (split, 1),
                name=f"{skip.name}_skip",
                value=value,
                meta_from=node,
            )
        for user in list(skip.users):
            if user in branch_side:
                user.replace_input_with(skip, into_branch)
        node.op = "call_function"
        node.target = U.residual_add
        node.args = (branch, skipped)
        node.kwargs = {"share": share}
        found.append(residual)
    return found
