"""plot: one row per kept tensor, guides, bars and arrows, no warnings, legible at scale."""

from __future__ import annotations

import math
import warnings
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest
from torch.fx import Graph

from unitscale.analysis import AnalysisError, graph_to_dataframe, plot


def plotted(graph: Graph, **kwargs: object) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning at all fails the test
        return plot(graph, **kwargs)  # type: ignore[arg-type]


def kept_labels(graph: Graph, prune: bool) -> set[str]:
    from unitscale.transforms import prune_same_scale_tensors

    df = graph_to_dataframe(prune_same_scale_tensors(graph) if prune else graph)
    shown = df.groupby("node", sort=False).filter(lambda g: (g.mean_abs > 0).any())
    return {
        name if weight or not module else f"{module}: {name}"
        for name, module, weight in zip(shown.name, shown.module, shown.weight, strict=True)
    }


@pytest.mark.parametrize("prune", [True, False])
def test_one_row_per_kept_tensor_without_warnings(
    tracked_gpt: tuple[Graph, dict], prune: bool, tmp_path: Path
) -> None:
    graph, _ = tracked_gpt
    ax = plotted(graph, title="gpt", prune_same_scale=prune)
    expected = kept_labels(graph, prune)
    labels = [t.get_text() for t in ax.get_yticklabels()]  # type: ignore[attr-defined]
    assert len(labels) == len(expected) and set(labels) == expected
    assert ax.get_ylim() == (len(expected) - 0.5, -0.5)  # type: ignore[attr-defined]
    # Parameters are labelled by qualified name and sit just above the op that reads them.
    assert labels.index("blocks.0.attn.qkv.weight") + 2 == labels.index("blocks.0.attn.qkv: qkv")
    assert {"lm_head.weight", "blocks.0.mlp.up.weight"} <= set(labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ax.figure.savefig(tmp_path / "scales.png")  # type: ignore[attr-defined]
        ax.figure.savefig(tmp_path / "scales.svg")  # type: ignore[attr-defined]
    assert (tmp_path / "scales.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert ET.parse(tmp_path / "scales.svg").getroot().tag.endswith("svg")


def test_pruning_hides_same_scale_views(tracked_gpt: tuple[Graph, dict]) -> None:
    graph, _ = tracked_gpt
    pruned = {t.get_text() for t in plotted(graph).get_yticklabels()}  # type: ignore[attr-defined]
    full = {
        t.get_text()
        for t in plotted(graph, prune_same_scale=False).get_yticklabels()  # type: ignore[attr-defined]
    }
    assert pruned < full
    assert any(": view" in label for label in full - pruned)


def test_guides_bars_and_arrows(chain_graph: Callable[..., Graph]) -> None:
    from matplotlib.collections import LineCollection
    from matplotlib.patches import FancyArrowPatch

    graph = chain_graph([(1.0, 0.5), (2.0**-10, 2.0**-20), (4.0, 1.0)])
    ax = plotted(graph, prune_same_scale=False)
    guides = {round(line.get_xdata()[0], 6) for line in ax.lines}  # type: ignore[attr-defined]
    for value in (2.0**-9, 2.0**-6, 448.0, 2.0**-16, 57344.0, 2.0**-24, 65504.0):
        assert round(math.log2(value), 6) in guides
    bars = [c for c in ax.collections if isinstance(c, LineCollection)]  # type: ignore[attr-defined]
    assert sum(len(c.get_segments()) for c in bars) == 6  # 3 tensors x 2 directions
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]  # type: ignore[attr-defined]
    assert len(arrows) == 4  # 2 edges x 2 directions
    # Marks sit at log2 of the metric.
    xs = sorted(
        x
        for c in ax.collections
        if not isinstance(c, LineCollection)  # type: ignore[attr-defined]
        for x, _ in c.get_offsets()
    )
    assert xs == sorted([0.0, -1.0, -10.0, -20.0, 2.0, 0.0])
    bare = plotted(graph, prune_same_scale=False, show_arrows=False, show_error_bars=False)
    assert not [c for c in bare.collections if isinstance(c, LineCollection)]  # type: ignore[attr-defined]
    assert not [p for p in bare.patches if isinstance(p, FancyArrowPatch)]  # type: ignore[attr-defined]
    limited = plotted(graph, prune_same_scale=False, xmin=-30, xmax=20)
    assert limited.get_xlim() == (-30, 20)  # type: ignore[attr-defined]


def test_each_format_guide_line_is_labelled_beside_it(chain_graph: Callable[..., Graph]) -> None:
    # The format ranges were told apart only by line style in a small legend.
    graph = chain_graph([(1.0, 0.5), (2.0**-10, 2.0**-20), (4.0, 1.0)])
    ax = plotted(graph, prune_same_scale=False)
    labels = {
        t.get_text(): (t.get_position()[0], t.get_color())  # type: ignore[attr-defined]
        for t in ax.texts  # type: ignore[attr-defined]
        if t.get_gid() == "format-guide"
    }
    assert labels["E4M3 max"][0] == pytest.approx(math.log2(448.0))
    assert labels["E5M2 smallest subnormal"][0] == pytest.approx(-16.0)
    assert labels["FP16 smallest normal"][0] == pytest.approx(-14.0)
    assert len(labels) == 9 and labels["E4M3 max"][1] != labels["E5M2 max"][1]
    # A guide outside the axis range gets no label.
    narrow = plotted(graph, prune_same_scale=False, xmin=-12, xmax=12)
    shown = {t.get_text() for t in narrow.texts if t.get_gid() == "format-guide"}  # type: ignore[attr-defined]
    assert "E4M3 max" in shown and "E5M2 max" not in shown


def test_zero_tensors_hidden_unless_asked(chain_graph: Callable[..., Graph]) -> None:
    graph = chain_graph([(1.0, 1.0), (0.0, 0.0), (2.0, None)])
    labels = [t.get_text() for t in plotted(graph, prune_same_scale=False).get_yticklabels()]  # type: ignore[attr-defined]
    assert labels == ["layer0: t0", "layer0: t2"]
    ax = plotted(graph, prune_same_scale=False, show_zero_tensors=True)
    assert [t.get_text() for t in ax.get_yticklabels()] == [  # type: ignore[attr-defined]
        "layer0: t0",
        "layer0: t1",
        "layer0: t2",
    ]


@pytest.mark.slow
def test_hundreds_of_tensors_stay_legible(chain_graph: Callable[..., Graph]) -> None:
    n = 1200  # beyond what fits at full label size in the tallest figure
    graph = chain_graph([(2.0 ** -(i % 20), 2.0 ** -(i % 7)) for i in range(n)])
    ax = plotted(graph, prune_same_scale=False, show_arrows=False)
    width, height = ax.figure.get_size_inches()  # type: ignore[attr-defined]
    assert height <= 100 and width <= 12
    ticks = ax.get_yticks()  # type: ignore[attr-defined]
    assert ax.get_ylim() == (n - 0.5, -0.5)  # type: ignore[attr-defined]
    assert n // 3 <= len(ticks) < n  # thinned, evenly
    spacing_pt = (height * 72) * ax.get_position().height / n * (ticks[1] - ticks[0])  # type: ignore[attr-defined]
    font = ax.get_yticklabels()[0].get_fontsize()  # type: ignore[attr-defined]
    assert spacing_pt >= font  # labels do not overlap
    for rows in (30, 500):  # below the cap: every row labelled, figure grows with the rows
        ax = plotted(chain_graph([(1.0, 1.0)] * rows), prune_same_scale=False, show_arrows=False)
        assert len(ax.get_yticks()) == rows  # type: ignore[attr-defined]
        assert ax.figure.get_size_inches()[1] >= 0.15 * rows  # type: ignore[attr-defined]


def test_bad_arguments(chain_graph: Callable[..., Graph]) -> None:
    graph = chain_graph([(1.0, 1.0)])
    with pytest.raises(AnalysisError, match="metric='median' is not a scale metric"):
        plot(graph, metric="median")
    with pytest.raises(AnalysisError, match="xmin=3 must be smaller than xmax=1"):
        plot(graph, xmin=3, xmax=1)
    with pytest.raises(AnalysisError, match="no scale metrics"):
        plot(_untracked())


def _untracked() -> Graph:
    g = Graph()
    g.output(g.placeholder("x"))
    return g


def test_legend_explains_every_mark_and_the_title_counts_as_the_summary(
    tracked_gpt: tuple[Graph, dict],
) -> None:
    from unitscale.analysis import risk_summary
    from unitscale.transforms import prune_same_scale_tensors

    graph, _ = tracked_gpt
    ax = plotted(graph, title="gpt", show_zero_tensors=True)
    legend = ax.get_legend()
    texts = {t.get_text(): t for t in legend.get_texts()}
    for label in (
        "forward (value)",
        "backward (grad)",
        "weight (matrix)",
        "bias or norm scale (vector)",
        "data flow (forward)",
        "gradient flow (backward)",
        "whisker: abs min..max",
        "smallest subnormal",
        "smallest normal",
        "largest",
        "green label: parameter",
    ):
        assert label in texts, sorted(texts)
    styles = {h.get_label(): h.get_linestyle() for h in legend.legend_handles}
    assert (styles["smallest subnormal"], styles["smallest normal"], styles["largest"]) == (
        "--",
        ":",
        "-",
    )
    assert texts["green label: parameter"].get_color() == "darkgreen"
    # The title counts values and gradients, the number the command's summary prints.
    counted = risk_summary(graph_to_dataframe(prune_same_scale_tensors(graph))).tensors
    title = ax.figure._suptitle.get_text()
    assert f"({counted} values and gradients of " in title


def test_zero_markers_are_explained_only_when_drawn() -> None:
    from unitscale.tracking.metrics import Metrics

    def graph(zero: bool) -> Graph:
        g = Graph()
        for name, value in (("x", 1.0), ("y", 0.0 if zero else 2.0)):
            node = g.placeholder(name)
            node.meta.update(clean_name=name, metrics=Metrics(
                fwd=Metrics.Data(value, 0.0, value, value, value, value, 16)))  # fmt: skip
        return g

    def labels(zero: bool) -> list[str]:
        ax = plotted(graph(zero), prune_same_scale=False, show_zero_tensors=True)
        return [t.get_text() for t in ax.get_legend().get_texts()]

    assert "mean_abs = 0 (left edge)" in labels(True)
    assert "mean_abs = 0 (left edge)" not in labels(False)


def test_weights_biases_and_norms_have_their_own_markers(
    tracked_gpt: tuple[Graph, dict],
) -> None:
    """Diamonds mark weights (matrices) only; biases and norm scales (vectors) are squares,
    each explained in the legend."""
    graph, params = tracked_gpt
    ax = plotted(graph)
    drawn = {c.get_gid(): len(c.get_offsets()) for c in ax.collections if c.get_gid()}  # type: ignore[attr-defined]
    df = graph_to_dataframe(graph)
    parameters = df[df.weight & (df.direction == "fwd")]
    matrices = sum(
        shape.count(",") >= 1 and not shape.endswith(",)") for shape in parameters["shape"]
    )
    vectors = len(parameters) - matrices
    assert matrices > 0 and vectors > 0  # the GPT has both: linear weights, biases, norms
    assert drawn["weight-fwd"] == drawn["weight-bwd"] == matrices
    # Every bias and norm scale has a gradient (at initialisation their values are 0 or 1).
    assert drawn["vector-parameter-bwd"] == vectors
    assert len(parameters) == len(params)


def test_the_legend_shows_the_arrows_only_when_drawn(chain_graph: Callable[..., Graph]) -> None:
    graph = chain_graph([(1.0, 0.5), (2.0, 1.0), (4.0, 2.0)])

    def labels(**kwargs: object) -> list[str]:
        ax = plotted(graph, prune_same_scale=False, **kwargs)
        return [t.get_text() for t in ax.get_legend().get_texts()]  # type: ignore[attr-defined]

    assert {"data flow (forward)", "gradient flow (backward)"} <= set(labels())
    assert not {"data flow (forward)", "gradient flow (backward)"} & set(labels(show_arrows=False))
    assert "weight (matrix)" not in labels()  # no parameter in this graph
