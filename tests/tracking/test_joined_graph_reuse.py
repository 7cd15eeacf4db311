"""scales_graph() keeps its last joined graph and refills it when nobody else holds it.

The refill must be indistinguishable from a fresh build, and a graph, node, meta dict or
Metrics the caller still holds must never change.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unitscale.tracking import graph_records
from unitscale.transforms import track_scales


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.up(x))
        print("", end="")  # a graph break: two pieces joined
        return self.down(h).sum()


def step(tracked: nn.Module, x: Tensor) -> None:
    tracked.zero_grad(set_to_none=True)
    tracked(x).backward()


def rows(graph: torch.fx.Graph) -> list[Any]:
    return [(r.node, r.direction, r.shape, r.metrics) for r in graph_records(graph)]


def metas(graph: torch.fx.Graph) -> list[dict[str, Any]]:
    """Every node's meta, metrics as their values (the objects are new at each read)."""
    out = []
    for node in graph.nodes:
        meta = dict(node.meta)
        metrics = meta.pop("metrics", None)
        if metrics is not None:
            meta["fwd"] = metrics.fwd and metrics.fwd.as_dict()
            meta["bwd"] = metrics.bwd and metrics.bwd.as_dict()
        out.append((node.name, node.op, str(node.target), str(node.args), meta))
    return out


@pytest.fixture
def tracked() -> nn.Module:
    torch.manual_seed(0)
    return track_scales(Net())


def test_a_refilled_graph_equals_a_fresh_build_at_every_step(tracked: nn.Module) -> None:
    optimiser = torch.optim.SGD(tracked.parameters(), lr=0.5)
    step(tracked, torch.randn(4, 8))
    kept = id(tracked.scales_graph())  # dropped at once: the next read may refill it
    for i in range(4):
        optimiser.step()
        step(tracked, torch.randn(4, 8) * (i + 1))
        refilled = tracked.scales_graph()
        assert id(refilled) == kept  # the refill path is the one under test
        fresh = tracked.scales_graph()  # `refilled` is held: this one is built anew
        assert fresh is not refilled
        assert metas(refilled) == metas(fresh)
        assert rows(refilled) == rows(fresh)
        del refilled, fresh
        kept = id(tracked.scales_graph())


def test_a_held_graph_never_changes(tracked: nn.Module) -> None:
    step(tracked, torch.randn(4, 8))
    first = tracked.scales_graph()
    before = metas(first)
    step(tracked, torch.randn(4, 8) * 100)
    second = tracked.scales_graph()
    assert second is not first
    assert metas(first) == before
    assert rows(second) != rows(first)


def test_a_held_graph_is_copied_and_refilled_not_joined_again(
    tracked: nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A user's loop holds the last graph (`graph = tracked.scales_graph()`) until the next
    # read: that read copies the held graph's nodes and refills the copy (joining the pieces
    # again costs several times more), equal to a fresh build, the held graph unchanged.
    from unitscale.tracking import _join
    from unitscale.tracking._recording import _pass as _recorder

    builds = []
    build = _join._build
    monkeypatch.setattr(_join, "_build", lambda *a, **k: builds.append(1) or build(*a, **k))
    track = next(p for p in tracked.passes if isinstance(p, _recorder.TrackScalesPass))
    step(tracked, torch.randn(4, 8))
    held = tracked.scales_graph()
    for i in range(3):
        before = metas(held)
        step(tracked, torch.randn(4, 8) * (i + 2))
        graph = tracked.scales_graph()
        assert graph is not held and metas(held) == before
        joined, track._joined = track._joined, None
        fresh = tracked.scales_graph()  # joined anew, to compare with
        track._joined = joined
        assert metas(graph) == metas(fresh)
        assert rows(graph) == rows(fresh)
        held = graph
    assert len(builds) == 1 + 3  # the first read and the three fresh ones only


def test_a_loop_holding_the_last_graph_refills_the_one_before_it(
    tracked: nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `graph = tracked.scales_graph()` in a loop: while the next read runs the caller holds
    # the last graph but has let go of the one before it, which is refilled (no copy, no
    # join), equal to a fresh build; the held graph is unchanged.
    from unitscale.tracking import _join

    made = []
    build, copy = _join._build, _join._Joined.copy
    monkeypatch.setattr(_join, "_build", lambda *a, **k: made.append("build") or build(*a, **k))
    monkeypatch.setattr(_join._Joined, "copy", lambda self: made.append("copy") or copy(self))
    step(tracked, torch.randn(4, 8))
    graph = tracked.scales_graph()
    ids = [id(graph)]
    step(tracked, torch.randn(4, 8) * 2)
    graph = tracked.scales_graph()
    ids.append(id(graph))
    assert made == ["build", "copy"]
    for i in range(4):
        before = metas(graph)
        step(tracked, torch.randn(4, 8) * (i + 3))
        new = tracked.scales_graph()
        assert id(new) == ids[-2] and new is not graph  # the graph before last, refilled
        assert metas(graph) == before
        graph = new
        ids.append(id(graph))
    assert made == ["build", "copy"]
    expected = metas(graph)
    kept = [graph, tracked.scales_graph()]  # both held: a third is copied, neither changes
    del graph
    assert metas(kept[0]) == expected and metas(kept[1]) == expected
    assert metas(tracked.scales_graph()) == expected
    assert made == ["build", "copy", "copy"]


@pytest.mark.parametrize("held", ["node", "meta", "metrics"])
def test_a_held_node_meta_or_metrics_never_changes(tracked: nn.Module, held: str) -> None:
    step(tracked, torch.randn(4, 8))
    graph = tracked.scales_graph()
    node = next(n for n in graph.nodes if n.meta.get("clean_name") == "h")
    kept: Any = {"node": node, "meta": node.meta, "metrics": node.meta["metrics"]}[held]
    value = node.meta["metrics"].fwd.mean_abs
    del graph, node
    step(tracked, torch.randn(4, 8) * 100)
    new = next(n for n in tracked.scales_graph().nodes if n.meta.get("clean_name") == "h")
    assert new.meta["metrics"].fwd.mean_abs > 10 * value
    metrics = {"node": lambda: kept.meta["metrics"], "meta": lambda: kept["metrics"]}.get(
        held, lambda: kept
    )()
    assert metrics.fwd.mean_abs == value


def test_an_edited_graph_is_not_returned_again(tracked: nn.Module) -> None:
    step(tracked, torch.randn(4, 8))
    expected = metas(tracked.scales_graph())
    graph = tracked.scales_graph()
    output = next(n for n in graph.nodes if n.op == "output")
    graph.erase_node(output)
    next(iter(graph.nodes)).meta["note"] = "mine"
    del graph, output
    assert metas(tracked.scales_graph()) == expected

    graph = tracked.scales_graph()
    next(n for n in graph.nodes if n.op == "call_function").name = "renamed"
    del graph
    assert metas(tracked.scales_graph()) == expected

    graph = tracked.scales_graph()
    node = next(n for n in graph.nodes if n.meta.get("clean_name") == "h")
    user = next(iter(node.users))
    user.replace_input_with(node, next(iter(graph.nodes)))
    del graph, node, user
    assert metas(tracked.scales_graph()) == expected


def facts(tracked: nn.Module) -> dict[str, tuple[Any, ...]]:
    """What the graph says of each named node; no node is held after the read."""
    return {
        n.meta["clean_name"]: (
            n.meta.get("shape"),
            n.meta["requires_grad"],
            n.meta["metrics"] and n.meta["metrics"].fwd.numel,
            n.meta["metrics"] and n.meta["metrics"].bwd is not None,
        )
        for n in tracked.scales_graph().nodes
        if n.op != "output"
    }


def test_trainable_and_shapes_follow_each_call(tracked: nn.Module) -> None:
    ids = set()
    for rows_in in (2, 3, 4, 5, 6, 7):  # from the third size on, one graph with dynamic sizes
        step(tracked, torch.randn(rows_in, 8))
        ids.add(id(tracked.scales_graph()))
        got = facts(tracked)
        assert got["h"][0] == (rows_in, 16)
        assert got["h"][2] == rows_in * 16
        assert got["x"][0] == (rows_in, 8)
    assert len(ids) < 6  # some calls were refills
    tracked.up.weight.requires_grad_(False)
    step(tracked, torch.randn(7, 8))
    got = facts(tracked)
    assert got["up.weight"][1:] == (False, 16 * 8, False)
    assert got["down.weight"][1:] == (True, 16 * 8, True)


def test_variable_sizes_across_a_graph_break_do_not_recompile_per_size(
    tracked: nn.Module,
) -> None:
    for rows_in in (2, 3, 4, 5, 6, 7, 8, 9, 10, 11):  # more sizes than Dynamo's recompile limit
        step(tracked, torch.randn(rows_in, 8))
        got = facts(tracked)
        assert got["h"][0] == (rows_in, 16) and got["h"][2:] == (rows_in * 16, True)
    capture = tracked.capture
    assert capture is not None
    # Each of the two pieces: one static graph, then one with dynamic sizes for the rest.
    assert len(capture.pieces) <= 4
