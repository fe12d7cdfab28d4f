"""Reading a training run's directory into the dict both pages render (`load_run`), and
the facts the pages derive from it: what each planner action did, per-step training
counts, which evaluations are "before" and "after", accuracy counts and flips per task
kind, tool shares, wall time. Plain data, no HTML.

Every file of a run may be missing (a run in progress, evaluation switched off) and a
line may be cut short by an interruption: every reader tolerates both, and returns
what exists.
"""

import json
import math
from collections import Counter
from pathlib import Path

from support.datasets import read_jsonl
from support.report.charts import num


def read_json(path: Path):
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


def as_summary(s):
    """An evaluation summary with the nested fields the pages read in the expected shape."""
    if not isinstance(s, dict):
        return None
    s = {**s, "tool_shares": _shares(s.get("tool_shares"))}
    kinds = s.get("by_kind") if isinstance(s.get("by_kind"), dict) else {}
    s["by_kind"] = {str(k): as_summary(v) for k, v in kinds.items() if isinstance(v, dict)}
    return s


def _evals_in(folder: Path) -> tuple[dict, dict]:
    """The evaluations in `folder`: ({step: entry} of its step_N folders, {name: entry} of the
    others), each entry {"summary", "results", "dir"}."""
    by_step, others = {}, {}
    for d in sorted(folder.iterdir()) if folder.is_dir() else ():
        summary = as_summary(read_json(d / "summary.json")) if d.is_dir() else None
        if summary is None:
            continue
        entry = {"summary": summary, "results": read_jsonl(d / "results.jsonl"), "dir": d.name}
        step = _step_of(d.name)
        if step is not None:
            by_step[step] = entry
        else:
            others[d.name] = entry
    return by_step, others


def load_run(out: Path) -> dict:
    """Everything the pages need; trajectories are read once here for per-step counts, and
    again by the run's page only for the steps its browser embeds."""
    metrics = {}
    for row in read_jsonl(out / "metrics.jsonl"):
        if isinstance(row.get("step"), int):
            row["tool_shares"] = _shares(row.get("tool_shares"))
            metrics[row["step"]] = row  # a resumed run may repeat a step: the last row wins
    evals, other_evals = _evals_in(out / "eval")  # train.py's held-out ones by step (0 = before); eval.py's
    paraphrase_evals, _ = _evals_in(out / "eval" / "paraphrase")  # train.py's, on data.paraphrase
    traj_files = {_step_of(p.name): p for p in (out / "trajectories").glob("step_*.jsonl")
                  if _step_of(p.name) is not None}
    config = read_json(out / "config.json")
    learning = read_json(out / "learning.json")
    if isinstance(learning, dict):
        learning = {k: as_summary(v) for k, v in learning.items()}
    run_json = read_json(out / "run.json")
    processes = run_json.get("processes") if isinstance(run_json, dict) else None
    sweep = read_json(out / "turn_sweep.json")
    table = out / "eval" / "paper" / "table.md"  # eval.py --suite paper's, with its default --out
    run = {"dir": out, "config": config if isinstance(config, dict) else None,
           "metrics": [metrics[k] for k in sorted(metrics)], "evals": evals, "other_evals": other_evals,
           "paraphrase_evals": paraphrase_evals,
           "learning": learning if isinstance(learning, dict) else None,
           "traj_files": dict(sorted(traj_files.items())),
           "processes": [p for p in processes if isinstance(p, dict)] if isinstance(processes, list) else [],
           "turn_sweep": sweep if isinstance(sweep, dict) and isinstance(sweep.get("planners"), dict) else None,
           "paper_table": table.read_text() if table.is_file() else None}
    run["train_stats"] = training_stats(run)
    return run


def cfg_get(cfg: dict | None, dotted: str, default=None):
    """cfg["a"]["b"] for dotted = "a.b", or `default` when any level is missing."""
    node = cfg
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


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
        out.append({"turn": t, "raw": raw, "prompt": str(entry.get("prompt") or ""),  # what the planner saw
                    "tool_line": line, "tool": tool, "record": rec, "recorded": t in records,
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
# Held-out evaluations: before vs after training


def before_after(run: dict) -> tuple[dict | None, dict | None, list | None, list | None, str]:
    """(before summary, after summary, before results rows, after results rows, where from)."""
    evals = run["evals"]
    first = evals.get(0)
    last_step = max((s for s in evals if s > 0), default=None)
    last = evals.get(last_step) if last_step is not None else None
    learning = run["learning"] or {}
    b, a = learning.get("before"), learning.get("after")  # summaries or None (as_summary)
    if b is not None or a is not None:
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
            before, after = ({r.get("id"): bool(r.get("correct")) for r in rows if kind in ("all", r.get("task"))}
                             for rows in (br, ar))
            common = set(before) & set(after)
            cells = Counter((before[i], after[i]) for i in common)
            row["paired"] = {"both": cells[(True, True)], "gained": cells[(False, True)],
                             "lost": cells[(True, False)], "neither": cells[(False, False)], "n": len(common)}
        out.append(row)
    return out


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
    parts = {"all": s, **(s.get("by_kind") or {})}
    return {kind: {t: (v, None) for t, v in (k.get("tool_shares") or {}).items()} for kind, k in parts.items()}


def tool_shares_ba(run) -> tuple[dict | None, dict | None, str]:
    b, a, br, ar, _ = before_after(run)
    sb = shares_from_results(br) if br else (shares_from_summary(b) if b else None)
    sa = shares_from_results(ar) if ar else (shares_from_summary(a) if a else None)
    how = "computed from eval results.jsonl" if (br or ar) else "from the evaluation summaries"
    return sb, sa, how


# ----------------------------------------------------------------------------------------
# The processes that ran it (run.json, written by support/provenance.py)


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
