"""The four-module loop on a tiny random model with the real tools: every stage runs and
is recorded, malformed outputs become recorded errors, and the ids the trainer needs
are exactly what the sampler produced."""

import json
from pathlib import Path

import pytest
import torch

from agentflow import AgentSystem, agent_config, parse_plan
from support.config import load_config
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
    from support.datasets import Item
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


# ----------------------------------------------------------------------------- verifier

class _Answering:
    """The frozen LLM with its verdict replaced: every verifier call answers `word`, and the
    prompts and parameters it was asked with are kept."""

    def __init__(self, llm, word):
        self.llm, self.tok, self.word, self.calls = llm, llm.tok, word, []

    def chat_ids(self, *a, **k):
        return self.llm.chat_ids(*a, **k)

    def sample(self, prompts, params, seed, **k):
        from engine import Sample
        self.calls.append(([self.tok.decode(p) for p in prompts], params))
        tid = self.tok.encode(self.word, add_special_tokens=False)[0]
        return [Sample([tid], [0.0], self.word, "length") for _ in prompts]


def _after(tool, result, query, error=""):
    from agentflow import Trajectory
    from memory import Memory
    tr = Trajectory(query, Memory(800, 300))
    tr.memory.add("a sub-goal", tool, "a command", result, error)
    return tr


def test_verifier_asks_the_check_of_the_tool_that_ran(tiny_llm):
    """After Local_Search the question is 'is a calculation still needed' (Yes = continue);
    after a tool without a Check, or a turn whose plan named no tool, the general
    STOP/CONTINUE prompt over the whole memory. One batched call per kind of question,
    the verdicts back in row order."""
    agent = make_agent(tiny_llm)
    live = [_after("Local_Search", "Orsk: a town of 900 people.", "How many people live in Orsk?"),
            _after("Python_Coder", "42", "Add 40 and 2."),
            _after("", "", "???", error="no known tool in the plan"),
            _after("Local_Search", "Orsk: a town of 900 people.", "Double the population of Orsk.")]
    check = (agent.yes_token, agent.no_token)
    general = (agent.stop_token, agent.continue_token)
    for word, want in [(" Yes", [False, None, None, False]), (" No", [True, None, None, True]),
                       (" STOP", [None, True, True, None]), (" CONTINUE", [None, False, False, None])]:
        agent.frozen = _Answering(tiny_llm, word)
        stops = agent._verify(live, seed=5)
        assert [s for s, w in zip(stops, want) if w is not None] == [w for w in want if w is not None]
        calls = {tuple(p.first_tokens): prompts for prompts, p in agent.frozen.calls}
        assert len(agent.frozen.calls) == 2 and set(calls) == {check, general}
        assert len(calls[general]) == 2 and all("Reply STOP if" in g and "Conclusion:" in g for g in calls[general])
        assert "no known tool in the plan" in calls[general][1]  # the whole memory, errors included
        search = calls[check]
        assert len(search) == 2 and all("still need a calculation" in c for c in search)
        assert search[1].endswith("Found: Orsk: a town of 900 people.\nQuestion: Double the population of Orsk."
                                  "<|im_end|>\n<|im_start|>assistant\nCalculation:")
        # Every worked example of the check sits in the prompt, with its answer.
        examples = agent.tools["Local_Search"].check.examples
        assert all(f"Found: {r}\nQuestion: {q}\nCalculation: {a}" in search[0] for q, r, a in examples)
    # Each verdict is told apart by the first token of its word.
    assert agent.yes_token != agent.no_token and agent.stop_token != agent.continue_token


def test_shipped_check_on_questions_in_new_wordings(default_model_path):
    """The real frozen 135M verifier after a search, on questions worded unlike the task
    templates and the check's examples: a looked-up fact that answers the question stops,
    one that must still be computed with continues, a failed search continues; and the
    general prompt stops after code on an arithmetic question. A frozen model is
    imperfect: the bar is 5 of 6 (4 of 6 for the questions that continue)."""
    from engine import LLM
    from support.models import load_model
    model, tok = load_model(default_model_path)
    agent = make_agent(LLM(model, tok))
    p = "Brel: Brel is a fishing town on the Mard coast. Brel was founded in 1840 and has a population of 9120."
    s = "Tova: The Tova is a ferry from the port of Lisk. The Tova was launched in 1961 and carries a crew of 58."
    m = "Gant: Gant is a mountain in the Oss range. Gant is 3312 metres high and was first climbed in 1899."
    answered = [("Local_Search", p, "Tell me how many inhabitants Brel has."),
                ("Local_Search", p, "Which year saw the founding of Brel?"),
                ("Local_Search", s, "How large is the crew of the Tova?"),
                ("Local_Search", m, "What height does Gant reach, in metres?"),
                ("Local_Search", s, "In which port is the Tova based?"),
                ("Local_Search", m, "When did climbers first reach the top of Gant?")]
    open_ = [("Local_Search", p, "Take Brel's population times 3."),
             ("Local_Search", s, "What is the Tova's crew multiplied by 11?"),
             ("Local_Search", m, "Double the height of Gant in metres."),
             ("Local_Search", "no passage matches '77 * 5'", "Find 77 * 5."),
             ("Local_Search", p, "If Brel's population grew by 500, how many people would live there?"),
             ("Local_Search", "no passage matches '4410 2'", "Halve 4410.")]
    code = [("Python_Coder", "1003", "Sum 412 and 591."), ("Python_Coder", "4026", "Give the product of 61 and 66."),
            ("Python_Coder", "17", "What do you get from 340 / 20?"), ("Python_Coder", "880", "Work out 44 * 20."),
            ("Python_Coder", "99", "Subtract 1 from 100."), ("Python_Coder", "35", "Compute 5 * 7.")]
    stops = agent._verify([_after(*c[:2], c[2]) for c in answered + open_ + code], seed=0)
    assert sum(stops[:6]) >= 5, stops
    assert sum(not s for s in stops[6:12]) >= 4, stops
    assert sum(stops[12:]) >= 5, stops


# Passages in the corpus's layout for the paraphrase wordings' tests (invented: no row of data/).
BREL = "Brel: Brel is a fishing town on the Mard coast. Brel was founded in 1840 and has a population of 9120."
TOVA = "Tova: The Tova is a ferry from the port of Lisk. The Tova was launched in 1961 and carries a crew of 58."
GANT = "Gant: Gant is a mountain in the Oss range. Gant is 3312 metres high and was first climbed in 1899."


def test_shipped_check_on_the_paraphrase_wordings(default_model_path):
    """The real frozen 135M check after a search, on wordings of data/paraphrase.jsonl
    (scripts/make_tasks.py, PARA_*), none of them in its examples: a lookup stops, a two_step
    question continues. These are the wordings it gets right on every passage here and on
    the set (python -m scripts.probe_tools --benchmark data/paraphrase.jsonl --check); the
    ones it gets wrong are the next test's."""
    from engine import LLM
    from support.models import load_model
    model, tok = load_model(default_model_path)
    agent = make_agent(LLM(model, tok))
    answered = [(BREL, "The population of Brel, please."),
                (TOVA, "Do you know the crew size of the ship Tova?"),
                (GANT, "I am looking for the height of Gant in metres.")]
    open_ = [(BREL, "I need 7 times the population of Brel."),
             (TOVA, "How much is the crew size of the ship Tova when scaled up 4-fold?"),
             (GANT, "Look up the height of Gant in metres and scale it by 4."),
             (BREL, "The population of Brel multiplied by 4, please.")]
    stops = agent._verify([_after("Local_Search", r, q) for r, q in answered + open_], seed=0)
    assert stops == [True] * len(answered) + [False] * len(open_), stops


@pytest.mark.xfail(strict=True, reason="the shipped check stops on these two_step wordings (measured on "
                   "data/paraphrase.jsonl: 10 of 16 two_step right); when a change makes them continue, "
                   "move them into the test above")
def test_shipped_check_on_paraphrase_wordings_it_gets_wrong(default_model_path):
    """Two_step wordings where the frozen check says nothing remains after the search: the
    factor before the quantity with no verb of multiplying ("the product of 7 and ...",
    "What number is 4 times ..."), and one that ends in "multiplied by 7, please"."""
    from engine import LLM
    from support.models import load_model
    model, tok = load_model(default_model_path)
    agent = make_agent(LLM(model, tok))
    open_ = [(BREL, "Find the product of 7 and the population of Brel."),
             (TOVA, "What number is 4 times the crew size of the ship Tova?"),
             (GANT, "The height of Gant in metres multiplied by 7, please.")]
    stops = agent._verify([_after("Local_Search", r, q) for r, q in open_], seed=0)
    assert stops == [False] * len(open_), stops


# ----------------------------------------------------------------------------- executor

def test_executor_examples_are_laid_out_like_its_prompts(tiny_llm):
    """Every worked example of every tool, its earlier turns rendered by Memory exactly as a
    real prompt's memory is, and the input after the tool's prefix."""
    from memory import EMPTY
    agent = make_agent(tiny_llm)
    system = agent.executor_system
    for tool in agent.tools.values():
        for question, earlier, goal, text in tool.examples:
            assert f"Question: {question}\nTool: {tool.name}\n{tool.input_prefix}{text}" in system
            for turn, (name, sub_goal, command, result) in enumerate(earlier, 1):
                assert (f"Known so far:\nTurn {turn}: {name} - {sub_goal}\n  Command: {command}\n"
                        f"  Result: {result}") in system
            if not earlier:
                assert f"Sub-goal: {goal}\nKnown so far:\n{EMPTY}\nQuestion: {question}" in system


def test_executor_copies_a_looked_up_number_into_code(default_model_path):
    """The second step of a two-step question, on the real frozen 135M executor: the memory
    holds a passage with two numbers, and the code must multiply the right one by the
    question's factor. Wordings and passages unlike the worked examples. A frozen 135M model
    is imperfect: the bar is half of them (with only the arithmetic example, 1 of 6)."""
    from agentflow import Plan
    from engine import LLM
    from support.models import load_model
    model, tok = load_model(default_model_path)
    agent = make_agent(LLM(model, tok), code_start="print(", **{"executor.max_new_tokens": 24})
    cases = [("Brel: Brel is a fishing town on the Mard coast. Brel was founded in 1840 and has a population of 9120.",
              "What is the population of Brel multiplied by 3?", 27360),
             ("Tova: The Tova is a ferry from the port of Lisk. The Tova was launched in 1961 and carries a crew of 58.",
              "What is 7 times the crew size of the ship Tova?", 406),
             ("Gant: Gant is a mountain in the Oss range. Gant is 3312 metres high and was first climbed in 1899.",
              "If you multiply the height of Gant in metres by 2, what do you get?", 6624),
             ("Sarn: The Sarn is a river in the Holt lowlands. The Sarn is 412 km long and is crossed by 23 bridges.",
              "What is the length of the Sarn river in km multiplied by 5?", 2060),
             ("Kepo: Kepo is a glass maker based in Ust. Kepo was founded in 1903 and has 7710 employees.",
              "What is 4 times the number of employees at Kepo?", 30840),
             ("Ila Dern: Ila Dern is a poet born in Varn. Ila Dern was born in 1921 and wrote 36 books.",
              "What is the number of books written by Ila Dern multiplied by 6?", 216)]
    live = [_after("Local_Search", passage, q) for passage, q, _ in cases]
    plans = [Plan("Python_Coder", "compute the answer", "") for _ in cases]
    commands = agent._execute(live, plans, list(range(len(cases))), turn=2, seed=0)
    outputs = [agent.tools["Python_Coder"].run(commands[i]).output.strip() for i in range(len(cases))]
    right = [out == str(want) for out, (_, _, want) in zip(outputs, cases)]
    assert sum(right) >= 3, list(zip(commands.values(), outputs))


def test_planner_reads_the_memory_as_what_each_step_found(tiny_llm):
    """The planner's state M^t: one line per earlier turn, named by what its tool does, never
    by the tool's name (a small planner copies a name it has just read); errors included."""
    agent = make_agent(tiny_llm, max_turns=2)
    tr = _after("Local_Search", "Orsk: a town of 900 people.", "Double the population of Orsk.")
    tr.memory.add("compute", "Python_Coder", "print(900 * 2)", "", "line 1: NameError: name 'x' is not defined")
    tr.memory.add("?", "", "", "", "no known tool in the plan")
    assert agent.view(tr.memory, agent.tools) == ("- a search found: Orsk: a town of 900 people.\n"
                                       "- code printed: line 1: NameError: name 'x' is not defined\n"
                                       "- a step without a tool gave: no known tool in the plan")
    # v^t is part of M^{t+1}: a turn the verifier continued says what it found still open,
    # in the words of the tool's check, or in general words after a tool without one.
    tr.memory.records[0].verdict, tr.memory.records[1].verdict = "continue", "continue"
    tr.memory.records[2].verdict = "stop"
    assert agent.view(tr.memory, agent.tools) == ("- a search found: Orsk: a town of 900 people.\n"
                                       "- the check said: a calculation is still needed\n"
                                       "- code printed: line 1: NameError: name 'x' is not defined\n"
                                       "- the check said: the question is not answered yet\n"
                                       "- a step without a tool gave: no known tool in the plan")
    assert agent.view(_after("Local_Search", "", "q").memory.__class__(800, 300), agent.tools) == "- nothing yet"
    agent.stop_token, agent.check_system = -1, {}  # the verifier never stops: two turns
    trajs = agent.rollout(["Compute 48213 * 9127."], seed=1)
    second = tiny_llm.tok.decode(trajs[0].turns[1].prompt_ids)
    assert "What the earlier steps found:\n- " in second and "Step 2 of at most 2." in second
    found = second.split("What the earlier steps found:")[1]  # the tool cards above name every tool
    assert not any(name in found for name in NAMES)


def test_tools_whose_names_share_a_first_token_are_refused(tiny_llm):
    """With constrain_tool the planner's tool choice is its first token: "Python_Helper"
    beside "Python_Coder" would collapse two tools into one choice. Refused when the agent
    is built, before any rollout, naming both tools and the token."""
    import pytest

    import tools as toolset
    from support.config import ConfigError

    class PythonHelper(toolset.BaseGenerator):
        name = "Python_Helper"

    tools = {**build_tools(NAMES, {"corpus": str(ROOT / "data" / "corpus.jsonl")}), "Python_Helper": PythonHelper()}
    cfg = agent_config(load_config(None, ["agent.tools=[Python_Coder]"])["agent"])
    with pytest.raises(ConfigError, match=r"Python_Coder and Python_Helper begin with the same token ' Python'"):
        AgentSystem(tiny_llm, tiny_llm, tools, cfg)
    free = agent_config(load_config(None, ["agent.constrain_tool=false"])["agent"])
    assert AgentSystem(tiny_llm, tiny_llm, tools, free).planner_params.first_tokens == ()  # not constrained: allowed
