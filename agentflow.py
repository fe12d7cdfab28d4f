"""AgentFlow: the LLM engine, the hand-written sampler, the four modules and the turn loop.

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
  * Two engines. The planner samples from the CURRENT trainable weights (no stale copy),
    the executor, verifier and generator run on a frozen copy of the initial weights,
    which is also the reference policy pi_ref of the KL term.
  * Explicit sampling parameters, the same on both sides of the loss (the official code
    silently samples at 0.7 with a frequency penalty while training on raw log-probs).

Simplifications: the planner's action is two short lines ("Tool: ...", "Sub-goal: ...";
the offline default keeps only the first, config.yaml says why); the executor's prompt
depends on the chosen tool; after a tool with a Check (tools.py) the verifier reads that
tool's output and the question, V(q, e^t), not the whole memory, because a 135M model
answers that narrower question and not the general one; prompts are written for small
models (tool cards and memory are the bulk, so both are kept tight).
"""

import copy
import re
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache

from memory import Memory
from support import speed
from support.batching import common_prefix_len, left_padded
from support.config import ConfigError
from support.device_memory import sampler_sub_batches
from support.seeds import derive_seed
from support.text import cut
from tools import Tool, run_tool_calls

# ----------------------------------------------------------------------------------------
# The engine: chat formatting and the hand-written batched, KV-cached sampler


@dataclass
class Sample:
    ids: list[int]  # the sampled token ids, including the EOS / stop-string token that ended the row
    logprobs: list[float]  # log-prob of each id, see LLM.sample for which distribution
    text: str  # decoded ids, cut before the stop string, EOS removed
    finish: str  # "eos", "stop" or "length"


@dataclass(frozen=True)
class SamplingParams:
    """How one module samples. For the planner this is also exactly what the loss scores
    (flow_grpo.token_logprobs takes the same object), so the two cannot disagree."""
    temperature: float  # 0 = greedy
    max_new_tokens: int
    stop: tuple[str, ...] = ()  # generation ends once the decoded text contains one of these
    first_tokens: tuple[int, ...] = ()  # if set, the first token is drawn from these ids only
    first_temperature: float = 0.0  # temperature of the first token alone; 0 = `temperature`

    def temperature_at(self, j: int) -> float:
        """The temperature of the action's j-th token (0-based)."""
        return self.first_temperature if j == 0 and self.first_temperature > 0 else self.temperature


class LLM:
    """A causal LM plus its tokenizer, with chat formatting and a batched sampler.

    The sampler owns its cache and its loop (no `model.generate`): prefill the prompts,
    then one forward per new token for the rows still running. Rows finish on their own
    (EOS, a stop string, or the token limit) and are then dropped from the batch and the
    cache, so a finished row costs nothing. Prompts that begin with the same tokens (the
    same module instructions and tool cards) share that prefix: it runs once and its
    keys and values are copied to every row.

    That is the plain path, written out in this file: `prefill`, `decode` and
    `multinomial` below, the three steps the loop calls. With fast=True (the default) the
    same loop calls support/speed.py's versions of those three steps: more shared text run
    once into a cache that grows in place, a written-out decode step, a cheaper draw. Both
    give the same greedy tokens and log-probs (tests/test_sampler.py); sampled tokens
    differ, because the fast draw uses the random stream differently.

    Memory (set by train.py from the memory plan; None = no limit, the CPU default):
    `sub_batch_bytes` caps one sub-batch of rows (their KV cache at its final size and the
    decode step's logits): more rows than fit run as successive sub-batches.
    `prefill_tokens` caps what one prefill forward holds. `check_every`: how many tokens
    are drawn between two looks at the stop rules, which need the tokens on the host:
    every token on a CPU (where that costs nothing), every 8 on a GPU (each look waits
    for the device).
    """

    def __init__(self, model, tokenizer, fast: bool = True, check_every: int | None = None):
        self.model, self.tok = model, tokenizer
        eos = {tokenizer.eos_token_id}
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        eos |= set(gen_eos) if isinstance(gen_eos, list) else {gen_eos}
        self.eos_ids = sorted(i for i in eos if i is not None)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.prefill = speed.prefill_prompts if fast else prefill
        self.draw = speed.draw if fast else multinomial
        self.use_decode(speed.choose_decode(model) if fast else "forward")  # measured once per machine
        self.sub_batch_bytes: int | None = None
        self.prefill_tokens: int | None = None
        self.check_every = check_every or (8 if self.device.type == "cuda" else 1)
        self.sub_batches_run = 0  # sub-batches sampled so far (metrics, tests)

    def use_decode(self, name: str) -> None:
        """Decode with `name`: "forward", the plain `decode` below, or one of the written-out
        steps of support/speed.py (speed.DECODE_STEPS), which give the same greedy tokens."""
        self.decode_name, self.decode = name, speed.DECODE_STEPS.get(name, decode)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def chat_ids(self, system: str, user: str, assistant_prefix: str = "") -> list[int]:
        """Token ids of a system + user exchange, opened for the assistant's reply.

        `assistant_prefix` is text the reply is forced to start with ("Tool:"): a format
        a small model can hardly miss. It is part of the prompt, never of the action."""
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.tok(text + assistant_prefix, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], params: SamplingParams, seed: int = 0,
               row_stops: list[tuple[str, ...]] | None = None) -> list[Sample]:
        """Sample a continuation for every prompt.

        `row_stops`, if given, replaces params.stop with one tuple of stop strings per row
        (one batched executor call serves tools whose commands end differently).

        Log-probs: token j is drawn from softmax(logits / T_j) over the full vocabulary,
        T_j = params.temperature_at(j), and its logprob is log softmax(logits / T_j)[id]:
        exactly the quantity flow_grpo.token_logprobs recomputes. For greedy decoding
        (T = 0) it is log softmax(logits)[id]. With `first_tokens`, the first position is
        a softmax over those ids alone (the other logits set to -inf), and its logprob is
        under that restricted softmax. Same prompts, params and seed give the same tokens.
        """
        n = len(prompts)
        if n == 0:
            return []
        stops = row_stops or [params.stop] * n
        gen = torch.Generator(device=self.device).manual_seed(seed)
        out = []
        for rows in sampler_sub_batches(prompts, params.max_new_tokens, self.sub_batch_bytes, self.model):
            out += self._sample_sub_batch([prompts[i] for i in rows], params, gen, [stops[i] for i in rows])
            self.sub_batches_run += 1
        return out

    def _sample_sub_batch(self, prompts: list[list[int]], params: SamplingParams, gen: torch.Generator,
                     stops: list[tuple[str, ...]]) -> list[Sample]:
        n, dev, M = len(prompts), self.device, params.max_new_tokens
        # 1. Prefill: every prompt's keys and values into the cache, and the logits that
        #    predict each row's first new token.
        logits, mask, cache = self.prefill(self.model, prompts, self.pad_id, extra=M, max_tokens=self.prefill_tokens)
        logits = logits.float()  # [n, V]
        next_pos = mask.sum(-1, keepdim=True)  # [n, 1] position of the next token

        # 2. Decode. `live` maps the rows of the shrinking batch to the original prompts.
        #    Drawn tokens and their log-probs wait on the device ([n, M] each) until the next
        #    look at the stop rules, which reads them back, ends rows at their finishing
        #    token, and drops finished rows (a row that ended since the last look has run a
        #    few steps too many: those tokens are discarded).
        live = torch.arange(n, device=dev)
        drawn = torch.zeros((n, M), dtype=torch.long, device=dev)  # [n, M]
        drawn_lp = torch.zeros((n, M), device=dev)  # [n, M]
        new_ids: list[list[int]] = [[] for _ in range(n)]
        new_lp: list[list[float]] = [[] for _ in range(n)]
        finish = ["length"] * n
        eos, looked = set(self.eos_ids), 0
        for step in range(M):
            if step == 0 and params.first_tokens:
                logits = restrict(logits, params.first_tokens)
            tok, lp = pick(logits, params.temperature_at(step), gen, self.draw)  # [b], [b]
            drawn[live, step], drawn_lp[live, step] = tok, lp
            if step + 1 - looked == self.check_every or step == M - 1:
                keep = self._end_finished_rows(live, drawn[live, looked:step + 1].tolist(),
                                               drawn_lp[live, looked:step + 1].tolist(), new_ids, new_lp, finish,
                                               stops, eos)
                looked = step + 1
                if not keep or step == M - 1:
                    break
                if len(keep) < len(live):  # drop finished rows from everything we carry
                    idx = torch.tensor(keep, device=dev)
                    cache.batch_select_indices(idx)
                    live, tok, mask, next_pos = live[idx], tok[idx], mask[idx], next_pos[idx]
            mask = torch.cat([mask, torch.ones_like(next_pos)], dim=-1)  # [b, len+1]
            logits = self.decode(self.model, tok, next_pos, mask, cache).float()  # [b, V]
            next_pos = next_pos + 1

        return [Sample(ids=new_ids[i], logprobs=new_lp[i], text=self._text(new_ids[i], stops[i]),
                       finish=finish[i]) for i in range(n)]

    def _end_finished_rows(self, live: torch.Tensor, ids: list[list[int]], lps: list[list[float]], new_ids, new_lp,
                           finish, stops, eos: set[int]) -> list[int]:
        """Append each live row's tokens since the last look, up to the one that finishes it
        (EOS, or the token that completes a stop string); return the live rows that go on."""
        keep = []
        for j, row in enumerate(live.tolist()):
            for t, l in zip(ids[j], lps[j]):
                new_ids[row].append(t)
                new_lp[row].append(l)
                if t in eos:
                    finish[row] = "eos"
                    break
                if stops[row] and self._hit_stop(new_ids[row], stops[row]):
                    finish[row] = "stop"
                    break
            else:
                keep.append(j)
        return keep

    def _hit_stop(self, ids: list[int], stops: tuple[str, ...]) -> bool:
        # A stop string is at most a few tokens long: decoding the tail is enough.
        tail = self.tok.decode(ids[-8:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    def _text(self, ids: list[int], stops: tuple[str, ...]) -> str:
        text = self.tok.decode(ids, skip_special_tokens=True)
        for s in stops:
            if s in text:
                text = text[: text.index(s)]
        return text


def prefill(model, prompts: list[list[int]], pad_id: int, extra: int = 0, max_tokens: int | None = None):
    """Run the prompts into a new cache; return (logits [n, V] at each prompt's last
    token, mask [n, S]: 1 where the cache holds a real token, the cache). The cache grows
    as decoding appends to it, and every prompt runs in one forward: `extra` and
    `max_tokens` (room to reserve, a cap per forward) are the fast path's, unused here.

    The P tokens every prompt starts with (a module's instructions and tool cards) run
    once at batch 1 and their keys and values are copied to every row: a token's keys
    and values depend only on the tokens before it. Each prompt's rest then runs as one
    left-padded batch behind that prefix. Left padding puts every row's last token in
    the last column, so the next token of every row goes in the same new column; pads
    are masked out and skipped by the position ids, so each row computes exactly what it
    would alone. (speed.prefill shares more and pads less; the result is the same.)"""
    n, dev = len(prompts), next(model.parameters()).device
    cache = DynamicCache()
    P = min(common_prefix_len(prompts), min(map(len, prompts)) - 1) if n > 1 else 0  # the last
    if P:                                                          # token must run with its row: its logits
        model(input_ids=torch.tensor([prompts[0][:P]], device=dev), cache=cache, use_cache=True,
              logits_to_keep=1)  # cache: [1, H, P, D] a layer
        cache.batch_repeat_interleave(n)  # [n, H, P, D]
    rest = [p[P:] for p in prompts]
    ids, rest_mask = left_padded(rest, max(map(len, rest)), pad_id, dev)  # [n, L] each
    mask = torch.cat([torch.ones((n, P), dtype=torch.long, device=dev), rest_mask], dim=-1)  # [n, P+L]
    pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, P:]  # [n, L] each token's position in its own sequence
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1], mask, cache  # [n, V], [n, P+L]


def decode(model, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
    """One new token per row through the model's own forward: logits [b, V].
    tok [b] the previous token of each row, pos [b, 1] its position, mask [b, S] the key
    mask (the last column is tok itself); its keys and values are appended to `cache`."""
    out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
    return out.logits[:, -1, :]  # [b, V]


def restrict(logits: torch.Tensor, allowed: tuple[int, ...]) -> torch.Tensor:
    """logits [..., V] with every id outside `allowed` set to -inf."""
    keep = torch.full_like(logits, float("-inf"))
    idx = torch.tensor(allowed, device=logits.device).expand(*logits.shape[:-1], -1)
    return keep.scatter(-1, idx, logits.gather(-1, idx))


def multinomial(weights: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One index per row of weights [b, V] (>= 0), drawn with probability weights / row sum."""
    return torch.multinomial(weights, 1, generator=gen)[:, 0]  # [b]


def pick(logits: torch.Tensor, temperature: float, gen: torch.Generator, draw=multinomial):
    """Choose one token per row from logits [b, V]; return (ids [b], logprobs [b]).
    temperature 0 is greedy; otherwise the token is drawn from softmax(logits / T)."""
    if temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)  # [b, V]
        tok = logits.argmax(dim=-1)  # [b]
    else:
        logp = torch.log_softmax(logits / temperature, dim=-1)  # [b, V] what the trainer recomputes
        tok = draw(logp.exp(), gen)  # [b]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


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

# The planner reads the memory as what each earlier step found, the tool named by what it
# did ("a search found: ..."): shown "Turn 1: Local_Search - ...", a 135M planner copies
# the last tool name into its reply (docs/LOG.md), and a second step is rarely sampled.
# After a step the verifier continued, the view also says what the verifier found still
# open ("the check said: a calculation is still needed"): without that line a trained
# planner searched again after a search on most two_step questions (docs/LOG.md).
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
                       code_start=a["code_start"], memory_budget_chars=a["memory_budget_chars"],
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


class AgentSystem:
    """The four modules around a toolset. `planner` samples from the trainable weights;
    `frozen` (the initial weights, also pi_ref) runs executor, verifier and generator."""

    def __init__(self, planner: LLM, frozen: LLM, tools: dict[str, Tool], cfg: AgentConfig):
        self.planner, self.frozen, self.tools, self.cfg = planner, frozen, tools, cfg
        self.tool_names = list(tools)
        cards = "\n".join(f"- {t.name}: {t.card}" for t in tools.values())
        self.planner_system = PLANNER_SYSTEM.format(cards=cards)
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
            CHECK_USER.format(result=out, query=q) + f"\n{t.check.label} {a}" for q, out, a in t.check.examples)
            for t in tools.values() if t.check}
        # The executor's worked examples, each laid out exactly like its own prompt, the
        # earlier turns rendered by the Memory the real prompts come from.
        self.executor_system = EXECUTOR_SYSTEM.format(examples="\n\n".join(
            EXECUTOR_USER.format(sub_goal=goal, memory=_example_memory(earlier).render(), query=q, tool=t.name)
            + f"\n{t.input_prefix}{text}" for t in tools.values() for q, earlier, goal, text in t.examples))

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
            prompts = [self.planner_prompt(tr.query, tr.memory, turn, T_max) for tr in live]
            params = (self.forced_params[min(turn, len(self.forced_params)) - 1] if self.forced_params
                      else self.planner_params)
            samples = self.planner.sample(prompts, params, seed=derive_seed("turn", seed, turn, 0))
            plans = []
            for tr, p, smp in zip(live, prompts, samples):
                tr.turns.append(PlannerTurn(p, smp.ids, smp.logprobs, smp.text))
                # tokens and finish ("length" = cut at max_new_tokens) let the report show what was cut.
                tr.log.append({"module": "planner", "turn": turn, "output": "Tool:" + smp.text,
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
        gprompts = [self.frozen.chat_ids(GENERATOR_SYSTEM, GENERATOR_USER.format(
            query=tr.query, memory=tr.memory.render()), "Answer:") for tr in trajs]
        for tr, smp in zip(trajs, self.frozen.sample(gprompts, self.cfg.generator, derive_seed("generator", seed))):
            tr.answer = smp.text.strip()
            tr.log.append({"module": "generator", "output": tr.answer})
        return trajs

    def planner_prompt(self, query: str, memory: Memory, turn: int, max_turns: int) -> list[int]:
        """The planner's state (q, K, M^t) as token ids, ending where its action begins."""
        return self.planner.chat_ids(self.planner_system, PLANNER_USER.format(
            query=query, found=self.planner_view(memory), turn=turn, max_turns=max_turns), "Tool:")

    def planner_view(self, memory: Memory) -> str:
        """The planner's view of M^t: one line per turn, what it did and what came back, and
        after a turn the verifier continued, a line with what it found still open (v^t)."""
        lines = []
        for r in memory.records:
            tool = self.tools.get(r.tool)
            lines.append(f"- {tool.found_as if tool else 'a step without a tool gave'}: {r.result or r.error}")
            if r.verdict == "continue":
                says = tool.check.continue_says if tool and tool.check else ""
                lines.append(f"- the check said: {says or 'the question is not answered yet'}")
        return cut("\n".join(lines), memory.budget_chars) if lines else "- nothing yet"

    def _verify(self, live, seed) -> list[bool]:
        """v^t for each live trajectory: True = stop. After a tool with a Check the frozen model
        answers that tool's question about the question and the tool's output e^t; otherwise
        the general question about the whole memory. One batched call per kind of question."""
        stops = [False] * len(live)
        rows_of: dict[str, list[int]] = {}  # the Check's tool, or "" for the general question
        for i, tr in enumerate(live):
            tool = tr.memory.records[-1].tool
            rows_of.setdefault(tool if tool in self.check_system else "", []).append(i)
        for tool, rows in rows_of.items():
            if tool:
                check, last = self.tools[tool].check, [live[i].memory.records[-1] for i in rows]
                prompts = [self.frozen.chat_ids(self.check_system[tool], CHECK_USER.format(
                    result=r.result or r.error, query=live[i].query), check.label) for i, r in zip(rows, last)]
                stop_token = self.yes_token if check.stop_if == "Yes" else self.no_token
                params = self.check_params
            else:
                prompts = [self.frozen.chat_ids(VERIFIER_SYSTEM, VERIFIER_USER.format(
                    query=live[i].query, memory=live[i].memory.render()), "Conclusion:") for i in rows]
                stop_token, params = self.stop_token, self.verifier_params
            for i, smp in zip(rows, self.frozen.sample(prompts, params, seed)):
                stops[i] = smp.ids[:1] == [stop_token]
        return stops

    def _execute(self, live, plans, valid, turn, seed) -> dict[int, str]:
        # The tool input starts with `start`: code_start for Python (config.yaml forces
        # "print(" so a 135M model writes one printed expression, not an uncalled def).
        starts = {i: self.cfg.code_start if self.tools[plans[i].tool].writes_code else "" for i in valid}
        prompts = []
        for i in valid:
            tool = self.tools[plans[i].tool]
            prompts.append(self.frozen.chat_ids(self.executor_system, EXECUTOR_USER.format(
                query=live[i].query, memory=live[i].memory.render(), tool=tool.name,
                sub_goal=plans[i].sub_goal or live[i].query), tool.input_prefix + starts[i]))
        stops = [self.tools[plans[i].tool].input_stops for i in valid]
        commands = {}
        for i, smp in zip(valid, self.frozen.sample(prompts, self.cfg.executor, seed, row_stops=stops)):
            commands[i] = (starts[i] + smp.text).strip()
            live[i].log.append({"module": "executor", "turn": turn, "tool": plans[i].tool, "output": commands[i]})
        return commands
