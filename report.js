(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("traj-data").textContent);
  var sel = document.getElementById("step-select"), box = document.getElementById("traj-groups");
  var only = document.getElementById("only-signal"), info = document.getElementById("step-info");
  // Every string from the run goes through textContent: it is never parsed as HTML.
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function field(parent, label, value, cls, always) {
    var empty = value === undefined || value === null || value === "";
    if (empty && !always) return;
    var d = el("div", "field " + (cls || ""));
    d.appendChild(el("span", "flabel", label));
    d.appendChild(el("pre", empty ? "dim" : null, empty ? "(empty)" : value));
    parent.appendChild(d);
  }
  function f3(v) { return (v === null || v === undefined) ? "n/a" : (v >= 0 ? "+" : "") + v.toFixed(3); }
  function stats(rs) {
    var r = rs.map(function (x) { return x.reward || 0; });
    var m = r.reduce(function (a, b) { return a + b; }, 0) / r.length;
    var v = r.reduce(function (a, b) { return a + (b - m) * (b - m); }, 0) / r.length;
    return {mean: m, std: Math.sqrt(v), flat: r.every(function (x) { return x === r[0]; })};
  }
  D.steps.forEach(function (s) { var o = el("option", null, "step " + s); o.value = String(s); sel.appendChild(o); });
  function rollout(r, i, gold) {
    var col = el("div", "rollout " + (r.reward > 0 ? "win" : "loss"));
    var h = el("div", "rhead");
    h.appendChild(el("b", null, "rollout " + (i + 1)));
    h.appendChild(el("span", "badge " + (r.reward > 0 ? "ok" : "bad"), "R = " + (r.reward === null ? "?" : r.reward)));
    col.appendChild(h);
    var adv = el("div", "adv " + (r.advantage > 0 ? "pos" : r.advantage < 0 ? "neg" : "zero"));
    adv.appendChild(el("b", null, "A_i = " + f3(r.advantage)));
    adv.appendChild(el("span", null, " advantage A_i, broadcast to every planner turn"));
    col.appendChild(adv);
    if (!r.turns.length) col.appendChild(el("p", "dim", "no turns recorded"));
    r.turns.forEach(function (t) {
      var c = el("div", "turn");
      var th = el("div", "thead");
      th.appendChild(el("b", null, "turn " + t.turn));
      th.appendChild(el("span", "tool", t.tool || "no tool"));
      if (t.verdict) th.appendChild(el("span", "verdict " + t.verdict, "verifier: " + t.verdict));
      c.appendChild(th);
      field(c, "planner action (trained, weight A_i = " + f3(r.advantage) + ")", t.planner, "planner");
      if (!t.recorded) c.appendChild(el("p", "dim", "no memory record for this turn"));
      // The memory record of the turn; empty fields are shown as such (they say something).
      field(c, "sub-goal", t.sub_goal, null, t.recorded);
      field(c, "command (executor)", t.command, null, t.recorded);
      field(c, "result", t.result, "result", t.recorded);
      field(c, "error", t.error, "err");
      col.appendChild(c);
    });
    var fin = el("div", "final " + (r.reward > 0 ? "ok" : "bad"));
    field(fin, "final answer " + (r.reward > 0 ? "\u2713" : "\u2717"), r.answer, null, true);
    field(fin, "gold", gold);
    col.appendChild(fin);
    return col;
  }
  function render() {
    var S = D.by_step[sel.value];
    box.replaceChildren();
    var m = S.metrics, parts = [S.groups.length + " query groups"];
    if (m) {
      if (m.reward_mean !== undefined) parts.push("reward mean " + Number(m.reward_mean).toFixed(3));
      if (m.zero_variance_groups !== undefined)
        parts.push("no-signal groups " + Math.round(100 * m.zero_variance_groups) + "%");
      if (m.mean_turns !== undefined) parts.push("mean turns " + Number(m.mean_turns).toFixed(2));
      if (m.top_tool !== undefined) parts.push("top tool " + m.top_tool);
    }
    info.textContent = parts.join(" \u00b7 ");
    var shown = 0;
    S.groups.forEach(function (g) {
      var st = stats(g.rollouts);
      if (only.checked && st.flat) return;
      shown++;
      var sec = el("div", "group");
      var hd = el("div", "ghead");
      hd.appendChild(el("b", null, "query " + g.group + (g.task ? " \u00b7 " + g.task : "")));
      hd.appendChild(el("span", "dim", " G = " + g.rollouts.length + " rollouts \u00b7 rewards [" +
        g.rollouts.map(function (r) { return r.reward; }).join(", ") + "] \u00b7 mean " + st.mean.toFixed(3) +
        " \u00b7 std " + st.std.toFixed(3)));
      sec.appendChild(hd);
      sec.appendChild(el("pre", "query", g.query));
      var gold = (g.gold || []).join("  |  ");
      if (st.flat) sec.appendChild(el("p", "flat", "All " + g.rollouts.length + " rewards are equal, so " +
        "every A_i = 0: this query contributes no gradient this step."));
      var row = el("div", "rollouts");
      row.style.gridTemplateColumns = "repeat(" + g.rollouts.length + ", minmax(220px, 1fr))";
      g.rollouts.forEach(function (r, i) { row.appendChild(rollout(r, i, gold)); });
      sec.appendChild(row);
      box.appendChild(sec);
      if (row.scrollWidth > row.clientWidth + 2)  // too many rollouts for the window: say so
        sec.insertBefore(el("p", "dim", "\u2194 scroll sideways to see all " + g.rollouts.length + " rollouts"), row);
    });
    if (!shown) box.appendChild(el("p", "note", only.checked ?
      "Every group of this step has equal rewards (no learning signal)." : "This step has no trajectories."));
  }
  function move(d) {
    var i = sel.selectedIndex + d;
    if (i >= 0 && i < sel.options.length) { sel.selectedIndex = i; render(); }
  }
  sel.addEventListener("change", render);
  only.addEventListener("change", render);
  document.getElementById("prev-step").addEventListener("click", function () { move(-1); });
  document.getElementById("next-step").addEventListener("click", function () { move(1); });
  sel.selectedIndex = sel.options.length - 1;  // the latest step
  render();
})();
