"""One page comparing training runs side by side: their provenance and config
differences, held-out before vs after with intervals, the items the runs disagree on,
the training curves overlaid, and each run's tool shift. `write_comparison(run_dirs)`
writes it; `python -m scripts.report RUN_A RUN_B [...]` does it from the shell. Each
run's own page (page.py) is linked, not repeated.
"""

import json
import os
import time
from pathlib import Path

from support.report.blocks import (INTERVALS_NOTE, PROVENANCE_FIELDS, RUN_COLORS, SUB, asset, change_cells, clip,
                                   count_cell, guarded, header_warnings, note, page_head, provenance_line,
                                   provenance_rows, tool_shift_figure, write_page)
from support.report.charts import esc
from support.report.curves import CURVES, curve_facts, curve_figure, step_values, x_extent
from support.report.runs import accuracy_rows, before_after, load_run


def write_comparison(run_dirs, out_file=None) -> Path:
    """Render one page comparing the runs in `run_dirs` (two or more); return its path.
    By default it is compare_<A>_<B>...html in the folder that holds the runs: a
    comparison belongs to no one run, so it is not written into any of them."""
    dirs = [Path(d) for d in run_dirs]
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"no run directory at {d}")
    if out_file is None:
        parent = Path(os.path.commonpath([str(d.resolve().parent) for d in dirs]))
        out_file = parent / ("compare_" + "_".join(d.resolve().name for d in dirs)[:150] + ".html")
    out_file = Path(out_file)
    return write_page(out_file, render_comparison([load_run(d) for d in dirs], out_file))


def run_labels(runs: list[dict]) -> list[str]:
    names = [r["dir"].resolve().name for r in runs]
    if len(set(names)) < len(names):  # same folder name in different places: add the parent
        names = [f"{r['dir'].resolve().parent.name}/{r['dir'].resolve().name}" for r in runs]
    return names


def _flat(d, prefix=""):
    for k, v in (d or {}).items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def compare_runs_section(runs: list[dict], labels: list[str], out_file: Path) -> str:
    head = "".join(f'<th><i class="sw box" style="--c:{c}"></i>{esc(n)}</th>' for n, c in zip(labels, RUN_COLORS))
    links = []
    for r in runs:
        page = r["dir"] / "report.html"
        href = os.path.relpath(page.resolve(), out_file.resolve().parent) if page.exists() else None
        links.append(f'<a href="{esc(href)}">report.html</a>' if href else "no report.html")
    rows = {"run report": links}
    provs = [dict(provenance_rows(r)) for r in runs]
    for label in ["seed"] + [lab for _, lab in PROVENANCE_FIELDS] + ["started", "wall time in all"]:
        if any(label in p for p in provs):
            rows[label] = [esc(p.get(label, "—")) for p in provs]
    steps = [str(r["metrics"][-1]["step"]) if r["metrics"] else "0" for r in runs]
    rows["steps done"] = steps
    flat = [dict(_flat(r["config"])) for r in runs]
    keys = sorted({k for f in flat for k in f} - {"out_dir"})
    differ = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flat}) > 1]
    for k in differ:
        rows[f"config: {k}"] = [esc(json.dumps(f.get(k))) if k in f else "—" for f in flat]
    body = "".join(f"<tr><th>{esc(k)}</th>{''.join(f'<td>{v}</td>' for v in vs)}</tr>" for k, vs in rows.items())
    return ('<section id="runs"><h2>1. The runs</h2><table class="grid kvgrid"><thead><tr><th></th>'
            f'{head}</tr></thead><tbody>{body}</tbody></table>'
            + note(f"{len(differ)} config key{'s' if len(differ) != 1 else ''} differ (out_dir left out)"
                   + (": " + ", ".join(f"<code>{esc(k)}</code>" for k in differ) if differ else "")
                   + ". Same seed, commit and config but another CPU kind, SIMD level, thread count or torch "
                   "version can still sum floats in another order and sample other tokens.")
            + "</section>")


def compare_heldout_section(runs: list[dict], labels: list[str]) -> str:
    parts = ['<section id="before-after"><h2>2. Held-out before vs after, side by side</h2>']
    tables = [accuracy_rows(b or {}, a or {}, br, ar) for b, a, br, ar, _ in (before_after(r) for r in runs)]
    kinds = ["all"] + sorted({row["kind"] for t in tables for row in t} - {"all"})
    head1 = "".join(f'<th colspan="4"><i class="sw box" style="--c:{c}"></i>{esc(n)}</th>'
                    for n, c in zip(labels, RUN_COLORS))
    head2 = "<th>before</th><th>after</th><th>Δ (interval)</th><th>flips + / −</th>" * len(runs)
    body = []
    for kind in kinds:
        cells = []
        for t in tables:
            row = next((r for r in t if r["kind"] == kind), {"kind": kind})
            cells.append(count_cell(row.get("before")) + count_cell(row.get("after")) + change_cells(row, False))
        label = "accuracy, all items" if kind == "all" else esc(kind)
        body.append(f'<tr><th{SUB if kind != "all" else ""}>{label}</th>{"".join(cells)}</tr>')
    parts.append(f'<table class="grid acc"><thead><tr><th rowspan="2">task kind</th>{head1}</tr><tr>{head2}</tr>'
                 f'</thead><tbody>{"".join(body)}</tbody></table>' + note(INTERVALS_NOTE, "note small"))
    parts.append(disagreements(runs, labels))
    parts.append("</section>")
    return "".join(parts)


def disagreements(runs: list[dict], labels: list[str]) -> str:
    """Held-out items whose verdict (before or after) is not the same in every run."""
    verdicts = []
    for r in runs:
        _, _, br, ar, _ = before_after(r)
        verdicts.append(({x.get("id"): x for x in br or []}, {x.get("id"): x for x in ar or []}))
    if not all(b and a for b, a in verdicts):
        return note("Per-item comparison: needs every run's before and after results.jsonl.")
    ids = sorted(set.intersection(*[set(a) for _, a in verdicts]))
    mark = lambda x: "✓" if x and x.get("correct") else "✗" if x else "—"  # noqa: E731
    flip = lambda x, y: ("good" if y == "✓" and x != "✓" else  # noqa: E731
                         "bad" if x == "✓" and y != "✓" else "")
    rows = []
    for i in ids:
        pairs = [(mark(b.get(i)), mark(a.get(i))) for b, a in verdicts]
        if len(set(pairs)) > 1:
            item = verdicts[0][1][i]
            cells = "".join(f'<td class="{flip(x, y)}">{x} → {y}</td>' for x, y in pairs)
            rows.append(f"<tr><th>{esc(i)}</th><td>{esc(item.get('task', ''))}</td>"
                        f'<td class="q">{esc(clip(item.get("question"), 120))}</td>{cells}</tr>')
    head = "".join(f"<th>{esc(n)}</th>" for n in labels)
    return (f"<h3>Items on which the runs differ ({len(rows)} of {len(ids)})</h3>"
            + note("Verdict before → after training in each run (✓ right, ✗ wrong); open a run's report for the "
                   "trajectories. Only items whose verdicts are not the same in every run are listed.")
            + (f'<table class="grid items"><thead><tr><th>item</th><th>kind</th><th>question</th>{head}</tr>'
               f'</thead><tbody>{"".join(rows)}</tbody></table>' if rows else ""))


def compare_curves_section(runs: list[dict], labels: list[str]) -> str:
    valses = [step_values(r) for r in runs]
    entries = [(r, v, curve_facts(r, v), lab, c) for r, v, lab, c in zip(runs, valses, labels, RUN_COLORS)]
    x_range = x_extent(valses)
    figs = "".join(curve_figure(row, entries, x_range) for row in CURVES)
    return ('<section id="curves"><h2>3. Training curves, overlaid</h2>'
            + note("One colour per run; where a chart has several series, they differ by dash (grey keys). "
                   "The explanations are those of the first run.")
            + f'<div class="charts">{figs}</div></section>')


def render_comparison(runs: list[dict], out_file: Path) -> str:
    labels = run_labels(runs)
    title = "Flow-GRPO runs compared: " + " vs ".join(labels)
    head = (page_head(title) + f'<header><h1>{esc(title)}</h1><div class="dim">generated '
            f'{esc(time.strftime("%Y-%m-%d %H:%M:%S"))} · written to <span id="run-dir" data-what="file">'
            f'{esc(out_file.resolve())}</span></div>')
    for r, lab, c in zip(runs, labels, RUN_COLORS):
        head += (f'<div class="prov"><i class="sw box" style="--c:{c}"></i><b>{esc(lab)}</b>: {provenance_line(r)}'
                 "</div>" + "".join(header_warnings(r)))
    nav = ('<nav><a href="#runs">1. runs</a><a href="#before-after">2. before vs after</a>'
           '<a href="#curves">3. curves</a><a href="#tool-shift">4. tool shift</a></nav>')
    shifts = "".join(guarded(tool_shift_figure, r, f"{lab}: tool shares before vs after") for r, lab in
                     zip(runs, labels))
    body = [guarded(compare_runs_section, runs, labels, out_file), guarded(compare_heldout_section, runs, labels),
            guarded(compare_curves_section, runs, labels),
            f'<section id="tool-shift"><h2>4. Tool-usage shift per task kind</h2><div class="charts wide">{shifts}'
            "</div></section>"]
    return (head + nav + "</header><main>" + "".join(body) + "</main>"
            + f"<script>{asset('report.js')}</script></body></html>\n")
