"""The four-module loop on a tiny random model with the real tools: every stage runs and
is recorded, malformed outputs become recorded errors, and the ids the trainer needs
are exactly what the sampler produced."""

import json
from pathlib import Path

import torch

from agentflow import AgentSystem, agent_config, parse_plan
from config import load_config
from tools import build_tools

ROOT = Path(__file__).resolve().parents[1]
NAMES = ["Base_Generator", "Python_Coder", "Local_Search"]
TOOLS = build_tools(NAMES)


def make_agent(tiny_llm, **cfg) -> AgentSystem:
    """The default agent config with short generations (a random model rambles), and `cfg`."""
    tools = build_tools(NAMES, {"corpus": str(ROOT / "data" / "corpus.jsonl"), "python_timeout_s": 3.0})
    overrides = ["agent.executor.max_new_tokens=12", "agent.generator.max_new_tokens=8",
                 "agent.planner.max_new_tokens=10"] + [f"agent.{k}={v}" for k, v in cfg.items()]
    return AgentSystem(tiny_llm, tiny_llm, tools, agent_config(load_config(None, overrides)["agent"]))


def test_parse_plan_is_tolerant():
    assert parse_plan(" Python_Coder\nSub-goal: multiply", TOOLS) == parse_plan(" python_coder\nsub goal: multiply", TOOLS)
    p = parse_plan(" Local_Search\nSub-goal: find the year", TOOLS)
    assert (p.tool, p.sub_goal, p.error) == ("Local_Search", "find the year", "")
    assert parse_plan(" I would run some python code", TOOLS).tool == "Python_Coder"  # alias
    assert parse_plan(" search then code", TOOLS).tool == "Local_Search"  # first mentioned wins
    bad = parse_plan(" banana\nSub-goal: ?", TOOLS)
    assert bad.tool == "" and "no known tool" in bad.error
    assert parse_plan("", TOOLS).error


def test_loop_runs_every_stage_and_records_it(tiny_llm):
    agent = make_agent(tiny_llm, max_turns=2)
    queries = ["Compute 48213 * 9127.", "When was the town of Velmora founded?"] * 2
    trajs = agent.rollout(queries, seed=3)
    assert len(trajs) == 4
    for q, tr in zip(queries, trajs):
        assert tr.query == q and tr.done
        assert 1 <= len(tr.turns) <= 2 and len(tr.memory.records) == len(tr.turns)
        modules = [e["module"] for e in tr.log]
        assert modules.count("planner") == len(tr.turns) and modules[-1] == "generator"
        for turn, rec in zip(tr.turns, tr.memory.records):
            # The constrained first token picks a tool: every plan names one.
            assert turn.action_ids[0] in agent.planner_params.first_tokens
            assert rec.tool in NAMES
            assert len(turn.action_ids) == len(turn.logprobs) > 0
            assert turn.prompt_ids[-2:] == tiny_llm.tok.encode("Tool:", add_special_tokens=False)[-2:]
    # Each trajectory has its own memory (no leaking between rollouts).
    assert len({id(tr.memory) for tr in trajs}) == 4


def test_logged_ids_reproduce_the_samplers_logprobs(tiny_llm):
    """The trainer scores the stored ids; they must give back the stored log-probs."""
    agent = make_agent(tiny_llm, max_turns=1)
    tr = agent.rollout(["What is 2 + 2?"], seed=1)[0]
    turn = tr.turns[0]
    with torch.no_grad():
        logits = tiny_llm.model(torch.tensor([turn.prompt_ids + turn.action_ids])).logits[0].float()
    lp = torch.log_softmax(logits / agent.planner_params.temperature, -1)
    first = logits[len(turn.prompt_ids) - 1, list(agent.planner_params.first_tokens)]
    ref0 = first[agent.planner_params.first_tokens.index(turn.action_ids[0])] - torch.logsumexp(first, -1)
    assert abs(ref0.item() - turn.logprobs[0]) < 1e-4  # restricted softmax over tool tokens
    for j in range(1, len(turn.action_ids)):
        assert abs(lp[len(turn.prompt_ids) - 1 + j, turn.action_ids[j]].item() - turn.logprobs[j]) < 1e-4


def test_malformed_planner_output_is_a_recorded_error_not_a_crash(tiny_llm):
    """Without the tool constraint a random model names no tool: each turn is recorded
    with an error, the loop goes on, and the generator still answers."""
    agent = make_agent(tiny_llm, max_turns=2, constrain_tool=False)
    trajs = agent.rollout(["Compute 1 + 1.", "Who is Velmora?"], seed=0)
    for tr in trajs:
        assert tr.memory.records, "every turn leaves a record"
        bad = [r for r in tr.memory.records if not r.tool]
        for r in bad:
            assert "no known tool" in r.error
        assert isinstance(tr.answer, str)
        d = tr.to_dict()
        assert d["n_turns"] == len(tr.turns) and d["memory"][0]["turn"] == 1


def test_tool_failures_become_error_results(tiny_llm):
    """A Python command the executor botches comes back as an error in memory."""
    tools = build_tools(["Python_Coder"], {"python_timeout_s": 3.0})
    res = tools["Python_Coder"].run("print(1/0)")
    assert not res.ok and "ZeroDivisionError" in res.error


def test_force_tool_and_code_start(tiny_llm):
    """force_tool (eval.py --force-tool) makes every planner action begin with that tool,
    and code_start is the fixed start of every Python_Coder input, so it is part of the
    command that runs. A random tiny model would otherwise pick any tool and any code."""
    agent = make_agent(tiny_llm, max_turns=2, force_tool="Python_Coder", code_start="print(")
    forced = tiny_llm.tok.encode(" Python_Coder", add_special_tokens=False)[0]
    assert [p.first_tokens for p in agent.forced_params] == [(forced,)]
    trajs = agent.rollout(["Compute 48213 * 9127.", "When was Velmora founded?"], seed=5)
    records = [r for tr in trajs for r in tr.memory.records]
    assert records and all(r.tool == "Python_Coder" for r in records)
    assert all(t.action_ids[0] == forced and t.logprobs[0] == 0.0 for tr in trajs for t in tr.turns)
    assert all(r.command.startswith("print(") for r in records)
    # Other tools' inputs are not touched by code_start.
    agent = make_agent(tiny_llm, max_turns=1, force_tool="Local_Search", code_start="print(")
    rec = agent.rollout(["When was Velmora founded?"], seed=5)[0].memory.records[0]
    assert rec.tool == "Local_Search" and not rec.command.startswith("print(")


def test_greedy_planner_evaluation_does_not_depend_on_the_seed(tiny_llm, tmp_path):
    """eval.planner_temperature = 0: every module is greedy, so the evaluation is a
    function of the weights alone (what before-vs-after should compare); the training
    temperature samples, so another seed gives other actions."""
    from benchmarks import Item
    from eval import evaluate

    agent = make_agent(tiny_llm, max_turns=1)
    items = [Item(id=str(i), question=q, gold=["1"], kind="number", meta={"task": "t"})
             for i, q in enumerate(["Compute 48213 * 9127.", "When was Velmora founded?", "Hi", "What is 2+2?"])]

    def planner_outputs(seed, temperature):
        out = tmp_path / f"{seed}_{temperature}"
        evaluate(agent, items, out, batch_size=4, max_turns=1, seed=seed, planner_temperature=temperature)
        rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
        return [[e["output"] for e in r["trajectory"]["log"] if e["module"] == "planner"] for r in rows]

    assert planner_outputs(1, 0.0) == planner_outputs(2, 0.0)
    assert planner_outputs(1, None) != planner_outputs(2, None)
    assert agent.planner_params.temperature == 1.0  # evaluation did not change the agent
