"""write_report: one self-contained file whose embedded data match the tracked graph."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from torch.fx import Graph

from unitscale.analysis import AnalysisError, graph_to_dataframe, write_report


def embedded(path: Path) -> dict[str, Any]:
    page = path.read_text(encoding="utf-8")
    match = re.search(
        r'<script type="application/json" id="unitscale-data">(.*?)</script>', page, re.S
    )
    assert match is not None
    return json.loads(match[1])  # type: ignore[no-any-return]


def test_report_is_self_contained(tracked_gpt: tuple[Graph, dict], tmp_path: Path) -> None:
    graph, _ = tracked_gpt
    path = write_report(graph, tmp_path / "sub" / "report.html", title="GPT <scales>")
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>")
    assert "<title>GPT &lt;scales&gt;</title>" in page
    # Nothing is fetched: no external scripts, styles, fonts or images; CSP forbids fetches.
    assert not re.search(r"<(script|img|iframe)[^>]*\ssrc=", page)
    assert "<link" not in page and "@import" not in page and "url(" not in page
    assert set(re.findall(r"https?://[^\s\"']+", page)) == {"http://www.w3.org/2000/svg"}
    assert "default-src 'none'" in page
    assert page.count("<script") == 2  # the data and the program


def test_embedded_data_match_the_table(tracked_gpt: tuple[Graph, dict], tmp_path: Path) -> None:
    from unitscale.transforms import prune_same_scale_tensors

    graph, _ = tracked_gpt
    data = embedded(write_report(graph, tmp_path / "r.html"))
    (model,) = data["models"]
    df = graph_to_dataframe(prune_same_scale_tensors(graph))
    assert sorted(r["node"] for r in model["rows"]) == sorted(set(df.node))
    marks = [(r["node"], d) for r in model["rows"] for d in ("fwd", "bwd") if r[d]]
    assert sorted(marks) == sorted(zip(df.node, df.direction, strict=True))
    row = next(r for r in model["rows"] if r["label"] == "lm_head: logits")
    expected = df[(df.name == "logits") & (df.direction == "bwd")].iloc[0]
    assert row["op"] == "linear" and row["shape"] == "(2, 16, 256)" and row["dtype"] == "float32"
    for metric in ("mean_abs", "abs_max", "underflow_e4m3", "overflow_e5m2", "numel"):
        assert row["bwd"][metric] == expected[metric]
    assert row["bwd"]["tensor_type"] == "grad_x"
    assert set(data["formats"]) == {"e4m3", "e5m2", "fp16", "bf16"}
    assert data["formats"]["e4m3"]["max"] == 448.0
    # Data flow: the logits read the final norm's output.
    assert any(s.startswith(("x", "layer_norm")) for s in row["sources"])


def test_several_models_in_one_page(chain_graph: Callable[..., Graph], tmp_path: Path) -> None:
    a = chain_graph([(1.0, 1.0), (2.0, 0.5)])
    b = chain_graph([(1.0, 1.0)])
    data = embedded(write_report({"plain": a, "unit-scaled": b}, tmp_path / "r.html"))
    assert [m["name"] for m in data["models"]] == ["plain", "unit-scaled"]
    assert [len(m["rows"]) for m in data["models"]] == [2, 1]
    with pytest.raises(AnalysisError, match="no graph given"):
        write_report({}, tmp_path / "empty.html")


def test_non_finite_values_and_hostile_names(
    chain_graph: Callable[..., Graph], tmp_path: Path
) -> None:
    graph = chain_graph([(math.nan, math.inf), (1.0, None)], names=["</script><b>x", "<!--y"])
    path = write_report(graph, tmp_path / "r.html", prune_same_scale=False)
    page = path.read_text(encoding="utf-8")
    assert "</script><b>" not in page and "<!--y" not in page
    data = embedded(path)  # strict JSON: NaN and Inf travel as strings
    rows = data["models"][0]["rows"]
    assert rows[0]["name"] == "</script><b>x" and rows[1]["name"] == "<!--y"
    assert rows[0]["fwd"]["mean_abs"] == "NaN" and rows[0]["bwd"]["mean_abs"] == "Infinity"
    assert rows[1]["bwd"] is None


class _TextWithoutScripts(HTMLParser):
    """The text a browser with scripts disabled shows: no <script>, <style> or <title>;
    <noscript> is shown."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = 0
        self.parts: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style", "title"):
            self.hidden += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style", "title"):
            self.hidden -= 1

    def handle_data(self, data: str) -> None:
        if not self.hidden and data.strip():
            self.parts.append(" ".join(data.split()))


def test_conclusion_and_worst_tensors_read_without_scripts(
    tracked_gpt: tuple[Graph, dict], tmp_path: Path
) -> None:
    from unitscale.analysis import risk_conclusion, risk_summary
    from unitscale.tracking import prune_same_scale_tensors

    graph, _ = tracked_gpt
    path = write_report({"plain <gpt>": graph}, tmp_path / "report.html")
    parser = _TextWithoutScripts()
    parser.feed(path.read_text(encoding="utf-8"))
    text = "\n".join(parser.parts)
    summary = risk_summary(graph_to_dataframe(prune_same_scale_tensors(graph)))
    conclusion = risk_conclusion([("plain <gpt>", summary)])
    assert conclusion.startswith("conclusion: in E4M3, plain <gpt> ")
    assert conclusion in parser.parts  # a line of its own, escaped in the page
    counts = summary.formats["e4m3"], summary.formats["e5m2"]
    row = f"plain <gpt>\n{summary.tensors}\n" + "\n".join(
        f"{c.underflow}\n{c.overflow}" for c in counts
    )
    assert row in text
    worst = [str(w) for key in ("e4m3", "e5m2") for w in summary.worst[key]]
    assert worst  # a plain model at initialisation has gradients that underflow in FP8
    for line in worst:
        assert line in parser.parts
    assert "need JavaScript" in text  # the <noscript> note says what needs scripts


def test_mean_abs_and_abs_mean_are_labelled_apart(
    tracked_gpt: tuple[Graph, dict], tmp_path: Path
) -> None:
    from unitscale.analysis.dataframe import METRIC_DESCRIPTIONS

    graph, _ = tracked_gpt
    data = embedded(write_report(graph, tmp_path / "report.html"))
    about = data["metric_descriptions"]
    assert about == METRIC_DESCRIPTIONS
    assert about["mean_abs"].startswith("mean of |x|")
    assert about["abs_mean"].startswith("|mean of x|")
    doc = graph_to_dataframe.__doc__ or ""
    assert "``mean_abs``: mean of ``|x|``" in doc and "``abs_mean``: ``|mean of x|``" in doc
