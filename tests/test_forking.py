"""docs/FORKING.md's recipes, run exactly as written: each module block is written to
a file beside a copy of config.yaml, each command line is run by train.main from there,
with overrides appended only to make it a one-step run on a tiny model."""

import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

import flow_grpo
import judge
import memory
import tools
import train
from scripts import tiny_model
from support.config import load_config

ROOT = Path(__file__).resolve().parents[1]
GUIDE = (ROOT / "docs" / "FORKING.md").read_text()
SECTIONS = re.split(r"^## ", GUIDE, flags=re.M)[1:]  # "1. Add a tool\n...", ...


def commands(text: str) -> tuple[list[list[str]], list[str]]:
    """(each `python -m scripts.tiny_model` line's arguments, the `python train.py` line's
    arguments) of the bash blocks in `text`."""
    lines = [shlex.split(line) for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)
             for line in block.splitlines()]
    builds = [words[3:] for words in lines if words[:3] == ["python", "-m", "scripts.tiny_model"]]
    (run,) = [words[2:] for words in lines if words[:2] == ["python", "train.py"]]
    assert len(builds) + 1 == len(lines), lines  # no command the test would leave out
    return builds, run


def recipe(number: int) -> tuple[dict[str, str], list[str]]:
    """({file name: code}, the command line's arguments after `python train.py`) of recipe N;
    the models its `python -m scripts.tiny_model` lines build are built."""
    text = next(s for s in SECTIONS if s.startswith(f"{number}. "))
    files = dict(re.findall(r"```python file=(\S+)\n(.*?)```", text, flags=re.S))
    builds, run = commands(text)
    for args in builds:
        assert tiny_model.main(args) == 0
    return files, run


RECIPE_MODULES = ("my_tools", "my_rewards", "my_credit", "my_estimator", "my_view")


@pytest.fixture()
def fork(tmp_path, monkeypatch):
    """A working folder like the repository root: config.yaml, the data, a module path; what
    the recipes register is removed afterwards, and their modules forgotten."""
    shutil.copy(ROOT / "config.yaml", tmp_path / "config.yaml")
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "smoke.yaml", tmp_path / "configs" / "smoke.yaml")
    (tmp_path / "data").symlink_to(ROOT / "data")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    # What the recipes registered goes (the registries stay the same objects: other modules
    # imported them by name; what a project module registered meanwhile stays).
    for registry in (tools.TOOL_CLASSES, judge.REWARD_TERMS, judge.TURN_SCORES, flow_grpo.ADVANTAGE_ESTIMATORS,
                     memory.PLANNER_VIEWS):
        for key in [k for k, v in registry.items() if v.__module__ in RECIPE_MODULES]:
            del registry[key]
    for name in RECIPE_MODULES:
        sys.modules.pop(name, None)


# Appended to a recipe's command: one step on short generations.
ONE_STEP = ("train.steps=1", "train.queries_per_step=2", "train.group_size=2", "train.eval_before_after=false",
            "agent.planner.max_new_tokens=6", "agent.executor.max_new_tokens=8", "agent.generator.max_new_tokens=6")


def run_recipe(number: int, folder: Path, *fast: str) -> Path:
    files, args = recipe(number)
    for name, code in files.items():
        (folder / name).write_text(code)
    out = folder / "run"
    assert train.main(args + [f"out_dir={out}", *ONE_STEP, *fast]) == 0
    return out


def test_the_guide_has_seven_recipes_each_with_a_command():
    assert [s.split("\n")[0] for s in SECTIONS[:7]] == ["1. Add a tool", "2. Add a reward term",
                                                       "3. Change the credit assignment", "4. Swap the planner model",
                                                       "5. Change the advantage estimator",
                                                       "6. Change what the planner reads of the memory",
                                                       "7. Change a module's prompt"]
    assert [len(recipe(n)[0]) for n in (1, 2, 3, 4, 5, 6, 7)] == [1, 1, 1, 0, 1, 1, 0]


def test_recipe_1_a_tool_of_ones_own(fork, tiny_model_dir):
    out = run_recipe(1, fork, f"model.name={tiny_model_dir}", "train.train_layers=2")
    cfg = json.loads((out / "config.json").read_text())
    assert "Word_Count" in cfg["agent"]["tools"] and cfg["tools"]["word_count_limit"] == 10_000
    assert tools.TOOL_CLASSES["Word_Count"]({}).run("one two three").output == "3"
    m = json.loads((out / "metrics.jsonl").read_text())
    assert m["optimizer_steps"] == 1 and set(m["tool_shares"]) <= {"Python_Coder", "Local_Search", "Word_Count"}


def test_recipe_2_a_reward_term(fork, tiny_model_dir):
    out = run_recipe(2, fork, f"model.name={tiny_model_dir}", "train.train_layers=2")
    m = json.loads((out / "metrics.jsonl").read_text())
    assert set(m["reward_terms"]) == {"correct", "short_answer"}
    for line in (out / "trajectories" / "step_1.jsonl").read_text().splitlines():
        tr = json.loads(line)
        assert tr["reward"] == pytest.approx(tr["reward_terms"]["correct"] + 0.1 * tr["reward_terms"]["short_answer"])


def test_recipe_3_credit_per_turn(fork, tiny_model_dir):
    out = run_recipe(3, fork, f"model.name={tiny_model_dir}", "train.train_layers=2")
    trajs = [json.loads(line) for line in (out / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    assert all(len(tr["turn_advantages"]) == tr["n_turns"] for tr in trajs)


def test_recipe_4_a_planner_model_of_ones_own(fork):
    """The recipe's tiny random model (the default's tokenizer) as the planner, the default
    model as the frozen modules."""
    out = run_recipe(4, fork, "train.train_layers=2")
    trained = AutoModelForCausalLM.from_pretrained(out / "model")
    assert trained.config.num_hidden_layers == 2 and trained.config.hidden_size == 64  # the planner trained
    assert json.loads((out / "config.json").read_text())["model"]["name"] == "smollm2-135m"


def test_the_tiny_model_check_runs_as_written(fork):
    """The guide's opening check: a tiny random model built offline, the smoke config on it."""
    builds, args = commands(GUIDE[:GUIDE.index("## 1. ")])
    assert builds == [["models/tiny"]] and args == ["configs/smoke.yaml", "out_dir=runs/tiny", "model.name=models/tiny"]
    assert tiny_model.main(builds[0]) == 0
    out = fork / "run"
    assert train.main(args + [f"out_dir={out}"]) == 0
    m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in m] == [1, 2]  # the smoke config's two steps, on the tiny model
    assert json.loads((out / "config.json").read_text())["model"]["name"] == "models/tiny"
    assert (out / "trajectories" / "step_2.jsonl").is_file() and (out / "report.html").is_file()


def test_recipe_5_an_advantage_estimator(fork, tiny_model_dir, monkeypatch):
    """The groups' advantages are the recipe's (1 for the best, 0 for the rest), not the
    paper's (+-1). A random model is never right: the reward is the answer's length being
    odd (as tests/test_train.py's learnable reward), with a sampled generator."""
    monkeypatch.setattr(judge, "score_item", lambda answer, *item: {"correct": len(answer) % 2 == 1, "f1": 0.0,
                                                                     "extracted": answer})
    out = run_recipe(5, fork, f"model.name={tiny_model_dir}", "train.train_layers=2", "train.queries_per_step=4",
                     "agent.generator.temperature=1.0")
    assert json.loads((out / "config.json").read_text())["train"]["advantage"] == "best_of_group"
    trajs = [json.loads(line) for line in (out / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    groups = [trajs[q:q + 2] for q in range(0, len(trajs), 2)]  # G = 2
    assert any(a["reward"] != b["reward"] for a, b in groups), "no group with a signal: nothing is checked"
    for a, b in groups:
        want = [1.0, 0.0] if a["reward"] > b["reward"] else [0.0, 1.0] if b["reward"] > a["reward"] else [0.0, 0.0]
        assert [a["advantage"], b["advantage"]] == want


def test_recipe_5_an_estimator_over_the_batch(fork, tiny_model_dir, monkeypatch):
    """The recipe's other estimator, as its text says to run it: each advantage is the reward
    minus the mean reward of the whole step, whichever group the rollout is in."""
    monkeypatch.setattr(judge, "score_item", lambda answer, *item: {"correct": len(answer) % 2 == 1, "f1": 0.0,
                                                                     "extracted": answer})
    out = run_recipe(5, fork, f"model.name={tiny_model_dir}", "train.train_layers=2", "train.queries_per_step=4",
                     "agent.generator.temperature=1.0", "train.advantage=batch_centred")
    trajs = [json.loads(line) for line in (out / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    rewards = [tr["reward"] for tr in trajs]
    assert len(set(rewards)) > 1, "every reward the same: nothing is checked"
    mean = sum(rewards) / len(rewards)
    assert [tr["advantage"] for tr in trajs] == pytest.approx([r - mean for r in rewards], abs=1e-12)


def test_recipe_6_a_planner_view(fork, tiny_model_dir):
    out = run_recipe(6, fork, f"model.name={tiny_model_dir}", "train.train_layers=2")
    for line in (out / "trajectories" / "step_1.jsonl").read_text().splitlines():
        tr = json.loads(line)
        seen = [e["prompt"] for e in tr["log"] if e["module"] == "planner"]
        assert "- nothing yet" in seen[0]  # turn 1: the view of an empty memory
        for turn, prompt in enumerate(seen[1:], start=1):  # later turns: the last result, the recipe's words
            rec = tr["memory"][turn - 1]
            assert "- the last step gave: " + (rec["result"] or rec["error"])[:40] in prompt


def test_recipe_7_a_prompt_of_ones_own(fork, tiny_model_dir):
    out = run_recipe(7, fork, f"model.name={tiny_model_dir}", "train.train_layers=2")
    ran = json.loads((out / "prompts.json").read_text())
    assert ran["generator"].startswith("You answer a question from the memory of tool results.")
    assert "Available tools" in ran["planner"]  # the others as shipped


def test_the_guide_run_top_to_bottom_as_printed_trains_every_command(fork):
    """A user's way through the guide: every block in order, in one working folder, each
    command with the out_dir it prints (on the opening check's tiny model, one step). Each
    trains its step in a folder no earlier command wrote: one folder for all would hold
    another config's run, which a run refuses rather than resume and train nothing."""
    for text in [GUIDE[:GUIDE.index("## 1. ")], *SECTIONS[:7]]:
        for name, code in re.findall(r"```python file=(\S+)\n(.*?)```", text, flags=re.S):
            (fork / name).write_text(code)
        builds, args = commands(text)
        assert all(tiny_model.main(build) == 0 for build in builds)
        out = fork / load_config(args[0], args[1:])["out_dir"]  # where the command as printed writes
        assert not out.exists(), f"{text.splitlines()[0]}: {out} holds an earlier command's run"
        assert train.main(args + ["model.name=models/tiny", *ONE_STEP]) == 0, text.splitlines()[0]
        assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]


def test_the_guide_names_every_prompt_field():
    """Recipe 7's table lists each prompt of agentflow.PROMPTS with exactly the fields it has."""
    import string
    from agentflow import PROMPTS
    rows = re.findall(r"^\| (`\w+`(?:, `\w+`)*) \| (.*) \|$", SECTIONS[6], flags=re.M)
    listed = {name: set(re.findall(r"\{(\w+)\}", fields))
              for names, fields in rows for name in re.findall(r"`(\w+)`", names)}
    assert listed == {name: {f for _, f, _, _ in string.Formatter().parse(text) if f} for name, text in PROMPTS.items()}
