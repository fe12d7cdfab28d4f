"""One self-contained HTML page per training run: what a learner would rather look at
than read logs.

    python report.py OUT_DIR            writes OUT_DIR/report.html and prints its path

`write_report(out_dir)` does the same from Python (train.py calls it after each
checkpoint and at the end of a run). The page has five sections:

  1. the run: model, seed, steps done, key hyper-parameters, where the wall time went;
  2. held-out accuracy before vs after training, overall and per task kind, tool-usage
     shares per kind, tool-call error rate, mean turns, with the deltas;
  3. training curves (small multiples, inline SVG): reward, KL, clip fraction, tool
     errors, tool shares, entropy, gradient norm, time per step, ...;
  4. the tool-usage shift per task kind, before vs after (stacked bars);
  5. a trajectory browser: pick a step, see each query's G rollouts side by side, with
     the reward R_i, the advantage A_i that every planner turn of rollout i was trained
     with, each turn's memory record and the planner's raw action, the answer vs the gold.

Every file of a run may be missing (a run in progress, evaluation switched off): each
section renders what exists and says what is not there. Nothing is fetched from the
network: CSS, SVG and the small script are inline; all text from the run is escaped
(html.escape in the markup; "<", ">" and "&" escaped inside the embedded JSON, which the
script only ever writes through textContent).
"""

import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks import read_jsonl
from charts import SMOOTH_FROM, esc, figure, line_chart, num, pct, shift_chart, smooth_window, stacked_bar_chart
from memory import cut
from tools import TOOL_CLASSES

MAX_EMBED_STEPS = 40  # trajectory steps embedded in the browser (evenly spaced, first and last kept)
MAX_EMBED_CHARS = 8_000_000  # and at most this much embedded JSON: fewer steps if needed
CAP = {"query": 600, "answer": 400, "sub_goal": 300, "command": 500, "result": 600, "error": 300,
       "planner": 500, "gold": 200}  # characters kept per embedded text field
TOOL_COLORS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#7f7f7f", "#000000"]
KNOWN_TOOLS = list(TOOL_CLASSES)  # tools.py's tools, in its order: each keeps its colour in every report
OKABE = {"blue": "#0072B2", "orange": "#E69F00", "green": "#009E73", "pink": "#CC79A7",
         "sky": "#56B4E9", "red": "#D55E00", "grey": "#7f7f7f"}


def write_report(out_dir) -> Path:
    """Render out_dir/report.html from whatever the run has written so far; return its path.

    Raises FileNotFoundError if out_dir is not a directory. A directory with nothing of a
    run in it still gets a page, one that says so."""
    out = Path(out_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"no run directory at {out}")
    page = render(load_run(out))
    path = out / "report.html"
    tmp = out / f".report.html.{os.getpid()}.tmp"
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees a half-written page
    return path


# ----------------------------------------------------------------------------------------
# Reading a run directory. Every reader tolerates a missing file and a line cut short by
# an interruption.


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _step_of(name: str) -> int | None:
    """step_12 or step_12.jsonl -> 12."""
    stem = name.split(".")[0]
    if stem.startswith("step_") and stem[5:].isdigit():
        return int(stem[5:])
    return None


def _shares(v) -> dict:
    """A {tool: share} dict with numeric shares, whatever the file held."""
    return {str(k): x for k, x in v.items() if num(x) is not None} if isinstance(v, dict) else {}


def _summary(s):
    """An evaluation summary with the nested fields the page reads in the expected shape."""
    if not isinstance(s, dict):
        return None
    s = {**s, "tool_shares": _shares(s.get("tool_shares"))}
    kinds = s.get("by_kind") if isinstance(s.get("by_kind"), dict) else {}
    s["by_kind"] = {str(k): _summary(v) for k, v in kinds.items() if isinstance(v, dict)}
    return s


def load_run(out: Path) -> dict:
    """Everything the page needs except trajectories, which are read only for the steps
    the browser embeds."""
    metrics = {}
    for row in read_jsonl(out / "metrics.jsonl"):
        if isinstance(row.get("step"), int):
            row["tool_shares"] = _shares(row.get("tool_shares"))
            metrics[row["step"]] = row  # a resumed run may repeat a step: the last row wins
    evals, other_evals = {}, {}
    if (out / "eval").is_dir():
        for d in sorted((out / "eval").iterdir()):
            summary = _summary(_read_json(d / "summary.json")) if d.is_dir() else None
            if summary is None:
                continue
            entry = {"summary": summary, "results": read_jsonl(d / "results.jsonl"), "dir": d.name}
            step = _step_of(d.name)
            if step is not None:
                evals[step] = entry  # train.py's held-out evaluations, step 0 = before training
            else:
                other_evals[d.name] = entry  # eval.py runs with its default --out
    traj_files = {}
    if (out / "trajectories").is_dir():
        for p in (out / "trajectories").glob("step_*.jsonl"):
            if _step_of(p.name) is not None:
                traj_files[_step_of(p.name)] = p
    config = _read_json(out / "config.json")
    learning = _read_json(out / "learning.json")
    if isinstance(learning, dict):
        learning = {k: _summary(v) for k, v in learning.items()}
    return {"dir": out, "config": config if isinstance(config, dict) else None,
            "metrics": [metrics[k] for k in sorted(metrics)], "evals": evals, "other_evals": other_evals,
            "learning": learning if isinstance(learning, dict) else None,
            "traj_files": dict(sorted(traj_files.items()))}


# ----------------------------------------------------------------------------------------
# Small formatting helpers


def cfg_get(cfg: dict | None, dotted: str, default=None):
    node = cfg
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def fmt(v, digits=3) -> str:
    v = num(v)
    if v is None:
        return "—"
    if v != 0 and (abs(v) < 10 ** -digits or abs(v) >= 1e6):
        return f"{v:.2e}"
    return f"{v:.{digits}f}"


def duration(seconds: float) -> str:
    s = int(round(seconds))
    if seconds < 60:
        return f"{seconds:.1f} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def clip(text, limit: int) -> str:
    """A text field of the run, embedded in at most `limit` characters (memory.cut)."""
    return cut("" if text is None else str(text), limit)


def note(text: str, cls: str = "note") -> str:
    """A sentence of explanation; `text` is already HTML."""
    return f'<p class="{cls}">{text}</p>'


def tool_colors(run: dict) -> dict[str, str]:
    """One colour per tool, the same in every chart and every run's report. Listed in the
    configured order (then any other tool seen), coloured by tools.py's order."""
    names = [str(t) for t in cfg_get(run["config"], "agent.tools", []) or []]
    seen = set()
    for m in run["metrics"]:
        seen |= set((m.get("tool_shares") or {}).keys())
    for e in list(run["evals"].values()) + [v for v in (run["learning"] or {}).values() if isinstance(v, dict)]:
        s = e.get("summary", e)
        seen |= set((s.get("tool_shares") or {}).keys())
        for k in (s.get("by_kind") or {}).values():
            seen |= set((k.get("tool_shares") or {}).keys())
    names += sorted(str(t) for t in seen if str(t) not in names)
    others = [t for t in names if t not in KNOWN_TOOLS]
    return {t: TOOL_COLORS[(KNOWN_TOOLS.index(t) if t in KNOWN_TOOLS else len(KNOWN_TOOLS) + others.index(t))
                           % len(TOOL_COLORS)] for t in names}


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
    rows = [("model", cfg_get(cfg, "model.name")), ("seed", cfg_get(cfg, "seed")),
            ("steps done", f"{steps_done} of {planned if planned is not None else '?'}{status}"),
            ("queries per step Q", t.get("queries_per_step")), ("rollouts per query G", t.get("group_size")),
            ("learning rate", t.get("lr")), ("KL coefficient β", t.get("beta")),
            ("clip ε low / high", f'{t.get("eps_low", "?")} / {t.get("eps_high", "?")}'
             if "eps_low" in t or "eps_high" in t else None),
            ("max turns (train / eval)", f'{cfg_get(cfg, "agent.max_turns", "?")} / '
             f'{cfg_get(cfg, "eval.max_turns", "?")}' if cfg else None),
            ("advantage mode", t.get("advantage_mode")),
            ("epochs × minibatches per step", f'{t["epochs"]} × {t["minibatches"]}'
             if "epochs" in t and "minibatches" in t else None),
            ("planner temperature (training)", cfg_get(cfg, "agent.planner.temperature")),
            ("tool-token temperature (training)", cfg_get(cfg, "agent.planner.first_temperature") or None),
            ("planner in held-out evaluation", None if cfg_get(cfg, "eval.planner_temperature") is None else
             "greedy" if cfg_get(cfg, "eval.planner_temperature") == 0 else
             f'temperature {cfg_get(cfg, "eval.planner_temperature")}'),
            ("toolset K", ", ".join(map(str, cfg_get(cfg, "agent.tools", []) or [])) or None),
            ("trained layers", (t.get("train_layers") or "all") if "train_layers" in t else None)]
    cells = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in rows if v is not None)
    parts = ['<section id="run"><h2>1. The run</h2>']
    if not cfg:
        parts.append(note("<b>config.json is missing</b>: hyper-parameters unknown; the run was not started "
                          "by train.py or the file was removed."))
    parts.append(f'<div class="cols"><table class="kv">{cells}</table>')

    # Where the time went.
    totals = {k: sum(num(m.get(f"time_{k}")) or 0.0 for m in metrics) for k in ("rollout", "judge", "update")}
    total = sum(totals.values())
    if total > 0:
        colors = {"rollout": OKABE["blue"], "judge": OKABE["orange"], "update": OKABE["green"]}
        bar = "".join(f'<div style="width:{100 * v / total:.2f}%;background:{colors[k]}" '
                      f'title="{esc(k)}: {esc(duration(v))}"></div>' for k, v in totals.items() if v > 0)
        lines = "".join(f'<tr><th><i class="sw box" style="--c:{colors[k]}"></i>{esc(k)}</th>'
                        f'<td>{esc(duration(v))}</td><td>{100 * v / total:.1f}%</td></tr>'
                        for k, v in totals.items())
        parts.append(f'<div><h3>Wall time of {len(metrics)} training steps: {esc(duration(total))}</h3>'
                     f'<div class="timebar">{bar}</div><table class="kv">{lines}</table>'
                     + note("rollout = the four-module loop sampling Q×G trajectories; judge = scoring the "
                            "final answers; update = the Flow-GRPO loss and optimizer steps. Held-out "
                            "evaluations and checkpoints are not included.") + "</div>")
    else:
        parts.append('<div>' + note("No timing yet: metrics.jsonl has no steps.") + "</div>")
    parts.append("</div>")
    if metrics:
        last = metrics[-1]
        parts.append(note(f"Last step ({esc(last['step'])}): reward mean {esc(fmt(last.get('reward_mean')))}, "
                          f"KL {esc(fmt(last.get('kl'), 4))}, mean turns {esc(fmt(last.get('mean_turns'), 2))}, "
                          f"most used tool {esc(last.get('top_tool', '—'))}."))
    parts.append("</section>")
    return "".join(parts)


# ----------------------------------------------------------------------------------------
# Section 2: held-out before vs after


def before_after(run: dict) -> tuple[dict | None, dict | None, list | None, list | None, str]:
    """(before summary, after summary, before results rows, after results rows, where from)."""
    evals = run["evals"]
    first = evals.get(0)
    last_step = max((s for s in evals if s > 0), default=None)
    last = evals.get(last_step) if last_step is not None else None
    learning = run["learning"] or {}
    b, a = learning.get("before"), learning.get("after")
    if isinstance(b, dict) or isinstance(a, dict):
        b = b if isinstance(b, dict) else None
        a = a if isinstance(a, dict) else None
        same = lambda s, e: bool(s and e and s.get("n") == e["summary"].get("n")  # noqa: E731
                                 and s.get("accuracy") == e["summary"].get("accuracy"))
        return (b, a, first["results"] if same(b, first) else None,
                last["results"] if same(a, last) else None, "learning.json")
    src = " and ".join(f"eval/{e['dir']}" for e in (first, last) if e)
    if last:
        src += f" (no learning.json yet: 'after' is the latest held-out evaluation, at step {last_step})"
    return (first["summary"] if first else None, last["summary"] if last else None,
            first["results"] if first else None, last["results"] if last else None, src)


def shares_from_results(rows: list[dict]) -> dict[str, dict[str, tuple[float, int]]]:
    """{task kind ('all' too): {tool: (share among tool calls, calls)}} from results.jsonl rows."""
    by_kind: dict[str, Counter] = {"all": Counter()}
    for r in rows:
        tools = [str(t) for t in (r.get("tools") or []) if t]
        by_kind["all"].update(tools)
        if r.get("task"):
            by_kind.setdefault(str(r["task"]), Counter()).update(tools)
    out = {}
    for kind, c in by_kind.items():
        n = sum(c.values())
        out[kind] = {t: (k / n, k) for t, k in sorted(c.items())} if n else {}
    return out


def shares_from_summary(s: dict) -> dict[str, dict[str, tuple[float, int | None]]]:
    out = {"all": {t: (v, None) for t, v in (s.get("tool_shares") or {}).items()}}
    for kind, k in (s.get("by_kind") or {}).items():
        out[kind] = {t: (v, None) for t, v in (k.get("tool_shares") or {}).items()}
    return out


def tool_shares_ba(run) -> tuple[dict | None, dict | None, str]:
    b, a, br, ar, _ = before_after(run)
    sb = shares_from_results(br) if br else (shares_from_summary(b) if b else None)
    sa = shares_from_results(ar) if ar else (shares_from_summary(a) if a else None)
    how = "computed from eval results.jsonl" if (br or ar) else "from the evaluation summaries"
    return sb, sa, how


def delta_cell(b, a, good: str = "up", scale: float = 1.0, unit: str = "", digits: int = 1) -> str:
    """The change after - before, coloured green when it is an improvement."""
    b, a = num(b), num(a)
    if b is None or a is None:
        return "<td>—</td>"
    d = round((a - b) * scale, digits)
    if d == 0:
        return "<td>±0</td>"
    cls = ""
    if good != "none":
        cls = "good" if (d > 0) == (good == "up") else "bad"
    return f'<td class="{cls}">{d:+.{digits}f}{esc(unit)}</td>'


def section_before_after(run: dict) -> str:
    b, a, _, _, src = before_after(run)
    parts = ['<section id="before-after"><h2>2. Held-out evaluation: before vs after training</h2>']
    if not b and not a:
        parts.append(note("<b>No held-out evaluation yet.</b> train.py writes eval/step_0 before the first step "
                          "and eval/step_N plus learning.json after the last one (when "
                          "train.eval_before_after is true). Neither is in this folder.", "note warn"))
    else:
        parts.append(note(f"Source: {esc(src)}. <i>Before</i> = the untrained planner (step 0); <i>after</i> = "
                          "the planner after Flow-GRPO. Same held-out items and evaluation seed on both sides; a "
                          "crashed item counts as wrong. Δ = after − before, in percentage points (pp) for "
                          "accuracies and rates; green = better."))
        if not a:
            parts.append(note("<b>No after-training evaluation yet</b> (the run or its final evaluation has not "
                              "finished): only the before column is filled.", "note warn"))
        if not b:
            parts.append(note("<b>No before-training evaluation</b> (eval/step_0 and learning.json's 'before' "
                              "are missing): only the after column is filled.", "note warn"))
        b, a = b or {}, a or {}
        kinds = sorted(set(b.get("by_kind") or {}) | set(a.get("by_kind") or {}))
        bk = lambda s, k: (s.get("by_kind") or {}).get(k, {})  # noqa: E731

        def row(label, bv, av, render, good, scale=1.0, unit="", digits=1):
            sub = ' class="sub"' if label.startswith("&nbsp;") else ""
            label = label.replace("&nbsp;&nbsp;", "")
            return (f"<tr><th{sub}>{label}</th><td>{esc(render(bv))}</td><td>{esc(render(av))}</td>"
                    f"{delta_cell(bv, av, good, scale, unit, digits)}</tr>")

        n = lambda s: f' <span class="dim">(n={esc(s.get("n", "?"))})</span>'  # noqa: E731
        rows = [row(f"accuracy, all items{n(a or b)}", b.get("accuracy"), a.get("accuracy"), pct, "up", 100, " pp")]
        rows += [row(f"&nbsp;&nbsp;accuracy, {esc(k)}{n(bk(a, k) or bk(b, k))}", bk(b, k).get("accuracy"),
                     bk(a, k).get("accuracy"), pct, "up", 100, " pp") for k in kinds]
        rows += [row("mean F1", b.get("mean_f1"), a.get("mean_f1"), fmt, "up", 1, "", 3),
                 row("tool-call error rate", b.get("tool_error_rate"), a.get("tool_error_rate"), pct, "down", 100,
                     " pp")]
        rows += [row(f"&nbsp;&nbsp;tool-call error rate, {esc(k)}", bk(b, k).get("tool_error_rate"),
                     bk(a, k).get("tool_error_rate"), pct, "down", 100, " pp") for k in kinds]
        rows += [row("mean turns", b.get("mean_turns"), a.get("mean_turns"), lambda v: fmt(v, 2), "none", 1, "", 2)]
        rows += [row(f"&nbsp;&nbsp;mean turns, {esc(k)}", bk(b, k).get("mean_turns"), bk(a, k).get("mean_turns"),
                     lambda v: fmt(v, 2), "none", 1, "", 2) for k in kinds]
        rows += [row("crashed items", b.get("crashed"), a.get("crashed"), lambda v: "—" if v is None else str(v),
                     "down", 1, "", 0)]
        parts.append('<table class="grid"><thead><tr><th></th><th>before</th><th>after</th><th>Δ</th></tr></thead>'
                     f'<tbody>{"".join(rows)}</tbody></table>')

        # Tool shares per kind: one column per tool, "before → after (Δ)".
        sb, sa, how = tool_shares_ba(run)
        sb, sa = sb or {}, sa or {}
        tools = [t for t in tool_colors(run) if any(t in d for d in list(sb.values()) + list(sa.values()))]
        kinds_all = ["all"] + [k for k in sorted(set(sb) | set(sa)) if k != "all"]
        if tools:
            head = "".join(f'<th><i class="sw box" style="--c:{esc(tool_colors(run)[t])}"></i>{esc(t)}</th>'
                           for t in tools)
            body = []
            for k in kinds_all:
                cells = []
                for t in tools:
                    bv = sb.get(k, {}).get(t, (0.0, 0))[0] if k in sb else None
                    av = sa.get(k, {}).get(t, (0.0, 0))[0] if k in sa else None
                    d = "" if bv is None or av is None else \
                        f' <span class="dim">({round(100 * (av - bv)) + 0:+d})</span>'
                    cells.append(f"<td>{esc(pct(bv))} → {esc(pct(av))}{d}</td>")
                body.append(f"<tr><th>{esc(k)}</th>{''.join(cells)}</tr>")
            parts.append(f"<h3>Tool-usage shares per task kind (before → after, Δ pp)</h3>"
                         f'<table class="grid"><thead><tr><th>task kind</th>{head}</tr></thead>'
                         f'<tbody>{"".join(body)}</tbody></table>'
                         + note(f"Share of each tool among all tool calls of that kind's items ({esc(how)}). "
                                "The paper's finding to look for: the trained planner shifts its tool choice per "
                                "task kind." + (" On the built-in suite the right tools are Python_Coder for "
                                "arithmetic, Local_Search for lookup, and Local_Search then Python_Coder for two_step." if set(kinds_all) <=
                                {"all", "arithmetic", "lookup", "two_step"} else "")))
        else:
            parts.append(note("No tool calls recorded in the evaluations."))
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


# ----------------------------------------------------------------------------------------
# Section 3: training curves. One row of CURVES per small chart; `step_values` turns a
# run into {series key: {step: value}}, and `curve_figure` draws one row from it.
#
# A row: title, y-axis label, y-axis ("unit" = 0..1, "zero" = from the data, with 0 in
# view, "free" = from the data, "turns" = 0..T_max), its series, and the explanation
# under the chart (HTML; {placeholders} filled from `curve_facts`). A series is
# (key, label, colour, style): style "line", "dash", "points" (held-out dots) or "box"
# (a stacked bar); key "tool_share:*" is one series per tool.

CURVES = [
    ("Reward and accuracy", "reward / accuracy", "unit", [
        ("reward_mean", "reward mean (train rollouts)", "blue", "line"),
        ("accuracy", "accuracy (train rollouts)", "green", "dash"),
        ("heldout_accuracy", "held-out accuracy", "orange", "points")],
     "Mean reward R over the step's Q×G rollouts{reward_note} Open dots: held-out accuracy from eval/step_N "
     "(step 0 = before training). Training rollouts sample, exploring on purpose, while a greedy held-out "
     "evaluation (eval.planner_temperature = 0) takes the most likely tool: compare each series with itself, "
     "not with the other.{heldout_note}"),
    ("Groups with no learning signal", "share of query groups", "unit", [
        ("zero_variance_groups", "zero-variance groups", "red", "line")],
     "Share of queries whose G rollouts all got the same reward: every A_i is 0, so they teach nothing. "
     "Near 1 means the tasks are too easy or too hard for the current planner."),
    ("KL to the reference policy", "KL(π_θ ‖ π_ref)", "zero", [("kl", "KL", "pink", "line")],
     "k3 estimate of the KL between the trained planner and the frozen initial weights, per planner token, "
     "averaged like the loss (over tokens, turns and rollouts). Penalised with weight β."),
    ("Clip fraction", "share of planner tokens", "zero", [("clip_frac", "clip fraction", "sky", "line")],
     "Share of planner tokens where the clip bites: ρ &lt; 1−ε_low with A &lt; 0, or ρ &gt; 1+ε_high with "
     "A &gt; 0. Always 0 when each batch gets a single update (ρ = 1 on the first pass)."),
    ("Tool-call error rate", "errors / tool calls", "unit", [
        ("tool_error_rate", "train rollouts", "red", "line"),
        ("heldout_tool_error_rate", "held-out", "orange", "points")],
     "Failed tool calls (bad plan, tool error) over all tool calls. The paper reports it falls with training."),
    ("Tool shares during training", "share of tool calls", "unit", [("tool_share:*", "", "", "line")],
     "Which tools the planner picks in the training rollouts, as a share of all tool calls of the step."),
    ("Policy entropy", "nats per token", "zero", [("entropy", "entropy", "green", "line")],
     "Mean entropy of the planner's (temperature-scaled) next-token distribution over its action tokens. "
     "A collapse towards 0 means the planner stopped exploring."),
    ("Gradient norm", "‖g‖ before clipping", "zero", [("grad_norm", "grad norm", "blue", "line")],
     "Gradient norm per optimizer step, before it is clipped to train.max_grad_norm. Only the KL term pushes "
     "when every group has zero variance."),
    ("Turns per trajectory", "mean turns", "turns", [("mean_turns", "mean turns", "orange", "line")],
     "Mean planner turns per training rollout{budget_note}; the verifier stops a trajectory early when memory "
     "is enough."),
    ("Loss", "−J", "free", [("loss", "loss", "grey", "line")],
     "The minimised Flow-GRPO objective −J (clipped surrogate + β·KL). Its level is not comparable across "
     "steps: advantages are renormalised per group."),
    ("Sampler vs trainer log-prob gap", "|Δ log-prob|", "zero", [("logprob_gap", "log-prob gap", "pink", "line")],
     "Largest difference between a token's log-prob recorded while sampling and the one the loss recomputes "
     "before the first update. Should stay ~0 (float noise): the update is on-policy."),
    ("Time per step", "seconds", "zero", [
        ("time_rollout", "rollout", "blue", "box"), ("time_judge", "judge", "orange", "box"),
        ("time_update", "update", "green", "box")],
     "Wall time of each step, split into rollout, judge and update."),
]


def step_values(run: dict) -> dict[str, dict[int, float]]:
    """{series key: {step: value}} for every key CURVES can name: the metrics rows' own
    keys, held-out points from eval/step_N, and one tool_share:NAME per tool."""
    vals: dict[str, dict[int, float]] = {}
    for r in run["metrics"]:
        for k, v in r.items():
            if num(v) is not None and k != "step":
                vals.setdefault(k, {})[r["step"]] = num(v)
        if r.get("tool_shares"):
            for t in tool_colors(run):
                vals.setdefault(f"tool_share:{t}", {})[r["step"]] = num(r["tool_shares"].get(t, 0.0))
    for s, e in run["evals"].items():
        for key, name in (("accuracy", "heldout_accuracy"), ("tool_error_rate", "heldout_tool_error_rate")):
            if num(e["summary"].get(key)) is not None:
                vals.setdefault(name, {})[s] = num(e["summary"][key])
    return {k: v for k, v in vals.items() if any(x is not None for x in v.values())}


def curve_facts(run: dict, vals: dict) -> dict[str, str]:
    """What the explanations of CURVES fill in."""
    same = vals.get("reward_mean") == vals.get("accuracy")
    max_turns = num(cfg_get(run["config"], "agent.max_turns"))
    return {"reward_note": " (= accuracy: the rewards are 0/1)." if same else
            "; accuracy = share of rollouts with R &gt; 0.",
            "heldout_note": "" if vals.get("heldout_accuracy") else " No held-out points: no eval/step_N yet.",
            "budget_note": f" (budget T_max = {max_turns:g})" if max_turns else ""}


def expand_series(run: dict, specs: list, vals: dict) -> list[tuple[str, str, str, str]]:
    """CURVES series with their colours resolved, "tool_share:*" expanded, and series that
    carry no data (or repeat the reward line) dropped."""
    out = []
    for key, label, color, style in specs:
        if key == "tool_share:*":
            out += [(f"tool_share:{t}", t, c, style) for t, c in tool_colors(run).items()
                    if f"tool_share:{t}" in vals]
        elif key in vals and not (key == "accuracy" and vals[key] == vals.get("reward_mean")):
            out.append((key, label, OKABE.get(color, color), style))
    return out


def curve_figure(run: dict, row: tuple, vals: dict, facts: dict) -> str:
    title, y_label, axis, specs, explain = row
    series = expand_series(run, specs, vals)
    missing = f"metrics.jsonl has no '{specs[0][0].split(':')[0].replace('tool_share', 'tool_shares')}'"
    keys = [(label, color, "dot" if style == "points" else style) for _, label, color, style in series]
    if len(series) == 1 and series[0][3] == "line":
        keys = None  # the title says what the one line is
    if not series:
        svg = None
    elif series[0][3] == "box":
        xs = sorted({s for key, *_ in series for s in vals[key]})
        svg = stacked_bar_chart(xs, [{"name": label, "color": color, "ys": [vals[key].get(x) for x in xs]}
                                     for key, label, color, _ in series], y_label)
        keys = [(label, color, "box") for _, label, color, _ in series]
    else:
        max_turns = num(cfg_get(run["config"], "agent.max_turns"))
        y_min, y_max, zero = {"unit": (0, 1, False), "zero": (None, None, True), "free": (None, None, False),
                              "turns": (0 if max_turns else None, max_turns or None, True)}[axis]
        lines = []
        for key, label, color, style in series:
            xs = sorted(vals[key])
            lines.append({"name": label, "xs": xs, "ys": [vals[key][x] for x in xs], "color": color,
                          "dash": style == "dash", "points": style == "points"})
        svg = line_chart(lines, y_label, y_min=y_min, y_max=y_max, zero=zero)
    return figure(title, svg, explain.format(**facts), keys, missing)


def section_curves(run: dict) -> str:
    m = run["metrics"]
    parts = ['<section id="curves"><h2>3. Training curves</h2>']
    if not m:
        parts.append(note("<b>No training steps yet</b>: metrics.jsonl is missing or empty (train.py appends "
                          "one row per finished step).", "note warn") + "</section>")
        return "".join(parts)
    if len(m) > SMOOTH_FROM:
        parts.append(note(f"Faint lines: the value at each step; solid lines: a centred moving average over "
                          f"{smooth_window(len(m))} steps. Hover a held-out dot for its value."))
    else:
        parts.append(note("Hover a dot for its exact value."))
    vals = step_values(run)
    facts = curve_facts(run, vals)
    figs = [curve_figure(run, row, vals, facts) for row in CURVES]
    parts.append(f'<div class="charts">{"".join(figs)}</div></section>')
    return "".join(parts)


# ----------------------------------------------------------------------------------------
# Section 4: tool-usage shift per task kind


def section_tool_shift(run: dict) -> str:
    parts = ['<section id="tool-shift"><h2>4. Tool-usage shift per task kind</h2>']
    sb, sa, how = tool_shares_ba(run)
    colors = dict(tool_colors(run))
    for d in (sb or {}, sa or {}):  # a tool seen only in eval rows still gets a colour
        for shares in d.values():
            for t in shares:
                colors.setdefault(t, TOOL_COLORS[len(colors) % len(TOOL_COLORS)])
    b, a, *_ = before_after(run)
    b, a = b or {}, a or {}
    acc = {"all": (num(b.get("accuracy")), num(a.get("accuracy")))}
    for k in set(b.get("by_kind") or {}) | set(a.get("by_kind") or {}):
        acc[k] = (num((b.get("by_kind") or {}).get(k, {}).get("accuracy")),
                  num((a.get("by_kind") or {}).get(k, {}).get("accuracy")))
    svg = shift_chart(sb or {}, sa or {}, colors, acc) if (sb or sa) else None
    if svg is None:
        why = ("no held-out evaluation in this folder yet" if not (sb or sa)
               else "the evaluations recorded no tool calls")
        parts.append(figure("Tool shares before vs after", None, "", missing=why))
    else:
        used = [t for t in colors if any(t in s for d in (sb or {}, sa or {}) for s in d.values())]
        parts.append(figure("Tool shares before vs after, per task kind", svg,
                            f"Each bar splits 100% of the held-out tool calls of one task kind ({esc(how)}); "
                            "hover a segment for the exact share and call count. Under each kind: its held-out "
                            "accuracy before → after."
                            + ("" if sa else " <b>No after-training evaluation yet.</b>")
                            + ("" if sb else " <b>No before-training evaluation.</b>"),
                            [(t, colors[t], "box") for t in used]))
    parts.append("</section>")
    return "".join(parts)


# ----------------------------------------------------------------------------------------
# Section 5: the trajectory browser (data embedded as JSON, drawn by a small script)


def pick_steps(steps: list[int], k: int) -> list[int]:
    """At most k steps, evenly spaced, always the first and the last."""
    if len(steps) <= k:
        return list(steps)
    if k <= 1:
        return [steps[-1]]
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


def step_payload(path: Path, metrics_row: dict | None, G: int | None) -> dict:
    """One step's trajectories as query groups of rollouts, text fields capped."""
    groups: dict = {}
    for k, tr in enumerate(read_jsonl(path)):
        gid = tr.get("group", k // G if G else 0)
        log, memory = (tr.get(k) if isinstance(tr.get(k), list) else [] for k in ("log", "memory"))
        planner = {e.get("turn"): e.get("output", "") for e in log
                   if isinstance(e, dict) and e.get("module") == "planner"}
        records = {r.get("turn"): r for r in memory if isinstance(r, dict)}
        turns = []
        for t in sorted(t for t in set(records) | set(planner) if isinstance(t, int)):
            r = records.get(t, {})
            turns.append({"turn": t, "planner": clip(planner.get(t), CAP["planner"]),
                          **{f: clip(r.get(f, ""), CAP.get(f, 300)) for f in ("sub_goal", "tool", "command", "result",
                                                                              "error", "verdict")},
                          "recorded": t in records})
        g = groups.setdefault(gid, {"group": gid, "task": tr.get("task", ""),
                                    "query": clip(tr.get("query"), CAP["query"]),
                                    "gold": [clip(x, CAP["gold"]) for x in (tr.get("gold") or [])][:10],
                                    "rollouts": []})
        g["rollouts"].append({"reward": num(tr.get("reward")), "advantage": num(tr.get("advantage")),
                              "answer": clip(tr.get("answer"), CAP["answer"]), "n_turns": tr.get("n_turns"),
                              "tools": [str(x) for x in tr.get("tools") or [] if x], "turns": turns})
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
        parts.append(note("<b>No trajectories in this folder</b>: train.py writes trajectories/step_N.jsonl "
                          "(every rollout of step N) as each step finishes; none is here yet.", "note warn"))
        parts.append("</section>")
        return "".join(parts)
    G = cfg_get(run["config"], "train.group_size")
    by_metric = {r["step"]: r for r in run["metrics"]}
    cache: dict[int, dict] = {}
    k = MAX_EMBED_STEPS
    while True:  # fewer steps until the embedded JSON fits the budget
        chosen = pick_steps(steps, k)
        for s in chosen:
            if s not in cache:
                cache[s] = step_payload(run["traj_files"][s], by_metric.get(s), G)
        data = {"steps": chosen, "n_steps_total": len(steps), "by_step": {str(s): cache[s] for s in chosen}}
        blob = embed_json(data)
        if len(blob) <= MAX_EMBED_CHARS or k <= 2:
            break
        k = max(2, int(k * 0.7))
    shown = (f"all {len(steps)} steps with trajectories" if len(chosen) == len(steps) else
             f"{len(chosen)} of {len(steps)} steps (evenly spaced, first and last included, to keep this page small)")
    turn_rows = cfg_get(run["config"], "train.advantage_mode") == "turn_rows"
    over = ("over all planner turns of the G rollouts (advantage_mode turn_rows: a rollout with T_i turns counts "
            "T_i times)" if turn_rows else "over the G rollouts")
    parts.append(note(
        f"Embedded: {esc(shown)}. Each row is one query; its columns are the G rollouts of that query, run "
        "independently from the same start. Per rollout: the reward R_i ∈ {0, 1} of its final answer, and its "
        f"<b>advantage A_i = (R_i − mean R) / (std R + ε) {over}, broadcast to every planner "
        "turn</b>: every planner action of the rollout is pushed up (A_i &gt; 0) or down (A_i &lt; 0) with the "
        "same weight. Only the planner's action is trained; executor, verifier and generator are frozen. Long "
        f"fields are cut (tool results at {CAP['result']} characters)."))
    parts.append('<div class="controls"><button type="button" id="prev-step">◀ previous</button>'
                 '<label>step <select id="step-select"></select></label>'
                 '<button type="button" id="next-step">next ▶</button>'
                 '<label><input type="checkbox" id="only-signal"> only groups with a learning signal '
                 '(rewards not all equal)</label><span id="step-info" class="dim"></span></div>'
                 '<div id="traj-groups"><p class="note">The trajectory browser needs JavaScript.</p></div>')
    parts.append(f'<script type="application/json" id="traj-data">{blob}</script>')
    parts.append("</section>")
    return "".join(parts)






# ----------------------------------------------------------------------------------------
# Provenance: what a reader needs to see why the same seed gives another number on
# another machine. train.py calls record_run once, right after it writes config.json.


def provenance(cfg: dict) -> dict:
    """This process: seed, code version, library versions, CPU, threads, start time."""
    import platform
    import subprocess

    import torch
    import transformers

    def git(*args):
        try:
            done = subprocess.run(["git", *args], cwd=ASSETS, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += " dirty"  # tracked files differ from that commit: the numbers may not reproduce from it
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    device = cfg_get(cfg, "model.device", "auto")
    gpu = torch.cuda.get_device_name(0) if device != "cpu" and torch.cuda.is_available() else None
    return {"seed": cfg_get(cfg, "seed"), "git_commit": commit, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu": cpu or platform.processor() or platform.machine(),
            # The SIMD level torch dispatches its CPU kernels to (AVX2, AVX512, ...): two
            # machines with the same CPU name can still sum floats in another order.
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count(),
            # train.py sets model.threads after this call, so the config says what the run uses.
            "threads": cfg_get(cfg, "model.threads") or torch.get_num_threads(), "gpu": gpu,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "started_unix": round(time.time(), 3)}


def record_run(out_dir, cfg: dict) -> dict:
    """Append this process's provenance to out_dir/run.json and stamp its wall time there
    when the process exits.

    A list, one entry per process: a resumed run may have been continued on another
    machine or another torch version, and its total wall time (evaluations included) is
    the sum of its processes' times. The exit stamp runs on a normal end, an exception or
    Ctrl-C (atexit); a process killed outright leaves its entry without wall_s, and the
    report says so."""
    import atexit

    path = Path(out_dir) / "run.json"
    entry = provenance(cfg)

    def save(update):
        old = _read_json(path)
        processes = old.get("processes") if isinstance(old, dict) else None
        processes = update([p for p in processes or [] if isinstance(p, dict)])
        tmp = path.with_name(f".run.json.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"processes": processes}, indent=2) + "\n")
        os.replace(tmp, path)

    def stamp():
        wall = round(time.time() - entry["started_unix"], 1)
        try:  # re-read: another run() in this process may have appended since
            save(lambda ps: [{**p, "wall_s": wall} if p.get("started_unix") == entry["started_unix"] else p
                             for p in ps])
        except OSError:  # the folder is gone (a test's temporary run): nothing to stamp
            pass

    save(lambda ps: ps + [entry])
    atexit.register(stamp)
    return entry


# ----------------------------------------------------------------------------------------
# The page. Its style sheet and script live next to this file (report.css, report.js) and
# are inlined at render time, so the page needs nothing but itself.

ASSETS = Path(__file__).resolve().parent


def asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


def render(run: dict) -> str:
    out = run["dir"]
    have = {"config.json": run["config"] is not None, "metrics.jsonl": bool(run["metrics"]),
            "trajectories/": bool(run["traj_files"]), "eval/step_N/": bool(run["evals"]),
            "learning.json": run["learning"] is not None}
    title = f"Flow-GRPO run report: {out.resolve().name}"
    head = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{asset("report.css")}</style></head><body>'
            f'<header><h1>{esc(title)}</h1><div class="dim">{esc(out.resolve())} · generated '
            f'{esc(time.strftime("%Y-%m-%d %H:%M:%S"))} · AgentFlow planner trained with Flow-GRPO</div>')
    if not any(have.values()):
        return (head + "</header><main><section id=\"nothing\"><h2>Nothing to report yet</h2>"
                + note(f"This folder has none of the files a training run writes (config.json, metrics.jsonl, "
                       f"trajectories/, eval/, learning.json). Start one with <code>python train.py config.yaml "
                       f"out_dir={esc(out)}</code>, or point report.py at a run's out_dir.", "note warn")
                + "</section></main></body></html>\n")
    nav = ('<nav><a href="#run">1. run</a><a href="#before-after">2. before vs after</a><a href="#curves">3. curves'
           '</a><a href="#tool-shift">4. tool shift</a><a href="#trajectories">5. trajectories</a></nav>')
    missing = [k for k, v in have.items() if not v]
    body = []
    if missing:
        body.append(note("Not in this folder (yet): " + ", ".join(f"<code>{esc(k)}</code>" for k in missing)
                         + ". The sections below say what that leaves out.", "note warn"))
    for section in (section_run, section_before_after, section_curves, section_tool_shift, section_trajectories):
        try:
            body.append(section(run))
        except Exception as e:  # one malformed field must not cost the whole page (or the training run)
            body.append(f'<section><h2>{esc(section.__name__)}</h2>'
                        + note(f"This section could not be drawn: {esc(type(e).__name__)}: {esc(e)}", "note warn")
                        + "</section>")
    script = f"<script>{asset('report.js')}</script>" if run["traj_files"] else ""
    return head + nav + "</header><main>" + "".join(body) + "</main>" + script + "</body></html>\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__.split("\n\n")[1])
        return 2
    try:
        path = write_report(argv[0])
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
