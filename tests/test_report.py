"""The run report (support/report/, scripts/report.py) on fake run directories laid out
like train.py's: a full run, a run with only metrics, an empty folder, two runs compared;
the interval arithmetic; provenance; and the page driven in headless Chromium (skipped,
saying why, when chromium or chromedriver is not installed). No model runs: the files are
written here, in the formats train.py and eval.py write."""

import base64
import json
import math
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

import scripts.report  # noqa: E402
from support import provenance  # noqa: E402
from support.report import charts, compare, curves, page, runs, stats  # noqa: E402
from eval import summarize  # noqa: E402  (the real summary format)

HOSTILE = "</script><img src=x onerror=alert(1)>"
TOOLS = ["Base_Generator", "Python_Coder", "Local_Search"]
TASKS = ["arithmetic", "lookup", "two_step"]
# The tool that makes each task kind solvable (as in tasks.py's suite).
RIGHT_TOOL = {"arithmetic": "Python_Coder", "lookup": "Local_Search", "two_step": "Local_Search"}
# What a planner's tool line says when it does not name its tool exactly (parse_plan
# reads it through the tool's aliases).
LOOSE_NAME = {"Python_Coder": "Python_Corner", "Local_Search": "Local", "Base_Generator": "Base"}
CAP = 40  # the fake runs' planner max_new_tokens


def fake_config(out: Path, steps: int, groups: int, G: int) -> dict:
    return {"seed": 0, "out_dir": str(out), "resume": True,
            "model": {"name": "smollm2-135m", "device": "auto", "dtype": "float32", "threads": 0},
            "agent": {"tools": TOOLS, "max_turns": 3, "constrain_tool": True,
                      "planner": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": CAP}},
            "train": {"steps": steps, "queries_per_step": groups, "group_size": G, "lr": 2e-5, "beta": 0.001,
                      "eps_low": 0.2, "eps_high": 0.3, "advantage_mode": "trajectory", "epochs": 1,
                      "minibatches": 1, "train_layers": 0, "eval_every": 0, "eval_before_after": True},
            "eval": {"limit": 0, "batch_size": 32, "max_turns": 3, "seed": 1234}}


def fake_question(rng: random.Random, task: str) -> tuple[str, str]:
    if task == "arithmetic":
        a, b = rng.randint(1000, 99999), rng.randint(100, 9999)
        return f"Evaluate {a} * {b}.", str(a * b)
    if task == "lookup":
        name = rng.choice(["Latrak", "Drakzar", "Skintor", "Krennos"])
        return f"How long is the {name} river in km?", str(rng.randint(100, 3000))
    name = rng.choice(["Krulbrel", "Zanthor"])
    return f"How many years after the founding of {name} was the Krulbrel launched?", str(rng.randint(5, 300))


def fake_trajectory(rng: random.Random, task: str, query: str, gold: str, skill: float, hostile: bool) -> dict:
    """One rollout: the planner picks the right tool with probability `skill`, names it
    loosely now and then, and sometimes runs into max_new_tokens."""
    memory, log, tools = [], [], []
    solved = False
    for t in range(1, 4):  # T_max = 3
        tool = RIGHT_TOOL[task] if rng.random() < skill else rng.choice(TOOLS)
        sub_goal = {"Python_Coder": "compute the value", "Local_Search": "find the fact in the corpus",
                    "Base_Generator": "answer directly"}[tool]
        error = "" if rng.random() > 0.2 * (1 - skill) else "tool error: NameError: name 'x' is not defined"
        command = {"Python_Coder": f"print({query.split()[-1].rstrip('.') if task == 'arithmetic' else 42})",
                   "Local_Search": query, "Base_Generator": query}[tool]
        result = gold if (tool == RIGHT_TOOL[task] and not error) else "I am not sure. " * rng.randint(1, 80)
        if hostile and t == 1:
            result = HOSTILE + " " + result
        solved = solved or (tool == RIGHT_TOOL[task] and not error)
        verdict = "" if t == 3 else "stop" if solved or rng.random() < 0.3 else "continue"
        memory.append({"turn": t, "sub_goal": sub_goal, "tool": tool, "command": command, "result": result,
                       "error": error, "verdict": verdict})
        line = LOOSE_NAME[tool] if rng.random() < 0.3 else tool
        tokens = CAP if rng.random() < 0.3 else rng.randint(4, CAP - 1)
        log.append({"module": "planner", "turn": t, "output": f"Tool: {line}\nSub-goal: {sub_goal}",
                    "tokens": tokens, "finish": "length" if tokens == CAP else "stop"})
        log.append({"module": "executor", "turn": t, "tool": tool, "output": command})
        if verdict:
            log.append({"module": "verifier", "turn": t, "output": verdict.upper()})
        tools.append(tool)
        if verdict != "continue":
            break
    n_turns = len(memory)
    answer = gold if solved and rng.random() < 0.9 else str(rng.randint(1, 999))
    log.append({"module": "generator", "output": answer})
    return {"query": query, "answer": answer, "reward": float(answer == gold), "advantage": 0.0,
            "n_turns": n_turns, "tools": tools, "memory": memory, "log": log,
            "_errors": sum(bool(m["error"]) for m in memory)}


def fake_eval(out: Path, step: int, skill: float, n: int = 18, hostile: bool = False, seed: int = 0) -> dict:
    rng = random.Random(1000 + step + 7919 * seed)
    rows = []
    for k in range(n):
        task = TASKS[k % 3]
        q, gold = fake_question(random.Random(k), task)
        tr = fake_trajectory(rng, task, q, gold, skill, hostile)
        rows.append({"id": f"heldout-{k:04d}", "question": q, "gold": [gold], "kind": "number", "task": task,
                     "answer": tr["answer"], "extracted": tr["answer"], "correct": bool(tr["reward"]),
                     "f1": tr["reward"], "turns": tr["n_turns"], "tools": tr["tools"], "tool_calls": len(tr["tools"]),
                     "tool_errors": tr["_errors"], "errors": [m["error"] for m in tr["memory"] if m["error"]],
                     "trajectory": {**{k: v for k, v in tr.items() if k != "_errors"}, "reward": 0.0}})
    d = out / "eval" / f"step_{step}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(rows)
    (d / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def make_fake_run(tmp_path: Path, steps: int = 5, groups: int = 2, G: int = 4, *, evals: bool = True,
                  trajectories: bool = True, hostile: bool = True, seed: int = 0, name: str = "run") -> Path:
    """A run directory laid out like train.py's, with a planner that learns the right tools."""
    out = Path(tmp_path) / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**fake_config(out, steps, groups, G), "seed": seed}, indent=2) + "\n")
    rng = random.Random(seed)
    if evals:
        before = fake_eval(out, 0, 0.3, seed=seed)
    metrics = []
    for step in range(1, steps + 1):
        skill = 0.3 + 0.6 * step / steps
        trajs = []
        for g in range(groups):
            task = TASKS[(step + g) % 3]
            q, gold = fake_question(rng, task)
            if hostile and step == 1 and g == 0:
                q = HOSTILE + " " + q
            group = [fake_trajectory(rng, task, q, gold, skill, hostile and step == 1) for _ in range(G)]
            rewards = [tr["reward"] for tr in group]
            mean = sum(rewards) / G
            std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / G)
            for tr in group:
                tr["advantage"] = (tr["reward"] - mean) / (std + 1e-6)
                trajs.append({"group": g, "task": task, "gold": [gold], **tr})
        if trajectories:
            (out / "trajectories").mkdir(exist_ok=True)
            (out / "trajectories" / f"step_{step}.jsonl").write_text(
                "".join(json.dumps({k: v for k, v in tr.items() if k != "_errors"}) + "\n" for tr in trajs))
        calls = [t for tr in trajs for t in tr["tools"]]
        shares = {t: calls.count(t) / len(calls) for t in sorted(set(calls))}
        rewards = [tr["reward"] for tr in trajs]
        zero_var = sum(len({tr["reward"] for tr in trajs[g * G:(g + 1) * G]}) == 1 for g in range(groups))
        metrics.append({"step": step, "reward_mean": sum(rewards) / len(rewards),
                        "accuracy": sum(r > 0 for r in rewards) / len(rewards),
                        "reward_terms": {"correct": sum(r > 0 for r in rewards) / len(rewards)},
                        "zero_variance_groups": zero_var / groups,
                        "mean_turns": sum(tr["n_turns"] for tr in trajs) / len(trajs), "tool_shares": shares,
                        "top_tool": max(shares, key=shares.get),
                        "tool_error_rate": sum(tr["_errors"] for tr in trajs) / len(calls),
                        "loss": rng.uniform(-0.05, 0.05), "kl": 2e-4 * step * rng.uniform(0.8, 1.2),
                        "clip_frac": 0.0, "entropy": 0.3 + 0.8 * math.exp(-step / 8),
                        "grad_norm": rng.uniform(0.3, 2.0),
                        "logprob_gap": rng.uniform(0, 2e-5), "planner_tokens": 11 * len(trajs),
                        "optimizer_steps": 1, "lr": 2e-5, "time_rollout": rng.uniform(20, 30),
                        "time_judge": rng.uniform(0.01, 0.05), "time_update": rng.uniform(3, 6)})
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if evals:
        after = fake_eval(out, steps, 0.9, seed=seed)
        (out / "learning.json").write_text(json.dumps({"before": before, "after": after}, indent=2) + "\n")
    return out


# ----------------------------------------------------------------------------------------
# An HTML checker: tag balance for every non-void element, scripts' contents, svg per figure.

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
SVG_LEAVES = {"rect", "line", "circle", "polyline", "path", "polygon"}  # may be self-closed (<rect .../>)


class Checker(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack, self.errors, self.tags, self.scripts, self.text = [], [], [], [], []
        self.headings, self.figures, self._fig_svgs, self._script = [], [], None, None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "figure":
            self._fig_svgs = 0
        if tag == "svg" and self._fig_svgs is not None:
            self._fig_svgs += 1
        if tag == "script":
            self._script = [dict(attrs), []]
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in VOID and tag not in SVG_LEAVES:
            self.errors.append(f"self-closed <{tag}/>")

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}>")
            return
        self.stack.pop()
        if tag == "figure":
            self.figures.append(self._fig_svgs)
            self._fig_svgs = None
        if tag == "script":
            self.scripts.append((self._script[0], "".join(self._script[1])))
            self._script = None

    def handle_data(self, data):
        if self._script is not None:
            self._script[1].append(data)
        else:
            self.text.append(data)
            if self.stack and self.stack[-1] in ("h1", "h2", "h3"):
                self.headings.append(data)


def check_html(text: str) -> Checker:
    assert text.lstrip().startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    c = Checker()
    c.feed(text)
    c.close()
    assert not c.errors, c.errors[:5]
    assert c.stack == [], f"unclosed: {c.stack}"
    return c


SECTIONS = ["1. The run", "2. Held-out evaluation: before vs after training", "3. Training curves",
            "4. Tool-usage shift per task kind", "5. Trajectory browser"]


def embedded(c: Checker, block: str = "traj-data") -> dict:
    blobs = [body for attrs, body in c.scripts if attrs.get("type") == "application/json" and attrs.get("id") == block]
    assert len(blobs) == 1
    return json.loads(blobs[0])


def results(out: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (out / "eval" / f"step_{step}" / "results.jsonl").read_text().splitlines()]


def loose_in(traj: dict) -> bool:
    """Written here without the report's code: the planner's tool line does not hold the
    name of the tool its turn was recorded with."""
    first = {e["turn"]: e["output"].splitlines()[0] for e in traj["log"] if e["module"] == "planner"}
    return any(m["tool"] and m["tool"].lower() not in first[m["turn"]].lower() for m in traj["memory"])


N_CURVES = len(curves.CURVES)


# ----------------------------------------------------------------------------------------


def test_full_run(tmp_path):
    steps, groups, G = 5, 2, 4
    out = make_fake_run(tmp_path, steps=steps, groups=groups, G=G)
    path = page.write_report(out)
    assert path == out / "report.html" and path.exists()
    assert not list(out.glob(".report.html.*"))  # the temporary file was renamed
    text = path.read_text(encoding="utf-8")
    c = check_html(text)
    for h in SECTIONS:
        assert h in c.headings, h
    # One chart = one <figure> with exactly one <svg>: every curve and the tool-shift bars.
    assert c.figures and all(n == 1 for n in c.figures), c.figures
    assert len(c.figures) == N_CURVES + 1
    assert sum(1 for t, _ in c.tags if t == "svg") == N_CURVES + 1
    # Self-contained: nothing loaded from elsewhere.
    for tag, attrs in c.tags:
        assert not (tag in ("script", "img", "link", "iframe") and (attrs.get("src") or attrs.get("href"))), tag
    assert "http://" not in text.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in text

    # Before/after: accuracy from learning.json with deltas.
    learning = json.loads((out / "learning.json").read_text())
    plain = " ".join(c.text)
    assert f"{100 * learning['before']['accuracy']:.1f}%" in plain
    assert f"{100 * learning['after']['accuracy']:.1f}%" in plain
    assert " pp" in plain and "arithmetic" in plain

    # The trajectory browser's data: every step, every group, G rollouts each, rewards and advantages.
    data = embedded(c)
    assert data["steps"] == list(range(1, steps + 1))
    for s in range(1, steps + 1):
        rows = [json.loads(line) for line in (out / "trajectories" / f"step_{s}.jsonl").read_text().splitlines()]
        st = data["by_step"][str(s)]
        assert len(st["groups"]) == groups
        for g in st["groups"]:
            assert len(g["rollouts"]) == G
            want = [r for r in rows if r["group"] == g["group"]]
            assert [r["reward"] for r in g["rollouts"]] == [r["reward"] for r in want]
            assert [r["advantage"] for r in g["rollouts"]] == pytest.approx([r["advantage"] for r in want])
            for r, w in zip(g["rollouts"], want):
                assert [t["turn"] for t in r["turns"]] == [m["turn"] for m in w["memory"]]
                assert r["turns"][0]["planner"].startswith("Tool: ")
    assert "advantage A_i, broadcast to every planner turn" in text
    # Text fields are capped.
    assert all(len(t["result"]) <= page.CAP["result"] + 60
               for st in data["by_step"].values() for g in st["groups"] for r in g["rollouts"] for t in r["turns"])


def test_hostile_text_is_escaped(tmp_path):
    out = make_fake_run(tmp_path, steps=2, groups=2, G=2, hostile=True)
    # Also in places that end up in tables, SVG titles and legends: a model name, a tool name.
    cfg = json.loads((out / "config.json").read_text())
    cfg["model"]["name"] = HOSTILE
    (out / "config.json").write_text(json.dumps(cfg))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["tool_shares"][HOSTILE] = 0.1
        r["top_tool"] = HOSTILE
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = page.write_report(out).read_text(encoding="utf-8")
    assert HOSTILE not in text and "<img" not in text and "</script><img" not in text
    c = check_html(text)
    assert not any(t == "img" for t, _ in c.tags)
    # Exactly the scripts the report emits (two data blocks, the browser script), the data
    # blocks intact with the string inside them.
    assert len(c.scripts) == 3
    data = embedded(c)
    g0 = data["by_step"]["1"]["groups"][0]
    assert g0["query"].startswith(HOSTILE)
    assert any(HOSTILE in t["result"] for r in g0["rollouts"] for t in r["turns"])


def test_only_metrics(tmp_path):
    out = make_fake_run(tmp_path, steps=3, evals=False, trajectories=False)
    (out / "config.json").unlink()
    text = page.write_report(out).read_text(encoding="utf-8")
    c = check_html(text)
    for h in SECTIONS:
        assert h in c.headings, h
    plain = " ".join(c.text)
    assert "No held-out evaluation yet" in plain
    assert "No trajectories in this folder" in plain
    assert "config.json is missing" in plain
    assert not [b for a, b in c.scripts if a.get("type") == "application/json"]
    # The curves from metrics.jsonl; those drawn from trajectories and the tool-shift bars
    # explain why they are empty.
    assert sum(1 for t, _ in c.tags if t == "svg") == N_CURVES - 4
    assert len(c.figures) == N_CURVES + 1


def test_run_in_progress_and_many_steps(tmp_path, monkeypatch):
    """No learning.json yet, a cut last line, and more steps than the browser embeds."""
    out = make_fake_run(tmp_path, steps=12, groups=1, G=2, evals=False)
    fake_eval(out, 0, 0.3)
    rows = (out / "metrics.jsonl").read_text().splitlines()
    rows[3] = rows[3].replace('"loss": ', '"loss": NaN, "old_loss": ')  # json.dumps writes NaN
    with open(out / "metrics.jsonl", "w") as f:
        f.write("\n".join(rows) + '\n{"step": 13, "reward_me')  # the last line cut mid-write
    monkeypatch.setattr(page, "MAX_EMBED_STEPS", 5)
    c = check_html(page.write_report(out).read_text(encoding="utf-8"))
    assert "No after-training evaluation yet" in " ".join(c.text)
    steps = embedded(c)["steps"]
    assert len(steps) <= 5 and steps[0] == 1 and steps[-1] == 12


def test_empty_and_missing_dir(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    text = page.write_report(empty).read_text(encoding="utf-8")
    c = check_html(text)
    assert "Nothing to report yet" in c.headings
    with pytest.raises(FileNotFoundError):
        page.write_report(tmp_path / "nope")
    assert scripts.report.main([str(tmp_path / "nope")]) == 2
    assert scripts.report.main([str(empty)]) == 0
    assert capsys.readouterr().out.strip().endswith("report.html")


def test_nice_ticks_and_step_picking():
    lo, hi, ticks = charts.nice_ticks(0.0013, 0.0087)
    assert lo <= 0.0013 and hi >= 0.0087 and 3 <= len(ticks) <= 7
    assert page.pick_steps(list(range(1, 101)), 40)[0] == 1 and page.pick_steps(list(range(1, 101)), 40)[-1] == 100
    assert len(page.pick_steps(list(range(1, 101)), 40)) == 40
    assert page.pick_steps([3, 4], 40) == [3, 4]


def test_malformed_values_still_render(tmp_path):
    """Odd values in the files (a hand-edited or foreign run) cost a line or a section, not the page."""
    out = make_fake_run(tmp_path, steps=3, groups=1, G=2)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows[0]["tool_shares"], rows[1]["kl"], rows[2] = "oops", "high", {"step": 3}
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (out / "learning.json").write_text(json.dumps({"before": {"by_kind": [1, 2], "tool_shares": None},
                                                   "after": "not a summary"}))
    with open(out / "trajectories" / "step_2.jsonl", "a") as f:
        f.write(json.dumps({"group": 0, "memory": "bad", "log": None, "reward": "x"}) + "\n")
    c = check_html(page.write_report(out).read_text(encoding="utf-8"))
    for h in SECTIONS:
        assert h in c.headings, h
    assert embedded(c)["steps"] == [1, 2, 3]


# ----------------------------------------------------------------------------------------
# Intervals


def test_wilson_interval():
    # At k = 0 the Wilson upper limit has the closed form z^2 / (n + z^2).
    z2 = stats.Z95 ** 2
    assert stats.wilson(0, 10) == pytest.approx((0.0, z2 / (10 + z2)))
    assert stats.wilson(10, 10) == pytest.approx((10 / (10 + z2), 1.0))
    lo, hi = stats.wilson(38, 40)
    assert lo < 0.95 < hi <= 1 and hi - lo < 0.2
    # Its centre is pulled towards 1/2, unlike the Wald interval's.
    assert (lo + hi) / 2 < 0.95


def exact_coverage(interval, n: int, probs: tuple[float, float, float, float]) -> float:
    """P(the interval covers the true change) summed over every paired table of n items:
    probs = (right both, gained, lost, wrong both)."""
    truth = probs[1] - probs[2]
    total = 0.0
    for a in range(n + 1):
        for b in range(n + 1 - a):
            for c in range(n + 1 - a - b):
                d = n - a - b - c
                p = (math.factorial(n) / (math.factorial(a) * math.factorial(b) * math.factorial(c) * math.factorial(d))
                     * probs[0] ** a * probs[1] ** b * probs[2] ** c * probs[3] ** d)
                lo, hi = interval(a, b, c, d)
                total += p * (lo <= truth <= hi)
    return total


def test_paired_change_interval():
    # Mirror image: swapping the flips mirrors the interval around 0.
    lo, hi = stats.paired_change_interval(10, 28, 2, 56)
    assert stats.paired_change_interval(10, 2, 28, 56) == pytest.approx((-hi, -lo))
    assert lo < 26 / 96 < hi and lo > 0
    # No flips: the change is 0 and the interval holds it.
    lo, hi = stats.paired_change_interval(30, 0, 0, 10)
    assert lo < 0 < hi
    # Pairing narrows it when the verdicts agree (most items stay as they were).
    paired = stats.paired_change_interval(30, 4, 1, 5)
    unpaired = stats.change_interval(34, 31, 40)
    assert paired[1] - paired[0] < unpaired[1] - unpaired[0]
    # It holds its nominal 95% on the size of a task kind's held-out split: exact coverage.
    for probs in ((0.6, 0.15, 0.05, 0.2), (0.45, 0.05, 0.05, 0.45), (0.3, 0.3, 0.1, 0.3)):
        cover = exact_coverage(stats.paired_change_interval, 20, probs)
        assert cover > 0.93, (probs, cover)
    # ... which the textbook Wald interval for a paired change does not.
    def wald(a, b, c, d):
        n = a + b + c + d
        diff = (b - c) / n
        se = math.sqrt(max(0.0, (b + c) / n - diff ** 2) / n)
        return diff - stats.Z95 * se, diff + stats.Z95 * se
    for probs in ((0.9, 0.08, 0.01, 0.01), (0.85, 0.1, 0.0, 0.05)):  # few flips, all one way
        assert exact_coverage(wald, 20, probs) < 0.9 < exact_coverage(stats.paired_change_interval, 20, probs)


def test_mcnemar_p():
    assert stats.mcnemar_p(0, 0) == 1.0 and stats.mcnemar_p(5, 5) == 1.0
    assert stats.mcnemar_p(0, 2) == pytest.approx(0.5)
    assert stats.mcnemar_p(28, 2) == pytest.approx(2 * (1 + 30 + 435) / 2 ** 30)
    assert stats.mcnemar_p(2, 28) == stats.mcnemar_p(28, 2)


# ----------------------------------------------------------------------------------------
# What was cut, read loosely, or ran out of turns


def one_turn(turn, line, tool, verdict="stop", tokens=None, finish=None):
    entry = {"module": "planner", "turn": turn, "output": f"Tool: {line}\nSub-goal: x"}
    if tokens is not None:
        entry.update(tokens=tokens, finish=finish)
    return entry, {"turn": turn, "sub_goal": "x", "tool": tool, "command": "c", "result": "r",
                   "error": "" if tool else "planner named no known tool", "verdict": verdict}


def test_planner_turns_flags():
    log, memory = zip(one_turn(1, "Python_Corner", "Python_Coder", "continue", 16, "length"),
                      one_turn(2, "nothing useful", "", "", 7, "stop"))
    turns = runs.planner_turns({"log": list(log), "memory": list(memory)})
    assert [t["loose"] for t in turns] == [True, False]
    assert [t["no_tool"] for t in turns] == [False, True]
    assert [t["at_cap"] for t in turns] == [True, False] and [t["tokens"] for t in turns] == [16, 7]
    assert turns[0]["tool_line"] == "Python_Corner"
    assert runs.out_of_turns(turns, 2) and not runs.out_of_turns(turns, 3)
    exact = runs.planner_turns(dict(zip(("log", "memory"), map(list, zip(one_turn(1, "Python_Coder", "Python_Coder"))))))
    assert not exact[0]["loose"] and exact[0]["at_cap"] is None  # no finish reason recorded
    stopped = runs.planner_turns(dict(zip(("log", "memory"), map(list, zip(one_turn(1, "Local", "Local_Search",
                                                                                         "stop"))))))
    assert stopped[0]["loose"] and not runs.out_of_turns(stopped, 1)
    # Without finish reasons, the share at the cap is bounded from the mean length.
    assert runs.cap_share({"actions": 10}, 15.6, 16) == (pytest.approx(0.6), False)
    assert runs.cap_share({"actions": 10}, 9.0, 16) == (0.0, False)
    assert runs.cap_share({"actions": 4, "with_finish": 4, "at_cap": 1}, 9.0, 16) == (0.25, True)


def test_cut_table_and_curves(tmp_path):
    out = make_fake_run(tmp_path, steps=3, groups=2, G=2)
    c = check_html(page.write_report(out).read_text(encoding="utf-8"))
    plain = " ".join(c.text)
    assert "What was cut or read loosely" in c.headings
    trajs = [json.loads(line) for s in (1, 2, 3) for line in (out / "trajectories" / f"step_{s}.jsonl").read_text().splitlines()]
    planner = [e for tr in trajs for e in tr["log"] if e["module"] == "planner"]
    at_cap = sum(e["finish"] == "length" for e in planner)
    assert f"{at_cap}/{len(planner)} ({100 * at_cap / len(planner):.1f}%)" in plain
    loose = sum(tr["memory"][e["turn"] - 1]["tool"].lower() not in e["output"].splitlines()[0].lower()
                for tr in trajs for e in tr["log"] if e["module"] == "planner")
    assert f"{loose}/{len(planner)} " in plain and "Python_Corner" in plain
    vals = curves.step_values(runs.load_run(out))
    st1 = [json.loads(line) for line in (out / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    tok = [e["tokens"] for tr in st1 for e in tr["log"] if e["module"] == "planner"]
    assert vals["tokens_per_action"][1] == pytest.approx(sum(tok) / len(tok))
    assert vals["planner_cap"][1] == CAP and "cap_share_min" not in vals
    kinds = {tr["task"] for tr in st1}
    for k in kinds:
        rs = [tr["reward"] for tr in st1 if tr["task"] == k]
        assert vals[f"reward_kind:{k}"][1] == pytest.approx(sum(rs) / len(rs))


def svg_of(text: str, title: str) -> str:
    m = re.search(r"<figcaption><b>" + re.escape(title) + r"</b></figcaption>.*?(<svg.*?</svg>)", text, re.S)
    assert m, title
    return m.group(1)


def x_ticks(svg: str) -> list[tuple[str, str]]:
    return re.findall(r'<text x="([\d.]+)" y="206" class="tick" text-anchor="middle">([^<]*)</text>', svg)


def test_small_charts_share_x_and_rates_autoscale(tmp_path):
    out = make_fake_run(tmp_path, steps=5, groups=2, G=2)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r["tool_error_rate"] = 0.01 * r["step"]  # small: a 0..1 axis would flatten it
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = page.write_report(out).read_text(encoding="utf-8")
    curves_html = text[text.index('id="curves"'):text.index('id="tool-shift"')]
    svgs = re.findall(r"<svg.*?</svg>", curves_html, re.S)
    assert len(svgs) == N_CURVES
    # The held-out points at step 0 and the training steps from 1: one x-axis for all.
    assert all(x_ticks(s) == x_ticks(svgs[0]) for s in svgs), {x_ticks(s)[0] for s in svgs}
    assert x_ticks(svgs[0])[0][1] == "0"
    y_labels = lambda svg: [float(v) for v in re.findall(r'text-anchor="end">([\d.]+)</text>', svg)]  # noqa: E731
    assert 0.05 <= max(y_labels(svg_of(curves_html, "Tool-call error rate"))) < 0.2
    assert max(y_labels(svg_of(curves_html, "Reward and accuracy"))) == 1.0  # accuracy keeps 0..1


# ----------------------------------------------------------------------------------------
# The held-out item list, provenance, the turn sweep, the sandbox warning


def test_flipped_items(tmp_path):
    out = make_fake_run(tmp_path, steps=2, groups=1, G=2)
    c = check_html(page.write_report(out).read_text(encoding="utf-8"))
    before = {r["id"]: r for r in results(out, 0)}
    after = {r["id"]: r for r in results(out, 2)}
    items = embedded(c, "items-data")["items"]
    assert {it["id"] for it in items} == set(before)
    want = {i: ("gained" if after[i]["correct"] and not before[i]["correct"] else
                "lost" if before[i]["correct"] and not after[i]["correct"] else
                "right" if after[i]["correct"] else "wrong") for i in before}
    assert {it["id"]: it["change"] for it in items} == want
    assert [it["change"] for it in items] == sorted((it["change"] for it in items),
                                                    key=list(page.CHANGE_ORDER).index)  # flips first
    it = items[0]
    assert it["before"]["turns"][0]["planner"] == before[it["id"]]["trajectory"]["log"][0]["output"]
    # The counts with their percentages, per kind: e.g. "5/6 = 83.3%".
    plain = "".join(c.text)
    for kind in TASKS:
        rows = [r for r in after.values() if r["task"] == kind]
        k = sum(r["correct"] for r in rows)
        assert f"{k}/{len(rows)} = {100 * k / len(rows):.1f}%" in plain
    gained, lost = Counter(want.values())["gained"], Counter(want.values())["lost"]
    assert f"+{gained} / −{lost}" in plain
    assert f"{stats.mcnemar_p(gained, lost):.3g}" in plain
    assert "Wilson score interval" in plain and "McNemar" in plain


def test_paraphrase_set_has_its_own_table(tmp_path):
    """train.py's evaluations of data.paraphrase (eval/paraphrase/step_N) get a table of their
    own under the held-out one, with their own counts; a run without them has none."""
    out = make_fake_run(tmp_path, steps=2, groups=1, G=2)
    assert "paraphrase set" not in "".join(check_html(page.write_report(out).read_text(encoding="utf-8")).text)
    for step in (0, 2):
        rows = results(out, step)
        for r in rows:  # on new wordings, the trained planner loses every two_step item
            r["correct"] = r["correct"] and not (step and r["task"] == "two_step")
        d = out / "eval" / "paraphrase" / f"step_{step}"
        d.mkdir(parents=True)
        (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "summary.json").write_text(json.dumps(summarize(rows)))
    c = check_html(page.write_report(out).read_text(encoding="utf-8"))
    plain = "".join(c.text)
    held, para = plain.split("The paraphrase set: new wordings, never trained on")
    n = sum(r["task"] == "two_step" for r in results(out, 2))
    assert f"0/{n} = 0.0%" in para and f"0/{n} = 0.0%" not in held  # its own counts, not the held-out's
    lost = sum(r["correct"] and r["task"] == "two_step" for r in results(out, 2))
    assert lost and f"−{lost}" in para and "eval/paraphrase/step_0 and step_2" in para


def test_plans_per_kind(tmp_path, capsys):
    """A plan is the tools of one trajectory in order. The summary's shares, the train.py
    table and the report's table all count them from the same held-out rows."""
    from support.text import plan_of
    from support.run_log import print_learning_table
    assert plan_of(["Local_Search", "Python_Coder"]) == "Local_Search > Python_Coder"
    assert plan_of([]) == "(no tool)"
    out = make_fake_run(tmp_path, steps=2, groups=1, G=2)
    before, after = results(out, 0), results(out, 2)
    summary = summarize(after)
    for kind in TASKS:
        rows = [r for r in after if r["task"] == kind]
        want = Counter(" > ".join(r["tools"]) or "(no tool)" for r in rows)
        got = summary["by_kind"][kind]["plans"]
        assert got == {p: n / len(rows) for p, n in want.items()}
        assert list(got.values()) == sorted(got.values(), reverse=True)  # most common first
    # The console table: mean turns and the commonest plans per kind, before -> after.
    print_learning_table({"before": summarize(before), "after": summary})
    lines = capsys.readouterr().out.splitlines()
    i = lines.index("mean turns and plans (the tools in order: share of items), before -> after:")
    two = next(line for line in lines[i:] if line.split()[0] == "two_step")
    top = next(iter(summary["by_kind"]["two_step"]["plans"]))
    assert f"turns {summarize(before)['by_kind']['two_step']['mean_turns']:.2f} -> " in two
    assert f"{top} " in two and f" -> {summary['by_kind']['two_step']['plans'][top]:.2f}" in two
    # The report's table, from results.jsonl, with the before share of the same plan.
    plain = " ".join(check_html(page.write_report(out).read_text(encoding="utf-8")).text)
    assert "Plans per task kind (before → after)" in plain
    b_two = summarize(before)["by_kind"]["two_step"]["plans"].get(top, 0.0)
    assert f"{top}: {100 * b_two:.1f}% → {100 * summary['by_kind']['two_step']['plans'][top]:.1f}%" in plain


def test_provenance_is_recorded_and_shown(tmp_path, monkeypatch):
    import atexit
    out = make_fake_run(tmp_path, steps=2, groups=1, G=2)
    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    cfg = json.loads((out / "config.json").read_text())
    first = provenance.record_run(out, cfg)
    provenance.record_run(out, {**cfg, "model": {**cfg["model"], "threads": 3}})  # resumed, other threads
    procs = json.loads((out / "run.json").read_text())["processes"]
    assert len(procs) == 2 and procs[0] == first
    for key in ("seed", "git_commit", "torch", "transformers", "python", "cpu", "cpu_capability", "threads",
                "started", "started_unix"):
        assert key in procs[0], key
    assert procs[1]["threads"] == 3
    import torch
    assert procs[0]["torch"] == torch.__version__
    repo = provenance.ROOT
    if (repo / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}( dirty)?", procs[0]["git_commit"])
    stamps = [f for f in registered if f.__qualname__.startswith("record_run")]  # (imports register theirs)
    assert len(stamps) == 2
    provenance.note_run(out, first, decode="step")  # known once the model has loaded: the first process's only
    for stamp in stamps:  # the exit hooks: each stamps its own process's wall time
        stamp()
    procs = json.loads((out / "run.json").read_text())["processes"]
    assert all(p["wall_s"] >= 0 for p in procs)
    assert procs[0]["decode"] == "step" and "decode" not in procs[1]  # kept through the exit stamp
    procs[0]["wall_s"], procs[1]["wall_s"] = 100.0, 65.0
    (out / "run.json").write_text(json.dumps({"processes": procs}))
    text = page.write_report(out).read_text(encoding="utf-8")
    header = text[text.index("<header>"):text.index("</header>")]
    assert "2 min 45 s wall time in all" in header and f"torch {torch.__version__}" in header
    assert "changed when the run was resumed" in text  # threads 0 -> 3
    assert "Weaker Python sandbox" not in text
    cfg["tools"] = {"python_isolation": "rlimits"}
    (out / "config.json").write_text(json.dumps(cfg))
    header = page.write_report(out).read_text(encoding="utf-8").split("</header>")[0]
    assert "Weaker Python sandbox" in header and "rlimits" in header


def test_turn_sweep(tmp_path):
    out = make_fake_run(tmp_path, steps=2, groups=1, G=2)
    assert "No turn-budget sweep in this run" in page.write_report(out).read_text(encoding="utf-8")
    rows = results(out, 0)
    sweep = {"budgets": [1, 2, 3], "planners": {}}
    for label, right in (("frozen (step 0)", 0.3), ("trained (step 2)", 0.7)):
        sweep["planners"][label] = {}
        for b in (1, 2, 3):  # accuracy grows with the budget, more for the trained planner
            graded = [{**r, "correct": k / len(rows) < right * b / 3} for k, r in enumerate(rows)]
            sweep["planners"][label][str(b)] = summarize(graded)
    (out / "turn_sweep.json").write_text(json.dumps(sweep))
    c = check_html(page.write_report(out).read_text(encoding="utf-8"))
    assert "Test-time turn budget" in c.headings
    plain = " ".join(c.text)
    for label in sweep["planners"]:
        assert label in plain
    cells = [pct for pct in re.findall(r"(\d+\.\d)%", plain)]
    for b in (1, 2, 3):
        assert f"{100 * sweep['planners']['trained (step 2)'][str(b)]['accuracy']:.1f}" in cells
        for kind in TASKS:
            assert f"{100 * sweep['planners']['frozen (step 0)'][str(b)]['by_kind'][kind]['accuracy']:.1f}" in cells
    assert sum(1 for h in c.headings if h.startswith("Accuracy by turn budget")) == 0  # figcaptions, not headings
    assert plain.count("Accuracy by turn budget") == 1 + len(TASKS)


def test_comparison_page(tmp_path, capsys):
    parent = tmp_path / "runs"
    a = make_fake_run(parent, steps=3, groups=2, G=2, seed=0, name="seed0")
    b = make_fake_run(parent, steps=3, groups=2, G=2, seed=1, name="seed1")
    page.write_report(a)
    assert scripts.report.main([str(a), str(b)]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == (parent / "compare_seed0_seed1.html").resolve() or path == parent / "compare_seed0_seed1.html"
    text = path.read_text(encoding="utf-8")
    c = check_html(text)
    assert "Flow-GRPO runs compared: seed0 vs seed1" in text
    plain = " ".join(c.text)
    assert "config: seed" in plain  # the one config key that differs
    assert 'href="seed0/report.html"' in text and "no report.html" in plain  # seed1 has none yet
    # Curves overlaid: every chart drawn once, with both runs in it.
    curves_html = text[text.index('id="curves"'):text.index('id="tool-shift"')]
    assert len(re.findall(r"<svg", curves_html)) == N_CURVES
    assert "seed0: reward mean" in curves_html and "seed1: reward mean" in curves_html
    # Before/after side by side, and the items on which the runs differ.
    flat = "".join(c.text)
    for run in (a, b):
        k = sum(r["correct"] for r in results(run, 3))
        assert f"{k}/18 = {100 * k / 18:.1f}%" in flat
    verdicts = [{r["id"]: (x["correct"], r["correct"]) for x, r in zip(results(run, 0), results(run, 3))}
                for run in (a, b)]
    differ = sum(verdicts[0][i] != verdicts[1][i] for i in verdicts[0])
    assert f"Items on which the runs differ ({differ} of 18)" in plain
    assert scripts.report.main([str(a), str(tmp_path / "nope")]) == 2
    out = tmp_path / "here.html"
    assert scripts.report.main([str(a), str(b), "--out", str(out)]) == 0 and out.exists()


# ----------------------------------------------------------------------------------------
# The page in a real browser: headless Chromium driven through chromedriver's W3C
# WebDriver HTTP API with `requests` (no extra dependency). .ci/run installs Debian's
# chromium and chromium-driver; without them the test is skipped and says why.

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  # without these it phones home and stalls on a closed network
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C key of an element reference


class Browser:
    def __init__(self, chromium: str, driver: str):
        import requests
        self.http = requests.Session()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen([driver, f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{port}"
        for _ in range(200):  # chromedriver is up when /status says ready
            try:
                if self.http.get(self.base + "/status", timeout=5).json()["value"]["ready"]:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.05)
        self.profile = tempfile.mkdtemp(prefix="chromium-profile-")
        options = {"binary": chromium, "args": CHROMIUM_FLAGS + [f"--user-data-dir={self.profile}",
                                                                  "--window-size=1400,1000"]}
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options,
                                                 "goog:loggingPrefs": {"browser": "ALL"}}}}
        self.sid = self.call("POST", "/session", caps)["sessionId"]

    def call(self, method: str, path: str, body=None):
        r = self.http.request(method, self.base + path, json=body, timeout=60)
        value = r.json()["value"]
        if r.status_code != 200:
            raise RuntimeError(f"{method} {path}: {value}")
        return value

    def session(self, method: str, path: str, body=None):
        return self.call(method, f"/session/{self.sid}{path}", body)

    def open(self, path: Path):
        self.session("POST", "/url", {"url": path.resolve().as_uri()})

    def find_all(self, css: str) -> list[str]:
        return [e[ELEMENT] for e in self.session("POST", "/elements", {"using": "css selector", "value": css})]

    def text(self, css: str) -> str:
        (e,) = self.find_all(css)
        return self.session("GET", f"/element/{e}/text")

    def choose(self, select_id: str, value: str):
        """Click an option of a <select>, as a reader would (the browser fires 'change')."""
        (e,) = self.find_all(f'#{select_id} option[value="{value}"]')
        self.session("POST", f"/element/{e}/click", {})

    def click(self, css: str):
        (e,) = self.find_all(css)
        self.session("POST", f"/element/{e}/click", {})

    def js(self, script: str):
        return self.session("POST", "/execute/sync", {"script": script, "args": []})

    def console(self) -> list[dict]:
        """Browser log entries since the last call (console messages, script errors)."""
        return self.session("POST", "/se/log", {"type": "browser"})

    def screenshot(self) -> bytes:
        return base64.b64decode(self.session("GET", "/screenshot"))

    def close(self):
        try:
            self.session("DELETE", "")
        finally:
            self.proc.terminate()
            self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("headless Chromium not installed: apt-get install chromium chromium-driver (.ci/run does)")
    b = Browser(chromium, driver)
    yield b
    b.close()


def test_report_in_a_browser(tmp_path, browser):
    out = make_fake_run(tmp_path, steps=3, groups=3, G=2, hostile=True)
    page.write_report(out)
    moved = out.rename(tmp_path / "moved-run")  # the header must name the folder as it is now
    browser.open(moved / "report.html")

    # The log channel works (so "no errors" below means something), then the page loads clean.
    browser.js('console.error("probe from the test")')
    assert any("probe from the test" in e["message"] for e in browser.console())
    browser.open(moved / "report.html")
    assert browser.text("#run-dir").endswith("/moved-run")
    assert browser.js("return document.title").startswith("Flow-GRPO run report: moved-run")
    assert browser.js("return document.querySelectorAll('img').length") == 0  # the hostile text stayed text

    # Held-out items: flipped ones first, then every item, then one kind, then one flag.
    before, after = results(moved, 0), {r["id"]: r for r in results(moved, 3)}
    change = {r["id"]: ("gained" if after[r["id"]]["correct"] and not r["correct"] else
                        "lost" if r["correct"] and not after[r["id"]]["correct"] else "same") for r in before}
    flipped = sorted(i for i, c in change.items() if c != "same")
    shown = lambda: sorted(browser.js(  # noqa: E731
        "return [...document.querySelectorAll('#item-list .item')].map(e => e.dataset.id)"))
    assert shown() == flipped
    counts = Counter(change.values())
    assert browser.text("#item-status") == (f"showing {len(flipped)} of {len(before)} held-out items · "
                                            f"{counts['gained']} wrong → right, {counts['lost']} right → wrong in view")
    browser.choose("item-change", "all")
    assert len(shown()) == len(before) and browser.text("#item-status").startswith(f"showing {len(before)} of")
    browser.choose("item-kind", "lookup")
    assert shown() == sorted(r["id"] for r in before if r["task"] == "lookup")
    browser.choose("item-kind", "")
    browser.choose("item-flag", "loose")
    want = sorted(r["id"] for r in before if loose_in(r["trajectory"]) or loose_in(after[r["id"]]["trajectory"]))
    assert 0 < len(want) < len(before) and shown() == want
    assert "read as" in browser.text("#item-list")

    # The trajectory browser: the latest step, then filters, then the step before.
    rows = [json.loads(line) for line in (moved / "trajectories" / "step_3.jsonl").read_text().splitlines()]
    groups = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r)
    count = lambda: browser.js("return document.querySelectorAll('#traj-groups .group').length")  # noqa: E731
    assert count() == len(groups)
    assert browser.text("#step-info").startswith(f"step 3: showing {len(groups)} of {len(groups)} query groups")
    browser.choose("traj-reward", "signal")
    mixed = [g for g in groups.values() if len({r["reward"] for r in g}) > 1]
    assert count() == len(mixed)
    assert browser.text("#step-info").startswith(f"step 3: showing {len(mixed)} of {len(groups)} query groups")
    browser.choose("traj-reward", "")
    browser.choose("traj-tool", "Local_Search")
    with_tool = [g for g in groups.values() if any("Local_Search" in r["tools"] for r in g)]
    assert count() == len(with_tool)
    dimmed = sum(1 for g in with_tool for r in g if "Local_Search" not in r["tools"])
    assert browser.js("return document.querySelectorAll('#traj-groups .rollout.dimmed').length") == dimmed
    browser.choose("traj-tool", "")
    browser.choose("traj-kind", rows[0]["task"])
    assert count() == sum(1 for g in groups.values() if g[0]["task"] == rows[0]["task"])
    browser.click("#prev-step")
    assert browser.text("#step-info").startswith("step 2: showing")
    # The filters stay in view while the list scrolls under them.
    browser.choose("traj-kind", "")
    top = browser.js("var c = document.getElementById('traj-controls'); var y = c.getBoundingClientRect().top + "
                     "window.scrollY; window.scrollTo(0, y + 200); return [window.scrollY - y, "
                     "c.getBoundingClientRect().top]")
    assert top[0] == pytest.approx(200, abs=1) and abs(top[1]) < 1, top

    errors = [e for e in browser.console() if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors


def test_comparison_in_a_browser(tmp_path, browser):
    parent = tmp_path / "runs"
    a = make_fake_run(parent, steps=2, groups=1, G=2, seed=0, name="seed0")
    b = make_fake_run(parent, steps=2, groups=1, G=2, seed=1, name="seed1")
    path = compare.write_comparison([a, b])
    browser.console()
    browser.open(path)
    assert browser.text("#run-dir").endswith("/compare_seed0_seed1.html")
    assert "seed0" in browser.text("#runs") and "seed1" in browser.text("#runs")
    errors = [e for e in browser.console() if e["level"] in ("SEVERE", "ERROR")]
    assert not errors, errors


def test_query_groups_are_named_by_item_from_each_training_file(tmp_path):
    """data.train as one path (older runs) or as a list: every file's ids name the groups;
    a missing file names none."""
    for i, name in enumerate(("a.jsonl", "b.jsonl")):
        (tmp_path / name).write_text(json.dumps({"id": f"item-{i}", "question": f"q{i}", "answer": "1"}) + "\n")
    listed = {"config": {"data": {"train": [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]}}}
    assert page.train_ids(listed) == {"q0": "item-0", "q1": "item-1"}
    assert page.train_ids({"config": {"data": {"train": str(tmp_path / "b.jsonl")}}}) == {"q1": "item-1"}
    assert page.train_ids({"config": {"data": {"train": [str(tmp_path / "gone.jsonl")]}}}) == {}
