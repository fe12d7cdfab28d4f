"""scripts/probe_tools.py: the planner's first-tool probabilities and the tool-gradient table,
against the sampler's own log-probs and a real optimizer step, in float32 and bfloat16."""

import json
from pathlib import Path

import torch

from scripts import probe_tools
from support.config import load_config
from test_agent import NAMES, make_agent

ROOT = Path(__file__).resolve().parents[1]


def test_first_tool_probs_are_the_policys_first_token_distribution(tiny_llm):
    """--tool-probs reads pi_theta's tool choice off a prefill: each row must be the
    distribution the sampler draws the first action token from at temperature 1, so the
    probability it gives the sampled tool is exp of the log-prob the rollout recorded,
    in a batch of mixed lengths (left padding must not move it)."""
    agent = make_agent(tiny_llm, max_turns=2)  # first_temperature 0: the first token at temperature 1
    queries = ["Compute 48213 * 9127.", "When was the town of Velmora founded?",
               "What is the population of Velmora multiplied by 7?"]
    probs = probe_tools.first_tool_probs(agent, queries, batch=2)  # two batches, one of them padded
    assert probs.shape == (3, len(NAMES)) and torch.allclose(probs.sum(-1), torch.ones(3))
    for q, row in zip(queries, probs):
        tr = agent.rollout([q] * 6, seed=5)  # six draws of the first tool from one state
        for t in tr:
            k = agent.tool_names.index(next(n for n in NAMES if agent.first_token[n] == t.turns[0].action_ids[0]))
            assert abs(row[k].log().item() - t.turns[0].logprobs[0]) < 1e-4


def test_eval_tool_probs_for_frozen_and_trained(tiny_model_dir, tmp_path, capsys):
    """probe_tools --tool-probs --model CK: no rollouts, each planner's turn-1 tool probabilities
    per task kind, printed and written to OUT/tool_probs.json. Given the frozen weights as the
    'trained' checkpoint, both planners' rows must agree item for item."""
    out = tmp_path / "probs"
    args = ["--benchmark", str(ROOT / "data" / "heldout.jsonl"), "--config", str(ROOT / "config.yaml"),
            "--limit", "5", "--tool-probs", "--model", tiny_model_dir, "--out", str(out),
            f"model.name={tiny_model_dir}", "model.device=cpu", f"tools.corpus={ROOT / 'data' / 'corpus.jsonl'}"]
    assert probe_tools.main(args) == 0
    probs = json.loads((out / "tool_probs.json").read_text())
    assert probs["tools"] == ["Base_Generator", "Python_Coder", "Local_Search"]
    (frozen, f), (trained, t) = probs["planners"].items()
    assert frozen == "frozen" and trained.startswith("trained") and f == t
    assert sum(s["n"] for s in f.values()) == 5 and set(f) <= {"arithmetic", "lookup", "two_step"}
    for s in f.values():
        assert abs(sum(s["mean"].values()) - 1) < 1e-5 and abs(sum(s["greedy"].values()) - 1) < 1e-5
    assert len(probs["items"]) == 5 and all(row[frozen] == row[trained] for row in probs["items"])
    assert "mean p / greedy" in capsys.readouterr().out


def _margins(agent, questions, first_a_b, max_turns=2):
    """m(q) = log p(A|q) - log p(B|q), the tool softmax of the turn-1 prompt: [n] float64."""
    from memory import Memory
    first = [agent.first_token[n] for n in agent.tool_names]
    a, b = (agent.tool_names.index(n) for n in first_a_b)
    out = []
    for q in questions:
        ids = agent.planner_prompt(q, Memory(agent.cfg.memory_budget_chars, agent.cfg.result_chars), 1, max_turns)
        lp = torch.log_softmax(agent.planner.model(torch.tensor([ids])).logits[0, -1, first].double(), -1)
        out.append(lp[a] - lp[b])
    return torch.stack(out)


def _gradient_agent(model_dir, dtype):
    from agentflow import LLM, AgentSystem, agent_config
    from support.models import load_model
    from tools import build_tools
    model, tok = load_model(model_dir, "cpu", dtype)
    llm = LLM(model, tok)
    cfg = load_config(None, [])
    tools = build_tools(cfg["agent"]["tools"], {"corpus": str(ROOT / "data" / "corpus.jsonl")})
    return AgentSystem(llm, llm, tools, agent_config(cfg["agent"]))


PAIR = ("Local_Search", "Python_Coder")


def _gradient_items():
    from support.datasets import load_benchmark
    return [it for it in load_benchmark(str(ROOT / "data" / "heldout.jsonl")) if it.meta["task"] != "two_step"][:8]


def test_tool_gradients_predict_what_a_step_does(tiny_model_dir):
    """tool_gradients' effect[K][J] is the first-order change of kind J's mean margin
    (over its second half) per unit step along U_K, the gradient of kind K's mean margin
    (over its first half). Checked against a real step of the trained weights, U_K from
    one backward of the mean margin, and the margins recomputed after the step."""
    from support.optim import select_trainable
    agent, items = _gradient_agent(tiny_model_dir, "float32"), _gradient_items()
    g = probe_tools.tool_gradients(agent, items, 2, 1, PAIR)
    kinds = g["kinds"]
    assert kinds == ["arithmetic", "lookup"] and g["n"] == {"arithmetic": 4, "lookup": 4}
    assert all(g["ratio"][k][k] == 1.0 for k in kinds)
    qs = {k: [it.question for it in items if it.meta["task"] == k] for k in kinds}
    model = agent.planner.model
    params = select_trainable(model, 1)
    for k in kinds:
        model.zero_grad()
        _margins(agent, qs[k][0::2], PAIR).mean().backward()
        step = [p.grad.clone() for p in params]
        with torch.no_grad():
            before = {j: float(_margins(agent, qs[j][1::2], PAIR).mean()) for j in kinds}
            eta = 0.01 / g["effect"][k][k]  # a step that moves K's margin by about 0.01
            for p, s in zip(params, step):
                p.add_(eta * s)
            for j in kinds:
                moved = (float(_margins(agent, qs[j][1::2], PAIR).mean()) - before[j]) / eta
                assert abs(moved - g["effect"][k][j]) <= 0.05 * abs(g["effect"][k][j]), (k, j, moved, g["effect"])
            for p, s in zip(params, step):
                p.sub_(eta * s)


def test_tool_gradients_in_bfloat16_agree_with_float32(tiny_model_dir):
    """The dtype a GPU run uses: the same weights in bfloat16 give the same margins, effects
    and ratios as in float32, to bfloat16's precision."""
    items = _gradient_items()
    f32, b16 = (probe_tools.tool_gradients(_gradient_agent(tiny_model_dir, d), items, 2, 1, PAIR)
                for d in ("float32", "bfloat16"))
    for k in f32["kinds"]:
        assert abs(b16["margin"][k] - f32["margin"][k]) < 0.1
        for j in f32["kinds"]:
            assert abs(b16["effect"][k][j] - f32["effect"][k][j]) <= 0.1 * abs(f32["effect"][k][j]), (b16, f32)
            assert abs(b16["ratio"][k][j] - f32["ratio"][k][j]) < 0.1


def test_eval_tool_gradients_for_frozen_and_trained(tiny_model_dir, tmp_path, capsys):
    """probe_tools --tool-gradients A,B --model CK: the table for each planner, written to
    OUT/tool_gradients.json; the same weights give the same table. A pair that is not two
    of the agent's tools is a clear error."""
    out = tmp_path / "grads"
    base = ["--benchmark", str(ROOT / "data" / "heldout.jsonl"), "--config", str(ROOT / "config.yaml"),
            "--limit", "8", "--model", tiny_model_dir, "--out", str(out), f"model.name={tiny_model_dir}",
            "model.device=cpu", f"tools.corpus={ROOT / 'data' / 'corpus.jsonl'}"]
    for bad in ("Local_Search,Web_Search", "Local_Search,Local_Search", "Local_Search"):
        assert probe_tools.main(base + ["--tool-gradients", bad]) == 2
        assert "two different tools of agent.tools" in capsys.readouterr().err
    assert probe_tools.main(base + ["--tool-gradients", "Local_Search,Python_Coder"]) == 0
    grads = json.loads((out / "tool_gradients.json").read_text())
    (frozen, f), (trained, t) = grads.items()
    assert frozen == "frozen" and trained.startswith("trained") and f == t
    assert f["tools"] == ["Local_Search", "Python_Coder"] and set(f["kinds"]) <= {"arithmetic", "lookup", "two_step"}
    assert "moves each kind's margin" in capsys.readouterr().out


def test_check_accuracy_asks_the_check_the_agent_asks(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """probe_tools --check: for each lookup and two_step item, one Local_Search record holding
    the real search's passage, and the verdict the agent's own _verify gives that memory;
    right = continue on two_step, stop on lookup. Arithmetic is not asked. The tiny model's
    verdicts are arbitrary; what is checked is that the counts and the wrong list are those
    verdicts, read against the kinds."""
    import agentflow
    out = tmp_path / "check"
    args = ["--benchmark", str(ROOT / "data" / "paraphrase.jsonl"), "--config", str(ROOT / "config.yaml"),
            "--limit", "12", "--check", "--out", str(out), f"model.name={tiny_model_dir}", "model.device=cpu",
            f"tools.corpus={ROOT / 'data' / 'corpus.jsonl'}"]
    seen = []
    real = agentflow.AgentSystem._verify

    def spy(self, live, seed):
        stops = real(self, live, seed)
        seen.extend((tr.query, tr.memory.records[-1].tool, tr.memory.records[-1].result, s) for tr, s in zip(live, stops))
        return stops

    monkeypatch.setattr(agentflow.AgentSystem, "_verify", spy)
    assert probe_tools.main(args) == 0
    check = json.loads((out / "check.json").read_text())
    rows = [json.loads(line) for line in (ROOT / "data" / "paraphrase.jsonl").read_text().splitlines()[:12]]
    task = {r["question"]: r["task"] for r in rows}
    assert sorted(q for q, *_ in seen) == sorted(q for q, t in task.items() if t != "arithmetic")
    assert check["misses"] == [] and all(tool == "Local_Search" and result for _, tool, result, _ in seen)
    for kind, right in (("two_step", False), ("lookup", True)):
        said = [s for q, _, _, s in seen if task[q] == kind]
        assert check["kinds"][kind]["n"] == len(said) and check["kinds"][kind]["right"] == said.count(right)
    assert sorted(w["question"] for w in check["wrong"]) == sorted(
        q for q, _, _, s in seen if s != (task[q] == "lookup"))
    assert "the check should say" in capsys.readouterr().out
