// The run report's script (report.py inlines it into every page): names the folder the
// page is opened from, and draws the two browsers from the JSON blocks report.py embeds,
// the held-out items (#items-data) and the training trajectories (#traj-data).
// Every string from the run goes through textContent: it is never parsed as HTML.
// Plain JavaScript and the DOM, no library: the page must work offline, from a file.
(function () {
  "use strict";
  function $(id) { return document.getElementById(id); }
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
  function option(sel, value, label) {
    var o = el("option", null, label);
    o.value = value;
    sel.appendChild(o);
  }
  function readData(id) {
    var node = $(id);
    return node ? JSON.parse(node.textContent) : null;
  }

  // The header names the run directory as it is now: the page may have been copied or
  // moved since report.py wrote it.
  var here = $("run-dir");
  if (here && location.protocol === "file:") {
    var path = decodeURIComponent(location.pathname).replace(/^\/([A-Za-z]:)/, "$1");
    var dir = path.replace(/\/[^\/]*$/, "") || "/";
    here.textContent = here.getAttribute("data-what") === "file" ? path : dir;
    var name = $("run-name");
    if (name && here.getAttribute("data-what") === "dir") {
      name.textContent = dir.split("/").pop() || dir;
      document.title = name.parentNode.textContent;
    }
  }

  // What can be wrong with a planner action or a trajectory; one filter option each.
  var FLAGS = [["", "any"], ["loose", "tool name matched loosely"], ["cap", "action cut at max_new_tokens"],
               ["notool", "no tool named"], ["out", "ran out of turns"], ["err", "a tool error"]];
  function flagsOf(turns, out) {
    var f = {loose: false, cap: false, notool: false, out: !!out, err: false};
    turns.forEach(function (t) {
      if (t.loose) f.loose = true;
      if (t.at_cap) f.cap = true;
      if (t.no_tool) f.notool = true;
      if (t.error) f.err = true;
    });
    return f;
  }
  function fillFlags(sel) { FLAGS.forEach(function (f) { option(sel, f[0], f[1]); }); }
  function fillValues(sel, values) {
    Object.keys(values).sort().forEach(function (v) { option(sel, v, v === "(none)" ? "no tool call" : v); });
  }
  function usesTool(tools, tool) {
    return tool === "(none)" ? tools.length === 0 : tools.indexOf(tool) >= 0;
  }

  // One planner turn: the raw action, what it was read as, the memory record.
  function turnBox(t, actionLabel) {
    var c = el("div", "turn");
    var th = el("div", "thead");
    th.appendChild(el("b", null, "turn " + t.turn));
    th.appendChild(el("span", "tool", t.tool || "no tool"));
    if (t.verdict) th.appendChild(el("span", "verdict " + t.verdict, "verifier: " + t.verdict));
    if (t.loose) th.appendChild(el("span", "flag", "loose: \u201c" + t.tool_line + "\u201d read as " + t.tool));
    if (t.no_tool) th.appendChild(el("span", "flag", "no tool named"));
    if (t.at_cap) th.appendChild(el("span", "flag", "cut at " + (t.tokens || "max") + " tokens"));
    c.appendChild(th);
    field(c, "what the planner saw (its own part of the prompt)", t.saw, null);
    field(c, actionLabel + (t.tokens ? " \u00b7 " + t.tokens + " tokens" : ""), t.planner, "planner");
    if (!t.recorded) c.appendChild(el("p", "dim", "no memory record for this turn"));
    // The memory record of the turn; empty fields are shown as such (they say something).
    field(c, "sub-goal", t.sub_goal, null, t.recorded);
    field(c, "command (executor)", t.command, null, t.recorded);
    field(c, "result", t.result, "result", t.recorded);
    field(c, "error", t.error, "err");
    return c;
  }

  // ---- The held-out items: before and after training, side by side -------------------
  var I = readData("items-data");
  if (I) {
    var ichange = $("item-change"), ikind = $("item-kind"), itool = $("item-tool"), iflag = $("item-flag");
    var ilist = $("item-list"), istatus = $("item-status");
    var kinds = {}, tools = {};
    I.items.forEach(function (it) {
      if (it.task) kinds[it.task] = 1;
      [it.before, it.after].forEach(function (s) {
        if (!s) return;
        if (!s.tools.length) tools["(none)"] = 1;
        s.tools.forEach(function (t) { tools[t] = 1; });
      });
    });
    fillValues(ikind, kinds);
    fillValues(itool, tools);
    fillFlags(iflag);
    var CHANGE = {gained: "wrong \u2192 right", lost: "right \u2192 wrong", right: "stayed right",
                  wrong: "stayed wrong", "before only": "before only", "after only": "after only"};
    var side = function (s, label) {
      var col = el("div", "rollout " + (s && s.correct ? "win" : "loss"));
      var h = el("div", "rhead");
      h.appendChild(el("b", null, label));
      if (!s) {
        col.appendChild(h);
        col.appendChild(el("p", "dim", "not evaluated"));
        return col;
      }
      h.appendChild(el("span", "badge " + (s.correct ? "ok" : "bad"), s.correct ? "right" : "wrong"));
      col.appendChild(h);
      var f = flagsOf(s.turns, s.out);
      if (f.out) col.appendChild(el("p", "flag", "ran out of turns: every turn used, the verifier never said STOP"));
      if (!s.turns.length) col.appendChild(el("p", "dim", "no trajectory recorded"));
      s.turns.forEach(function (t) { col.appendChild(turnBox(t, "planner action")); });
      s.crash.forEach(function (e) { field(col, "crash", e, "err"); });
      var fin = el("div", "final " + (s.correct ? "ok" : "bad"));
      field(fin, "final answer " + (s.correct ? "\u2713" : "\u2717"), s.answer, null, true);
      col.appendChild(fin);
      return col;
    };
    var renderItems = function () {
      var want = ichange.value, kind = ikind.value, tool = itool.value, flag = iflag.value;
      var shown = 0, inView = {gained: 0, lost: 0};
      ilist.replaceChildren();
      I.items.forEach(function (it) {
        if (want === "flipped" ? (it.change !== "gained" && it.change !== "lost")
            : (want !== "all" && it.change !== want)) return;
        if (kind && it.task !== kind) return;
        var sides = [it.before, it.after].filter(Boolean);
        if (tool && !sides.some(function (s) { return usesTool(s.tools, tool); })) return;
        if (flag && !sides.some(function (s) { return flagsOf(s.turns, s.out)[flag]; })) return;
        shown++;
        if (it.change in inView) inView[it.change]++;
        var box = el("div", "group item");
        box.setAttribute("data-id", it.id);
        var hd = el("div", "ghead");
        hd.appendChild(el("b", null, it.id + (it.task ? " \u00b7 " + it.task : "")));
        hd.appendChild(el("span", "chg " + it.change.replace(" ", "-"), CHANGE[it.change] || it.change));
        box.appendChild(hd);
        box.appendChild(el("pre", "query", it.question));
        field(box, "gold", (it.gold || []).join("  |  "));
        var row = el("div", "sides");
        row.appendChild(side(it.before, "before training"));
        row.appendChild(side(it.after, "after training"));
        box.appendChild(row);
        ilist.appendChild(box);
      });
      istatus.textContent = "showing " + shown + " of " + I.items.length + " held-out items \u00b7 " +
        inView.gained + " wrong \u2192 right, " + inView.lost + " right \u2192 wrong in view";
      if (!shown) ilist.appendChild(el("p", "note", "No held-out item matches these filters."));
    };
    [ichange, ikind, itool, iflag].forEach(function (s) { s.addEventListener("change", renderItems); });
    renderItems();
  }

  // ---- The training trajectories: one step's query groups, G rollouts each ------------
  var D = readData("traj-data");
  if (D) {
    var sel = $("step-select"), box = $("traj-groups"), info = $("step-info");
    var tkind = $("traj-kind"), treward = $("traj-reward"), ttool = $("traj-tool"), tflag = $("traj-flag");
    var tkinds = {}, ttools = {};
    D.steps.forEach(function (s) {
      option(sel, String(s), "step " + s);
      D.by_step[String(s)].groups.forEach(function (g) {
        if (g.task) tkinds[g.task] = 1;
        g.rollouts.forEach(function (r) {
          if (!r.tools.length) ttools["(none)"] = 1;
          r.tools.forEach(function (t) { ttools[t] = 1; });
        });
      });
    });
    fillValues(tkind, tkinds);
    fillValues(ttool, ttools);
    fillFlags(tflag);
    var stats = function (rs) {
      var r = rs.map(function (x) { return x.reward || 0; });
      var m = r.reduce(function (a, b) { return a + b; }, 0) / r.length;
      var v = r.reduce(function (a, b) { return a + (b - m) * (b - m); }, 0) / r.length;
      return {mean: m, std: Math.sqrt(v), flat: r.every(function (x) { return x === r[0]; })};
    };
    var rollout = function (r, i, gold, dimmed) {
      var col = el("div", "rollout " + (r.correct ? "win" : "loss") + (dimmed ? " dimmed" : ""));
      var h = el("div", "rhead");
      h.appendChild(el("b", null, "rollout " + (i + 1)));
      h.appendChild(el("span", "badge " + (r.correct ? "ok" : "bad"), "R = " + (r.reward === null ? "?" : Math.round(r.reward * 1000) / 1000)));
      col.appendChild(h);
      var adv = el("div", "adv " + (r.advantage > 0 ? "pos" : r.advantage < 0 ? "neg" : "zero"));
      adv.appendChild(el("b", null, "A_i = " + f3(r.advantage)));
      adv.appendChild(el("span", null, " advantage A_i, broadcast to every planner turn"));
      col.appendChild(adv);
      if (r.out) col.appendChild(el("p", "flag", "ran out of turns"));
      if (!r.turns.length) col.appendChild(el("p", "dim", "no turns recorded"));
      r.turns.forEach(function (t) {
        col.appendChild(turnBox(t, "planner action (trained, weight A_i = " + f3(r.advantage) + ")"));
      });
      var fin = el("div", "final " + (r.correct ? "ok" : "bad"));
      field(fin, "final answer " + (r.correct ? "\u2713" : "\u2717"), r.answer, null, true);
      field(fin, "gold", gold);
      col.appendChild(fin);
      return col;
    };
    var render = function () {
      var S = D.by_step[sel.value];
      var kind = tkind.value, rew = treward.value, tool = ttool.value, flag = tflag.value;
      box.replaceChildren();
      var shown = 0;
      S.groups.forEach(function (g) {
        var st = stats(g.rollouts);
        if (kind && g.task !== kind) return;
        if (rew === "signal" && st.flat) return;
        if (rew === "all1" && !g.rollouts.every(function (r) { return r.correct; })) return;
        if (rew === "all0" && !g.rollouts.every(function (r) { return !r.correct; })) return;
        var match = g.rollouts.map(function (r) {
          return (!tool || usesTool(r.tools, tool)) && (!flag || flagsOf(r.turns, r.out)[flag]);
        });
        if ((tool || flag) && !match.some(Boolean)) return;
        shown++;
        var sec = el("div", "group");
        var hd = el("div", "ghead");
        hd.appendChild(el("b", null, (g.id ? g.id : "query group " + g.group) + (g.task ? " \u00b7 " + g.task : "")));
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
        g.rollouts.forEach(function (r, i) { row.appendChild(rollout(r, i, gold, (tool || flag) && !match[i])); });
        sec.appendChild(row);
        box.appendChild(sec);
        if (row.scrollWidth > row.clientWidth + 2)  // too many rollouts for the window: say so
          sec.insertBefore(el("p", "dim", "\u2194 scroll sideways to see all " + g.rollouts.length + " rollouts"), row);
      });
      var m = S.metrics, parts = ["step " + sel.value + ": showing " + shown + " of " + S.groups.length +
                                  " query groups"];
      if (m) {
        if (m.reward_mean !== undefined) parts.push("reward mean " + Number(m.reward_mean).toFixed(3));
        if (m.zero_variance_groups !== undefined)
          parts.push("no-signal groups " + Math.round(100 * m.zero_variance_groups) + "%");
        if (m.mean_turns !== undefined) parts.push("mean turns " + Number(m.mean_turns).toFixed(2));
        if (m.top_tool !== undefined) parts.push("top tool " + m.top_tool);
      }
      info.textContent = parts.join(" \u00b7 ");
      if (!shown) box.appendChild(el("p", "note", S.groups.length ?
        "No query group of this step matches these filters." : "This step has no trajectories."));
    };
    var move = function (d) {
      var i = sel.selectedIndex + d;
      if (i >= 0 && i < sel.options.length) { sel.selectedIndex = i; render(); }
    };
    [sel, tkind, treward, ttool, tflag].forEach(function (s) { s.addEventListener("change", render); });
    $("prev-step").addEventListener("click", function () { move(-1); });
    $("next-step").addEventListener("click", function () { move(1); });
    sel.selectedIndex = sel.options.length - 1;  // the latest step
    render();
  }
})();
