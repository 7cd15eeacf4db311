# ruff: noqa: E501  (embedded JavaScript and HTML keep their natural line lengths)
"""The HTML report's page: CSS and hand-written vanilla JavaScript, inlined by report.py.

Nothing here is fetched at view time: no CDN, no fonts, no images. The script reads the JSON
embedded in ``<script id="unitscale-data">`` and draws an inline SVG chart, a tooltip and a
sortable table. Element ids and classes used by the browser test: ``svg#chart``,
``.mark[data-row][data-dir]``, ``#tooltip``, ``#risk-table``, ``#filter``, ``#show-fwd``,
``#show-bwd``, ``#format``, ``#model``, ``#metric``.
"""

from __future__ import annotations

__all__ = ["CSS", "JS", "PAGE"]

CSS = """
* { box-sizing: border-box; }
body { font: 13px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0;
       color: #1d1d1f; background: #fafafa; }
header { padding: 12px 20px; background: #fff; border-bottom: 1px solid #ddd;
         position: sticky; top: 0; z-index: 2; }
h1 { font-size: 18px; margin: 0 0 6px 0; }
h2 { font-size: 15px; margin: 18px 0 6px 0; }
.controls { display: flex; flex-wrap: wrap; gap: 14px; align-items: center; }
.controls label { white-space: nowrap; }
.controls input[type=text] { width: 220px; padding: 3px 6px; }
main { padding: 10px 20px 40px 20px; }
#summary { margin: 6px 0 10px 0; color: #333; }
#chart-wrap { background: #fff; border: 1px solid #ddd; overflow-x: auto; }
#chart { display: block; width: 100%; height: auto; }  /* fits the window: no sideways scroll */
svg text { font: 11px system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
.label { fill: #222; }
.label.weight { fill: #1a7f37; }
.axis text { fill: #555; }
.grid { stroke: #eee; }
.bar { stroke-width: 1; opacity: 0.45; }
.flow { stroke-width: 0.7; opacity: 0.35; fill: none; }
.mark { cursor: pointer; stroke-width: 0; }
.mark.weight { stroke: #000; stroke-width: 0.8; }
.mark.zero { fill: #fff !important; stroke-width: 1.2; }
.mark:hover, .mark.active { stroke: #000; stroke-width: 2; }
.fwd { fill: #1f77b4; stroke: #1f77b4; }
.bwd { fill: #ff7f0e; stroke: #ff7f0e; }
.mark.zero.fwd { stroke: #1f77b4; }
.mark.zero.bwd { stroke: #ff7f0e; }
#tooltip { position: fixed; display: none; pointer-events: none; z-index: 5; background: #fff;
           border: 1px solid #888; border-radius: 4px; padding: 8px 10px; max-width: 460px;
           box-shadow: 0 2px 8px rgba(0,0,0,.2); font-size: 12px; }
#tooltip .title { font-weight: 600; margin-bottom: 4px; word-break: break-all; }
#tooltip table { border-collapse: collapse; }
#tooltip td { padding: 0 8px 0 0; }
#tooltip td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.risk { border-collapse: collapse; background: #fff; display: block; max-width: 100%;
             overflow-x: auto; }  /* a narrow window scrolls the table, not the page */
table.risk td:first-child { overflow-wrap: anywhere; }
table.risk th, table.risk td { border: 1px solid #ddd; padding: 3px 8px; }
table.risk th { background: #f0f0f0; cursor: pointer; user-select: none; }
table.risk td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.risk tr.hot td { background: #fff1f0; }
.legend span { margin-right: 14px; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 5px;
          vertical-align: middle; margin-right: 4px; }
.swatch.fwd { background: #1f77b4; }
.swatch.bwd { background: #ff7f0e; }
.note { color: #666; }
"""

JS = r"""
(function () {
  "use strict";
  var DATA = JSON.parse(document.getElementById("unitscale-data").textContent);
  var SVGNS = "http://www.w3.org/2000/svg";
  var ROW = 18, TOP = 34, RIGHT = 30, BOTTOM = 24, PLOT_W = 760;
  var state = { model: 0, metric: "mean_abs", fwd: true, bwd: true, filter: "",
                format: "e4m3", sortKey: "risk", sortDesc: true };
  var byId = function (id) { return document.getElementById(id); };

  function num(v) {  // JSON carries non-finite values as strings
    if (v === null || v === undefined) { return NaN; }
    return typeof v === "number" ? v : Number(v);
  }
  function fmt(v) {
    v = num(v);
    if (!isFinite(v)) { return String(v); }
    if (v === 0) { return "0"; }
    var a = Math.abs(v);
    if (a >= 1e4 || a < 1e-3) { return v.toExponential(3); }
    return String(Number(v.toPrecision(4)));
  }
  function pct(v) {
    v = num(v);
    if (!isFinite(v)) { return String(v); }
    if (v === 0) { return "0%"; }
    if (v < 1e-4) { return "<0.01%"; }
    return (100 * v).toFixed(2) + "%";
  }
  function el(tag, attrs, text) {
    var e = document.createElementNS(SVGNS, tag);
    for (var k in attrs) { if (Object.prototype.hasOwnProperty.call(attrs, k)) { e.setAttribute(k, attrs[k]); } }
    if (text !== undefined) { e.textContent = text; }
    return e;
  }
  function html(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined) { e.textContent = text; }
    if (cls) { e.className = cls; }
    return e;
  }
  function model() { return DATA.models[state.model]; }
  function visibleRows() {
    var f = state.filter.toLowerCase();
    return model().rows.filter(function (r) {
      return !f || r.label.toLowerCase().indexOf(f) >= 0 || r.op.toLowerCase().indexOf(f) >= 0;
    });
  }
  function log2(v) { v = num(v); return (isFinite(v) && v > 0) ? Math.log(v) / Math.LN2 : null; }

  function xRange(rows) {
    var vals = [];
    Object.keys(DATA.formats).forEach(function (k) {
      var f = DATA.formats[k];
      if (f.guide) { vals.push(log2(f.min_subnormal), log2(f.max)); }
    });
    rows.forEach(function (r) {
      ["fwd", "bwd"].forEach(function (d) {
        if (r[d]) {
          var a = log2(r[d][state.metric]), b = log2(r[d].abs_max);
          if (a !== null) { vals.push(a); }
          if (b !== null) { vals.push(b); }
        }
      });
    });
    // Every guide line stays inside the axis (E4M3's largest value included).
    Object.keys(DATA.formats).forEach(function (k) {
      var f = DATA.formats[k];
      if (f.guide) { vals.push(log2(f.min_subnormal), log2(f.max)); }
    });
    return [Math.floor(Math.min.apply(null, vals)) - 1, Math.ceil(Math.max.apply(null, vals)) + 1];
  }

  function drawChart() {
    var svg = byId("chart");
    while (svg.firstChild) { svg.removeChild(svg.firstChild); }
    var rows = visibleRows();
    var longest = rows.reduce(function (m, r) { return Math.max(m, r.label.length); }, 8);
    var LEFT = Math.min(480, 12 + 6.3 * longest);
    var width = LEFT + PLOT_W + RIGHT, height = TOP + ROW * Math.max(rows.length, 1) + BOTTOM;
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    svg.setAttribute("viewBox", "0 0 " + width + " " + height);
    var range = xRange(rows), lo = range[0], hi = range[1];
    var x = function (lv) { return LEFT + (lv - lo) / (hi - lo) * PLOT_W; };
    var y = function (i, d) { return TOP + ROW * i + ROW / 2 + (d === "fwd" ? -3 : 3); };
    var axis = el("g", { "class": "axis" });
    var step = (hi - lo) > 40 ? 5 : ((hi - lo) > 20 ? 2 : 1);
    for (var t = Math.ceil(lo / step) * step; t <= hi; t += step) {
      axis.appendChild(el("line", { "class": "grid", x1: x(t), x2: x(t), y1: TOP - 4, y2: height - BOTTOM }));
      var tick = el("text", { x: x(t), y: TOP - 10, "text-anchor": "middle" }, "2");
      tick.appendChild(el("tspan", { "baseline-shift": "super", "font-size": "8" }, String(t)));
      axis.appendChild(tick);
    }
    axis.appendChild(el("text", { x: LEFT + PLOT_W / 2, y: height - 6, "text-anchor": "middle" },
                        state.metric + " (log2 scale)"));
    svg.appendChild(axis);
    var guides = el("g", { "class": "guides" });
    Object.keys(DATA.formats).forEach(function (k) {
      var f = DATA.formats[k];
      if (!f.guide) { return; }
      [[f.min_subnormal, "4 3"], [f.min_normal, "1 3"], [f.max, ""]].forEach(function (g) {
        var lv = log2(g[0]);
        var line = el("line", { x1: x(lv), x2: x(lv), y1: TOP - 4, y2: height - BOTTOM,
                                stroke: f.colour, "stroke-width": 1, opacity: 0.6 });
        if (g[1]) { line.setAttribute("stroke-dasharray", g[1]); }
        line.appendChild(el("title", {}, f.label + " " + fmt(g[0])));
        guides.appendChild(line);
      });
    });
    svg.appendChild(guides);
    var index = {};
    rows.forEach(function (r, i) { index[r.node] = i; });
    var pos = function (r, d) {
      var lv = r[d] ? log2(r[d][state.metric]) : null;
      return lv === null ? null : x(lv);
    };
    var bars = el("g", {}), flows = el("g", {}), marks = el("g", {}), labels = el("g", {});
    rows.forEach(function (r, i) {
      labels.appendChild(el("text", { "class": "label" + (r.weight ? " weight" : ""),
                                      x: LEFT - 8, y: TOP + ROW * i + ROW / 2 + 4,
                                      "text-anchor": "end" }, r.label));
      ["fwd", "bwd"].forEach(function (d) {
        if (!r[d] || !state[d]) { return; }
        var top = log2(r[d].abs_max), bottom = log2(r[d].abs_min);
        if (top !== null) {
          bars.appendChild(el("line", { "class": "bar " + d, x1: x(bottom === null ? lo : Math.max(bottom, lo)),
                                        x2: x(Math.min(top, hi)), y1: y(i, d), y2: y(i, d) }));
        }
        var px = pos(r, d), zero = px === null;
        var mark = el("circle", { "class": "mark " + d + (r.weight ? " weight" : "") + (zero ? " zero" : ""),
                                  cx: zero ? LEFT + 4 : px, cy: y(i, d), r: r.weight ? 4.5 : 3.5,
                                  "data-row": i, "data-dir": d, "data-node": r.node });
        mark.addEventListener("mouseenter", function (ev) { showTip(ev, r, d, mark); });
        mark.addEventListener("mousemove", moveTip);
        mark.addEventListener("mouseleave", hideTip);
        marks.appendChild(mark);
        if (byId("show-flow").checked && !r.weight) {
          r.sources.forEach(function (s) {
            var j = index[s];
            if (j === undefined || rows[j].weight) { return; }
            var a = pos(rows[j], d), b = pos(r, d);
            if (a === null || b === null) { return; }
            var from = d === "fwd" ? [a, y(j, d)] : [b, y(i, d)];
            var to = d === "fwd" ? [b, y(i, d)] : [a, y(j, d)];
            flows.appendChild(el("line", { "class": "flow " + d, x1: from[0], y1: from[1], x2: to[0], y2: to[1] }));
          });
        }
      });
    });
    svg.appendChild(bars);
    svg.appendChild(flows);
    svg.appendChild(labels);
    svg.appendChild(marks);
    byId("row-count").textContent = rows.length + " of " + model().rows.length + " tensors shown";
  }

  var tip = null;
  function showTip(ev, r, d, mark) {
    var m = r[d];
    while (tip.firstChild) { tip.removeChild(tip.firstChild); }
    tip.appendChild(html("div", r.label + (d === "fwd" ? "  (forward value)" : "  (gradient)"), "title"));
    var t = document.createElement("table");
    var add = function (k, v, isNum) {
      var tr = document.createElement("tr");
      tr.appendChild(html("td", k));
      tr.appendChild(html("td", v, isNum ? "num" : ""));
      t.appendChild(tr);
    };
    add("name", r.name);
    add("module", r.module || "(top level)");
    add("op", r.op);
    add("shape", r.shape || "unknown");
    add("dtype", r.dtype || "unknown");
    add("tensor type", m.tensor_type);
    DATA.metrics.forEach(function (k) {
      if (k.indexOf("underflow_") === 0 || k.indexOf("overflow_") === 0) { return; }
      add(DATA.metric_descriptions[k] ? k + " (" + DATA.metric_descriptions[k] + ")" : k,
          fmt(m[k]), true);
    });
    tip.appendChild(t);
    var f = document.createElement("table");
    var head = document.createElement("tr");
    ["format", "underflow", "overflow"].forEach(function (h) { head.appendChild(html("td", h)); });
    f.appendChild(head);
    Object.keys(DATA.formats).forEach(function (k) {
      var tr = document.createElement("tr");
      tr.appendChild(html("td", DATA.formats[k].label));
      tr.appendChild(html("td", pct(m["underflow_" + k]), "num"));
      tr.appendChild(html("td", pct(m["overflow_" + k]), "num"));
      f.appendChild(tr);
    });
    tip.appendChild(html("div", "per-format (fraction of values):", "note"));
    tip.appendChild(f);
    tip.style.display = "block";
    tip.setAttribute("data-node", r.node);
    tip.setAttribute("data-dir", d);
    mark.classList.add("active");
    moveTip(ev);
  }
  function moveTip(ev) {
    var w = tip.offsetWidth, h = tip.offsetHeight;
    var left = ev.clientX + 14, top = ev.clientY + 14;
    if (left + w > window.innerWidth - 4) { left = Math.max(4, ev.clientX - w - 14); }
    if (top + h > window.innerHeight - 4) { top = Math.max(4, window.innerHeight - h - 4); }
    tip.style.left = left + "px";
    tip.style.top = top + "px";
  }
  function hideTip(ev) {
    tip.style.display = "none";
    if (ev && ev.target) { ev.target.classList.remove("active"); }
  }

  function riskRows() {
    var k = state.format, out = [];
    visibleRows().forEach(function (r) {
      ["fwd", "bwd"].forEach(function (d) {
        if (!r[d] || !state[d]) { return; }
        var u = num(r[d]["underflow_" + k]), o = num(r[d]["overflow_" + k]);
        out.push({ label: r.label, direction: d, op: r.op, shape: r.shape,
                   underflow: u, overflow: o, risk: u + o, metric: num(r[d][state.metric]) });
      });
    });
    var key = state.sortKey, sign = state.sortDesc ? -1 : 1;
    out.sort(function (a, b) {
      var x = a[key], y = b[key];
      if (typeof x === "string") { return sign * x.localeCompare(y); }
      x = isNaN(x) ? -Infinity : x; y = isNaN(y) ? -Infinity : y;
      return x === y ? 0 : (x < y ? -sign : sign);
    });
    return out;
  }

  var COLUMNS = [["label", "tensor"], ["direction", "direction"], ["op", "op"], ["shape", "shape"],
                 ["underflow", "underflow"], ["overflow", "overflow"], ["risk", "at risk"],
                 ["metric", "metric"]];
  function drawTable() {
    var table = byId("risk-table");
    while (table.firstChild) { table.removeChild(table.firstChild); }
    var head = document.createElement("tr");
    COLUMNS.forEach(function (c) {
      var name = c[0] === "metric" ? state.metric : c[1];
      var th = html("th", name + (state.sortKey === c[0] ? (state.sortDesc ? " \u25BC" : " \u25B2") : ""));
      th.setAttribute("data-key", c[0]);
      th.addEventListener("click", function () {
        if (state.sortKey === c[0]) { state.sortDesc = !state.sortDesc; }
        else { state.sortKey = c[0]; state.sortDesc = true; }
        drawTable();
      });
      head.appendChild(th);
    });
    table.appendChild(head);
    var rows = riskRows(), limit = byId("show-all").checked ? rows.length : Math.min(rows.length, 50);
    for (var i = 0; i < limit; i++) {
      var r = rows[i], tr = document.createElement("tr");
      if (r.risk > DATA.risk_fraction) { tr.className = "hot"; }
      tr.appendChild(html("td", r.label));
      tr.appendChild(html("td", r.direction));
      tr.appendChild(html("td", r.op));
      tr.appendChild(html("td", r.shape));
      tr.appendChild(html("td", pct(r.underflow), "num"));
      tr.appendChild(html("td", pct(r.overflow), "num"));
      tr.appendChild(html("td", pct(r.risk), "num"));
      tr.appendChild(html("td", fmt(r.metric), "num"));
      table.appendChild(tr);
    }
    byId("table-count").textContent = "showing " + limit + " of " + rows.length;
  }

  function drawSummary() {
    var s = byId("summary");
    while (s.firstChild) { s.removeChild(s.firstChild); }
    var m = model(), parts = [], total = 0;
    m.rows.forEach(function (r) { total += (r.fwd ? 1 : 0) + (r.bwd ? 1 : 0); });
    ["e4m3", "e5m2"].forEach(function (k) {
      var under = 0, over = 0;
      m.rows.forEach(function (r) {
        ["fwd", "bwd"].forEach(function (d) {
          if (!r[d]) { return; }
          if (num(r[d]["underflow_" + k]) > DATA.risk_fraction) { under++; }
          if (num(r[d]["overflow_" + k]) > 0) { over++; }
        });
      });
      parts.push(DATA.formats[k].label + ": " + under + " underflow (more than " +
                 (100 * DATA.risk_fraction) + "% of values), " + over + " overflow");
    });
    s.textContent = m.name + ": " + m.rows.length + " tensors, " + total +
      " values and gradients. " + parts.join("; ") + ".";
  }

  function redraw() { drawSummary(); drawChart(); drawTable(); }

  function init() {
    tip = byId("tooltip");
    var sel = byId("model");
    DATA.models.forEach(function (m, i) {
      var o = document.createElement("option");
      o.value = String(i); o.textContent = m.name; sel.appendChild(o);
    });
    if (DATA.models.length < 2) { byId("model-control").style.display = "none"; }
    var ms = byId("metric");
    DATA.scale_metrics.forEach(function (k) {
      var o = document.createElement("option");
      var about = DATA.metric_descriptions[k];
      o.value = k; o.textContent = about ? k + ": " + about : k; ms.appendChild(o);
    });
    ms.value = state.metric;
    var fs = byId("format");
    Object.keys(DATA.formats).forEach(function (k) {
      var o = document.createElement("option");
      o.value = k; o.textContent = DATA.formats[k].label; fs.appendChild(o);
    });
    fs.value = state.format;
    sel.addEventListener("change", function () { state.model = Number(sel.value); redraw(); });
    ms.addEventListener("change", function () { state.metric = ms.value; redraw(); });
    fs.addEventListener("change", function () { state.format = fs.value; drawTable(); });
    byId("show-fwd").addEventListener("change", function (e) { state.fwd = e.target.checked; drawChart(); drawTable(); });
    byId("show-bwd").addEventListener("change", function (e) { state.bwd = e.target.checked; drawChart(); drawTable(); });
    byId("show-flow").addEventListener("change", drawChart);
    byId("show-all").addEventListener("change", drawTable);
    byId("filter").addEventListener("input", function (e) { state.filter = e.target.value; drawChart(); drawTable(); });
    redraw();
    document.body.setAttribute("data-ready", "1");
  }
  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", init); }
  else { init(); }
})();
"""

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:">
<title>{title}</title>
<style>{css}</style>
</head>
<body>
<header>
<h1>{title}</h1>
<div class="controls">
<label id="model-control">model <select id="model"></select></label>
<label>metric <select id="metric"></select></label>
<label><input type="checkbox" id="show-fwd" checked> forward</label>
<label><input type="checkbox" id="show-bwd" checked> backward</label>
<label><input type="checkbox" id="show-flow" checked> data flow</label>
<label>filter <input type="text" id="filter" placeholder="name, module or op"></label>
<span id="row-count" class="note"></span>
</div>
</header>
<main>
{verdict}
<div id="summary"></div>
<div class="legend note"><span><i class="swatch fwd"></i>forward value</span><span><i class="swatch bwd"></i>gradient</span><span>outlined: weight</span><span>hollow at the left edge: zero</span><span>bars: abs_min..abs_max</span><span>guides: smallest subnormal (dashed), smallest normal (dotted), largest value (solid){guide_legend}</span></div>
<div id="chart-wrap"><svg id="chart" xmlns="http://www.w3.org/2000/svg" role="img" aria-label="tensor scales"></svg></div>
<h2>Tensors most at risk in <select id="format"></select></h2>
<p class="note">Underflow: fraction of non-zero values that would round to zero; overflow: fraction beyond the format's largest value. <label><input type="checkbox" id="show-all"> show all</label> <span id="table-count"></span></p>
<table id="risk-table" class="risk"></table>
<p class="note">{footer}</p>
</main>
<div id="tooltip"></div>
<script type="application/json" id="unitscale-data">{data}</script>
<script>{js}</script>
</body>
</html>
"""
