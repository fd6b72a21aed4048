// attnprobe attention view: offline, no libraries. Reads the JSON block #attnprobe-examples-N
// and draws, for one prompt, layer and head, a line from each query token (right) to each key
// token (left) with opacity = attention weight. Hover a token to see only its lines.
// Text is inserted with textContent only: prompt text is user data.
(function () {
  "use strict";
  var SVG = "http://www.w3.org/2000/svg";

  function el(name, attrs, parent, svg) {
    var node = svg ? document.createElementNS(SVG, name) : document.createElement(name);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (parent) parent.appendChild(node);
    return node;
  }

  function option(select, value, text) {
    var o = el("option", { value: String(value) }, select);
    o.textContent = text;
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

  function setup(root) {
    if (root.getAttribute("data-ready")) return; // a notebook runs this script once per view
    root.setAttribute("data-ready", "1");
    var examples = JSON.parse(document.getElementById(root.getAttribute("data-source")).textContent).map(decode);
    if (!examples.length) { root.textContent = "no example prompts in this run"; return; }
    var controls = el("div", { "class": "view-controls" }, root);
    var pick = el("select", { "aria-label": "prompt" }, controls);
    examples.forEach(function (ex, i) { option(pick, i, "#" + ex.prompt_id + " (" + ex.label + "): " + ex.text); });
    var layer = el("select", { "aria-label": "layer" }, controls);
    var head = el("select", { "aria-label": "head" }, controls);
    var L = examples[0].weights.length, H = examples[0].weights[0].length;
    for (var l = 0; l < L; l++) option(layer, l, "layer " + l);
    for (var h = 0; h < H; h++) option(head, h, "head " + h);
    var svg = el("svg", { "class": "view-svg", role: "img" }, root, true);
    var focus = null;

    function draw() {
      var ex = examples[+pick.value], w = ex.weights[+layer.value][+head.value], T = ex.tokens.length;
      var rowH = 22, width = 520, left = 170, right = width - 170;
      svg.setAttribute("viewBox", "0 0 " + width + " " + (T * rowH + 10));
      svg.setAttribute("height", String(T * rowH + 10));
      while (svg.firstChild) svg.removeChild(svg.firstChild);
      var pronoun = ex.spans.pronoun ? ex.spans.pronoun[0] : -1;
      for (var q = 0; q < T; q++) {
        for (var k = 0; k <= q; k++) {
          var weight = w[q][k];
          if (weight < 0.01 || (focus !== null && focus !== q)) continue;
          el("line", { x1: right - 5, y1: q * rowH + 15, x2: left + 5, y2: k * rowH + 15, stroke: q === pronoun ? "#b2182b" : "#2166ac",
                       "stroke-opacity": String(Math.min(1, weight)), "stroke-width": "2" }, svg, true);
        }
      }
      ex.tokens.forEach(function (tok, i) {
        [[left, "end"], [right, "start"]].forEach(function (side) {
          var t = el("text", { x: side[0], y: i * rowH + 19, "text-anchor": side[1], "class": i === pronoun ? "tok pronoun" : "tok" }, svg, true);
          t.textContent = tok;
          t.addEventListener("mouseenter", function () { focus = i; draw(); });
          t.addEventListener("mouseleave", function () { focus = null; draw(); });
        });
      });
    }
    [pick, layer, head].forEach(function (s) { s.addEventListener("change", draw); });
    var start = root.getAttribute("data-start");
    if (start) { var parts = start.split(","); layer.value = parts[0]; head.value = parts[1]; }
    draw();
  }

  document.querySelectorAll(".attention-view").forEach(setup);
})();
