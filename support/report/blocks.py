"""The HTML blocks both pages are built from, the run's page (page.py) and the page
comparing runs (compare.py): number and text formatting, colours, the header's
provenance line and warnings, the accuracy cells with their intervals, the tool-shift
figure, the page's head with its inlined style sheet, the guard around each section,
and the write that no reader sees half-done.

All text from a run reaches the markup through `esc` (html.escape); `note` takes text
that is already HTML, the pages' own.
"""

import os
from pathlib import Path

from support.report.charts import esc, figure, num, pct, shift_chart
from support.report.runs import before_after, cfg_get, tool_shares_ba, wall_time
from support.report.stats import change_interval, mcnemar_p, paired_change_interval, wilson
from support.text import cut

OKABE = {"blue": "#0072B2", "orange": "#E69F00", "green": "#009E73", "pink": "#CC79A7",
         "sky": "#56B4E9", "red": "#D55E00", "grey": "#7f7f7f"}
TOOL_COLORS = list(OKABE.values()) + ["#000000"]
RUN_COLORS = list(OKABE.values())  # one per run on a comparison page, in the order given
ASSETS = Path(__file__).resolve().parent  # report.css and report.js, inlined into every page
SUB = ' class="sub"'  # an indented row header (a task kind under its total)


# ----------------------------------------------------------------------------------------
# Small formatting helpers


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
    """A text field of the run, embedded in at most `limit` characters (support.text.cut)."""
    return cut("" if text is None else str(text), limit)


def note(text: str, cls: str = "note") -> str:
    """A sentence of explanation; `text` is already HTML."""
    return f'<p class="{cls}">{text}</p>'


# ----------------------------------------------------------------------------------------
# Colours: a tool, a task kind or a run keeps its colour on every chart of a page


def tool_colors(run: dict) -> dict[str, str]:
    """One colour per tool, the same in every chart of a report: by the configured order
    (agent.tools), then any other tool seen, by name; runs with the same toolset share them."""
    names = [str(t) for t in cfg_get(run["config"], "agent.tools", []) or []]
    seen = {t for m in run["metrics"] for t in m.get("tool_shares") or {}}
    for e in list(run["evals"].values()) + [v for v in (run["learning"] or {}).values() if isinstance(v, dict)]:
        s = e.get("summary", e)
        for summary in [s] + list((s.get("by_kind") or {}).values()):
            seen |= set(summary.get("tool_shares") or {})
    names += sorted(str(t) for t in seen if str(t) not in names)
    return {t: TOOL_COLORS[i % len(TOOL_COLORS)] for i, t in enumerate(names)}


def kind_colors(kinds) -> dict[str, str]:
    """One colour per task kind, by sorted name (the same kind keeps it across runs)."""
    palette = [OKABE[c] for c in ("sky", "pink", "green", "red", "grey", "blue", "orange")]
    return {k: palette[i % len(palette)] for i, k in enumerate(sorted(kinds))}


# ----------------------------------------------------------------------------------------
# Held-out accuracy cells: counts with their Wilson interval, the change with its paired
# interval, the flips and McNemar's p


def count_cell(kn) -> str:
    if not kn:
        return "<td>—</td>"
    k, n = kn
    lo, hi = wilson(k, n)
    return (f'<td><b>{k}/{n}</b> = {esc(pct(k / n if n else None))}'
            f'<br><span class="ci">[{100 * lo:.1f}, {100 * hi:.1f}]</span></td>')


def change_cells(row: dict, with_p: bool = True) -> str:
    """Δ with its interval, the flips, and McNemar's p (flips and p only when paired)."""
    b, a, p = row.get("before"), row.get("after"), row.get("paired")
    if not b or not a:
        return "<td>—</td>" * (3 if with_p else 2)
    if p and p["n"] == b[1] == a[1]:
        lo, hi = paired_change_interval(p["both"], p["gained"], p["lost"], p["neither"])
        how = "paired"
    else:
        lo, hi = change_interval(a[0], b[0], a[1]) if a[1] == b[1] else (None, None)
        how = "unpaired"
    d = round(100 * (a[0] / a[1] - b[0] / b[1]), 1) if a[1] and b[1] else 0.0
    cls = "good" if lo is not None and lo > 0 else "bad" if hi is not None and hi < 0 else ""
    ci = f'<br><span class="ci">[{100 * lo:+.1f}, {100 * hi:+.1f}] {how}</span>' if lo is not None else ""
    change = f'<td class="{cls}">{d:+.1f} pp{ci}</td>'
    if not p:
        return change + '<td class="dim">no results.jsonl</td>' + ("<td>—</td>" if with_p else "")
    return (change + f'<td><span class="good">+{p["gained"]}</span> / <span class="bad">−{p["lost"]}</span></td>'
            + (f'<td>{mcnemar_p(p["gained"], p["lost"]):.3g}</td>' if with_p else ""))


INTERVALS_NOTE = (
    "Brackets: 95% intervals, in %. For each accuracy, the <b>Wilson score interval</b> for k correct out of n: "
    "unlike p ± 1.96·SE it stays within 0–100% and keeps its width at 0/n and n/n. Before and after score the "
    "<i>same</i> items, so the change is <b>paired</b>: an item right (or wrong) on both sides says nothing "
    "about it, and only the flips do. Its interval is <b>Newcombe's paired score interval</b> (method 10: the two "
    "Wilson intervals combined with the correlation of the before and after verdicts), and p is the <b>exact "
    "McNemar test</b> of wrong→right against right→wrong flips (under no change each flip is a fair coin). "
    "Green or red: the interval excludes 0. The evaluation is greedy, so the uncertainty is over which items were "
    "drawn, not over sampling: with n = 40 one item is 2.5 points and a 5-point change is two questions.")


# ----------------------------------------------------------------------------------------
# Where a run ran: the header's line, the rows of a table, the warnings under the title


PROVENANCE_FIELDS = [("git_commit", "git commit"), ("torch", "torch"), ("transformers", "transformers"),
                     ("python", "python"), ("cpu", "CPU"), ("cpu_capability", "CPU kernels (SIMD)"),
                     ("threads", "torch threads"), ("decode", "decode step"), ("gpu", "GPU")]


def short_commit(c) -> str:
    if not c:
        return "not in a git checkout"
    sha, *rest = str(c).split()
    return " ".join([sha[:10]] + rest)


def provenance_rows(run: dict) -> list[tuple[str, str]]:
    """(label, value) rows of where the run ran; a field that changed between the
    processes of a resumed run shows every value."""
    procs = run["processes"]
    rows = [("seed", cfg_get(run["config"], "seed", (procs[0] if procs else {}).get("seed")))]
    for key, label in PROVENANCE_FIELDS:
        values = []
        for p in procs:
            v = short_commit(p.get(key)) if key == "git_commit" else p.get(key)
            if v is not None and v not in values:
                values.append(v)
        if values:
            rows.append((label, " → ".join(map(str, values)) + ("  (changed when the run was resumed)"
                                                               if len(values) > 1 else "")))
    if procs:
        rows.append(("started", procs[0].get("started")))
    total, how = wall_time(run)
    rows.append(("wall time in all", (duration(total) if total is not None else "—") + f" ({how})"))
    return [(k, v) for k, v in rows if v is not None]


def provenance_line(run: dict) -> str:
    """The header's one line: enough to tell two runs apart at a glance."""
    procs, cfg = run["processes"], run["config"]
    p = procs[-1] if procs else {}
    bits = []
    if cfg_get(cfg, "seed") is not None:
        bits.append(f"seed {cfg_get(cfg, 'seed')}")
    if p:
        bits += [f"commit {short_commit(p.get('git_commit'))}", f"torch {p.get('torch')}",
                 f"CPU {p.get('cpu')}" + (f" ({p['cpu_capability']})" if p.get("cpu_capability") else ""),
                 f"{p.get('threads')} threads"]
        if p.get("gpu"):
            bits.append(f"GPU {p['gpu']}")
    else:
        bits.append("provenance not recorded (no run.json: the run predates it)")
    total, how = wall_time(run)
    if total is not None:
        bits.append(f"{duration(total)} wall time in all" + (" (at least)" if "at least" in how else ""))
    return " · ".join(esc(b) for b in bits)


def header_warnings(run: dict) -> list[str]:
    out = []
    if cfg_get(run["config"], "tools.python_isolation") == "rlimits":
        out.append("<b>Weaker Python sandbox:</b> this run set <code>tools.python_isolation: rlimits</code>, "
                   "so the code the model wrote ran under resource limits only, without the default isolation. "
                   "It was selected explicitly in the config.")
    return [note(w, "note warn banner") for w in out]


# ----------------------------------------------------------------------------------------
# The tool-usage shift per task kind, before vs after (stacked bars)


def tool_shift_figure(run: dict, title: str = "Tool shares before vs after, per task kind") -> str:
    sb, sa, how = tool_shares_ba(run)
    sb, sa = sb or {}, sa or {}
    colors = tool_colors(run)
    for shares in list(sb.values()) + list(sa.values()):  # a tool seen only in eval rows still gets a colour
        for t in shares:
            colors.setdefault(t, TOOL_COLORS[len(colors) % len(TOOL_COLORS)])
    b, a, *_ = before_after(run)
    b, a = b or {}, a or {}
    acc = {"all": (num(b.get("accuracy")), num(a.get("accuracy")))}
    for k in set(b.get("by_kind") or {}) | set(a.get("by_kind") or {}):
        acc[k] = (num((b.get("by_kind") or {}).get(k, {}).get("accuracy")),
                  num((a.get("by_kind") or {}).get(k, {}).get("accuracy")))
    svg = shift_chart(sb, sa, colors, acc)
    if svg is None:
        why = ("no held-out evaluation in this folder yet" if not (sb or sa)
               else "the evaluations recorded no tool calls")
        return figure(title, None, "", missing=why)
    used = [t for t in colors if any(t in s for d in (sb, sa) for s in d.values())]
    return figure(title, svg, f"Each bar splits 100% of the held-out tool calls of one task kind ({esc(how)}); "
                  "hover a segment for the exact share and call count. Under each kind: its held-out accuracy "
                  "before → after." + ("" if sa else " <b>No after-training evaluation yet.</b>")
                  + ("" if sb else " <b>No before-training evaluation.</b>"), [(t, colors[t], "box") for t in used])


# ----------------------------------------------------------------------------------------
# The page around the sections. Its style sheet and script live next to this file
# (report.css, report.js) and are inlined at render time, so a page needs nothing but
# itself.


def asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


def page_head(title: str) -> str:
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{asset("report.css")}'
            "</style></head><body>")


def guarded(section, *args) -> str:
    try:
        return section(*args)
    except Exception as e:  # one malformed field must not cost the whole page (or the training run)
        return (f'<section><h2>{esc(section.__name__)}</h2>'
                + note(f"This section could not be drawn: {esc(type(e).__name__)}: {esc(e)}", "note warn")
                + "</section>")


def write_page(path: Path, page: str) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees a half-written page
    return path
