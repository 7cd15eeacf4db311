"""The HTML report in real headless Chromium, offline, driven over the DevTools protocol.

The browser is driven through ``--remote-debugging-pipe`` (JSON messages on file descriptors
3 and 4), so no Python package and no network port are needed. The page is loaded from disk
with every network feature off and the network emulated offline; the test checks that no
request leaves ``file:``/``data:``, that nothing is logged as an error, that the chart has one
mark per tensor and direction, and that hovering a mark shows that tensor's details. A
screenshot goes to ``test-artifacts/``.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from unitscale.analysis import graph_to_dataframe, write_report
from unitscale.data import example_batch
from unitscale.models import GPTConfig, plain_gpt

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# A browser: run in full CI, skipped by -m 'not slow'.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)"
    ),
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"


class Browser:
    """Minimal DevTools-protocol client over Chromium's debugging pipe."""

    def __init__(self, executable: str, user_data_dir: str) -> None:
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        # Park the child's ends above 10 so that dup2 onto 3 and 4 cannot clobber them.
        high_r = os.dup2(to_child_r, 110)
        high_w = os.dup2(from_child_w, 111)
        os.close(to_child_r)
        os.close(from_child_w)

        def wire_pipes() -> None:
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.proc = subprocess.Popen(
            [
                executable,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                "--disable-default-apps",
                "--no-first-run",
                "--no-default-browser-check",
                "--mute-audio",
                "--window-size=1400,1000",
                f"--user-data-dir={user_data_dir}",
                "--remote-debugging-pipe",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(3, 4),
            preexec_fn=wire_pipes,
        )
        os.close(high_r)
        os.close(high_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no message from Chromium in time")
            ready, _, _ = select.select([self._from_child], [], [], remaining)
            if ready:
                chunk = os.read(self._from_child, 1 << 16)
                if not chunk:
                    raise RuntimeError("Chromium closed the debugging pipe")
                self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)  # type: ignore[no-any-return]

    def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        session: str | None = None,
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})  # type: ignore[no-any-return]
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        for event in self.events:
            if event.get("method") == method:
                return event
        while True:
            event = self._read_message(deadline)
            self.events.append(event)
            if event.get("method") == method:
                return event

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_child)
        os.close(self._from_child)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from unitscale.transforms import prune_same_scale_tensors, track_scales

    model = plain_gpt(GPTConfig(hidden_size=32, depth=1, seq_len=16), seed=0)
    batch = example_batch(2, 16, seed=0)
    tracked = track_scales(model)
    tracked(**batch).backward()
    graph = tracked.scales_graph()
    path = write_report(graph, tmp_path_factory.mktemp("report") / "report.html", title="t")
    expected = graph_to_dataframe(prune_same_scale_tensors(graph))
    return path, expected


@pytest.fixture(scope="module")
def page(report: tuple[Path, Any]) -> Iterator[tuple[Browser, str]]:
    assert CHROMIUM is not None
    with tempfile.TemporaryDirectory() as profile:
        browser = Browser(CHROMIUM, profile)
        try:
            targets = browser.send("Target.getTargets")["targetInfos"]
            target = next(t for t in targets if t["type"] == "page")
            session = browser.send(
                "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
            )["sessionId"]
            for domain in ("Runtime", "Log", "Page", "Network"):
                browser.send(f"{domain}.enable", session=session)
            browser.send(
                "Network.emulateNetworkConditions",
                {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
                session=session,
            )
            browser.send("Page.navigate", {"url": report[0].as_uri()}, session=session)
            browser.wait_for("Page.loadEventFired")
            yield browser, session
        finally:
            browser.close()


def evaluate(browser: Browser, session: str, expression: str) -> Any:
    result = browser.send(
        "Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session
    )
    if "exceptionDetails" in result:
        raise AssertionError(f"page script failed: {result['exceptionDetails']}")
    return result["result"].get("value")


def test_report_loads_offline_without_errors(page: tuple[Browser, str]) -> None:
    browser, session = page
    assert evaluate(browser, session, "document.body.getAttribute('data-ready')") == "1"
    errors = [
        e
        for e in browser.events
        if e.get("method") == "Runtime.exceptionThrown"
        or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] == "error")
        or (e.get("method") == "Log.entryAdded" and e["params"]["entry"]["level"] == "error")
    ]
    assert errors == []
    requests = [
        e["params"]["request"]["url"]
        for e in browser.events
        if e.get("method") == "Network.requestWillBeSent"
    ]
    assert requests, "the page load itself should be observed"
    assert all(url.startswith(("file:", "data:")) for url in requests), requests


def test_chart_has_one_mark_per_tensor_and_direction(
    page: tuple[Browser, str], report: tuple[Path, Any]
) -> None:
    browser, session = page
    expected = report[1]
    counts = evaluate(
        browser,
        session,
        "[document.querySelectorAll('#chart .mark.fwd').length,"
        " document.querySelectorAll('#chart .mark.bwd').length]",
    )
    assert counts == [
        int((expected.direction == "fwd").sum()),
        int((expected.direction == "bwd").sum()),
    ]
    # The toggle hides the backward marks.
    hidden = evaluate(
        browser,
        session,
        "(() => { const c = document.getElementById('show-bwd'); c.click();"
        " const n = document.querySelectorAll('#chart .mark.bwd').length; c.click();"
        " return n; })()",
    )
    assert hidden == 0


def test_hovering_a_mark_shows_its_details(
    page: tuple[Browser, str], report: tuple[Path, Any]
) -> None:
    browser, session = page
    expected = report[1]
    # A backward mark of a linear op inside a block: a tensor with a module path and a shape.
    row = expected[(expected.op == "linear") & (expected.direction == "bwd")].iloc[0]
    box = evaluate(
        browser,
        session,
        f"(() => {{ const m = document.querySelector('#chart .mark.bwd[data-node=\"{row.node}\"]');"
        " m.scrollIntoView({block: 'center'}); const r = m.getBoundingClientRect();"
        " return [r.x + r.width / 2, r.y + r.height / 2]; })()",
    )
    for kind in ("mouseMoved",):
        browser.send(
            "Input.dispatchMouseEvent",
            {"type": kind, "x": box[0], "y": box[1]},
            session=session,
        )
    tip = evaluate(
        browser,
        session,
        "(() => { const t = document.getElementById('tooltip');"
        " return [getComputedStyle(t).display, t.getAttribute('data-node'), t.textContent]; })()",
    )
    display, node, text = tip
    assert display == "block"
    assert node == row.node
    for needle in (
        row["name"],
        row["module"],
        "linear",
        row["shape"],
        "float32",
        "underflow",
        "E4M3",
    ):
        assert needle in text, (needle, text)
    assert "mean_abs" in text and "abs_max" in text
    ARTIFACTS.mkdir(exist_ok=True)
    shot = browser.send("Page.captureScreenshot", {"format": "png"}, session=session)
    (ARTIFACTS / "report_hover.png").write_bytes(base64.b64decode(shot["data"]))
    assert (ARTIFACTS / "report_hover.png").stat().st_size > 10_000
    _ = torch  # keep torch imported before chromium starts (fork of a loaded interpreter)


def test_filter_and_sortable_risk_table(
    page: tuple[Browser, str], report: tuple[Path, Any]
) -> None:
    browser, session = page
    expected = report[1]
    labels = [
        n if w or not m else f"{m}: {n}"
        for n, m, w in zip(expected.name, expected.module, expected.weight, strict=True)
    ]
    wanted = sum("lm_head" in label.lower() for label in labels)
    shown = evaluate(
        browser,
        session,
        "(() => { const f = document.getElementById('filter'); f.value = 'lm_head';"
        " f.dispatchEvent(new Event('input'));"
        " const n = document.querySelectorAll('#chart .mark').length;"
        " f.value = ''; f.dispatchEvent(new Event('input')); return n; })()",
    )
    assert shown == wanted > 0
    # The table lists the tensors most at risk first; a click on a header sorts by it.
    column = evaluate(
        browser,
        session,
        "(() => { const cells = () => [...document.querySelectorAll('#risk-table tr')]"
        ".slice(1).map(r => r.children[6].textContent);"
        " const before = cells();"
        " document.querySelector('#risk-table th[data-key=risk]').click();"
        " const after = cells();"
        " document.querySelector('#risk-table th[data-key=risk]').click();"
        " return [before, after]; })()",
    )
    before, after = column
    as_number = [float(v.rstrip("%").lstrip("<")) for v in before]
    assert as_number == sorted(as_number, reverse=True) and as_number[0] > 0
    assert [float(v.rstrip("%").lstrip("<")) for v in after] == sorted(
        float(v.rstrip("%").lstrip("<")) for v in after
    )


def test_at_800_px_the_page_does_not_scroll_sideways_and_keeps_every_guide(
    page: tuple[Browser, str],
) -> None:
    browser, session = page
    browser.send(
        "Emulation.setDeviceMetricsOverride",
        {"width": 800, "height": 900, "deviceScaleFactor": 1, "mobile": False},
        session=session,
    )
    try:
        evaluate(browser, session, "window.dispatchEvent(new Event('resize')); 0")
        widths = evaluate(
            browser,
            session,
            "[document.documentElement.scrollWidth, document.documentElement.clientWidth,"
            " document.getElementById('chart-wrap').scrollWidth,"
            " document.getElementById('chart-wrap').clientWidth]",
        )
        assert widths[0] <= widths[1] and widths[2] <= widths[3], widths
        # Every guide line (E4M3's largest value included) lies inside the chart's drawing.
        inside = evaluate(
            browser,
            session,
            "(function () { var svg = document.getElementById('chart');"
            " var w = svg.viewBox.baseVal.width;"
            " return Array.prototype.map.call(svg.querySelectorAll('.guides line'),"
            " function (l) { return [l.textContent, 0 <= +l.getAttribute('x1')"
            " && +l.getAttribute('x1') <= w]; }); })()",
        )
        assert inside and all(ok for _, ok in inside), inside
        assert any(label.startswith("E4M3") and "448" in label for label, _ in inside), inside
    finally:
        browser.send("Emulation.clearDeviceMetricsOverride", {}, session=session)
