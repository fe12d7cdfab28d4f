"""AgentFlow: the four modules and the turn loop (the LLM engine they call is engine.py).

Paper, section 1. Given a query q and a toolset K, four modules share a memory M:

    a^t ~ pi_theta(. | q, K, M^t)     Action Planner   (the only trained module)
    e^t = E(a^t)                       Tool Executor    (frozen LLM writes the call, the tool runs it)
    v^t = V(q, e^t, M^t)               Execution Verifier (frozen LLM: is M enough to stop?)
    M^{t+1} = f_mem(M^t, a^t, e^t, v^t)                   (memory.py, deterministic)
    stop when v^t = 1 or t = T_max; then o = G(q, M^T)   Solution Generator (frozen LLM)

What this file adds to that picture, and why:

  * Lockstep batching. Many trajectories (the G rollouts of several queries) advance
    turn by turn together: each turn is ONE batched planner call, ONE batched executor
    call, the tool calls run concurrently, ONE batched verifier call; finished
    trajectories drop out; at the end ONE batched generator call. On-policy RL spends
    most of its time generating, and batching is what makes generating cheap.
  * Token ids end to end. For every planner turn we keep the exact prompt ids, the
    sampled ids and the log-prob of each sampled id. The trainer (flow_grpo.py) scores
    those very ids; nothing is decoded and re-encoded between sampling and the loss.
  * Two copies of the weights. The planner samples from the CURRENT trainable weights
    (no stale copy); the executor, verifier and generator run on a frozen copy of the
    initial weights, which is also the reference policy pi_ref of the KL term.
  * Explicit sampling parameters, the same on both sides of the loss (the official code
    silently samples at 0.7 with a frequency penalty while training on raw log-probs).

Simplifications: the planner's action is short: its reply begins after a forced "Tool:",
names one tool, and may add one line "Sub-goal: ..." (PLANNER_SYSTEM asks for both lines;
parse_plan reads them, and without a sub-goal the executor reads the question instead).

What a 135M model needs (the offline default), gathered here; a larger model runs the
same code, and each choice is a config key or a prompt a fork can change:
  1. the tool choice is constrained: the action's first token is drawn among the first
     tokens of the tool names (agent.constrain_tool), at its own temperature
     (agent.planner.first_temperature); AgentSystem.__init__;
  2. the action is the tool line alone: config.yaml's planner stops at the first newline
     (agent.planner.stop), before any sub-goal (a 135M planner's sub-goal drifts into
     noise under training, and the frozen executor copies it);
  3. code input starts with "print(" (agent.code_start): otherwise it writes a def and
     never calls it; AgentSystem._execute;
  4. the verifier's verdict is one forced choice between two words, and after a tool
     with a Check (tools.py) it answers that tool's narrower question, V(q, e^t), not the
     general one about the whole memory; AgentSystem._verify;
  5. prompts put what the model must copy last (the question after the executor's
     examples, the question after the checked output), and the planner reads the memory
     as what each step found, not as tool names it would copy; the prompts below.
"""

from __future__ import annotations  # the turn loop comes first, the types it names below it

import copy
import re
import string
from dataclasses import dataclass, field, replace

from engine import LLM, SamplingParams
from memory import ERROR_CHARS, PLANNER_VIEWS, Memory
from support.config import ConfigError
from support.seeds import derive_seed
from support.text import cut
from tools import Tool, run_tool_calls

# ----------------------------------------------------------------------------------------
# The turn loop


class AgentSystem:
    """The four modules around a toolset. `planner` samples from the trainable weights;
    `frozen` (the initial weights, also pi_ref) runs executor, verifier and generator."""

    def __init__(self, planner: LLM, frozen: LLM, tools: dict[str, Tool], cfg: AgentConfig):
        self.planner, self.frozen, self.tools, self.cfg = planner, frozen, tools, cfg
        self.tool_names = list(tools)
        cards = "\n".join(f"- {t.name}: {t.card}" for t in tools.values())
        self.prompts = p = cfg.prompts  # PROMPTS, or a fork's replacements (agent.prompts)
        self.planner_system = p["planner_system"].format(cards=cards)
        self.view = PLANNER_VIEWS.named(cfg.planner_view)  # what the planner reads of M^t (memory.py)
        # A 135M model at temperature 1 rarely writes a tool name where one belongs. With
        # constrain_tool, the action's first token is drawn among the first tokens of the
        # tool names (" Python", " Local", ...): the policy over tools becomes a softmax
        # over those few tokens, and the trainer applies the same restriction
        # (flow_grpo.token_logprobs), so log-probs still match exactly.
        self.first_token = first_token = tool_first_tokens(self.tool_names, planner.tok, cfg.constrain_tool)
        self.planner_params = replace(cfg.planner, first_tokens=tuple(sorted(set(first_token.values())))
                                      if cfg.constrain_tool else ())
        # With force_tool (eval.py --force-tool), the only allowed first token at turn t is
        # the t-th tool of the list (the last one for later turns): what each plan of tool
        # choices is worth, the yardstick for a trained planner. Measurement only.
        forced = [n.strip() for n in cfg.force_tool.split(",") if n.strip()]
        self.forced_params = [replace(cfg.planner, first_tokens=(first_token[n],)) for n in forced]
        # The verifier's verdict is the first token of its reply, forced to one of two
        # words (greedy: whichever the frozen model finds likelier). After a tool with a
        # Check (tools.py: Local_Search) it answers that tool's question with " Yes" or
        # " No"; after any other tool, or a turn without one, the general question with
        # " STOP" or " CONTINUE". (A check after code, "did the question ask for a
        # calculation?", was measured too: docs/LOG.md says why it is not shipped.)
        word = lambda w: frozen.tok.encode(w, add_special_tokens=False)[0]
        self.stop_token, self.continue_token = word(" STOP"), word(" CONTINUE")
        self.yes_token, self.no_token = word(" Yes"), word(" No")
        self.verifier_params = replace(cfg.verifier, max_new_tokens=1,
                                       first_tokens=(self.stop_token, self.continue_token))
        self.check_params = replace(self.verifier_params, first_tokens=(self.yes_token, self.no_token))
        self.check_system = {t.name: t.check.question + "\n\n" + "\n\n".join(
            p["check_user"].format(result=out, query=q) + f"\n{t.check.label} {a}" for q, out, a in t.check.examples)
            for t in tools.values() if t.check}
        # The executor's worked examples, each laid out exactly like its own prompt, the
        # earlier turns rendered by the Memory the real prompts come from.
        self.executor_system = p["executor_system"].format(examples="\n\n".join(
            p["executor_user"].format(sub_goal=goal, memory=_example_memory(earlier).render(), query=q, tool=t.name)
            + f"\n{t.input_prefix}{text}" for t in tools.values() for q, earlier, goal, text in t.examples))

    def system_prompts(self) -> dict[str, str]:
        """Each module's system prompt, the same for every trajectory of a run (train.py
        writes them to prompts.json; each trajectory records its own part)."""
        return {"planner": self.planner_system, "executor": self.executor_system,
                "verifier": self.prompts["verifier_system"],
                **{f"check after {tool}": text for tool, text in self.check_system.items()},
                "generator": self.prompts["generator_system"]}

    def with_planner_temperature(self, temperature: float) -> "AgentSystem":
        """The same modules and tools with the planner sampling at `temperature` (0 = greedy),
        its tool choice included: how held-out evaluation runs the policy."""
        other = copy.copy(self)
        other.planner_params = replace(self.planner_params, temperature=temperature, first_temperature=0.0)
        other.forced_params = [replace(p, temperature=temperature, first_temperature=0.0) for p in self.forced_params]
        return other

    def rollout(self, queries: list[str], seed: int = 0, max_turns: int | None = None) -> list[Trajectory]:
        """Run every query to a final answer, all trajectories in lockstep.

        For G rollouts of a query, pass the query G times: each copy gets its own memory
        and its own samples (rows of one batch draw different random tokens)."""
        T_max = max_turns or self.cfg.max_turns
        trajs = [Trajectory(q, Memory(self.cfg.memory_budget_chars, self.cfg.result_chars)) for q in queries]
        for turn in range(1, T_max + 1):
            live = [tr for tr in trajs if not tr.done]
            if not live:
                break

            # Planner: a^t ~ pi_theta(. | q, K, M^t), one batched call over live trajectories.
            users = [self.planner_user(tr.query, tr.memory, turn, T_max) for tr in live]
            prompts = [self.planner.chat_ids(self.planner_system, u, "Tool:") for u in users]
            params = (self.planner_params if not self.forced_params  # forced: eval.py --force-tool
                      else self.forced_params[min(turn, len(self.forced_params)) - 1])
            samples = self.planner.sample(prompts, params, seed=derive_seed("turn", seed, turn, 0))
            plans = []
            for tr, u, p, smp in zip(live, users, prompts, samples):
                tr.turns.append(PlannerTurn(p, smp.ids, smp.logprobs, smp.text))
                # What it saw (its own part of the prompt; the system prompt is the run's,
                # prompts.json), what it wrote; tokens and finish ("length" = cut at
                # max_new_tokens) let the report show what was cut.
                tr.log.append({"module": "planner", "turn": turn, "prompt": u, "output": "Tool:" + smp.text,
                               "tokens": len(smp.ids), "finish": smp.finish})
                plans.append(parse_plan(smp.text, self.tools))

            # Executor: the frozen LLM turns each valid plan into a concrete command.
            valid = [i for i, pl in enumerate(plans) if pl.tool]
            commands = self._execute(live, plans, valid, turn, derive_seed("turn", seed, turn, 1))

            # Tools, concurrently: e^t = E(a^t).
            results = run_tool_calls([(self.tools[plans[i].tool], commands[i]) for i in valid])
            result_of = dict(zip(valid, results))

            # f_mem: record the turn (a bad plan is recorded too, as an error).
            for i, (tr, pl) in enumerate(zip(live, plans)):
                r = result_of.get(i)
                tr.memory.add(pl.sub_goal, pl.tool, commands.get(i, ""), r.output if r else "",
                              pl.error or (r.error if r else ""), infra=bool(r and r.infra))

            # Verifier: v^t = V(q, e^t, M^t), one batched call per kind of question; the last
            # turn needs none.
            if turn < T_max:
                for tr, stop in zip(live, self._verify(live, derive_seed("turn", seed, turn, 2))):
                    tr.memory.records[-1].verdict = "stop" if stop else "continue"
                    tr.log.append({"module": "verifier", "turn": turn, "output": "STOP" if stop else "CONTINUE"})
                    tr.done = stop
            else:
                for tr in live:
                    tr.done = True

        # Generator: o = G(q, M^T), one batched call.
        gprompts = [self.generator_prompt(tr.query, tr.memory) for tr in trajs]
        for tr, smp in zip(trajs, self.frozen.sample(gprompts, self.cfg.generator, derive_seed("generator", seed))):
            tr.answer = smp.text.strip()
            tr.log.append({"module": "generator", "output": tr.answer})
        return trajs

    # Each module's prompt as token ids, ending where its reply begins: the one place each
    # is laid out (the turn loop builds them here, and so does longest_prompts).

    def planner_prompt(self, query: str, memory: Memory, turn: int, max_turns: int) -> list[int]:
        """The planner's state (q, K, M^t) as token ids, ending where its action begins."""
        return self.planner.chat_ids(self.planner_system, self.planner_user(query, memory, turn, max_turns), "Tool:")

    def executor_prompt(self, query: str, memory: Memory, sub_goal: str, tool: Tool) -> list[int]:
        """The executor's prompt for one planned step, ending where the tool's input begins:
        after the tool's prefix and its forced start (input_start)."""
        return self.frozen.chat_ids(self.executor_system, self.prompts["executor_user"].format(
            query=query, memory=memory.render(), tool=tool.name, sub_goal=sub_goal),
            tool.input_prefix + self.input_start(tool))

    def input_start(self, tool: Tool) -> str:
        """What a tool's input is forced to begin with: agent.code_start for a tool that writes
        code, nothing for the others."""
        return self.cfg.code_start if tool.writes_code else ""

    def verifier_prompt(self, query: str, memory: Memory) -> list[int]:
        """The verifier's general question: does the whole memory answer the query?"""
        return self.frozen.chat_ids(self.prompts["verifier_system"], self.prompts["verifier_user"].format(
            query=query, memory=memory.render()), "Conclusion:")

    def check_prompt(self, tool: str, result: str, query: str) -> list[int]:
        """The Check of `tool` (the one that ran last): its question about its output `result`."""
        return self.frozen.chat_ids(self.check_system[tool], self.prompts["check_user"].format(
            result=result, query=query), self.tools[tool].check.label)

    def generator_prompt(self, query: str, memory: Memory) -> list[int]:
        """The generator's prompt, o = G(q, M^T)."""
        return self.frozen.chat_ids(self.prompts["generator_system"], self.prompts["generator_user"].format(
            query=query, memory=memory.render()), "Answer:")

    def planner_user(self, query: str, memory: Memory, turn: int, max_turns: int) -> str:
        """The part of the planner's prompt that is this trajectory's own: the question, its
        view of M^t (memory.PLANNER_VIEWS), the turn (what the trajectories record)."""
        return self.prompts["planner_user"].format(query=query, found=self.view(memory, self.tools), turn=turn,
                                                   max_turns=max_turns)

    def _verify(self, live, seed) -> list[bool]:
        """v^t for each live trajectory: True = stop. The frozen model answers the paper's
        question, whether the whole memory answers the query (V(q, e^t, M^t)), with STOP or
        CONTINUE; after a tool with a Check (a 135M model's narrower question), that tool's
        question about the query and the tool's output e^t instead. One batched call per kind
        of question."""
        stops = [False] * len(live)
        rows_of: dict[str, list[int]] = {}  # the Check's tool, or "" for the general question
        for i, tr in enumerate(live):
            tool = tr.memory.records[-1].tool
            rows_of.setdefault(tool if tool in self.check_system else "", []).append(i)
        for tool, rows in rows_of.items():
            if not tool:  # the general question
                prompts = [self.verifier_prompt(live[i].query, live[i].memory) for i in rows]
                stop_token, params = self.stop_token, self.verifier_params
            else:  # the Check of the tool that ran last
                last = [live[i].memory.records[-1] for i in rows]
                prompts = [self.check_prompt(tool, r.result or r.error, live[i].query) for i, r in zip(rows, last)]
                stop_token = self.yes_token if self.tools[tool].check.stop_if == "Yes" else self.no_token
                params = self.check_params
            for i, smp in zip(rows, self.frozen.sample(prompts, params, seed)):
                stops[i] = smp.ids[:1] == [stop_token]
        return stops

    def _execute(self, live, plans, valid, turn, seed) -> dict[int, str]:
        # The tool input starts with `start`: code_start for Python (config.yaml forces
        # "print(" so a 135M model writes one printed expression, not an uncalled def).
        starts = {i: self.input_start(self.tools[plans[i].tool]) for i in valid}
        prompts = [self.executor_prompt(live[i].query, live[i].memory, plans[i].sub_goal or live[i].query,
                                        self.tools[plans[i].tool]) for i in valid]
        stops = [self.tools[plans[i].tool].input_stops for i in valid]
        commands = {}
        for i, smp in zip(valid, self.frozen.sample(prompts, self.cfg.executor, seed, row_stops=stops)):
            commands[i] = (starts[i] + smp.text).strip()
            live[i].log.append({"module": "executor", "turn": turn, "tool": plans[i].tool, "output": commands[i]})
        return commands


# ----------------------------------------------------------------------------------------
# The longest call of each module, before any weights load (the preflight's)

# A memory block of M characters counts as M tokens: a byte-level BPE or a SentencePiece
# vocabulary holds every ASCII character as a token of its own, so ASCII text never needs
# more tokens than characters (merges only lower the count). Text far from ASCII (a web page
# in Chinese, say) can need more, up to a token per byte: this bound does not cover it.
TOKENS_PER_CHAR = 1


@dataclass(frozen=True)
class PromptBound:
    """The most tokens one module's call can hold: its prompt's own text (system prompt with
    the tools' cards or examples, chat template, the user prompt's words, the forced start
    of the reply), measured with the tokenizer, and the parts the config bounds, each
    (tokens, what and which key bounds it), its reply among them. The question is the
    data's and bounded by no key: it comes on top."""
    text: int
    parts: tuple[tuple[int, str], ...]

    @property
    def total(self) -> int:
        return self.text + sum(n for n, _ in self.parts)


class TokenizerOnly:
    """What AgentSystem reads of an LLM to lay out its prompts, from the tokenizer alone."""
    chat_ids = LLM.chat_ids  # the very chat formatting of the engine

    def __init__(self, tok):
        self.tok = tok


def longest_prompts(cfg: dict, planner_tok, frozen_tok) -> dict[str, PromptBound]:
    """Each module's longest call under the config, from the tokenizers alone (what
    support/models.check_models holds against the models' positions): its prompt as
    AgentSystem lays it out for an empty question and an empty memory, plus the memory at
    its cap (agent.memory_budget_chars: the planner's view and Memory.render are cut to it)
    at TOKENS_PER_CHAR, the other parts the config bounds, and its reply. The executor: its
    longest tool, the planner's sub-goal at most the planner's reply. The verifier: the
    longer of its general question and each tool's Check, whose result the memory keeps to
    agent.result_chars (an error to ERROR_CHARS). The tools are read from their classes, as
    their cards and examples are: nothing is built."""
    from tools import TOOL_CLASSES
    a = cfg["agent"]
    agent = AgentSystem(TokenizerOnly(planner_tok), TokenizerOnly(frozen_tok),
                        {name: TOOL_CLASSES[name] for name in a["tools"]}, agent_config(a))
    empty, T = Memory(a["memory_budget_chars"], a["result_chars"]), a["max_turns"]
    memory = (a["memory_budget_chars"] * TOKENS_PER_CHAR, "of memory (agent.memory_budget_chars)")
    reply = lambda m: (a[m]["max_new_tokens"], f"of reply (agent.{m}.max_new_tokens)")  # noqa: E731
    verdict = (agent.verifier_params.max_new_tokens, "of reply (its one forced word)")
    result = (max(a["result_chars"], ERROR_CHARS) * TOKENS_PER_CHAR, "of checked result (agent.result_chars)")
    sub_goal = (a["planner"]["max_new_tokens"], "of the planner's sub-goal (agent.planner.max_new_tokens)")
    executor = [PromptBound(len(agent.executor_prompt("", empty, "", t)), (memory, sub_goal, reply("executor")))
                for t in agent.tools.values()]
    verifier = [PromptBound(len(agent.verifier_prompt("", empty)), (memory, verdict))]
    verifier += [PromptBound(len(agent.check_prompt(name, "", "")), (result, verdict)) for name in agent.check_system]
    total = lambda bound: bound.total  # noqa: E731
    return {"planner": PromptBound(len(agent.planner_prompt("", empty, T, T)), (memory, reply("planner"))),
            "executor": max(executor, key=total), "verifier": max(verifier, key=total),
            "generator": PromptBound(len(agent.generator_prompt("", empty)), (memory, reply("generator")))}


# ----------------------------------------------------------------------------------------
# Trajectories


@dataclass
class PlannerTurn:
    """One planner action a^t with exactly what the trainer needs to score it."""
    prompt_ids: list[int]  # the state (q, K, M^t) as the sampler saw it
    action_ids: list[int]  # the sampled tokens of a^t
    logprobs: list[float]  # their log-probs at sampling time (pi_theta_old)
    text: str


@dataclass
class Trajectory:
    query: str
    memory: Memory
    turns: list[PlannerTurn] = field(default_factory=list)
    answer: str = ""  # the generator's final output o
    done: bool = False  # the verifier said stop, or the turn budget ran out
    log: list[dict] = field(default_factory=list)  # every module call: module, turn, prompt, output
    reward: float = 0.0  # R_i, filled by the judge (judge.Reward)
    reward_terms: dict = field(default_factory=dict)  # the named terms R_i weighs
    advantage: float = 0.0  # A_i, filled by flow_grpo.kept_rows
    turn_advantages: list | None = None  # A_i^t per turn, where credit is per turn (advantage_mode per_turn)

    @property
    def tools_used(self) -> list[str]:
        return [r.tool for r in self.memory.records if r.tool]

    @property
    def tool_errors(self) -> int:
        return sum(1 for r in self.memory.records if r.tool and r.error)

    def to_dict(self) -> dict:
        out = {"query": self.query, "answer": self.answer, "reward": self.reward,
               "reward_terms": self.reward_terms, "advantage": self.advantage, "n_turns": len(self.turns),
               "tools": self.tools_used, "memory": [vars(r) for r in self.memory.records], "log": self.log}
        if self.turn_advantages is not None:
            out["turn_advantages"] = self.turn_advantages
        return out


@dataclass
class AgentConfig:
    """The config's `agent` section as the agent reads it (support/config.py holds every key's
    default and comment: the one home of those facts)."""
    max_turns: int  # T_max
    constrain_tool: bool  # the planner's first token must begin a tool name
    force_tool: str  # "A" or "A,B,...": turn t's action begins with the t-th tool (measurement only)
    code_start: str  # text every input of a tool that writes code is forced to begin with, e.g. "print("
    planner_view: str  # what the planner reads of the memory: a name in memory.PLANNER_VIEWS
    prompts: dict  # every module prompt by name: PROMPTS with agent.prompts' replacements
    memory_budget_chars: int
    result_chars: int
    planner: SamplingParams
    executor: SamplingParams
    verifier: SamplingParams
    generator: SamplingParams


def agent_config(a: dict) -> AgentConfig:
    """AgentConfig from the config's `agent` section."""
    modules = {k: SamplingParams(temperature=a[k]["temperature"], max_new_tokens=a[k]["max_new_tokens"],
                                 stop=tuple(a[k]["stop"]), first_temperature=a[k].get("first_temperature", 0.0))
               for k in ("planner", "executor", "verifier", "generator")}
    return AgentConfig(max_turns=a["max_turns"], constrain_tool=a["constrain_tool"], force_tool=a["force_tool"],
                       code_start=a["code_start"], planner_view=a["planner_view"],
                       prompts=prompts_with(a["prompts"]), memory_budget_chars=a["memory_budget_chars"],
                       result_chars=a["result_chars"], **modules)


def tool_first_tokens(names: list[str], tok, distinct: bool = True) -> dict[str, int]:
    """The first token of each tool's name as the planner writes it after "Tool:" (" Python",
    " Local", ...). With constrain_tool the planner's choice of a tool is a choice among these
    tokens, so two tools that share one could not be told apart: refused (distinct=True)."""
    first = {n: tok.encode(" " + n, add_special_tokens=False)[0] for n in names}
    shared = [[n for n in names if first[n] == t] for t in dict.fromkeys(first.values())]
    clash = next((ns for ns in shared if len(ns) > 1), None)
    if distinct and clash:
        raise ConfigError(f"agent.tools: {' and '.join(clash)} begin with the same token "
                          f"{tok.decode([first[clash[0]]])!r}, so the planner's first token cannot tell them apart; "
                          f"rename one so that its first word differs, or set agent.constrain_tool: false")
    return first


def _example_memory(earlier) -> Memory:
    """The memory of a worked example: its earlier turns (tool, sub-goal, command, result)."""
    m = Memory(budget_chars=10_000, result_chars=10_000)
    for tool, goal, command, result in earlier:
        m.add(goal, tool, command, result)
    return m


# ----------------------------------------------------------------------------------------
# The four modules: prompts and tolerant parsers. Every prompt starts with text that is
# the same for every row of a batched call (instructions, tool cards), so the sampler
# runs it once; the question and the memory come last.

PLANNER_SYSTEM = """You plan the next step of solving a question with tools.
Available tools:
{cards}
Pick the ONE tool that fits the next step. Reply in exactly two lines:
Tool: <tool name>
Sub-goal: <what this step must find out>"""

# {found} is the planner's view of the memory (memory.PLANNER_VIEWS, agent.planner_view).
PLANNER_USER = """Question: {query}
What the earlier steps found:
{found}
Step {turn} of at most {max_turns}. What is the next step?"""

# The executor sees one worked example per tool of the toolset (all in the shared system
# prompt, so the sampler runs them once per batch), each laid out exactly like its own
# prompt: the planner's sub-goal, what is known so far, the question, the chosen tool.
# The question comes last on purpose: a 135M executor copies what it read most recently,
# and a sampled sub-goal can be noise ("Sure, the previous"), while the question always
# names the entity to search for or the numbers to compute with. Its reply is forced to
# start with the tool's prefix and ends at the tool's stop string: code ends at the
# closing fence, a query or a URL at the end of its line.
EXECUTOR_SYSTEM = """You write the input for a tool, nothing else. Examples:

{examples}"""
EXECUTOR_USER = """Sub-goal: {sub_goal}
Known so far:
{memory}
Question: {query}
Tool: {tool}"""
# The verifier's reply is one forced choice between two words (see
# AgentSystem.__init__): a 135M model rarely writes a readable verdict freely.
VERIFIER_SYSTEM = """You check whether the memory already holds the answer to the question.
Reply STOP if it does, CONTINUE if another tool step is needed."""
VERIFIER_USER = """Question: {query}
Memory:
{memory}"""
# After a tool with a Check: its output, then the question last (what a 135M model reads
# most recently weighs most; the check is about the question).
CHECK_USER = """Found: {result}
Question: {query}"""

GENERATOR_SYSTEM = """You give the final answer to a question, using the memory of tool results.
Reply with the answer only; when a tool result holds it, copy it exactly.

Example:
Question: How many crew does the Telpok carry?
Memory:
Turn 1: Local_Search - Find the crew of the Telpok
  Command: Telpok crew
  Result: Telpok: The Telpok is a fishing ship. It was launched in 1957 and carries a crew of 12.
Answer: 12

Example:
Question: What is 12 * 3?
Memory:
Turn 1: Python_Coder - Compute 12 * 3
  Command: print(12 * 3)
  Result: 36
Answer: 36"""
GENERATOR_USER = """Question: {query}
Memory:
{memory}"""

# The prompts as data: agent.prompts replaces any of them by name (a fork's own wording,
# no core edit); each replacement keeps the {fields} of the one it replaces.
PROMPTS = {"planner_system": PLANNER_SYSTEM, "planner_user": PLANNER_USER, "executor_system": EXECUTOR_SYSTEM,
           "executor_user": EXECUTOR_USER, "verifier_system": VERIFIER_SYSTEM, "verifier_user": VERIFIER_USER,
           "check_user": CHECK_USER, "generator_system": GENERATOR_SYSTEM, "generator_user": GENERATOR_USER}


def prompts_with(overrides: dict) -> dict[str, str]:
    """PROMPTS with agent.prompts' replacements, each checked to name a prompt and to keep its fields."""
    out = dict(PROMPTS)
    for name, text in overrides.items():
        if name not in PROMPTS:
            raise ConfigError(f"agent.prompts: no prompt is called {name!r}; the prompts are {', '.join(PROMPTS)}")
        want = {f for _, f, _, _ in string.Formatter().parse(PROMPTS[name]) if f}
        got = {f for _, f, _, _ in string.Formatter().parse(str(text)) if f} if isinstance(text, str) else None
        if got != want:
            raise ConfigError(f"agent.prompts.{name} must be text with the fields {sorted(want) or 'none'} "
                              f"(each in braces), got {text!r}")
        out[name] = text
    return out

@dataclass
class Plan:
    tool: str  # a name from the toolset, or "" when none could be read
    sub_goal: str
    error: str  # "" when the reply parsed


def parse_plan(text: str, tools: dict[str, Tool]) -> Plan:
    """Read "Tool: X / Sub-goal: Y" out of the planner's reply (which began after "Tool:").

    Tolerant: the tool line is matched by exact name first, then by the tool's aliases
    (tools.py); the first tool mentioned wins. A reply naming no tool is an error
    recorded in memory."""
    lines = text.strip().splitlines() or [""]
    tool_line = lines[0].lower()
    m = re.search(r"sub[- ]?goal\s*:\s*(.+)", text, flags=re.IGNORECASE)
    sub_goal = m.group(1).strip() if m else " ".join(lines[1:]).strip()
    # Exact names, then aliases, each in the order they appear in the tool line.
    for table in ({n: (n.lower(),) for n in tools}, {n: t.aliases for n, t in tools.items()}):
        hits = [(tool_line.find(w), n) for n, words in table.items() for w in words if w in tool_line]
        if hits:
            return Plan(tool=min(hits)[1], sub_goal=sub_goal, error="")
    return Plan(tool="", sub_goal=sub_goal,
                error=f"planner named no known tool (wrote {text.strip()[:60]!r})")
