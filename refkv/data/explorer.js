// refkv show: select one (layer, KV head) and colour every policy's text by its decisions.
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("refkv-data").textContent);
  var state = { layer: null, head: null, mode: "decision" };

  function spans(p) { return document.getElementById("text-" + p).querySelectorAll(".t"); }

  function blockColour(b) {  // evicted early: light red; at the last block: dark red
    var f = D.n_blocks > 1 ? b / (D.n_blocks - 1) : 1;
    return "hsl(4," + Math.round(70 + 10 * f) + "%," + Math.round(78 - 38 * f) + "%)";
  }

  function fractions() {
    D.runs.forEach(function (run, p) {
      spans(p).forEach(function (s) {
        s.style.background = s.dataset.bg; s.style.color = ""; s.classList.remove("prot");
        s.title = s.dataset.title || s.title; 
      });
      document.getElementById("sel-" + p).textContent =
        "coloured by the share of (layer, KV head) pairs that kept each token";
    });
    document.querySelectorAll("td.cell.on").forEach(function (c) { c.classList.remove("on"); });
    document.getElementById("selected").textContent =
      "no head selected: the text shows the share of heads that kept each token";
  }

  function ranks(values, members) {  // rank in [0, 1] of each member's value among the members
    var idx = members.filter(function (i) { return values[i] !== null; });
    idx.sort(function (a, b) { return values[a] - values[b] || a - b; });
    var r = {};
    idx.forEach(function (i, k) { r[i] = idx.length > 1 ? k / (idx.length - 1) : 1; });
    return r;
  }

  function select(layer, head) {
    if (!(layer >= 0 && layer < D.n_layers && head >= 0 && head < D.n_kv_heads)) { fractions(); return; }
    state.layer = layer; state.head = head;
    document.querySelectorAll("td.cell.on").forEach(function (c) { c.classList.remove("on"); });
    document.querySelectorAll('td.cell[data-l="' + layer + '"][data-h="' + head + '"]').forEach(
      function (c) { c.classList.add("on"); });
    document.getElementById("selected").textContent = "layer " + layer + ", KV head " + head +
      " selected: " + (state.mode === "score" ? "scores at the layer's last eviction" : "kept or evicted at block b");
    D.runs.forEach(function (run, p) {
      var dec = run.decisions[layer][head], sc = run.scores[layer][head];
      var prot = {}; run.protected[layer][head].forEach(function (i) { prot[i] = true; });
      var last = run.last_block[layer];
      var members = [];
      dec.forEach(function (d, i) { if (d < 0 || d === last) { members.push(i); } });
      var rank = state.mode === "score" ? ranks(sc, members) : null;
      var kept = 0;
      spans(p).forEach(function (s, i) {
        var d = dec[i], score = sc[i] === null ? "none" : sc[i];
        if (!s.dataset.title) { s.dataset.title = s.title; }
        var what = d < 0 ? "kept" : "evicted at block " + d;
        if (d < 0) { kept += 1; }
        s.classList.toggle("prot", !!prot[i]);
        s.style.color = "";
        if (state.mode === "score") {
          if (rank[i] === undefined) { s.style.background = "#e6e6e6"; }
          else { s.style.background = "hsl(" + Math.round(120 * rank[i]) + ",60%,74%)"; }
        } else if (d < 0) { s.style.background = "#5abe6e"; }
        else {
          s.style.background = blockColour(d);
          if (D.n_blocks > 1 && d / (D.n_blocks - 1) > 0.6) { s.style.color = "#fff"; }
        }
        s.title = "token " + i + ": " + what + (prot[i] ? " (protected)" : "") + "; score " + score;
      });
      document.getElementById("sel-" + p).textContent = "layer " + layer + ", KV head " + head + ": " + kept +
        " kept" + (last >= 0 ? "; last eviction at block " + last : "; never evicted");
    });
    var frag = "#layer=" + layer + "&head=" + head + (state.mode === "score" ? "&mode=score" : "");
    if (location.hash !== frag) { history.replaceState(null, "", frag); }
  }

  function fromHash() {
    var q = {};
    location.hash.replace(/^#/, "").split("&").forEach(function (kv) {
      var parts = kv.split("="); if (parts.length === 2) { q[parts[0]] = parts[1]; }
    });
    if (q.mode === "score" || q.mode === "decision") {
      state.mode = q.mode;
      document.querySelector('input[name="mode"][value="' + q.mode + '"]').checked = true;
    }
    if (q.layer !== undefined && q.head !== undefined) { select(parseInt(q.layer, 10), parseInt(q.head, 10)); }
  }

  document.querySelectorAll("td.cell").forEach(function (c) {
    c.addEventListener("click", function () { select(parseInt(c.dataset.l, 10), parseInt(c.dataset.h, 10)); });
    c.addEventListener("keydown", function (e) {  // the keyboard selects too
      if (e.key === "Enter" || e.key === " ") { e.preventDefault(); c.click(); }
    });
  });
  document.querySelectorAll('input[name="mode"]').forEach(function (r) {
    r.addEventListener("change", function () {
      state.mode = r.value; if (state.layer !== null) { select(state.layer, state.head); }
    });
  });
  document.getElementById("clear").addEventListener("click", function () {
    state.layer = null; state.head = null; fractions(); history.replaceState(null, "", location.pathname);
  });
  window.addEventListener("hashchange", fromHash);
  fromHash();
})();
