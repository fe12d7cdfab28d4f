"""report.py on fake run directories: a full run, a run with only metrics, an empty folder.
No model and no browser: the page is parsed with html.parser."""

import json
import math
import random
import sys
from html.parser import HTMLParser
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest  # noqa: E402

import charts  # noqa: E402
import report  # noqa: E402
from eval import summarize  # noqa: E402  (the real summary format)

HOSTILE = "</script><img src=x onerror=alert(1)>"
TOOLS = ["Base_Generator", "Python_Coder", "Local_Search"]
TASKS = ["arithmetic", "lookup", "two_step"]
# The tool that makes each task kind solvable (as in tasks.py's suite).
RIGHT_TOOL = {"arithmetic": "Python_Coder", "lookup": "Local_Search", "two_step": "Local_Search"}


def fake_config(out: Path, steps: int, groups: int, G: int) -> dict:
    return {"seed": 0, "out_dir": str(out), "resume": True,
            "model": {"name": "smollm2-135m", "device": "auto", "dtype": "float32", "threads": 0},
            "agent": {"tools": TOOLS, "max_turns": 3, "constrain_tool": True,
                      "planner": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 40}},
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
    """One rollout: the planner picks the right tool with probability `skill`."""
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
        log.append({"module": "planner", "turn": t, "output": f"Tool: {tool}\nSub-goal: {sub_goal}"})
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


def fake_eval(out: Path, step: int, skill: float, n: int = 18, hostile: bool = False) -> dict:
    rng = random.Random(1000 + step)
    rows = []
    for k in range(n):
        task = TASKS[k % 3]
        q, gold = fake_question(random.Random(k), task)
        tr = fake_trajectory(rng, task, q, gold, skill, hostile)
        rows.append({"id": f"heldout-{k:04d}", "question": q, "gold": [gold], "kind": "number", "task": task,
                     "answer": tr["answer"], "extracted": tr["answer"], "correct": bool(tr["reward"]),
                     "f1": tr["reward"], "turns": tr["n_turns"], "tools": tr["tools"], "tool_calls": len(tr["tools"]),
                     "tool_errors": tr["_errors"], "errors": [m["error"] for m in tr["memory"] if m["error"]],
                     "trajectory": None})
    d = out / "eval" / f"step_{step}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = summarize(rows)
    (d / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def make_fake_run(tmp_path: Path, steps: int = 5, groups: int = 2, G: int = 4, *, evals: bool = True,
                  trajectories: bool = True, hostile: bool = True, seed: int = 0) -> Path:
    """A run directory laid out like train.py's, with a planner that learns the right tools."""
    out = Path(tmp_path) / "run"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(fake_config(out, steps, groups, G), indent=2) + "\n")
    rng = random.Random(seed)
    if evals:
        before = fake_eval(out, 0, 0.3)
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
        after = fake_eval(out, steps, 0.9)
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


def embedded(c: Checker) -> dict:
    blobs = [body for attrs, body in c.scripts if attrs.get("type") == "application/json"]
    assert len(blobs) == 1
    return json.loads(blobs[0])


# ----------------------------------------------------------------------------------------


def test_full_run(tmp_path):
    steps, groups, G = 5, 2, 4
    out = make_fake_run(tmp_path, steps=steps, groups=groups, G=G)
    path = report.write_report(out)
    assert path == out / "report.html" and path.exists()
    assert not list(out.glob(".report.html.*"))  # the temporary file was renamed
    text = path.read_text(encoding="utf-8")
    c = check_html(text)
    for h in SECTIONS:
        assert h in c.headings, h
    # One chart = one <figure> with exactly one <svg>: 12 curves and the tool-shift bars.
    assert c.figures and all(n == 1 for n in c.figures), c.figures
    assert len(c.figures) == 13
    assert sum(1 for t, _ in c.tags if t == "svg") == 13
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
    assert all(len(t["result"]) <= report.CAP["result"] + 60
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
    text = report.write_report(out).read_text(encoding="utf-8")
    assert HOSTILE not in text and "<img" not in text and "</script><img" not in text
    c = check_html(text)
    assert not any(t == "img" for t, _ in c.tags)
    # Exactly the two scripts the report emits, the data block intact with the string inside it.
    assert len(c.scripts) == 2
    data = embedded(c)
    g0 = data["by_step"]["1"]["groups"][0]
    assert g0["query"].startswith(HOSTILE)
    assert any(HOSTILE in t["result"] for r in g0["rollouts"] for t in r["turns"])


def test_only_metrics(tmp_path):
    out = make_fake_run(tmp_path, steps=3, evals=False, trajectories=False)
    (out / "config.json").unlink()
    text = report.write_report(out).read_text(encoding="utf-8")
    c = check_html(text)
    for h in SECTIONS:
        assert h in c.headings, h
    plain = " ".join(c.text)
    assert "No held-out evaluation yet" in plain
    assert "No trajectories in this folder" in plain
    assert "config.json is missing" in plain
    assert not [b for a, b in c.scripts if a.get("type") == "application/json"]
    assert sum(1 for t, _ in c.tags if t == "svg") == 12  # the curves, no tool-shift bars
    assert len(c.figures) == 13  # the tool-shift figure explains why it is empty


def test_run_in_progress_and_many_steps(tmp_path, monkeypatch):
    """No learning.json yet, a cut last line, and more steps than the browser embeds."""
    out = make_fake_run(tmp_path, steps=12, groups=1, G=2, evals=False)
    fake_eval(out, 0, 0.3)
    rows = (out / "metrics.jsonl").read_text().splitlines()
    rows[3] = rows[3].replace('"loss": ', '"loss": NaN, "old_loss": ')  # json.dumps writes NaN
    with open(out / "metrics.jsonl", "w") as f:
        f.write("\n".join(rows) + '\n{"step": 13, "reward_me')  # the last line cut mid-write
    monkeypatch.setattr(report, "MAX_EMBED_STEPS", 5)
    c = check_html(report.write_report(out).read_text(encoding="utf-8"))
    assert "No after-training evaluation yet" in " ".join(c.text)
    steps = embedded(c)["steps"]
    assert len(steps) <= 5 and steps[0] == 1 and steps[-1] == 12


def test_empty_and_missing_dir(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    text = report.write_report(empty).read_text(encoding="utf-8")
    c = check_html(text)
    assert "Nothing to report yet" in c.headings
    with pytest.raises(FileNotFoundError):
        report.write_report(tmp_path / "nope")
    assert report.main([str(tmp_path / "nope")]) == 2
    assert report.main([str(empty)]) == 0
    assert capsys.readouterr().out.strip().endswith("report.html")


def test_nice_ticks_and_step_picking():
    lo, hi, ticks = charts.nice_ticks(0.0013, 0.0087)
    assert lo <= 0.0013 and hi >= 0.0087 and 3 <= len(ticks) <= 7
    assert report.pick_steps(list(range(1, 101)), 40)[0] == 1 and report.pick_steps(list(range(1, 101)), 40)[-1] == 100
    assert len(report.pick_steps(list(range(1, 101)), 40)) == 40
    assert report.pick_steps([3, 4], 40) == [3, 4]


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
    c = check_html(report.write_report(out).read_text(encoding="utf-8"))
    for h in SECTIONS:
        assert h in c.headings, h
    assert embedded(c)["steps"] == [1, 2, 3]
