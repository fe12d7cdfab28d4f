"""One self-contained HTML page per training run, and one page comparing runs: what a
learner would rather look at than read logs.

    python report.py OUT_DIR                 writes OUT_DIR/report.html and prints its path
    python report.py RUN_A RUN_B [...] [--out FILE]
                                             compares runs; writes FILE, by default
                                             compare_<A>_<B>...html in the folder that holds
                                             the runs (a comparison belongs to no one run, so
                                             it is not written into any of them)

`write_report(out_dir)` and `write_comparison(dirs)` do the same from Python (train.py
calls write_report after each checkpoint and at the end of a run; it also calls
`record_run`, which writes run.json: the provenance shown in each header). A run's page:

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
import os
import sys
import time
from collections import Counter
from pathlib import Path

from support.datasets import read_jsonl
from support.report.charts import (SMOOTH_FROM, esc, figure, line_chart, num, pct, shift_chart, smooth_window,
                    stacked_bar_chart)
from support.text import cut, plan_of

MAX_EMBED_STEPS = 40  # trajectory steps embedded in the browser (evenly spaced, first and last kept)
MAX_EMBED_CHARS = 8_000_000  # and at most this much embedded JSON: fewer steps if needed
CAP = {"query": 600, "answer": 400, "sub_goal": 300, "command": 500, "result": 600, "error": 300,
       "planner": 500, "gold": 200}  # characters kept per embedded text field
TOOL_COLORS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#7f7f7f", "#000000"]
OKABE = {"blue": "#0072B2", "orange": "#E69F00", "green": "#009E73", "pink": "#CC79A7",
         "sky": "#56B4E9", "red": "#D55E00", "grey": "#7f7f7f"}
RUN_COLORS = list(OKABE.values())  # one per run on a comparison page, in the order given
ASSETS = Path(__file__).resolve().parent  # report.css and report.js live here, and so does the code
Z95 = 1.959963984540054  # the standard normal's 97.5% quantile: two-sided 95% intervals
SUB = ' class="sub"'  # an indented row header (a task kind under its total)


def write_report(out_dir) -> Path:
    """Render out_dir/report.html from whatever the run has written so far; return its path.

    Raises FileNotFoundError if out_dir is not a directory. A directory with nothing of a
    run in it still gets a page, one that says so."""
    out = Path(out_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"no run directory at {out}")
    return _write(out / "report.html", render(load_run(out)))


def write_comparison(run_dirs, out_file=None) -> Path:
    """Render one page comparing the runs in `run_dirs` (two or more); return its path."""
    dirs = [Path(d) for d in run_dirs]
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"no run directory at {d}")
    if out_file is None:
        parent = Path(os.path.commonpath([str(d.resolve().parent) for d in dirs]))
        out_file = parent / ("compare_" + "_".join(d.resolve().name for d in dirs)[:150] + ".html")
    out_file = Path(out_file)
    return _write(out_file, render_comparison([load_run(d) for d in dirs], out_file))


def _write(path: Path, page: str) -> Path:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
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
    """Everything the page needs; trajectories are read once for per-step counts, and
    again only for the steps the browser embeds."""
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
    run_json = _read_json(out / "run.json")
    processes = run_json.get("processes") if isinstance(run_json, dict) else None
    sweep = _read_json(out / "turn_sweep.json")
    run = {"dir": out, "config": config if isinstance(config, dict) else None,
           "metrics": [metrics[k] for k in sorted(metrics)], "evals": evals, "other_evals": other_evals,
           "learning": learning if isinstance(learning, dict) else None,
           "traj_files": dict(sorted(traj_files.items())),
           "processes": [p for p in processes if isinstance(p, dict)] if isinstance(processes, list) else [],
           "turn_sweep": sweep if isinstance(sweep, dict) and isinstance(sweep.get("planners"), dict) else None}
    run["train_stats"] = training_stats(run)
    return run


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
    """One colour per tool, the same in every chart of a report: by the configured order
    (agent.tools), then any other tool seen, by name; runs with the same toolset share them."""
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
    return {t: TOOL_COLORS[i % len(TOOL_COLORS)] for i, t in enumerate(names)}


def kind_colors(kinds) -> dict[str, str]:
    """One colour per task kind, by sorted name (the same kind keeps it across runs)."""
    palette = [OKABE[c] for c in ("sky", "pink", "green", "red", "grey", "blue", "orange")]
    return {k: palette[i % len(palette)] for i, k in enumerate(sorted(kinds))}


# ----------------------------------------------------------------------------------------
# Intervals for held-out accuracies. The before and after evaluations score the same n
# items, so the change is a paired comparison: only the items that flipped say anything
# about it (an item right on both sides, or wrong on both, adds nothing).


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion k/n. Unlike p ± z·sqrt(p(1-p)/n) it stays in
    [0, 1] and does not shrink to a point at k = 0 or k = n, where held-out accuracies
    per task kind often sit."""
    if n <= 0:
        return 0.0, 1.0
    p, z2 = k / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_change_interval(both: int, gained: int, lost: int, neither: int, z: float = Z95) -> tuple[float, float]:
    """Interval for after - before accuracy on the same items: Newcombe's hybrid score
    interval for paired proportions (his method 10, 1998).

    With a = right on both sides, b = gained (wrong -> right), c = lost (right -> wrong),
    d = wrong on both: p_after = (a+b)/n, p_before = (a+c)/n, change D = (b-c)/n. phi is
    the correlation of the before and after verdicts, (ad - bc) / sqrt((a+b)(c+d)(a+c)(b+d)),
    with ad - bc moved n/2 towards 0 when positive (Newcombe's correction) and phi = 0
    when a margin is empty. Items that stay right (or wrong) make phi > 0, which narrows
    the interval: the change is then carried by the few items that flipped."""
    n = both + gained + lost + neither
    margins = (both + gained) * (lost + neither) * (both + lost) * (gained + neither)
    cross = both * neither - gained * lost
    cross = max(cross - n / 2, 0.0) if cross > 0 else cross
    return change_interval(both + gained, both + lost, n, cross / math.sqrt(margins) if margins else 0.0, z)


def change_interval(k_after: int, k_before: int, n: int, phi: float = 0.0, z: float = Z95) -> tuple[float, float]:
    """Newcombe's interval for p_after - p_before from each side's Wilson interval (l, u):
    the distances from each p to its limits, added in quadrature less 2 phi times their
    product,
        lower = D - sqrt((pa - la)^2 - 2 phi (pa - la)(ub - pb) + (ub - pb)^2)
        upper = D + sqrt((pb - lb)^2 - 2 phi (pb - lb)(ua - pa) + (ua - pa)^2).
    phi = 0 treats the two sides as independent samples (wider than the paired interval
    whenever the verdicts are positively correlated)."""
    if n <= 0:
        return -1.0, 1.0
    pa, pb = k_after / n, k_before / n
    (la, ua), (lb, ub) = wilson(k_after, n, z), wilson(k_before, n, z)
    d = pa - pb
    lower = d - math.sqrt(max(0.0, (pa - la) ** 2 - 2 * phi * (pa - la) * (ub - pb) + (ub - pb) ** 2))
    upper = d + math.sqrt(max(0.0, (pb - lb) ** 2 - 2 * phi * (pb - lb) * (ua - pa) + (ua - pa) ** 2))
    return max(-1.0, lower), min(1.0, upper)


def mcnemar_p(gained: int, lost: int) -> float:
    """Exact McNemar test: if training changed nothing, each flipped item is equally likely
    to have flipped either way, so gained ~ Binomial(gained + lost, 1/2). Two-sided p."""
    m = gained + lost
    if m == 0:
        return 1.0
    tail = sum(math.comb(m, i) for i in range(min(gained, lost) + 1)) / 2 ** m
    return min(1.0, 2 * tail)


# ----------------------------------------------------------------------------------------
# What each planner action did: the raw text, the tool it was read as, whether it was cut
# at max_new_tokens, whether the tool name was matched loosely. Shared by the training
# trajectories and the trajectories inside held-out results.


def planner_turns(traj: dict) -> list[dict]:
    """One entry per turn of a trajectory dict (Trajectory.to_dict), in turn order."""
    log = traj.get("log") if isinstance(traj.get("log"), list) else []
    memory = traj.get("memory") if isinstance(traj.get("memory"), list) else []
    planner = {e.get("turn"): e for e in log if isinstance(e, dict) and e.get("module") == "planner"}
    records = {r.get("turn"): r for r in memory if isinstance(r, dict)}
    out = []
    for t in sorted(t for t in set(records) | set(planner) if isinstance(t, int)):
        entry, rec = planner.get(t, {}), records.get(t, {})
        raw = str(entry.get("output") or "")
        line = (raw.strip().splitlines() or [""])[0].strip()
        if line.lower().startswith("tool:"):
            line = line[5:].strip()
        tool = str(rec.get("tool") or "")
        tokens, finish = entry.get("tokens"), entry.get("finish")
        out.append({"turn": t, "raw": raw, "tool_line": line, "tool": tool, "record": rec, "recorded": t in records,
                    # agentflow.parse_plan takes an exact tool name first, then any alias
                    # ("python" -> Python_Coder): a tool line without the exact name was
                    # read loosely, "Python_Corner" as Python_Coder.
                    "loose": bool(tool) and tool.lower() not in line.lower(),
                    "no_tool": t in records and not tool and t in planner,
                    "tokens": tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None,
                    "at_cap": finish == "length" if isinstance(finish, str) else None})
    return out


def out_of_turns(turns: list[dict], max_turns) -> bool:
    """Used the whole turn budget without the verifier ever saying STOP."""
    recorded = [t for t in turns if t["recorded"]]
    return bool(max_turns) and len(recorded) >= max_turns and not any(
        str(t["record"].get("verdict", "")).lower() == "stop" for t in recorded)


def cut_counts(trajs: list[dict], max_turns) -> dict:
    """Counts over trajectories: planner actions, their tokens where recorded, actions cut
    at max_new_tokens, loose tool-name matches (and which: "loose_names"), actions naming
    no tool, trajectories out of turns."""
    c, names = Counter(), Counter()
    for tr in trajs:
        turns = planner_turns(tr)
        c["trajectories"] += 1
        c["out_of_turns"] += out_of_turns(turns, max_turns)
        for t in turns:
            if not t["raw"] and not t["recorded"]:
                continue
            c["actions"] += 1
            c["loose"] += t["loose"]
            if t["loose"]:
                names[(t["tool_line"], t["tool"])] += 1
            c["no_tool"] += t["no_tool"]
            if t["tokens"] is not None:
                c["with_tokens"] += 1
                c["tokens"] += t["tokens"]
            if t["at_cap"] is not None:
                c["with_finish"] += 1
                c["at_cap"] += t["at_cap"]
    return {**c, "loose_names": names}


def training_stats(run: dict) -> dict[int, dict]:
    """Per training step, from trajectories/step_N.jsonl: the cut counts, reward per task
    kind, and the spread of rewards within query groups."""
    max_turns = num(cfg_get(run["config"], "agent.max_turns"))
    out = {}
    for step, path in run["traj_files"].items():
        rows = [r for r in read_jsonl(path) if isinstance(r, dict)]
        if not rows:
            continue
        st = cut_counts(rows, max_turns)
        by_kind, groups = {}, {}
        for k, r in enumerate(rows):
            reward = num(r.get("reward"))
            if reward is None:
                continue
            by_kind.setdefault(str(r.get("task") or ""), []).append(reward)
            groups.setdefault(r.get("group", k), []).append(reward)
        st["reward_kind"] = {k: sum(v) / len(v) for k, v in by_kind.items() if k}
        stds = [math.sqrt(sum((x - sum(g) / len(g)) ** 2 for x in g) / len(g)) for g in groups.values() if g]
        st["reward_std"] = sum(stds) / len(stds) if stds else None
        out[step] = st
    return out


def tokens_per_action(run: dict, step: int, st: dict) -> float | None:
    """Mean tokens per planner action at this step. From the planner log entries
    when they carry token counts; otherwise metrics' planner_tokens (every action token
    the loss scored) over the number of actions."""
    if st.get("with_tokens") and st["with_tokens"] == st.get("actions"):
        return st["tokens"] / st["with_tokens"]
    row = next((m for m in run["metrics"] if m["step"] == step), None)
    tokens = num((row or {}).get("planner_tokens"))
    if tokens is None or not st.get("actions"):
        return None
    return tokens / st["actions"]


def cap_share(st: dict, mean_tokens: float | None, cap) -> tuple[float | None, bool]:
    """(share of planner actions cut at max_new_tokens, exact?). Exact from the finish
    reasons in the log; without them, a lower bound from the mean: actions not at the cap
    have at most cap - 1 tokens, so mean <= cap - 1 + share, i.e. share >= mean - cap + 1."""
    if st.get("with_finish") and st["with_finish"] == st.get("actions"):
        return st["at_cap"] / st["with_finish"], True
    if mean_tokens is None or not cap:
        return None, False
    return max(0.0, min(1.0, mean_tokens - cap + 1)), False


# ----------------------------------------------------------------------------------------
# Section 1: the run, and the header line that says where it ran

PROVENANCE_FIELDS = [("git_commit", "git commit"), ("torch", "torch"), ("transformers", "transformers"),
                     ("python", "python"), ("cpu", "CPU"), ("cpu_capability", "CPU kernels (SIMD)"),
                     ("threads", "torch threads"), ("decode", "decode step"), ("gpu", "GPU")]


def wall_time(run: dict) -> tuple[float | None, str]:
    """(total wall time of the run, evaluations included, or None; how it was counted)."""
    procs = run["processes"]
    last = num(cfg_get(run["learning"], "run.wall_s"))  # the last process, start to final evaluation
    if procs:
        times = [num(p.get("wall_s")) for p in procs]
        if times[-1] is None and last is not None:
            times[-1] = last
        known = [t for t in times if t is not None]
        if not known:
            return None, "not recorded yet: the run is in progress, or its process was killed"
        how = f"{len(procs)} process{'es' if len(procs) > 1 else ''}, evaluations included"
        if len(known) < len(times):
            how += f"; {len(times) - len(known)} not timed (still running, or killed), so at least this"
        return sum(known), how
    if last is not None:
        return last, "from learning.json, evaluations included (only the last process if the run was resumed)"
    return None, "not recorded (no run.json, no learning.json)"


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


def accuracy_rows(b: dict, a: dict, br: list | None, ar: list | None) -> list[dict]:
    """Per task kind ('all' first): n, correct before and after, and, when both results
    files are there, the flips (paired by item id)."""
    kinds = sorted(set(b.get("by_kind") or {}) | set(a.get("by_kind") or {}))
    out = []
    for kind in ["all"] + kinds:
        sb = b if kind == "all" else (b.get("by_kind") or {}).get(kind) or {}
        sa = a if kind == "all" else (a.get("by_kind") or {}).get(kind) or {}
        row = {"kind": kind}
        for side, s in (("before", sb), ("after", sa)):
            n, acc = s.get("n"), num(s.get("accuracy"))
            if isinstance(n, int) and acc is not None:
                row[side] = (round(acc * n), n)  # accuracy = correct / n, so this is the count
        if br and ar:
            before = {r.get("id"): bool(r.get("correct")) for r in br if kind in ("all", r.get("task"))}
            after = {r.get("id"): bool(r.get("correct")) for r in ar if kind in ("all", r.get("task"))}
            common = set(before) & set(after)
            cells = Counter((before[i], after[i]) for i in common)
            row["paired"] = {"both": cells[(True, True)], "gained": cells[(False, True)],
                             "lost": cells[(True, False)], "neither": cells[(False, False)], "n": len(common)}
        out.append(row)
    return out


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


INTERVALS_NOTE = (
    "Brackets: 95% intervals, in %. For each accuracy, the <b>Wilson score interval</b> for k correct out of n: "
    "unlike p ± 1.96·SE it stays within 0–100% and keeps its width at 0/n and n/n. Before and after score the "
    "<i>same</i> items, so the change is <b>paired</b>: an item right (or wrong) on both sides says nothing "
    "about it, and only the flips do. Its interval is <b>Newcombe's paired score interval</b> (method 10: the two "
    "Wilson intervals combined with the correlation of the before and after verdicts), and p is the <b>exact "
    "McNemar test</b> of wrong→right against right→wrong flips (under no change each flip is a fair coin). "
    "Green or red: the interval excludes 0. The evaluation is greedy, so the uncertainty is over which items were "
    "drawn, not over sampling: with n = 40 one item is 2.5 points and a 5-point change is two questions.")


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
        rows = accuracy_rows(b, a, br, ar)
        body = "".join(f'<tr><th{SUB if r["kind"] != "all" else ""}>'
                       f'{"accuracy, all items" if r["kind"] == "all" else esc(r["kind"])}</th>'
                       f'{count_cell(r.get("before"))}{count_cell(r.get("after"))}{change_cells(r)}</tr>'
                       for r in rows)
        parts.append('<table class="grid acc"><thead><tr><th>task kind</th><th>before</th><th>after</th>'
                     '<th>Δ (interval)</th><th>flips: wrong→right / right→wrong</th><th>McNemar p</th></tr></thead>'
                     f'<tbody>{body}</tbody></table>' + note(INTERVALS_NOTE, "note small"))

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
    suite = set(kinds_all) <= {"all", "arithmetic", "lookup", "two_step"}
    return (f"<h3>Tool-usage shares per task kind (before → after, Δ pp)</h3>"
            f'<table class="grid"><thead><tr><th>task kind</th>{head}</tr></thead><tbody>{"".join(body)}</tbody>'
            "</table>" + note(f"Share of each tool among all tool calls of that kind's items ({esc(how)}). The "
                              "paper's finding to look for: the trained planner shifts its tool choice per task "
                              "kind." + (" On the built-in suite the right tools are Python_Coder for arithmetic, "
                                         "Local_Search for lookup, and Local_Search then Python_Coder for "
                                         "two_step." if suite else "")))


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
    return {"turn": t["turn"], "planner": clip(t["raw"], CAP["planner"]), "recorded": t["recorded"],
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
    cell = lambda p, b: _summary(planners[p].get(str(b))) or {}  # noqa: E731
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
# Section 3: what was cut, and the training curves. One row of CURVES per small chart;
# `step_values` turns a run into {series key: {step: value}}, and `curve_figure` draws
# one row from it, for one run or overlaid for several.
#
# A row: title, y-axis label, y-axis ("unit" = 0..1; "rate" = from 0 to the data, at
# most 1; "zero" = from the data, with 0 in view; "free" = from the data; "turns" =
# 0..T_max), its series, and the explanation under the chart (HTML; {placeholders}
# filled from `curve_facts`). A series is (key, label, colour, style): style "line",
# "dash", "points" (held-out dots) or "box" (a stacked bar); a key ending in ":*" is one
# series per tool (tool_share:*) or per task kind (reward_kind:*).

CURVES = [
    ("Reward and accuracy", "reward / accuracy", "unit", [
        ("reward_mean", "reward mean (train rollouts)", "blue", "line"),
        ("accuracy", "accuracy (train rollouts)", "green", "dash"),
        ("heldout_accuracy", "held-out accuracy", "orange", "points")],
     "Mean reward R over the step's Q×G rollouts{reward_note} Open dots: held-out accuracy from eval/step_N "
     "(step 0 = before training). Training rollouts sample, exploring on purpose, while a greedy held-out "
     "evaluation (eval.planner_temperature = 0) takes the most likely tool: compare each series with itself, "
     "not with the other.{heldout_note}"),
    ("Training reward per task kind", "reward mean", "unit", [("reward_kind:*", "", "", "line")],
     "Mean reward of the step's training rollouts of each task kind (trajectories/step_N.jsonl). A step draws "
     "each kind in proportion, so a kind has only a few queries per step: expect noise."),
    ("Groups with no learning signal", "share of query groups", "rate", [
        ("zero_variance_groups", "zero-variance groups", "red", "line")],
     "Share of queries whose G rollouts all got the same reward: every A_i is 0, so they teach nothing. "
     "Near 1 means the tasks are too easy or too hard for the current planner."),
    ("Reward spread within groups", "std of R in a group", "zero", [
        ("reward_std", "within-group std, mean over groups", "green", "line")],
     "Standard deviation of the G rewards of a query, averaged over the step's queries. A_i divides by it: "
     "0 for a group means no signal from that query, 0.5 is the most a 0/1 reward can spread."),
    ("KL to the reference policy", "KL(π_θ ‖ π_ref)", "zero", [("kl", "KL", "pink", "line")],
     "k3 estimate of the KL between the trained planner and the frozen initial weights, per planner token, "
     "averaged like the loss (over tokens, turns and rollouts). Penalised with weight β."),
    ("Clip fraction", "share of planner tokens", "rate", [("clip_frac", "clip fraction", "sky", "line")],
     "Share of planner tokens where the clip bites: ρ &lt; 1−ε_low with A &lt; 0, or ρ &gt; 1+ε_high with "
     "A &gt; 0. Always 0 when each batch gets a single update (ρ = 1 on the first pass)."),
    ("Tool-call error rate", "errors / tool calls", "rate", [
        ("tool_error_rate", "train rollouts", "red", "line"),
        ("heldout_tool_error_rate", "held-out", "orange", "points")],
     "Failed tool calls (bad plan, tool error) over all tool calls. The paper reports it falls with training."),
    ("Tool shares during training", "share of tool calls", "unit", [("tool_share:*", "", "", "line")],
     "Which tools the planner picks in the training rollouts, as a share of all tool calls of the step."),
    ("Tokens per planner action", "tokens", "zero", [
        ("tokens_per_action", "mean tokens per action", "blue", "line"),
        ("planner_cap", "max_new_tokens", "grey", "dash")],
     "Mean length of the planner's sampled action{tokens_note}. An action that reaches max_new_tokens is cut "
     "there, often mid-word in its sub-goal."),
    ("Cut, loose and out of turns", "share", "rate", [
        ("cap_share", "actions cut at max_new_tokens", "red", "line"),
        ("cap_share_min", "actions cut at max_new_tokens (at least)", "red", "dash"),
        ("loose_share", "tool name matched loosely", "orange", "line"),
        ("no_tool_share", "no tool named", "pink", "line"),
        ("out_of_turns_share", "trajectories out of turns", "sky", "line")],
     "Per training step: planner actions stopped by the token limit{cap_note}; actions whose tool line did not "
     "name a tool exactly (read through an alias, e.g. 'Python' as Python_Coder) or named none; trajectories "
     "that used every turn without the verifier saying STOP."),
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
# On a comparison page a run is a colour and its series differ by dash: (SVG pattern, legend style).
DASHES = [(None, "line"), ("6 4", "dash"), ("2 3", "dotted"), ("9 3 2 3", "dashdot")]


def step_values(run: dict) -> dict[str, dict[int, float]]:
    """{series key: {step: value}} for every key CURVES can name: the metrics rows' own
    keys, held-out points from eval/step_N, and what the trajectories give (reward per
    kind, spread, tokens, cut and loose shares)."""
    vals: dict[str, dict[int, float]] = {}

    def put(key, step, v):
        if num(v) is not None:
            vals.setdefault(key, {})[step] = num(v)

    colors = tool_colors(run)
    for r in run["metrics"]:
        for k, v in r.items():
            if k != "step":
                put(k, r["step"], v)
        if r.get("tool_shares"):
            for t in colors:
                put(f"tool_share:{t}", r["step"], r["tool_shares"].get(t, 0.0))
    for s, e in run["evals"].items():
        put("heldout_accuracy", s, e["summary"].get("accuracy"))
        put("heldout_tool_error_rate", s, e["summary"].get("tool_error_rate"))
    cap = num(cfg_get(run["config"], "agent.planner.max_new_tokens"))
    for step, st in run["train_stats"].items():
        for kind, v in st["reward_kind"].items():
            put(f"reward_kind:{kind}", step, v)
        put("reward_std", step, st["reward_std"])
        mean = tokens_per_action(run, step, st)
        put("tokens_per_action", step, mean)
        if mean is not None:
            put("planner_cap", step, cap)
        share, exact = cap_share(st, mean, cap)
        put("cap_share" if exact else "cap_share_min", step, share)
        if st.get("actions"):
            put("loose_share", step, st.get("loose", 0) / st["actions"])
            put("no_tool_share", step, st.get("no_tool", 0) / st["actions"])
        if st.get("trajectories"):
            put("out_of_turns_share", step, st.get("out_of_turns", 0) / st["trajectories"])
    return vals


def curve_facts(run: dict, vals: dict) -> dict[str, str]:
    """What the explanations of CURVES fill in."""
    same = vals.get("reward_mean") == vals.get("accuracy")
    max_turns = num(cfg_get(run["config"], "agent.max_turns"))
    cap = num(cfg_get(run["config"], "agent.planner.max_new_tokens"))
    exact = "cap_share" in vals
    return {"reward_note": " (= accuracy: the rewards are 0/1)." if same else
            "; accuracy = share of rollouts with R &gt; 0.",
            "heldout_note": "" if vals.get("heldout_accuracy") else " No held-out points: no eval/step_N yet.",
            "budget_note": f" (budget T_max = {max_turns:g})" if max_turns else "",
            "tokens_note": f" (cap: max_new_tokens = {cap:g}, dashed)" if cap else "",
            "cap_note": "" if exact or "cap_share_min" not in vals else
            " (dashed: a lower bound from the mean length, since this run's logs do not record why each action "
            "ended: actions below the cap have at most cap − 1 tokens)"}


def expand_series(run: dict, specs: list, vals: dict) -> list[tuple[str, str, str, str]]:
    """CURVES series with their colours resolved, ":*" keys expanded, and series that carry
    no data (or repeat the reward line) dropped."""
    out = []
    for key, label, color, style in specs:
        if key == "tool_share:*":
            out += [(f"tool_share:{t}", t, c, style) for t, c in tool_colors(run).items()
                    if f"tool_share:{t}" in vals]
        elif key == "reward_kind:*":
            kinds = [k.split(":", 1)[1] for k in vals if k.startswith("reward_kind:")]
            out += [(f"reward_kind:{k}", k, c, style) for k, c in kind_colors(kinds).items()]
        elif key in vals and not (key == "accuracy" and vals[key] == vals.get("reward_mean")):
            out.append((key, label, OKABE.get(color, color), style))
    return out


def x_extent(valses: list[dict]) -> tuple[float, float] | None:
    """One x-range for every small chart: the steps any CURVES series covers, half a step
    of margin each side (where the time bars need it)."""
    keys = {k for _, _, _, specs, _ in CURVES for k, *_ in specs}
    steps = [s for vals in valses for k, v in vals.items() if k in keys or k.split(":")[0] + ":*" in keys
             for s in v]
    return (min(steps) - 0.5, max(steps) + 0.5) if steps else None


def curve_figure(row: tuple, entries: list[tuple], x_range) -> str:
    """One CURVES row as a figure. entries: (run, vals, facts, label, colour) per run; with
    one entry the series keep their own colours, with several each run has its colour and
    its series differ by dash."""
    title, y_label, axis, specs, explain = row
    multi = len(entries) > 1
    drawn, keys, stacks = [], [], []
    for run, vals, facts, label, run_color in entries:
        series = expand_series(run, specs, vals)
        for i, (key, name, color, style) in enumerate(series):
            xs = sorted(vals[key])
            ys = [vals[key][x] for x in xs]
            if style == "box" and not multi:
                stacks.append({"name": name, "color": color, "ys": ys, "xs": xs})
                continue
            if style == "box":  # overlaid runs: each part of the time as its own line
                style = "line"
            dash = DASHES[i % len(DASHES)][0] if multi else (style == "dash")
            drawn.append({"name": f"{label}: {name}" if multi else name, "xs": xs, "ys": ys,
                          "color": run_color if multi else color, "dash": dash, "points": style == "points"})
            if not multi:
                keys.append((name, color, "dot" if style == "points" else style))
        if multi:
            keys.append((label, run_color, "line"))
    if multi:  # then one key per series, in grey, with its dash (the same in every run)
        names = {}
        for run, vals, *_ in entries:
            for i, (_, n, _, s) in enumerate(expand_series(run, specs, vals)):
                names.setdefault(n, "dot" if s == "points" else DASHES[i % len(DASHES)][1])
        if len(names) > 1:
            keys += [(n, "#555", style) for n, style in names.items()]
    facts = entries[0][2]
    missing = f"metrics.jsonl has no '{specs[0][0].split(':')[0].replace('tool_share', 'tool_shares')}'"
    if stacks:
        xs = sorted({x for s in stacks for x in s["xs"]})
        svg = stacked_bar_chart(xs, [{"name": s["name"], "color": s["color"],
                                      "ys": [dict(zip(s["xs"], s["ys"])).get(x) for x in xs]} for s in stacks],
                                y_label, x_range=x_range)
        keys = [(s["name"], s["color"], "box") for s in stacks]
    elif drawn:
        max_turns = max((num(cfg_get(e[0]["config"], "agent.max_turns")) or 0 for e in entries), default=0)
        y_min, y_max, zero, y_cap = {"unit": (0, 1, False, None), "rate": (None, None, True, 1.0),
                                     "zero": (None, None, True, None), "free": (None, None, False, None),
                                     "turns": (0 if max_turns else None, max_turns or None, True, None)}[axis]
        svg = line_chart(drawn, y_label, y_min=y_min, y_max=y_max, zero=zero, x_range=x_range, y_cap=y_cap)
    else:
        svg = None
    if not multi and len(keys) == 1 and keys[0][2] == "line":
        keys = []  # the title says what the one line is
    return figure(title, svg, explain.format(**facts), keys or None, missing)


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
    loose = Counter()
    for _, c, _ in cols:
        loose.update(c["loose_names"])
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
        parts.append(note("<b>No training steps yet</b>: metrics.jsonl is missing or empty (train.py appends "
                          "one row per finished step).", "note warn") + "</section>")
        return "".join(parts)
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


def section_tool_shift(run: dict) -> str:
    parts = ['<section id="tool-shift"><h2>4. Tool-usage shift per task kind</h2>', tool_shift_figure(run),
             "</section>"]
    return "".join(parts)


def tool_shift_figure(run: dict, title: str = "Tool shares before vs after, per task kind") -> str:
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
        return figure(title, None, "", missing=why)
    used = [t for t in colors if any(t in s for d in (sb or {}, sa or {}) for s in d.values())]
    return figure(title, svg, f"Each bar splits 100% of the held-out tool calls of one task kind ({esc(how)}); "
                  "hover a segment for the exact share and call count. Under each kind: its held-out accuracy "
                  "before → after." + ("" if sa else " <b>No after-training evaluation yet.</b>")
                  + ("" if sb else " <b>No before-training evaluation.</b>"), [(t, colors[t], "box") for t in used])


# ----------------------------------------------------------------------------------------
# Section 5: the trajectory browser (data embedded as JSON, drawn by report.js)


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


def train_ids(run: dict) -> dict[str, str]:
    """question -> item id in the run's training file (when it can still be found), so
    that a query group is named by its item. trajectories/step_N.jsonl rows that carry
    an "id" field are named by it directly."""
    path = cfg_get(run["config"], "data.train")
    if not isinstance(path, str) or not path:
        return {}
    p = Path(path)
    for candidate in ([p] if p.is_absolute() else [p, ASSETS / p]):
        if candidate.is_file() and candidate.suffix == ".jsonl":
            return {str(r.get("question")): str(r["id"]) for r in read_jsonl(candidate)
                    if isinstance(r, dict) and r.get("id") is not None}
    return {}


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
        g["rollouts"].append({"reward": num(tr.get("reward")), "advantage": num(tr.get("advantage")),
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
        parts.append(note("<b>No trajectories in this folder</b>: train.py writes trajectories/step_N.jsonl "
                          "(every rollout of step N) as each step finishes; none is here yet.", "note warn"))
        parts.append("</section>")
        return "".join(parts)
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
    turn_rows = cfg_get(run["config"], "train.advantage_mode") == "turn_rows"
    over = ("over all planner turns of the G rollouts (advantage_mode turn_rows: a rollout with T_i turns counts "
            "T_i times)" if turn_rows else "over the G rollouts")
    parts.append(note(
        f"Embedded: {esc(shown)}. Each row is one query (named by its training item id where the training file "
        "is found); its columns are the G rollouts of that query, run independently from the same start. Per "
        "rollout: the reward R_i ∈ {0, 1} of its final answer, and its "
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
                 '<option value="all1">all R = 1</option><option value="all0">all R = 0</option></select></label>'
                 '<label>tool <select id="traj-tool"><option value="">any</option></select></label>'
                 '<label>flag <select id="traj-flag"></select></label>'
                 '<span id="step-info" class="status" role="status"></span></div>'
                 '<div id="traj-groups"><p class="note">The trajectory browser needs JavaScript.</p></div>')
    parts.append(f'<script type="application/json" id="traj-data">{blob}</script>')
    parts.append("</section>")
    return "".join(parts)


# ----------------------------------------------------------------------------------------
# The page. Its style sheet and script live next to this file (report.css, report.js) and
# are inlined at render time, so the page needs nothing but itself.


def asset(name: str) -> str:
    return (ASSETS / name).read_text(encoding="utf-8")


def page_head(title: str) -> str:
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)}</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{asset("report.css")}'
            "</style></head><body>")


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
                       f"out_dir={esc(out)}</code>, or point report.py at a run's out_dir.", "note warn")
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


def guarded(section, *args) -> str:
    try:
        return section(*args)
    except Exception as e:  # one malformed field must not cost the whole page (or the training run)
        return (f'<section><h2>{esc(section.__name__)}</h2>'
                + note(f"This section could not be drawn: {esc(type(e).__name__)}: {esc(e)}", "note warn")
                + "</section>")


# ----------------------------------------------------------------------------------------
# The comparison page: runs side by side (provenance and config differences, held-out
# before/after with intervals, items the runs disagree on), curves overlaid, tool shifts.


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
    rows = []
    for i in ids:
        pairs = [(mark(b.get(i)), mark(a.get(i))) for b, a in verdicts]
        if len(set(pairs)) > 1:
            item = verdicts[0][1][i]
            cells = "".join(f'<td class="{"good" if y == "✓" and x != "✓" else "bad" if x == "✓" and y != "✓" else ""}">'
                            f"{x} → {y}</td>" for x, y in pairs)
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
            f'{esc(time.strftime("%Y-%m-%d %H:%M:%S"))} · written to <span id="run-dir" data-what="file">{esc(out_file.resolve())}'
            "</span></div>")
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


def main(argv: list[str]) -> int:
    args, out = list(argv), None
    if "--out" in args:
        i = args.index("--out")
        out = args[i + 1] if i + 1 < len(args) else None
        del args[i:i + 2]
        if out is None:
            args = []
    if not args or any(a.startswith("-") for a in args):
        print(__doc__.split("\n\n")[1])
        return 2
    try:
        path = write_report(args[0]) if len(args) == 1 else write_comparison(args, out)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
