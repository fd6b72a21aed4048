// attnprobe attention view: offline, no libraries. Reads the JSON block named by data-source
// (example prompts with full attention) and draws two views:
//  - heads of a layer: lines from each query token (right) to the keys it attends to (left),
//    opacity = weight, one colour per head, heads toggled by their swatches; hover a token to
//    isolate its lines and read the weights; a prompt and a comparison prompt of the same length
//    (the she and he variants of one item) side by side, with their difference A - B;
//  - layers x heads: one thumbnail (the T x T weight matrix) per head; a click opens that head.
// Text is inserted with textContent only: prompt text is user data.
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";
  var HEAD_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                      "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd"];
  var SPAN_COLOURS = ["#fde0dd", "#e0ecf4", "#e5f5e0", "#fff7bc", "#efedf5"];
  var STYLE = ".view-controls select, .view-controls button { margin: 0 0.4em 0.4em 0; max-width: 100%; font-size: 12px; }" +
    ".view-panels { display: flex; flex-wrap: wrap; gap: 8px; } .view-panel { flex: 1 1 300px; max-width: 640px; }" +
    ".view-panel h5 { margin: 2px 0; font: 12px sans-serif; color: #444; } .view-svg { width: 100%; border: 1px solid #eee; display: block; }" +
    ".tok { font: 13px monospace; fill: #222; cursor: default; } .tok.source { fill: #b2182b; font-weight: bold; }" +
    ".weight { font: 10px monospace; } .swatch { border: 2px solid transparent; color: #fff; cursor: pointer; }" +
    ".swatch[aria-pressed=false] { opacity: 0.25; } .thumb { cursor: pointer; } .view-legend { font: 12px sans-serif; color: #444; }" +
    ".view-legend span { padding: 0 4px; margin-right: 6px; }";

  function el(name, attrs, parent, svg) {
    var node = svg ? document.createElementNS(SVG, name) : document.createElement(name);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (parent) parent.appendChild(node);
    return node;
  }

  function option(select, value, text) {
    el("option", { value: String(value) }, select).textContent = text;
  }

  function addStyle() {
    if (document.getElementById("attnprobe-view-style")) return;
    el("style", { id: "attnprobe-view-style" }, document.head || document.body).textContent = STYLE;
  }

  // weights arrive as little-endian uint16 (weight x 65535), base64-encoded, shape [L, H, T, T]
  function decode(ex) {
    var bytes = atob(ex.weights_u16_base64), L = ex.shape[0], H = ex.shape[1], T = ex.shape[2], i = 0, out = [];
    for (var l = 0; l < L; l++) {
      var heads = [];
      for (var h = 0; h < H; h++) {
        var rows = [];
        for (var q = 0; q < T; q++) {
          var row = [];
          for (var k = 0; k < T; k++, i += 2) row.push((bytes.charCodeAt(i) | (bytes.charCodeAt(i + 1) << 8)) / 65535);
          rows.push(row);
        }
        heads.push(rows);
      }
      out.push(heads);
    }
    ex.weights = out;
    return ex;
  }

  function name(ex) { return "#" + ex.prompt_id + (ex.label ? " (" + ex.label + ")" : "") + ": " + ex.text; }
  function group(ex) { return ex.item_id !== undefined && ex.item_id !== null ? String(ex.item_id) : JSON.stringify(ex.spans); }

  // the source span (red) is "pronoun" in the bundled suites, else the last span declared
  function sourceSpan(ex) {
    var names = Object.keys(ex.spans || {});
    return ex.spans.pronoun ? "pronoun" : names[names.length - 1];
  }

  function setup(root) {
    if (root.getAttribute("data-ready")) return; // a notebook runs this script once per view
    root.setAttribute("data-ready", "1");
    addStyle();
    var examples = JSON.parse(document.getElementById(root.getAttribute("data-source")).textContent).map(decode);
    if (!examples.length) { root.textContent = "no example prompts in this run"; return; }
    var L = examples[0].weights.length, H = examples[0].weights[0].length;
    var controls = el("div", { "class": "view-controls" }, root);
    var pick = el("select", { "aria-label": "prompt" }, controls);
    examples.forEach(function (ex, i) { option(pick, i, name(ex)); });
    var compare = el("select", { "aria-label": "compare with" }, controls);
    var layer = el("select", { "aria-label": "layer" }, controls);
    for (var l = 0; l < L; l++) option(layer, l, "layer " + l);
    var mode = el("select", { "aria-label": "view" }, controls);
    option(mode, "heads", "heads of a layer");
    option(mode, "grid", "layers x heads");
    var swatches = el("div", { "class": "view-controls" }, root);
    var selected = [];
    for (var h = 0; h < H; h++) {
      var b = el("button", { "class": "swatch", "aria-pressed": "false", "data-head": String(h), style: "background:" + HEAD_COLOURS[h % HEAD_COLOURS.length] }, swatches);
      b.textContent = "head " + h;
      b.addEventListener("click", toggle.bind(null, h));
    }
    var legend = el("div", { "class": "view-legend" }, root);
    var panels = el("div", { "class": "view-panels" }, root);
    var focus = null; // {side: "query" | "key", index}

    function toggle(h) {
      var at = selected.indexOf(h);
      if (at >= 0) selected.splice(at, 1); else selected.push(h);
      draw();
    }

    function fillCompare() {
      var a = examples[+pick.value], keep = compare.value;
      while (compare.firstChild) compare.removeChild(compare.firstChild);
      option(compare, "", "no comparison");
      var first = "";
      examples.forEach(function (ex, i) {
        if (ex === a || ex.tokens.length !== a.tokens.length) return; // a difference needs aligned tokens
        option(compare, i, "vs " + name(ex));
        if (first === "" && group(ex) === group(a)) first = String(i);
      });
      compare.value = Array.prototype.some.call(compare.options, function (o) { return o.value === keep && keep !== ""; }) ? keep : first;
    }

    function drawLegend(ex) {
      while (legend.firstChild) legend.removeChild(legend.firstChild);
      Object.keys(ex.spans || {}).forEach(function (span, i) {
        var s = el("span", { style: span === sourceSpan(ex) ? "color:#b2182b;font-weight:bold" : "background:" + SPAN_COLOURS[i % SPAN_COLOURS.length] }, legend);
        s.textContent = span + (span === sourceSpan(ex) ? " (source)" : "");
      });
    }

    // one panel: weights[q][k] per selected head (or their difference when `diff`)
    function headPanel(title, ex, matrices, diff) {
      var panel = el("div", { "class": "view-panel", "data-panel": title }, panels);
      el("h5", {}, panel).textContent = title;
      // columns: weight labels (hover) | key tokens | lines | query tokens | weight labels (hover)
      var T = ex.tokens.length, rowH = 22, labels = 36 * matrices.length, left = 170 + labels, right = left + 180, width = right + 170 + labels;
      var svg = el("svg", { "class": "view-svg", role: "img", viewBox: "0 0 " + width + " " + (T * rowH + 10), height: String(T * rowH + 10) }, panel, true);
      var scale = 1;
      if (diff) {
        scale = 0;
        matrices.forEach(function (m) { m.w.forEach(function (row) { row.forEach(function (v) { scale = Math.max(scale, Math.abs(v)); }); }); });
        scale = scale || 1;
        panel.firstChild.textContent = title + " (opacity: |difference| / " + scale.toFixed(3) + "; red: A higher, blue: B higher)";
      }
      var source = ex.spans[sourceSpan(ex)] || [-1, -1];
      var spanOf = {};
      Object.keys(ex.spans || {}).forEach(function (span, i) {
        for (var t = ex.spans[span][0]; t < ex.spans[span][1]; t++) spanOf[t] = i;
      });
      Object.keys(spanOf).forEach(function (t) {
        if (+t >= source[0] && +t < source[1]) return;
        [[left - 160, 160], [right - 4, 160]].forEach(function (box) {
          el("rect", { x: box[0], y: t * rowH + 4, width: box[1], height: rowH - 4, fill: SPAN_COLOURS[spanOf[t] % SPAN_COLOURS.length] }, svg, true);
        });
      });
      matrices.forEach(function (m) {
        for (var q = 0; q < T; q++) {
          for (var k = 0; k <= q; k++) {
            var v = m.w[q][k], strength = Math.abs(v) / scale;
            if (strength < 0.01) continue;
            if (focus && ((focus.side === "query" && focus.index !== q) || (focus.side === "key" && focus.index !== k))) continue;
            var line = el("line", { x1: right - 5, y1: q * rowH + 15, x2: left + 5, y2: k * rowH + 15, "stroke-width": "2",
                                    stroke: diff ? (v > 0 ? "#b2182b" : "#2166ac") : m.colour, "stroke-opacity": String(Math.min(1, strength)) }, svg, true);
            el("title", {}, line, true).textContent = m.name + ": " + ex.tokens[q] + " -> " + ex.tokens[k] + " " + v.toFixed(3);
          }
        }
      });
      ex.tokens.forEach(function (tok, i) {
        [["key", left, "end"], ["query", right, "start"]].forEach(function (side) {
          var t = el("text", { x: side[1], y: i * rowH + 19, "text-anchor": side[2], "class": i >= source[0] && i < source[1] ? "tok source" : "tok",
                               "data-side": side[0], "data-index": String(i) }, svg, true);
          t.textContent = tok;
          t.addEventListener("mouseenter", function () {
            if (focus && focus.side === side[0] && focus.index === i) return; // redrawn under the pointer: nothing new
            focus = { side: side[0], index: i };
            draw();
          });
          t.addEventListener("mouseleave", function () { focus = null; draw(); });
        });
      });
      if (focus) weightLabels(svg, ex, matrices, rowH, left, right);
    }

    // hovering a query shows the weight on each key (left margin); hovering a key, each query's weight on it
    function weightLabels(svg, ex, matrices, rowH, left, right) {
      var T = ex.tokens.length;
      for (var other = 0; other < T; other++) {
        var q = focus.side === "query" ? focus.index : other, k = focus.side === "query" ? other : focus.index;
        if (k > q) continue;
        matrices.forEach(function (m, j) {
          var x = focus.side === "query" ? 4 + 36 * j : right + 165 + 36 * j;
          var label = el("text", { "class": "weight", x: x, y: other * rowH + 19, fill: m.colour }, svg, true);
          label.textContent = m.w[q][k].toFixed(2);
        });
      }
    }

    // thumbnails of every head; with a comparison B, of A - B scaled by the largest |A - B| of any head
    function grid(ex, b) {
      var T = ex.tokens.length, cell = Math.max(2, Math.floor(48 / T)), size = cell * T, scale = 1;
      function value(l, h, q, k) { return ex.weights[l][h][q][k] - (b ? b.weights[l][h][q][k] : 0); }
      if (b) {
        scale = 0;
        for (var l0 = 0; l0 < L; l0++) for (var h0 = 0; h0 < H; h0++) for (var q0 = 0; q0 < T; q0++) for (var k0 = 0; k0 <= q0; k0++)
          scale = Math.max(scale, Math.abs(value(l0, h0, q0, k0)));
        scale = scale || 1;
      }
      var panel = el("div", { "class": "view-panel", style: "max-width:none;flex-basis:100%" }, panels);
      el("h5", {}, panel).textContent = (b ? "A - B per head (red: A higher, blue: B higher; opacity: |difference| / " + scale.toFixed(3) + ")"
                                           : "every head of A (rows: queries, columns: keys; opacity: weight)") + "; click a head to open it";
      var width = 30 + H * (size + 6), height = 16 + L * (size + 6);
      var svg = el("svg", { role: "img", viewBox: "0 0 " + width + " " + height, width: String(1.5 * width), style: "max-width:100%;height:auto" }, panel, true);
      for (var h = 0; h < H; h++) el("text", { x: 30 + h * (size + 6), y: 11, "class": "weight" }, svg, true).textContent = "H" + h;
      for (var l = 0; l < L; l++) {
        el("text", { x: 0, y: 16 + l * (size + 6) + size / 2, "class": "weight" }, svg, true).textContent = "L" + l;
        for (var h2 = 0; h2 < H; h2++) {
          var g = el("g", { "class": "thumb", "data-layer": String(l), "data-head": String(h2),
                            transform: "translate(" + (30 + h2 * (size + 6)) + "," + (16 + l * (size + 6)) + ")" }, svg, true);
          el("rect", { width: size, height: size, fill: "#fff", stroke: "#ddd" }, g, true);
          el("title", {}, g, true).textContent = "layer " + l + ", head " + h2;
          for (var q = 0; q < T; q++) {
            for (var k = 0; k <= q; k++) {
              var v = value(l, h2, q, k) / scale;
              if (Math.abs(v) < 0.02) continue;
              el("rect", { x: k * cell, y: q * cell, width: cell, height: cell, fill: b ? (v > 0 ? "#b2182b" : "#2166ac") : "#08519c",
                           "fill-opacity": String(Math.min(1, Math.abs(v))) }, g, true);
            }
          }
          g.addEventListener("click", open.bind(null, l, h2));
        }
      }
    }

    function open(l, h) {
      layer.value = String(l);
      selected = [h];
      mode.value = "heads";
      draw();
    }

    function draw() {
      var a = examples[+pick.value], b = compare.value === "" ? null : examples[+compare.value], l = +layer.value;
      while (panels.firstChild) panels.removeChild(panels.firstChild);
      Array.prototype.forEach.call(swatches.children, function (s) { s.setAttribute("aria-pressed", String(selected.indexOf(+s.getAttribute("data-head")) >= 0)); });
      swatches.style.display = layer.style.display = mode.value === "heads" ? "" : "none";
      drawLegend(a);
      if (mode.value === "grid") { grid(a, b); return; }
      function heads(ex) {
        return selected.map(function (h) { return { name: "L" + l + "H" + h, colour: HEAD_COLOURS[h % HEAD_COLOURS.length], w: ex.weights[l][h] }; });
      }
      headPanel("A: " + name(a), a, heads(a), false);
      if (!b) return;
      headPanel("B: " + name(b), b, heads(b), false);
      var diffs = heads(a).map(function (m, j) {
        var w = m.w.map(function (row, q) { return row.map(function (v, k) { return v - b.weights[l][selected[j]][q][k]; }); });
        return { name: m.name + " A - B", colour: m.colour, w: w };
      });
      headPanel("A - B", a, diffs, true);
    }

    pick.addEventListener("change", function () { fillCompare(); draw(); });
    [compare, layer, mode].forEach(function (s) { s.addEventListener("change", draw); });
    // data-start: "layer,head[,target span]": open that head on the first prompt that has the target
    var start = (root.getAttribute("data-start") || "0,0").split(",");
    layer.value = start[0];
    selected = [+start[1]];
    var withTarget = examples.findIndex(function (ex) { return !start[2] || (ex.spans && ex.spans[start[2]]); });
    pick.value = String(Math.max(0, withTarget));
    fillCompare();
    draw();
  }

  document.querySelectorAll(".attention-view").forEach(setup);
})();
