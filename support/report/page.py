"""One self-contained HTML page per training run, out_dir/report.html: what a learner
would rather look at than read logs. `write_report(out_dir)` writes it (train.py calls
it after each checkpoint and at the end of a run; `python -m scripts.report OUT_DIR`
does it from the shell). The page:

  1. the run: where it ran (seed, commit, library versions, CPU, threads, total wall
     time with evaluations), its hyper-parameters, where the training time went;
  2. held-out accuracy before vs after training per task kind, as counts (38/40) with a
     95% interval for each accuracy and for the paired change, the items that flipped
     and a browser of them with the before and after trajectories side by side, tool
     shares per kind, and the test-time turn-budget sweep when the run has one;
  3. what was cut or read loosely (planner actions stopped at max_new_tokens, tool names
     matched loosely, trajectories out of turns), then the training curves as small
     multiples on one shared x-range;
  4. the tool-usage shift per task kind, before vs after (stacked bars);
  5. a trajectory browser: each training query's G rollouts side by side, with the
     reward R_i, the advantage A_i broadcast to every planner turn, each turn's memory
     record and the planner's raw action, filtered by task kind, reward, tool and flags.

Every file of a run may be missing (a run in progress, evaluation switched off): each
section renders what exists and says what is not there. Nothing is fetched from the
network: the style sheet (report.css), the SVG (charts.py) and the script (report.js)
are inline; all text from the run is escaped (html.escape in the markup; "<", ">" and
"&" escaped inside the embedded JSON, which the script only writes through textContent).

What it simplifies: the intervals are for the choice of items (the held-out evaluation
is greedy, so a rerun of the same weights gives the same verdicts); a trajectory step
browser embeds at most MAX_EMBED_STEPS steps.
"""

import json
import math
import time
from collections import Counter
from pathlib import Path

from support.datasets import PAPER_TABLE_1, read_jsonl
from support.report.blocks import (INTERVALS_NOTE, OKABE, RUN_COLORS, SUB, asset, change_cells, clip, count_cell,
                                   duration, fmt, guarded, header_warnings, note, page_head, provenance_line,
                                   provenance_rows, tool_colors, tool_shift_figure, write_page)
from support.report.charts import SMOOTH_FROM, esc, figure, line_chart, num, pct, smooth_window
from support.report.curves import CURVES, curve_facts, curve_figure, step_values, x_extent
from support.report.runs import (accuracy_rows, as_summary, before_after, cfg_get, cut_counts, load_run,
                                 out_of_turns, planner_turns, tool_shares_ba)
from support.report.stats import wilson
from support.text import plan_of

MAX_EMBED_STEPS = 40  # trajectory steps embedded in the browser (evenly spaced, first and last kept)
MAX_EMBED_CHARS = 8_000_000  # and at most this much embedded JSON: fewer steps if needed
CAP = {"query": 600, "answer": 400, "sub_goal": 300, "command": 500, "result": 600, "error": 300,
       "planner": 500, "saw": 1500, "gold": 200}  # characters kept per embedded text field
ROOT = Path(__file__).resolve().parents[2]  # the checkout, where a relative data.train is also looked for


def write_report(out_dir) -> Path:
    """Render out_dir/report.html from whatever the run has written so far; return its path.

    Raises FileNotFoundError if out_dir is not a directory. A directory with nothing of a
    run in it still gets a page, one that says so."""
    out = Path(out_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"no run directory at {out}")
    return write_page(out / "report.html", render(load_run(out)))


# ----------------------------------------------------------------------------------------
# Section 1: the run


def section_run(run: dict) -> str:
    cfg, metrics = run["config"], run["metrics"]
    t = cfg_get(cfg, "train", {}) or {}
    steps_done = metrics[-1]["step"] if metrics else max(run["traj_files"], default=0)
    planned = t.get("steps")
    status = ""
    if planned is not None:
        status = (" (finished)" if steps_done >= planned and run["learning"] else
                  " (training finished; final evaluation not written yet)" if steps_done >= planned
                  else " (in progress, or stopped early)")
    rows = [("model", cfg_get(cfg, "model.name")),
            ("steps done", f"{steps_done} of {planned if planned is not None else '?'}{status}"),
            ("queries per step Q", t.get("queries_per_step")), ("rollouts per query G", t.get("group_size")),
            ("learning rate", t.get("lr")), ("KL coefficient β", t.get("beta")),
            ("clip ε low / high", f'{t.get("eps_low", "?")} / {t.get("eps_high", "?")}'
             if "eps_low" in t or "eps_high" in t else None),
            ("max turns (train / eval)", f'{cfg_get(cfg, "agent.max_turns", "?")} / '
             f'{cfg_get(cfg, "eval.max_turns", "?")}' if cfg else None),
            ("planner max_new_tokens", cfg_get(cfg, "agent.planner.max_new_tokens")),
            ("advantage mode", t.get("advantage_mode")),
            ("epochs × minibatches per step", f'{t["epochs"]} × {t["minibatches"]}'
             if "epochs" in t and "minibatches" in t else None),
            ("planner temperature (training)", cfg_get(cfg, "agent.planner.temperature")),
            ("tool-token temperature (training)", cfg_get(cfg, "agent.planner.first_temperature") or None),
            ("planner in held-out evaluation", None if cfg_get(cfg, "eval.planner_temperature") is None else
             "greedy" if cfg_get(cfg, "eval.planner_temperature") == 0 else
             f'temperature {cfg_get(cfg, "eval.planner_temperature")}'),
            ("toolset K", ", ".join(map(str, cfg_get(cfg, "agent.tools", []) or [])) or None),
            ("Python sandbox", cfg_get(cfg, "tools.python_isolation")),
            ("trained layers", (t.get("train_layers") or "all") if "train_layers" in t else None)]
    cells = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows if v is not None)
    prov = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in provenance_rows(run))
    parts = ['<section id="run"><h2>1. The run</h2>']
    if not cfg:
        parts.append(note("<b>config.json is missing</b>: hyper-parameters unknown; the run was not started "
                          "by train.py or the file was removed."))
    parts.append(f'<div class="cols"><div><h3>Hyper-parameters</h3><table class="kv">{cells}</table></div>'
                 f'<div><h3>Where it ran</h3><table class="kv">{prov}</table>'
                 + ("" if run["processes"] else note("No run.json: train.py writes it from this version on "
                                                     "(seed, commit, versions, CPU, threads, wall time).")))

    # Where the training time went.
    totals = {k: sum(num(m.get(f"time_{k}")) or 0.0 for m in metrics) for k in ("rollout", "judge", "update")}
    total = sum(totals.values())
    if total > 0:
        colors = {"rollout": OKABE["blue"], "judge": OKABE["orange"], "update": OKABE["green"]}
        bar = "".join(f'<div style="width:{100 * v / total:.2f}%;background:{colors[k]}" '
                      f'title="{esc(k)}: {esc(duration(v))}"></div>' for k, v in totals.items() if v > 0)
        lines = "".join(f'<tr><th><i class="sw box" style="--c:{colors[k]}"></i>{esc(k)}</th>'
                        f'<td>{esc(duration(v))}</td><td>{100 * v / total:.1f}%</td></tr>'
                        for k, v in totals.items())
        parts.append(f'<h3>Wall time of {len(metrics)} training steps: {esc(duration(total))}</h3>'
                     f'<div class="timebar">{bar}</div><table class="kv">{lines}</table>'
                     + note("rollout = the four-module loop sampling Q×G trajectories; judge = scoring the "
                            "final answers; update = the Flow-GRPO loss and optimizer steps. Held-out "
                            "evaluations and checkpoints are not included here; the wall time in all (above) "
                            "includes them."))
    else:
        parts.append(note("No timing yet: metrics.jsonl has no steps."))
    parts.append("</div></div>")  # the right-hand column, the columns
    if metrics:
        last = metrics[-1]
        parts.append(note(f"Last step ({esc(last['step'])}): reward mean {esc(fmt(last.get('reward_mean')))}, "
                          f"KL {esc(fmt(last.get('kl'), 4))}, mean turns {esc(fmt(last.get('mean_turns'), 2))}, "
                          f"most used tool {esc(last.get('top_tool', '—'))}."))
    parts.append("</section>")
    return "".join(parts)


# ----------------------------------------------------------------------------------------
# Section 2: held-out before vs after


def delta_cell(b, a, good: str = "up", scale: float = 1.0, unit: str = "", digits: int = 1) -> str:
    """The change after - before, coloured green when it is an improvement."""
    b, a = num(b), num(a)
    if b is None or a is None:
        return "<td>—</td>"
    d = round((a - b) * scale, digits)
    if d == 0:
        return "<td>±0</td>"
    cls = "" if good == "none" else "good" if (d > 0) == (good == "up") else "bad"
    return f'<td class="{cls}">{d:+.{digits}f}{esc(unit)}</td>'


def accuracy_table(rows: list[dict]) -> str:
    """Accuracy per task kind before and after, with the change, its interval and the flips."""
    body = "".join(f'<tr><th{SUB if r["kind"] != "all" else ""}>'
                   f'{"accuracy, all items" if r["kind"] == "all" else esc(r["kind"])}</th>'
                   f'{count_cell(r.get("before"))}{count_cell(r.get("after"))}{change_cells(r)}</tr>'
                   for r in rows)
    return ('<table class="grid acc"><thead><tr><th>task kind</th><th>before</th><th>after</th>'
            '<th>Δ (interval)</th><th>flips: wrong→right / right→wrong</th><th>McNemar p</th></tr></thead>'
            f'<tbody>{body}</tbody></table>')


def paraphrase_table(run: dict) -> str:
    """The same table for the paraphrase set (data.paraphrase, eval/paraphrase/step_N): new
    wordings the planner never trained on, so the gap to the held-out table above is what
    the learned tool choice owes to the training wordings."""
    evals = run.get("paraphrase_evals") or {}
    if not evals:
        return ""
    first, last = evals.get(0), evals[max(evals)] if max(evals) > 0 else None
    pick = lambda e, key: e[key] if e else None  # noqa: E731
    rows = accuracy_rows(pick(first, "summary") or {}, pick(last, "summary") or {},
                         pick(first, "results"), pick(last, "results"))
    turns = "; ".join(f"{esc(k)} {fmt((last['summary']['by_kind'].get(k) or {}).get('mean_turns'), 2)}"
                      for k in sorted(last["summary"]["by_kind"])) if last else ""
    return ("<h3>The paraphrase set: new wordings, never trained on</h3>" + accuracy_table(rows)
            + note(f"From eval/paraphrase/step_0 and step_{max(evals)}, evaluated like the held-out set with a "
                   "seed of its own." + (f" Mean turns after training: {turns}." if turns else ""), "note small"))


def section_before_after(run: dict) -> str:
    b, a, br, ar, src = before_after(run)
    parts = ['<section id="before-after"><h2>2. Held-out evaluation: before vs after training</h2>']
    if not b and not a:
        parts.append(note("<b>No held-out evaluation yet.</b> train.py writes eval/step_0 before the first step "
                          "and eval/step_N plus learning.json after the last one (when "
                          "train.eval_before_after is true). Neither is in this folder.", "note warn"))
    else:
        parts.append(note(f"Source: {esc(src)}. <i>Before</i> = the untrained planner (step 0); <i>after</i> = "
                          "the planner after Flow-GRPO. Same held-out items and evaluation seed on both sides; a "
                          "crashed item counts as wrong. Δ = after − before, in percentage points (pp)."))
        if not a:
            parts.append(note("<b>No after-training evaluation yet</b> (the run or its final evaluation has not "
                              "finished): only the before column is filled.", "note warn"))
        if not b:
            parts.append(note("<b>No before-training evaluation</b> (eval/step_0 and learning.json's 'before' "
                              "are missing): only the after column is filled.", "note warn"))
        b, a = b or {}, a or {}
        parts.append(accuracy_table(accuracy_rows(b, a, br, ar)) + note(INTERVALS_NOTE, "note small"))
        parts.append(paraphrase_table(run))

        kinds = sorted(set(b.get("by_kind") or {}) | set(a.get("by_kind") or {}))
        bk = lambda s, k: (s.get("by_kind") or {}).get(k, {})  # noqa: E731

        def row(label, bv, av, render, good, scale=1.0, unit="", digits=1, sub=False):
            return (f"<tr><th{SUB if sub else ''}>{label}</th><td>{esc(render(bv))}</td>"
                    f"<td>{esc(render(av))}</td>{delta_cell(bv, av, good, scale, unit, digits)}</tr>")

        more = [row("mean F1", b.get("mean_f1"), a.get("mean_f1"), fmt, "up", 1, "", 3),
                row("tool-call error rate", b.get("tool_error_rate"), a.get("tool_error_rate"), pct, "down", 100,
                    " pp")]
        more += [row(f"tool-call error rate, {esc(k)}", bk(b, k).get("tool_error_rate"),
                     bk(a, k).get("tool_error_rate"), pct, "down", 100, " pp", sub=True) for k in kinds]
        more += [row("mean turns", b.get("mean_turns"), a.get("mean_turns"), lambda v: fmt(v, 2), "none", 1, "", 2)]
        more += [row(f"mean turns, {esc(k)}", bk(b, k).get("mean_turns"), bk(a, k).get("mean_turns"),
                     lambda v: fmt(v, 2), "none", 1, "", 2, sub=True) for k in kinds]
        more += [row("crashed items", b.get("crashed"), a.get("crashed"), lambda v: "—" if v is None else str(v),
                     "down", 1, "", 0)]
        parts.append('<h3>Other measures</h3><table class="grid"><thead><tr><th></th><th>before</th><th>after</th>'
                     f'<th>Δ</th></tr></thead><tbody>{"".join(more)}</tbody></table>')
        parts.append(tool_share_table(run))
        parts.append(plan_table(run))
    parts.append(turn_sweep_html(run))
    parts.append(paper_table_html(run))
    if b or a:
        parts.append(section_items(run, br, ar))
    if run["other_evals"]:
        rows = "".join(f'<tr><th>eval/{esc(name)}</th><td>{esc(e["summary"].get("n", "?"))}</td>'
                       f'<td>{esc(pct(e["summary"].get("accuracy")))}</td>'
                       f'<td>{esc(pct(e["summary"].get("tool_error_rate")))}</td>'
                       f'<td>{esc(fmt(e["summary"].get("mean_turns"), 2))}</td></tr>'
                       for name, e in run["other_evals"].items())
        parts.append("<h3>Other evaluations in this folder</h3>"
                     '<table class="grid"><thead><tr><th></th><th>n</th><th>accuracy</th><th>tool errors</th>'
                     f'<th>mean turns</th></tr></thead><tbody>{rows}</tbody></table>'
                     + note("Written by eval.py with its default --out; which checkpoint ran them is not recorded."))
    parts.append("</section>")
    return "".join(parts)


def tool_share_table(run: dict) -> str:
    """Tool shares per kind: one column per tool, "before → after (Δ)"."""
    sb, sa, how = tool_shares_ba(run)
    sb, sa = sb or {}, sa or {}
    colors = tool_colors(run)
    tools = [t for t in colors if any(t in d for d in list(sb.values()) + list(sa.values()))]
    kinds_all = ["all"] + [k for k in sorted(set(sb) | set(sa)) if k != "all"]
    if not tools:
        return note("No tool calls recorded in the evaluations.")
    head = "".join(f'<th><i class="sw box" style="--c:{esc(colors[t])}"></i>{esc(t)}</th>' for t in tools)
    body = []
    for k in kinds_all:
        cells = []
        for t in tools:
            bv = sb.get(k, {}).get(t, (0.0, 0))[0] if k in sb else None
            av = sa.get(k, {}).get(t, (0.0, 0))[0] if k in sa else None
            d = "" if bv is None or av is None else f' <span class="dim">({round(100 * (av - bv)) + 0:+d})</span>'
            cells.append(f"<td>{esc(pct(bv))} → {esc(pct(av))}{d}</td>")
        body.append(f"<tr><th>{esc(k)}</th>{''.join(cells)}</tr>")
    return (f"<h3>Tool-usage shares per task kind (before → after, Δ pp)</h3>"
            f'<table class="grid"><thead><tr><th>task kind</th>{head}</tr></thead><tbody>{"".join(body)}</tbody>'
            "</table>" + note(f"Share of each tool among all tool calls of that kind's items ({esc(how)}). The "
                              "paper's finding to look for: the trained planner shifts its tool choice per task "
                              "kind."))


def plans_from(summary: dict | None, rows: list | None) -> dict[str, dict[str, float]]:
    """{task kind ('all' too): {plan: share of items}} from results.jsonl rows when there are
    any, else from the summary (summaries written before plans were recorded have none)."""
    if rows:
        out: dict[str, Counter] = {"all": Counter()}
        for r in rows:
            plan = plan_of([str(t) for t in (r.get("tools") or []) if t])
            out["all"][plan] += 1
            if r.get("task"):
                out.setdefault(str(r["task"]), Counter())[plan] += 1
        return {k: {p: n / sum(c.values()) for p, n in c.items()} for k, c in out.items()}
    s = summary or {}
    out = {"all": s.get("plans") or {}}
    out.update({str(k): v.get("plans") or {} for k, v in (s.get("by_kind") or {}).items() if isinstance(v, dict)})
    return {k: v for k, v in out.items() if isinstance(v, dict) and v}


def plan_table(run: dict) -> str:
    """Per task kind, the commonest plans (the tools a trajectory called, in order), share
    of the kind's items before → after: where a second turn shows, or does not."""
    b, a, br, ar, _ = before_after(run)
    pb, pa = plans_from(b, br), plans_from(a, ar)
    kinds = [k for k in ["all"] + sorted((set(pb) | set(pa)) - {"all"}) if pb.get(k) or pa.get(k)]
    if not kinds:
        return ""
    body = []
    for k in kinds:
        xb, xa = pb.get(k, {}), pa.get(k, {})
        top = sorted(set(xb) | set(xa), key=lambda p: (-xa.get(p, 0), -xb.get(p, 0), p))[:4]
        cells = "".join(f"<td>{esc(p)}: {esc(pct(xb.get(p, 0.0) if k in pb else None))} → "
                        f"{esc(pct(xa.get(p, 0.0) if k in pa else None))}</td>" for p in top)
        body.append(f"<tr><th>{esc(k)}</th>{cells}</tr>")
    return ("<h3>Plans per task kind (before → after)</h3>"
            f'<table class="grid"><tbody>{"".join(body)}</tbody></table>'
            + note("A plan is the sequence of tools one trajectory called (“A > B”: A at turn 1, B at turn 2); "
                   "each cell is its share of the kind's held-out items, the four commonest after training "
                   "first."))


# The held-out item browser: every item with its before and after trajectory, drawn by
# report.js from an embedded JSON block (flipped items first).


def turn_payload(t: dict) -> dict:
    rec = t["record"]
    return {"turn": t["turn"], "planner": clip(t["raw"], CAP["planner"]), "saw": clip(t["prompt"], CAP["saw"]),
            "recorded": t["recorded"],
            **{f: clip(rec.get(f, ""), CAP.get(f, 300)) for f in ("sub_goal", "tool", "command", "result", "error",
                                                                   "verdict")},
            "loose": t["loose"], "tool_line": clip(t["tool_line"], 80), "no_tool": t["no_tool"],
            "tokens": t["tokens"], "at_cap": t["at_cap"]}


def item_side(row: dict, max_turns) -> dict:
    traj = row.get("trajectory") if isinstance(row.get("trajectory"), dict) else {}
    turns = planner_turns(traj)
    crash = [clip(e, CAP["error"]) for e in row.get("errors") or []
             if str(e).startswith(("crashed", "judge crashed"))]
    return {"correct": bool(row.get("correct")), "answer": clip(row.get("answer"), CAP["answer"]),
            "tools": [str(x) for x in row.get("tools") or [] if x], "turns": [turn_payload(t) for t in turns],
            "out": out_of_turns(turns, max_turns), "crash": crash}


CHANGE_ORDER = {"gained": 0, "lost": 1, "right": 2, "wrong": 3, "before only": 4, "after only": 5}


def items_payload(run: dict, br: list, ar: list) -> dict:
    max_turns = num(cfg_get(run["config"], "eval.max_turns"))
    items: dict = {}
    for side, rows in (("before", br), ("after", ar)):
        for r in rows:
            if not isinstance(r, dict) or r.get("id") is None:
                continue
            it = items.setdefault(str(r["id"]), {"id": str(r["id"]), "task": str(r.get("task") or ""),
                                                 "question": clip(r.get("question"), CAP["query"]),
                                                 "gold": [clip(x, CAP["gold"]) for x in (r.get("gold") or [])][:10],
                                                 "before": None, "after": None})
            it[side] = item_side(r, max_turns)
    for it in items.values():
        b, a = it["before"], it["after"]
        it["change"] = ("before only" if not a else "after only" if not b else
                        "gained" if a["correct"] and not b["correct"] else
                        "lost" if b["correct"] and not a["correct"] else "right" if a["correct"] else "wrong")
    ordered = sorted(items.values(), key=lambda it: (CHANGE_ORDER[it["change"]], it["id"]))
    return {"items": ordered, "max_turns": max_turns}


def section_items(run: dict, br: list | None, ar: list | None) -> str:
    head = '<h3 id="items">Held-out items: which changed, and how</h3>'
    if not br or not ar:
        return head + note("The item list needs both evaluations' results.jsonl (eval/step_0 and the final "
                           "eval/step_N, matching learning.json); " + ("neither is" if not br and not ar else
                                                                        "one is not") + " here.")
    data = items_payload(run, br, ar)
    counts = Counter(it["change"] for it in data["items"])
    return (head + note(f"{counts['gained']} items went wrong → right and {counts['lost']} right → wrong; "
                        f"{counts['right']} stayed right and {counts['wrong']} stayed wrong. Each item shows its "
                        "trajectory before (left) and after training (right): the planner's raw action, the tool "
                        "it was read as, the executor's command, the tool result, the answer. Flags: "
                        "<span class='flag'>loose</span> the tool line did not name the tool exactly, "
                        "<span class='flag'>cut</span> the action stopped at max_new_tokens, "
                        "<span class='flag'>out of turns</span> the turn budget ran out without STOP.")
            + '<div class="controls" id="item-controls">'
            '<label>change <select id="item-change"><option value="flipped">flipped (either way)</option>'
            '<option value="gained">wrong → right</option><option value="lost">right → wrong</option>'
            '<option value="right">stayed right</option><option value="wrong">stayed wrong</option>'
            '<option value="all">all items</option></select></label>'
            '<label>task kind <select id="item-kind"><option value="">all</option></select></label>'
            '<label>tool <select id="item-tool"><option value="">any</option></select></label>'
            '<label>flag <select id="item-flag"></select></label>'
            '<span id="item-status" class="status" role="status"></span></div>'
            '<div id="item-list"><p class="note">The item list needs JavaScript.</p></div>'
            f'<script type="application/json" id="items-data">{embed_json(data)}</script>')


# The paper's Table 1 beside ours, when eval.py --suite paper has written it.


def table_markdown(table: dict) -> str:
    """eval.py --suite paper's table.json as table.md: one row per benchmark in the paper's order,
    ours beside the paper's, the notes under it (paper_table_html shows the same in the report)."""
    def cell(p):
        return f"{100 * p['accuracy']:.1f} [{100 * p['ci95'][0]:.0f}, {100 * p['ci95'][1]:.0f}]" if p else "-"

    lines = ["| benchmark | n | frozen [95% CI] | trained [95% CI] | gain | tool calls / item | infra | time (s) "
             "| paper untrained | paper trained | paper gain |", "|---" * 11 + "|"]
    for b, (paper_untrained, paper_trained) in PAPER_TABLE_1.items():  # the paper's order
        r = table["benchmarks"].get(b)
        paper = f"{paper_untrained} | {paper_trained} | {paper_trained - paper_untrained:+.1f} |"
        if r is None:
            lines.append(f"| {b} | absent | | | | | | | {paper}")
            continue
        f, t = r["planners"].get("frozen"), r["planners"].get("trained")
        both = [p for p in (f, t) if p]
        gain = f"{100 * (t['accuracy'] - f['accuracy']):+.1f}" if f and t else "-"
        per = lambda key, form: " / ".join(form.format(p[key]) for p in both)  # noqa: E731
        lines.append(f"| {b} | {r['n']} | {cell(f)} | {cell(t)} | {gain} | {per('tool_calls_per_item', '{:.2f}')} | "
                     f"{per('infra_failures', '{}')} | {per('seconds', '{:.1f}')} | {paper}")
    return "\n".join(lines) + "\n\n" + "\n\n".join(table["notes"]) + "\n"


def paper_table_html(run: dict) -> str:
    """eval/paper/table.md (table_markdown's) as an HTML table, its notes under it."""
    text = run["paper_table"]
    if not text:
        return ""
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|---")]
    cells = lambda row, tag: "".join(f"<{tag}>{esc(c)}</{tag}>" for c in row)  # noqa: E731
    body = "".join(f"<tr>{cells(row, 'td')}</tr>" for row in rows[1:])
    return ("<h3>The paper's Table 1 beside ours (eval.py --suite paper)</h3><table class=\"grid\"><thead><tr>"
            f"{cells(rows[0], 'th')}</tr></thead><tbody>{body}</tbody></table>"
            + "".join(note(p, "note small") for p in text.split("\n\n") if not p.startswith("|")))


# The test-time turn-budget sweep, when the run has one.


def sweep_table(sweep: dict) -> str:
    """eval.py --sweep's result as text: a row per planner and budget, accuracy overall and per
    task kind, mean turns (turn_sweep_html shows it in the report)."""
    kinds = sorted({k for per in sweep["planners"].values() for s in per.values() for k in s.get("by_kind", {})})
    lines = [f"\n{'planner':24s}{'turns':>6s}{'all':>8s}" + "".join(f"{k:>12s}" for k in kinds)
             + f"{'mean turns':>12s}"]
    for label, per in sweep["planners"].items():
        lines += [f"{label:24.24s}{T:>6s}{s['accuracy']:8.3f}"
                  + "".join(f"{s['by_kind'][k]['accuracy']:12.3f}" for k in kinds) + f"{s['mean_turns']:12.2f}"
                  for T, s in per.items()]
    return "\n".join(lines)


def turn_sweep_html(run: dict) -> str:
    """The test-time turn-budget analysis (turn_sweep.json, when the run has one): held-out
    accuracy per budget and task kind, one column group per planner."""
    sweep = run["turn_sweep"]
    if not sweep:
        return note("No turn-budget sweep in this run (turn_sweep.json: accuracy under test-time turn "
                    "budgets, frozen vs trained planner).", "note dim")
    planners = {str(k): v for k, v in sweep["planners"].items() if isinstance(v, dict)}
    budgets = sorted({int(b) for v in planners.values() for b in v if str(b).isdigit()}
                     | {b for b in sweep.get("budgets") or [] if isinstance(b, int)})
    cell = lambda p, b: as_summary(planners[p].get(str(b))) or {}  # noqa: E731
    kinds = sorted({k for p in planners for b in budgets for k in cell(p, b).get("by_kind") or {}})
    head1 = "".join(f'<th colspan="{len(budgets)}">{esc(p)}</th>' for p in planners)
    head2 = "".join(f"<th>T = {b}</th>" for _ in planners for b in budgets)

    def acc(s):
        n, a = s.get("n"), num(s.get("accuracy"))
        if a is None:
            return "<td>—</td>"
        lo, hi = wilson(round(a * n), n) if isinstance(n, int) and n else (None, None)
        tip = f' title="{esc(f"n = {n}, 95% Wilson [{100 * lo:.1f}, {100 * hi:.1f}]")}"' if lo is not None else ""
        return f"<td{tip}>{esc(pct(a))}</td>"

    body = [f"<tr><th>accuracy, all</th>{''.join(acc(cell(p, b)) for p in planners for b in budgets)}</tr>"]
    body += [f'<tr><th class="sub">{esc(k)}</th>'
             f"{''.join(acc((cell(p, b).get('by_kind') or {}).get(k) or {}) for p in planners for b in budgets)}</tr>"
             for k in kinds]
    for key, label, digits in (("mean_turns", "mean turns used", 2), ("tool_error_rate", "tool-call error rate", 3)):
        body.append(f"<tr><th>{label}</th>"
                    + "".join(f"<td>{esc(fmt(cell(p, b).get(key), digits))}</td>" for p in planners for b in budgets)
                    + "</tr>")
    colors = dict(zip(planners, RUN_COLORS))
    figs = []
    for kind in ["all"] + kinds:
        series = []
        for p in planners:
            ys = [num((cell(p, b) if kind == "all" else (cell(p, b).get("by_kind") or {}).get(kind) or {})
                      .get("accuracy")) for b in budgets]
            series.append({"name": p, "xs": budgets, "ys": ys, "color": colors[p]})
        figs.append(figure(f"Accuracy by turn budget: {kind}", line_chart(series, "accuracy", "turn budget T",
                                                                          y_min=0, y_max=1),
                           "Held-out accuracy when the agent may take at most T turns.",
                           [(p, colors[p], "line") for p in planners]))
    return ('<h3 id="turn-sweep">Test-time turn budget</h3>'
            + note("The paper's test-time analysis: the same planners evaluated with more or fewer turns "
                   "allowed (turn_sweep.json). Hover a cell for n and its 95% Wilson interval.")
            + f'<table class="grid"><thead><tr><th rowspan="2">task kind</th>{head1}</tr><tr>{head2}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table><div class="charts">{"".join(figs)}</div>')


# ----------------------------------------------------------------------------------------
# Section 3: what was cut, and the training curves (curves.py)


def cut_table(run: dict) -> str:
    """Training rollouts (all steps) and the two held-out evaluations side by side: what
    the token cap cut, which tool names were read loosely, who ran out of turns."""
    cfg = run["config"]
    cap, t_train, t_eval = (cfg_get(cfg, k) for k in ("agent.planner.max_new_tokens", "agent.max_turns",
                                                      "eval.max_turns"))
    cols = []
    if run["train_stats"]:
        total = Counter()
        for st in run["train_stats"].values():
            total.update({k: v for k, v in st.items() if isinstance(v, int)})
        scored = [s for s in run["train_stats"] if any(m["step"] == s and num(m.get("planner_tokens")) is not None
                                                       for m in run["metrics"])]
        if not total.get("with_tokens") and scored:  # the loss's own token count, over the same actions
            total["tokens"] = sum(num(m["planner_tokens"]) for m in run["metrics"] if m["step"] in scored)
            total["with_tokens"] = sum(run["train_stats"][s]["actions"] for s in scored)
        names = sum((st["loose_names"] for st in run["train_stats"].values()), Counter())
        cols.append((f"training rollouts ({len(run['train_stats'])} steps)", {**total, "loose_names": names}, t_train))
    _, _, br, ar, _ = before_after(run)
    for label, rows in (("held-out, before", br), ("held-out, after", ar)):
        if rows:
            trajs = [r["trajectory"] for r in rows if isinstance(r.get("trajectory"), dict)]
            if trajs:
                cols.append((label, cut_counts(trajs, t_eval), t_eval))
    if not cols:
        return ""

    def share(k, n, lower=False):
        if not n:
            return "—"
        return f"{'≥ ' if lower else ''}{k}/{n} ({100 * k / n:.1f}%)"

    rows = {"planner actions": [], f"mean tokens per action (max_new_tokens = {cap})": [],
            "actions cut at max_new_tokens": [], "tool name matched loosely": [], "no tool named": [],
            "trajectories": [], "trajectories out of turns (budget T)": []}
    for label, c, budget in cols:
        n, mean = c.get("actions", 0), (c["tokens"] / c["with_tokens"] if c.get("with_tokens") else None)
        cells = list(rows.values())
        cells[0].append(str(n))
        cells[1].append(fmt(mean, 2) if mean is not None else "not recorded")
        if c.get("with_finish") == n and n:
            cells[2].append(share(c.get("at_cap", 0), n))
        elif mean is not None and cap:
            cells[2].append(share(round(max(0.0, mean - cap + 1) * n), n, lower=True))
        else:
            cells[2].append("not recorded")
        cells[3].append(share(c.get("loose", 0), n))
        cells[4].append(share(c.get("no_tool", 0), n))
        cells[5].append(str(c.get("trajectories", 0)))
        cells[6].append(share(c.get("out_of_turns", 0), c.get("trajectories", 0)) + f" (T = {budget})")
    loose = sum((c["loose_names"] for _, c, _ in cols), Counter())
    seen = ", ".join(f"“{esc(clip(line, 60))}” → {esc(tool)} ×{k}" for (line, tool), k in loose.most_common(6))
    head = "".join(f"<th>{esc(label)}</th>" for label, _, _ in cols)
    body = "".join(f"<tr><th>{esc(k)}</th>{''.join(f'<td>{esc(v)}</td>' for v in vs)}</tr>" for k, vs in rows.items())
    return ('<h3 id="cut">What was cut or read loosely</h3>'
            f'<table class="grid"><thead><tr><th></th>{head}</tr></thead><tbody>{body}</tbody></table>'
            + note("An action cut at max_new_tokens ends mid-sentence (its sub-goal reaches the executor cut). "
                   "≥: a lower bound from the mean length, where the logs do not say why each action ended. A "
                   "loose match is a tool line that names no tool exactly and was read through a tool's "
                   "aliases (agentflow.parse_plan)." + (f" Seen: {seen}." if seen else "")
                   + " The trajectory browser (section 5) and the item list (section 2) flag each one."))


def section_curves(run: dict) -> str:
    m = run["metrics"]
    parts = ['<section id="curves"><h2>3. Training curves</h2>', cut_table(run)]
    if not m:
        return "".join(parts) + note("<b>No training steps yet</b>: metrics.jsonl is missing or empty (train.py "
                                     "appends one row per finished step).", "note warn") + "</section>"
    parts.append("<h3>Curves</h3>")
    if len(m) > SMOOTH_FROM:
        parts.append(note(f"Faint lines: the value at each step; solid lines: a centred moving average over "
                          f"{smooth_window(len(m))} steps. Hover a held-out dot for its value. All charts share "
                          "one x-range."))
    else:
        parts.append(note("Hover a dot for its exact value. All charts share one x-range; rates are scaled to "
                          "their data."))
    vals = step_values(run)
    entry = (run, vals, curve_facts(run, vals), "", None)
    x_range = x_extent([vals])
    figs = [curve_figure(row, [entry], x_range) for row in CURVES]
    parts.append(f'<div class="charts">{"".join(figs)}</div></section>')
    return "".join(parts)


# ----------------------------------------------------------------------------------------
# Section 4: the tool-usage shift


def section_tool_shift(run: dict) -> str:
    return f'<section id="tool-shift"><h2>4. Tool-usage shift per task kind</h2>{tool_shift_figure(run)}</section>'


# ----------------------------------------------------------------------------------------
# Section 5: the trajectory browser (data embedded as JSON, drawn by report.js)


def pick_steps(steps: list[int], k: int) -> list[int]:
    """At most k steps, evenly spaced, always the first and the last."""
    if len(steps) <= k:
        return list(steps)
    return sorted({steps[round(i * (len(steps) - 1) / (k - 1))] for i in range(k)})


def _clean(v):
    """JSON-safe: NaN and inf become None (JSON.parse rejects them)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def train_ids(run: dict) -> dict[str, str]:
    """question -> item id in the run's training file (when it can still be found), so
    that a query group is named by its item. trajectories/step_N.jsonl rows that carry
    an "id" field are named by it directly."""
    paths = cfg_get(run["config"], "data.train")
    ids = {}
    for path in [paths] if isinstance(paths, str) else paths if isinstance(paths, list) else []:
        p = Path(path)
        found = [c for c in ([p] if p.is_absolute() else [p, ROOT / p]) if c.is_file() and c.suffix == ".jsonl"]
        ids.update({str(r.get("question")): str(r["id"]) for r in read_jsonl(found[0])
                    if isinstance(r, dict) and r.get("id") is not None} if found else {})
    return ids


def step_payload(path: Path, metrics_row: dict | None, G: int | None, ids: dict, max_turns) -> dict:
    """One step's trajectories as query groups of rollouts, text fields capped."""
    groups: dict = {}
    for k, tr in enumerate(read_jsonl(path)):
        gid = tr.get("group", k // G if G else 0)
        turns = planner_turns(tr)
        g = groups.setdefault(gid, {"group": gid, "id": str(tr.get("id") or ids.get(str(tr.get("query"))) or ""),
                                    "task": str(tr.get("task") or ""), "query": clip(tr.get("query"), CAP["query"]),
                                    "gold": [clip(x, CAP["gold"]) for x in (tr.get("gold") or [])][:10],
                                    "rollouts": []})
        right = tr.get("correct")  # the judge's verdict; older runs record only R, which was it
        g["rollouts"].append({"reward": num(tr.get("reward")), "advantage": num(tr.get("advantage")),
                              "correct": bool(right) if right is not None else (num(tr.get("reward")) or 0) > 0,
                              "answer": clip(tr.get("answer"), CAP["answer"]), "n_turns": tr.get("n_turns"),
                              "tools": [str(x) for x in tr.get("tools") or [] if x],
                              "turns": [turn_payload(t) for t in turns], "out": out_of_turns(turns, max_turns)})
    keep = ("reward_mean", "zero_variance_groups", "mean_turns", "tool_error_rate", "top_tool", "kl", "entropy")
    return {"groups": list(groups.values()),
            "metrics": {k: metrics_row.get(k) for k in keep if k in metrics_row} if metrics_row else None}


def embed_json(obj) -> str:
    """JSON for a <script type="application/json"> block: nothing in it can close the tag."""
    text = json.dumps(_clean(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return (text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def section_trajectories(run: dict) -> str:
    parts = ['<section id="trajectories"><h2>5. Trajectory browser</h2>']
    steps = list(run["traj_files"])
    if not steps:
        return parts[0] + note("<b>No trajectories in this folder</b>: train.py writes trajectories/step_N.jsonl "
                               "(every rollout of step N) as each step finishes; none is here yet.",
                               "note warn") + "</section>"
    G = cfg_get(run["config"], "train.group_size")
    max_turns = num(cfg_get(run["config"], "agent.max_turns"))
    by_metric = {r["step"]: r for r in run["metrics"]}
    ids = train_ids(run)
    cache: dict[int, dict] = {}
    k = MAX_EMBED_STEPS
    while True:  # fewer steps until the embedded JSON fits the budget
        chosen = pick_steps(steps, k)
        for s in chosen:
            if s not in cache:
                cache[s] = step_payload(run["traj_files"][s], by_metric.get(s), G, ids, max_turns)
        data = {"steps": chosen, "n_steps_total": len(steps), "by_step": {str(s): cache[s] for s in chosen}}
        blob = embed_json(data)
        if len(blob) <= MAX_EMBED_CHARS or k <= 2:
            break
        k = max(2, int(k * 0.7))
    shown = (f"all {len(steps)} steps with trajectories" if len(chosen) == len(steps) else
             f"{len(chosen)} of {len(steps)} steps (evenly spaced, first and last included, to keep this page small)")
    mode = cfg_get(run["config"], "train.advantage_mode")
    over = {"turn_rows": "over all planner turns of the G rollouts (advantage_mode turn_rows: a rollout with T_i "
                         "turns counts T_i times)",
            "per_turn": "over all planner turns of the G rollouts, each turn from its own score (advantage_mode "
                        "per_turn: the A_i shown is the mean of the rollout's turns')"}.get(mode, "over the G rollouts")
    parts.append(note(
        f"Embedded: {esc(shown)}. Each row is one query (named by its training item id where the training file "
        "is found); its columns are the G rollouts of that query, run independently from the same start. Per "
        "rollout: the reward R_i (the judge's 0/1 verdict on its final answer, ✓ or ✗, unless reward.terms "
        "weighs other terms in), and its "
        f"<b>advantage A_i = (R_i − mean R) / (std R + ε) {over}, broadcast to every planner "
        "turn</b>: every planner action of the rollout is pushed up (A_i &gt; 0) or down (A_i &lt; 0) with the "
        "same weight. Only the planner's action is trained; executor, verifier and generator are frozen. Long "
        f"fields are cut (tool results at {CAP['result']} characters). With a tool or flag filter, the "
        "rollouts of a shown query that do not match are dimmed."))
    parts.append('<div class="controls" id="traj-controls"><button type="button" id="prev-step">◀ previous</button>'
                 '<label>step <select id="step-select"></select></label>'
                 '<button type="button" id="next-step">next ▶</button>'
                 '<label>task kind <select id="traj-kind"><option value="">all</option></select></label>'
                 '<label>rewards <select id="traj-reward"><option value="">any</option>'
                 '<option value="signal">mixed (a learning signal)</option>'
                 '<option value="all1">all right</option><option value="all0">all wrong</option></select></label>'
                 '<label>tool <select id="traj-tool"><option value="">any</option></select></label>'
                 '<label>flag <select id="traj-flag"></select></label>'
                 '<span id="step-info" class="status" role="status"></span></div>'
                 '<div id="traj-groups"><p class="note">The trajectory browser needs JavaScript.</p></div>')
    parts.append(f'<script type="application/json" id="traj-data">{blob}</script>')
    parts.append("</section>")
    return "".join(parts)


# ----------------------------------------------------------------------------------------
# The page


def run_title(run: dict) -> tuple[str, str, str]:
    """The page title in three parts, (before, the folder's name, after)."""
    seed = cfg_get(run["config"], "seed")
    return "Flow-GRPO run report: ", run["dir"].resolve().name, f" (seed {seed})" if seed is not None else ""


def render(run: dict) -> str:
    out = run["dir"]
    have = {"config.json": run["config"] is not None, "metrics.jsonl": bool(run["metrics"]),
            "trajectories/": bool(run["traj_files"]), "eval/step_N/": bool(run["evals"]),
            "learning.json": run["learning"] is not None}
    before, name, after = run_title(run)
    title = before + name + after
    # report.js replaces the folder with where the page is opened from: a moved or copied
    # run directory is named as it is now, not where it was generated.
    head = (page_head(title) + f'<header><h1>{esc(before)}<span id="run-name">{esc(name)}</span>{esc(after)}</h1>'
            f'<div class="dim"><span id="run-dir" data-what="dir" title="the run directory">'
            f'{esc(out.resolve())}</span> · generated '
            f'{esc(time.strftime("%Y-%m-%d %H:%M:%S"))} · AgentFlow planner trained with Flow-GRPO</div>'
            f'<div class="prov" id="provenance">{provenance_line(run)}</div>' + "".join(header_warnings(run)))
    script = f"<script>{asset('report.js')}</script>"
    if not any(have.values()):
        return (head + "</header><main><section id=\"nothing\"><h2>Nothing to report yet</h2>"
                + note(f"This folder has none of the files a training run writes (config.json, metrics.jsonl, "
                       f"trajectories/, eval/, learning.json). Start one with <code>python train.py config.yaml "
                       f"out_dir={esc(out)}</code>, or point <code>python -m scripts.report</code> at a run's "
                       "out_dir.", "note warn")
                + "</section></main>" + script + "</body></html>\n")
    nav = ('<nav><a href="#run">1. run</a><a href="#before-after">2. before vs after</a><a href="#items">items</a>'
           '<a href="#curves">3. cut &amp; curves</a><a href="#tool-shift">4. tool shift</a>'
           '<a href="#trajectories">5. trajectories</a></nav>')
    missing = [k for k, v in have.items() if not v]
    body = []
    if missing:
        body.append(note("Not in this folder (yet): " + ", ".join(f"<code>{esc(k)}</code>" for k in missing)
                         + ". The sections below say what that leaves out.", "note warn"))
    for section in (section_run, section_before_after, section_curves, section_tool_shift, section_trajectories):
        body.append(guarded(section, run))
    return head + nav + "</header><main>" + "".join(body) + "</main>" + script + "</body></html>\n"
