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

import html
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

from benchmarks import read_jsonl
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


def esc(x) -> str:
    return html.escape(str(x), quote=True)


def num(v) -> float | None:
    """A finite float, or None (missing, not a number, NaN, inf)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def cfg_get(cfg: dict | None, dotted: str, default=None):
    node = cfg
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def pct(v) -> str:
    v = num(v)
    return "—" if v is None else f"{100 * v:.1f}%"


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


def light(color: str) -> bool:
    """Is this #rrggbb colour light enough that text on it should be dark?"""
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    return 0.299 * r + 0.587 * g + 0.114 * b > 150


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
# Inline SVG charts. Axis ranges get "nice" round ticks; titles and legends live in the
# HTML around the SVG, so nothing inside the plot can overlap them.

W, H = 460, 230
ML, MR, MT, MB = 64, 14, 12, 40  # margins: left (tick labels + y label), right, top, bottom


def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> tuple[float, float, list[float]]:
    """Round bounds that contain [lo, hi] and about n evenly spaced ticks between them."""
    if hi < lo:
        lo, hi = hi, lo
    if hi == lo:
        pad = abs(lo) * 0.1 or (1.0 if integer else 0.1)
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if (hi - lo) / (m * mag) <= n)
    if integer:
        step = max(1.0, round(step))
    start, end = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    ticks = [start + i * step for i in range(int(round((end - start) / step)) + 1)]
    return start, end, ticks


def tick_exponent(ticks: list[float]) -> int:
    """e such that the ticks read best as multiples of 10^e (0 for ordinary ranges)."""
    top = max(abs(t) for t in ticks)
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else top
    if top == 0 or (step >= 1e-3 and top < 1e5):
        return 0
    return math.floor(math.log10(top))


def tick_label(v: float, ticks: list[float]) -> str:
    step = abs(ticks[1] - ticks[0]) if len(ticks) > 1 else 1.0
    if abs(v) < step * 1e-6:
        return "0"
    decimals = next((d for d in range(7) if abs(round(step, d) - step) < step * 1e-6), 6)
    return f"{v:,.{decimals}f}"


def _axes(x0, x1, xt, y0, y1, yt, x_label, y_label, y_fmt=None) -> list[str]:
    pw, ph = W - ML - MR, H - MT - MB
    sx = lambda x: ML + (x - x0) / (x1 - x0) * pw  # noqa: E731
    sy = lambda y: MT + ph - (y - y0) / (y1 - y0) * ph  # noqa: E731
    out = [f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" class="plot"/>']
    e = 0 if y_fmt else tick_exponent(yt)  # tiny or huge values: ticks in units of 10^e
    scaled = [t / 10 ** e for t in yt]
    for t, st in zip(yt, scaled):
        out.append(f'<line x1="{ML}" x2="{ML + pw}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" class="grid"/>')
        label = y_fmt(t) if y_fmt else tick_label(st, scaled)
        out.append(f'<text x="{ML - 6}" y="{sy(t) + 4:.1f}" class="tick" text-anchor="end">{esc(label)}</text>')
    for t in xt:
        if x0 - 1e-9 <= t <= x1 + 1e-9:
            out.append(f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{MT + ph}" y2="{MT + ph + 4}" class="axis"/>')
            out.append(f'<text x="{sx(t):.1f}" y="{MT + ph + 16}" class="tick" text-anchor="middle">'
                       f'{esc(tick_label(t, xt))}</text>')
    out.append(f'<text x="{ML + pw / 2}" y="{H - 6}" class="alabel" text-anchor="middle">{esc(x_label)}</text>')
    unit = f' (×10<tspan dy="-5" font-size="9">{e}</tspan><tspan dy="5"> </tspan>)' if e else ""
    out.append(f'<text transform="translate(13 {MT + ph / 2}) rotate(-90)" class="alabel" '
               f'text-anchor="middle">{esc(y_label)}{unit}</text>')
    return out


def _scales(xs, ys, y_min, y_max, zero):
    x0, x1 = min(xs), max(xs)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    _, _, xt = nice_ticks(x0, x1, n=6, integer=True)
    lo, hi = min(ys), max(ys)
    if zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        if lo == hi == 0.0:
            hi = 1.0  # all zero: draw the line on a 0..1 axis, not around it
    if y_min is not None and y_max is not None:
        y0, y1 = y_min, y_max
        _, _, yt = nice_ticks(y0, y1)
    else:
        y0, y1, yt = nice_ticks(lo, hi)
    return x0, x1, xt, y0, y1, yt


SMOOTH_FROM = 30  # longer series: a faint raw line under a moving average, no dots


def smooth_window(n: int) -> int:
    """Width of the centred moving average drawn over a series of n steps (odd)."""
    return max(3, n // 15) | 1


def moving_average(ys: list, w: int) -> list:
    """Centred moving average over the values present in each window (None stays None)."""
    out = []
    for i, y in enumerate(ys):
        window = [v for v in ys[max(0, i - w // 2):i + w // 2 + 1] if v is not None]
        out.append(None if y is None else sum(window) / len(window))
    return out


def _polylines(data: list, sx, sy, attrs: str) -> list[str]:
    """One <polyline> per run of present values (None breaks the line)."""
    out, segment = [], []
    for x, y in data + [(None, None)]:
        if y is None:
            if len(segment) > 1:
                out.append(f'<polyline points="{" ".join(segment)}" fill="none" {attrs}/>')
            segment = []
        else:
            segment.append(f"{sx(x):.1f},{sy(y):.1f}")
    return out


def line_chart(series: list[dict], y_label: str, x_label: str = "step", y_min=None, y_max=None,
               zero: bool = False, y_fmt=None) -> str | None:
    """series: [{name, xs, ys, color, dash?, points?}]; None values break a line. None if no data.
    points: markers only (held-out evaluations). Over SMOOTH_FROM values, a line is drawn
    faint with its moving average on top."""
    pts = [(x, y) for s in series for x, y in zip(s["xs"], s["ys"]) if y is not None]
    if not pts:
        return None
    x0, x1, xt, y0, y1, yt = _scales([p[0] for p in pts], [p[1] for p in pts], y_min, y_max, zero)
    pw, ph = W - ML - MR, H - MT - MB
    sx = lambda x: ML + (x - x0) / (x1 - x0) * pw  # noqa: E731
    sy = lambda y: MT + ph - (min(max(y, y0), y1) - y0) / (y1 - y0) * ph  # noqa: E731
    out = _axes(x0, x1, xt, y0, y1, yt, x_label, y_label, y_fmt)
    for s in series:
        color, name = esc(s["color"]), s["name"]
        data = list(zip(s["xs"], s["ys"]))
        present = [(x, y) for x, y in data if y is not None]
        dash = ' stroke-dasharray="6 4"' if s.get("dash") else ""
        if s.get("points"):
            pass
        elif len(present) > SMOOTH_FROM:
            out += _polylines(data, sx, sy, f'stroke="{color}" stroke-width="1" stroke-opacity="0.35"')
            smooth = moving_average(list(s["ys"]), smooth_window(len(present)))
            out += _polylines(list(zip(s["xs"], smooth)), sx, sy, f'stroke="{color}" stroke-width="2.2"{dash}')
        else:
            out += _polylines(data, sx, sy, f'stroke="{color}" stroke-width="2"{dash}')
        if s.get("points") or len(present) <= SMOOTH_FROM:  # dots with a hover tooltip
            r = 4.5 if s.get("points") else (2.5 if len(present) > 1 else 3.5)
            for x, y in present:
                tip = f"{name}, step {x:g}: {y:.4g}"
                fill = "#fff" if s.get("points") else color
                out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="{r}" fill="{fill}" stroke="{color}" '
                           f'stroke-width="2"><title>{esc(tip)}</title></circle>')
    return _svg(out)


def stacked_bar_chart(xs: list, stacks: list[dict], y_label: str, x_label: str = "step") -> str | None:
    """One bar per x, split into stacks [{name, ys, color}] (missing values count 0)."""
    if not xs or not stacks:
        return None
    totals = [sum(num(s["ys"][i]) or 0.0 for s in stacks) for i in range(len(xs))]
    x0, x1, xt, y0, y1, yt = _scales([x - 0.5 for x in xs] + [x + 0.5 for x in xs], totals, None, None, True)
    pw, ph = W - ML - MR, H - MT - MB
    sx = lambda x: ML + (x - x0) / (x1 - x0) * pw  # noqa: E731
    sy = lambda y: MT + ph - (y - y0) / (y1 - y0) * ph  # noqa: E731
    out = _axes(x0, x1, xt, y0, y1, yt, x_label, y_label)
    bw = max(1.0, 0.8 * pw / max(1.0, x1 - x0))
    for i, x in enumerate(xs):
        base = 0.0
        for s in stacks:
            v, name = num(s["ys"][i]) or 0.0, s["name"]
            if v > 0:
                out.append(f'<rect x="{sx(x) - bw / 2:.1f}" y="{sy(base + v):.1f}" width="{bw:.1f}" '
                           f'height="{max(0.0, sy(base) - sy(base + v)):.1f}" fill="{esc(s["color"])}">'
                           f'<title>{esc(f"step {x}: {name} {v:.1f} s")}</title></rect>')
            base += v
    return _svg(out)


def _svg(parts: list[str], width: int = W, height: int = H) -> str:
    return (f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
            f'xmlns="http://www.w3.org/2000/svg" role="img">' + "".join(parts) + "</svg>")


def legend(items: list[tuple[str, str, str]]) -> str:
    """items: (name, colour, style) with style 'line' | 'dash' | 'dot' | 'box'."""
    spans = []
    for name, color, style in items:
        spans.append(f'<span class="key"><i class="sw {esc(style)}" style="--c:{esc(color)}"></i>{esc(name)}</span>')
    return f'<div class="legend">{"".join(spans)}</div>'


def figure(title: str, svg: str | None, explain: str, keys: list[tuple[str, str, str]] | None = None,
           missing: str = "") -> str:
    """A chart with its title, legend and one line saying what it shows. With no data, the
    figure says so instead of drawing empty axes."""
    body = svg if svg else f'<div class="empty">No data: {esc(missing or "nothing recorded yet")}.</div>'
    return (f'<figure class="chart"><figcaption><b>{esc(title)}</b></figcaption>'
            f'{legend(keys) if keys and svg else ""}{body}<p class="explain">{explain}</p></figure>')


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
# Section 3: training curves


def section_curves(run: dict) -> str:
    m = run["metrics"]
    parts = ['<section id="curves"><h2>3. Training curves</h2>']
    if not m:
        parts.append(note("<b>No training steps yet</b>: metrics.jsonl is missing or empty (train.py appends "
                          "one row per finished step).", "note warn") + "</section>")
        return "".join(parts)
    xs = [r["step"] for r in m]
    col = lambda k: [num(r.get(k)) for r in m]  # noqa: E731
    has = lambda k: any(v is not None for v in col(k))  # noqa: E731
    miss = lambda k: f"metrics.jsonl has no '{k}'"  # noqa: E731
    heldout = {s: num(e["summary"].get("accuracy")) for s, e in run["evals"].items()}
    for r in m:
        if num(r.get("heldout_accuracy")) is not None:
            heldout.setdefault(r["step"], num(r["heldout_accuracy"]))
    ho_x = sorted(s for s, v in heldout.items() if v is not None)
    ho_err = {s: num(e["summary"].get("tool_error_rate")) for s, e in run["evals"].items()}
    he_x = sorted(s for s, v in ho_err.items() if v is not None)
    if len(m) > SMOOTH_FROM:
        parts.append(note(f"Faint lines: the value at each step; solid lines: a centred moving average over "
                          f"{smooth_window(len(m))} steps. Hover a held-out dot for its value."))
    else:
        parts.append(note("Hover a dot for its exact value."))
    B, O, G_, P, S, R, GR = (OKABE[c] for c in ("blue", "orange", "green", "pink", "sky", "red", "grey"))
    max_turns = num(cfg_get(run["config"], "agent.max_turns"))
    figs = []

    series = [{"name": "reward mean (train rollouts)", "xs": xs, "ys": col("reward_mean"), "color": B}]
    keys = [("reward mean (train rollouts)", B, "line")]
    same = all(a == b for a, b in zip(col("reward_mean"), col("accuracy")))
    if not same:
        series.append({"name": "accuracy (train rollouts)", "xs": xs, "ys": col("accuracy"), "color": G_, "dash": True})
        keys.append(("accuracy (train rollouts)", G_, "dash"))
    if ho_x:
        series.append({"name": "held-out accuracy", "xs": ho_x, "ys": [heldout[s] for s in ho_x], "color": O,
                       "points": True})
        keys.append(("held-out accuracy", O, "dot"))
    figs.append(figure("Reward and accuracy", line_chart(series, "reward / accuracy", y_min=0, y_max=1), (
        "Mean reward R over the step's Q×G rollouts" + (" (= accuracy: the rewards are 0/1)." if same else
        "; accuracy = share of rollouts with R &gt; 0.") + " Open dots: held-out accuracy from eval/step_N "
        "(step 0 = before training). Training rollouts sample, exploring on purpose, while a greedy "
        "held-out evaluation (eval.planner_temperature = 0) takes the most likely tool: compare each "
        "series with itself, not with the other."
        + ("" if ho_x else " No held-out points: no eval/step_N yet.")), keys, miss("reward_mean")))

    figs.append(figure("Groups with no learning signal", line_chart(
        [{"name": "zero-variance groups", "xs": xs, "ys": col("zero_variance_groups"), "color": R}],
        "share of query groups", y_min=0, y_max=1),
        "Share of queries whose G rollouts all got the same reward: every A_i is 0, so they teach nothing. "
        "Near 1 means the tasks are too easy or too hard for the current planner.", None, miss("zero_variance_groups")))
    figs.append(figure("KL to the reference policy", line_chart(
        [{"name": "KL", "xs": xs, "ys": col("kl"), "color": P}], "KL(π_θ ‖ π_ref)", zero=True),
        "k3 estimate of the KL between the trained planner and the frozen initial weights, per planner "
        "token, averaged like the loss (over tokens, turns and rollouts). Penalised with weight β.", None, miss("kl")))
    figs.append(figure("Clip fraction", line_chart(
        [{"name": "clip fraction", "xs": xs, "ys": col("clip_frac"), "color": S}], "share of planner tokens",
        zero=True), "Share of planner tokens where the clip bites: ρ &lt; 1−ε_low with A &lt; 0, or ρ &gt; 1+ε_high "
        "with A &gt; 0. Always 0 when each batch gets a single update (ρ = 1 on the first pass).", None, miss("clip_frac")))

    series = [{"name": "tool-call error rate (train)", "xs": xs, "ys": col("tool_error_rate"), "color": R}]
    keys = [("train rollouts", R, "line")]
    if he_x:
        series.append({"name": "held-out tool-call error rate", "xs": he_x, "ys": [ho_err[s] for s in he_x],
                       "color": O, "points": True})
        keys.append(("held-out", O, "dot"))
    figs.append(figure("Tool-call error rate", line_chart(series, "errors / tool calls", y_min=0, y_max=1),
                       "Failed tool calls (bad plan, tool error) over all tool calls. The paper reports it falls "
                       "with training.", keys, miss("tool_error_rate")))

    colors = tool_colors(run)
    tools = [t for t in colors if any(t in (r.get("tool_shares") or {}) for r in m)]
    series = [{"name": t, "xs": xs, "color": colors[t],
               "ys": [num((r.get("tool_shares") or {}).get(t, 0.0)) if r.get("tool_shares") else None for r in m]}
              for t in tools]
    figs.append(figure("Tool shares during training", line_chart(series, "share of tool calls", y_min=0, y_max=1)
                       if series else None, "Which tools the planner picks in the training rollouts, as a share "
                       "of all tool calls of the step.", [(t, colors[t], "line") for t in tools],
                       miss("tool_shares")))
    figs.append(figure("Policy entropy", line_chart(
        [{"name": "entropy", "xs": xs, "ys": col("entropy"), "color": G_}], "nats per token", zero=True),
        "Mean entropy of the planner's (temperature-scaled) next-token distribution over its action tokens. "
        "A collapse towards 0 means the planner stopped exploring.", None, miss("entropy")))
    figs.append(figure("Gradient norm", line_chart(
        [{"name": "grad norm", "xs": xs, "ys": col("grad_norm"), "color": B}], "‖g‖ before clipping", zero=True),
        "Gradient norm per optimizer step, before it is clipped to train.max_grad_norm. Only the KL term "
        "pushes when every group has zero variance.", None, miss("grad_norm")))
    figs.append(figure("Turns per trajectory", line_chart(
        [{"name": "mean turns", "xs": xs, "ys": col("mean_turns"), "color": O}], "mean turns",
        y_min=0 if max_turns else None, y_max=max_turns or None, zero=True),
        "Mean planner turns per training rollout" + (f" (budget T_max = {max_turns:g})" if max_turns else "")
        + "; the verifier "
        "stops a trajectory early when memory is enough.", None, miss("mean_turns")))
    figs.append(figure("Loss", line_chart([{"name": "loss", "xs": xs, "ys": col("loss"), "color": GR}], "−J"),
                       "The minimised Flow-GRPO objective −J (clipped surrogate + β·KL). Its level is not "
                       "comparable across steps: advantages are renormalised per group.", None, miss("loss")))
    figs.append(figure("Sampler vs trainer log-prob gap", line_chart(
        [{"name": "log-prob gap", "xs": xs, "ys": col("logprob_gap"), "color": P}], "|Δ log-prob|", zero=True),
        "Largest difference between a token's log-prob recorded while sampling and the one the loss recomputes "
        "before the first update. Should stay ~0 (float noise): the update is on-policy.", None, miss("logprob_gap")))
    tcolors = {"rollout": B, "judge": O, "update": G_}
    stacks = [{"name": k, "ys": col(f"time_{k}"), "color": c} for k, c in tcolors.items() if has(f"time_{k}")]
    figs.append(figure("Time per step", stacked_bar_chart(xs, stacks, "seconds") if stacks else None,
                       "Wall time of each step, split into rollout, judge and update.",
                       [(k, c, "box") for k, c in tcolors.items()], miss("time_rollout")))
    parts.append(f'<div class="charts">{"".join(figs)}</div></section>')
    return "".join(parts)


# ----------------------------------------------------------------------------------------
# Section 4: tool-usage shift per task kind


def shift_chart(sb: dict, sa: dict, colors: dict[str, str], acc: dict | None = None) -> str | None:
    """Two stacked bars (before, after) per task kind; each bar splits 100% of tool calls.
    acc: {kind: (accuracy before, accuracy after)}, written under each kind's name."""
    kinds = ["all"] + [k for k in sorted(set(sb) | set(sa)) if k != "all"]
    kinds = [k for k in kinds if sb.get(k) or sa.get(k)]
    if not kinds:
        return None
    bw, gap, group_gap, ml, mt, mb, ph = 46, 8, 40, 52, 12, 64, 220
    width = ml + len(kinds) * (2 * bw + gap + group_gap) + 10
    height = mt + ph + mb
    sy = lambda v: mt + ph - v * ph  # noqa: E731
    out = []
    for t in (0, 0.25, 0.5, 0.75, 1.0):
        out.append(f'<line x1="{ml}" x2="{width - 10}" y1="{sy(t):.1f}" y2="{sy(t):.1f}" class="grid"/>'
                   f'<text x="{ml - 6}" y="{sy(t) + 4:.1f}" class="tick" text-anchor="end">{100 * t:.0f}%</text>')
    out.append(f'<text transform="translate(13 {mt + ph / 2}) rotate(-90)" class="alabel" '
               f'text-anchor="middle">share of tool calls</text>')
    for i, kind in enumerate(kinds):
        gx = ml + group_gap / 2 + i * (2 * bw + gap + group_gap)
        for j, (label, shares) in enumerate((("before", sb.get(kind)), ("after", sa.get(kind)))):
            x = gx + j * (bw + gap)
            out.append(f'<text x="{x + bw / 2}" y="{mt + ph + 14}" class="tick" text-anchor="middle">{label}</text>')
            if not shares:  # that evaluation does not exist yet, or had no tool call of this kind
                missing = "not yet" if not (sb if label == "before" else sa) else "no calls"
                out.append(f'<text x="{x + bw / 2}" y="{sy(0.5)}" class="tick" text-anchor="middle">{missing}</text>')
                continue
            base = 0.0
            for tool in colors:
                share, calls = shares.get(tool, (0.0, 0))
                if share <= 0:
                    continue
                y_top, h = sy(base + share), share * ph
                tip = f"{kind}, {label}: {tool} {100 * share:.1f}%" + (f" ({calls} calls)" if calls else "")
                out.append(f'<rect x="{x}" y="{y_top:.1f}" width="{bw}" height="{h:.1f}" fill="{esc(colors[tool])}" '
                           f'stroke="#fff" stroke-width="0.5"><title>{esc(tip)}</title></rect>')
                if h >= 15:
                    out.append(f'<text x="{x + bw / 2}" y="{y_top + h / 2 + 4:.1f}" class="inbar" '
                               f'fill="{"#1d2125" if light(colors[tool]) else "#fff"}" '
                               f'text-anchor="middle">{100 * share:.0f}%</text>')
                base += share
        out.append(f'<text x="{gx + bw + gap / 2}" y="{mt + ph + 34}" class="alabel" text-anchor="middle">'
                   f'{esc(kind)}</text>')
        b_acc, a_acc = (acc or {}).get(kind, (None, None))
        if b_acc is not None or a_acc is not None:
            out.append(f'<text x="{gx + bw + gap / 2}" y="{mt + ph + 50}" class="tick" text-anchor="middle">'
                       f'acc {esc(pct(b_acc))} → {esc(pct(a_acc))}</text>')
    return _svg(out, int(width), height)


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
    parts.append(f"<script>{BROWSER_JS}</script></section>")
    return "".join(parts)


BROWSER_JS = r"""
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
"""


# ----------------------------------------------------------------------------------------
# The page


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:0;color:#1d2125;
 background:#f6f7f9;font-size:14px;line-height:1.45}
header{background:#1f2933;color:#fff;padding:14px 24px}
header h1{margin:0 0 4px;font-size:20px} header .dim{color:#c9d1d9}
nav a{color:#9fd3ff;margin-right:14px;text-decoration:none}
main{padding:8px 24px 40px;max-width:1900px}
section{background:#fff;border:1px solid #dde1e6;border-radius:8px;padding:8px 18px 16px;margin:16px 0}
h2{font-size:18px;margin:10px 0} h3{font-size:15px;margin:14px 0 6px}
.note{color:#444;max-width:1100px} .warn{background:#fff6e0;border-left:4px solid #E69F00;padding:6px 10px}
.dim{color:#6b7280;font-weight:normal}
.cols{display:flex;gap:48px;flex-wrap:wrap;align-items:flex-start} .cols>div{flex:0 1 560px}
table.kv th{text-align:left;padding:2px 14px 2px 0;font-weight:600;color:#374151}
table.kv td{padding:2px 10px 2px 0}
table.grid{border-collapse:collapse;margin:6px 0}
table.grid th,table.grid td{border:1px solid #dde1e6;padding:4px 10px;text-align:right;white-space:nowrap}
table.grid th:first-child{text-align:left} table.grid th.sub{font-weight:normal;padding-left:22px}
table.grid thead th{background:#f0f2f5;text-align:center}
td.good{color:#0a7a3e;font-weight:600} td.bad{color:#b42318;font-weight:600}
.timebar{display:flex;height:18px;width:420px;border-radius:4px;overflow:hidden;margin:4px 0 8px}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(400px,1fr));gap:14px}
figure.chart{margin:0;border:1px solid #e5e7eb;border-radius:6px;padding:8px 10px;background:#fff}
figure.chart svg{width:100%;max-width:640px;height:auto;display:block}
#tool-shift figure.chart svg{width:auto;max-width:100%}
figcaption{font-size:14px;margin-bottom:2px}
.explain{color:#4b5563;font-size:12.5px;margin:4px 0 0}
.empty{color:#6b7280;background:#f3f4f6;border-radius:4px;padding:30px 12px;text-align:center}
.legend{font-size:12px;margin:2px 0 4px} .key{margin-right:12px;white-space:nowrap}
i.sw{display:inline-block;width:18px;height:0;border-top:2.5px solid var(--c);vertical-align:middle;margin-right:4px}
i.sw.dash{border-top-style:dashed} i.sw.box{width:11px;height:11px;border:0;background:var(--c);border-radius:2px}
i.sw.dot{width:8px;height:8px;border:2px solid var(--c);border-radius:50%;background:#fff}
svg .plot{fill:#fff;stroke:#9ca3af} svg .grid{stroke:#e5e7eb} svg .axis{stroke:#6b7280}
svg .tick{font-size:11px;fill:#4b5563} svg .alabel{font-size:12px;fill:#1f2937}
svg .inbar{font-size:11px;font-weight:600}
.controls{display:flex;gap:14px;align-items:center;flex-wrap:wrap;margin:8px 0 12px}
.controls select,.controls button{font-size:14px;padding:3px 8px}
.group{border-top:2px solid #dde1e6;padding:10px 0 14px}
.ghead{margin-bottom:4px} pre{white-space:pre-wrap;word-break:break-word;margin:0;font-size:12.5px;
 font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace}
pre.query{background:#eef2ff;padding:6px 8px;border-radius:4px;margin:4px 0 8px;font-size:13.5px}
.flat{color:#92400e;background:#fef3c7;padding:4px 8px;border-radius:4px;margin:4px 0 8px}
.rollouts{display:grid;gap:10px;overflow-x:auto}
.rollout{border:1px solid #dde1e6;border-radius:6px;padding:8px;background:#fcfcfd;min-width:0}
.rollout.win{border-top:4px solid #009E73} .rollout.loss{border-top:4px solid #D55E00}
.rhead{display:flex;justify-content:space-between;align-items:center}
.badge{padding:1px 8px;border-radius:10px;font-weight:600;font-size:12.5px}
.badge.ok{background:#d1fae5;color:#065f46} .badge.bad{background:#fee2e2;color:#991b1b}
.adv{margin:6px 0;padding:4px 6px;border-radius:4px;font-size:12.5px}
.adv.pos{background:#ecfdf5} .adv.neg{background:#fef2f2} .adv.zero{background:#f3f4f6}
.adv span{color:#4b5563}
.turn{border-left:3px solid #cbd5e1;padding:2px 0 4px 8px;margin:8px 0}
.thead{display:flex;gap:8px;align-items:center;flex-wrap:wrap;margin-bottom:2px}
.tool{background:#e0f2fe;color:#075985;border-radius:4px;padding:0 6px;font-size:12.5px}
.verdict{font-size:12px;border-radius:4px;padding:0 6px;background:#f3f4f6}
.verdict.stop{background:#ede9fe;color:#5b21b6}
.field{margin:3px 0} .flabel{display:block;font-size:11.5px;color:#6b7280;font-style:italic}
.field.planner pre{background:#fffbeb;padding:3px 5px;border-radius:3px}
.field.err pre{color:#b42318}
.field.result pre{max-height:9.5em;overflow-y:auto;background:#f8fafc}
.final{margin-top:8px;padding:6px;border-radius:4px} .final.ok{background:#ecfdf5} .final.bad{background:#fef2f2}
"""


def render(run: dict) -> str:
    out = run["dir"]
    have = {"config.json": run["config"] is not None, "metrics.jsonl": bool(run["metrics"]),
            "trajectories/": bool(run["traj_files"]), "eval/step_N/": bool(run["evals"]),
            "learning.json": run["learning"] is not None}
    title = f"Flow-GRPO run report: {out.resolve().name}"
    head = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head><body>'
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
    return head + nav + "</header><main>" + "".join(body) + "</main></body></html>\n"


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
