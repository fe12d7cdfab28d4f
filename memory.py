"""The evolving memory M of one trajectory (paper, section 1: M^{t+1} = f_mem(M^t, a^t, e^t, v^t)).

The paper replaces a growing hidden chain of thought with an explicit, structured,
deterministic record of each turn. Because the planner only ever sees (q, K, M^t),
every planner turn is a self-contained single-turn decision, and that is what makes
Flow-GRPO's reward broadcast valid (every turn can be trained as its own prompt ->
action pair). Two things follow for the code:

  * one Memory per trajectory, created fresh for each rollout and never shared
    (the official training workers never reset theirs, so earlier queries leak
    into later prompts);
  * rendering is a pure function of the records: the same records give the same
    bytes, so the prompt the sampler saw can be rebuilt exactly.

What we simplify: f_mem is "append one record"; nothing is summarised by an LLM.
Instead of pasting a raw dict repr with no limit (prompts of 18k tokens in the
official code), we render a compact text block and cap it:
  * each tool result is cut to `result_chars` when it is recorded, with a visible
    "...[cut N chars]" marker, so the reader knows text is missing;
  * the whole block is cut to `budget_chars` by dropping the OLDEST turns first
    (the latest evidence matters most to the next decision) and saying so.

What each module reads of M lives here too: the executor, the verifier and the generator
read Memory.render(); the planner reads a view of its own (PLANNER_VIEWS, named by
agent.planner_view), which a fork replaces like a reward term.
"""

from dataclasses import dataclass, field

from support.registry import Registry
from support.text import cut


EMPTY = "(empty: no tool has been used yet)"  # how an empty memory reads in a prompt
# What a record keeps of each field, in characters (a result: the memory's result_chars).
SUB_GOAL_CHARS, COMMAND_CHARS, ERROR_CHARS = 200, 300, 200


@dataclass
class TurnRecord:
    turn: int  # 1-based turn number t
    sub_goal: str  # what the planner wanted from this turn
    tool: str  # the tool the planner chose ("" when it named none)
    command: str  # the concrete call the executor wrote (code, a search query, ...)
    result: str  # the tool's output e^t, already cut to the memory's result budget
    error: str  # "" on success, else why the turn failed (bad plan, tool error, ...)
    verdict: str  # the verifier's v^t: "stop", "continue", or "" if it did not run
    # The tool failed for infrastructure reasons (network, quota, key; tools.ToolResult.infra),
    # not the model's: the trainer leaves the trajectory out instead of scoring it. Not rendered.
    infra: bool = False

    def render(self) -> str:
        lines = [f"Turn {self.turn}: {self.tool or 'no tool'} - {self.sub_goal or '(no sub-goal)'}"]
        if self.command:
            lines.append(f"  Command: {self.command}")
        if self.error:
            lines.append(f"  Error: {self.error}")
        if self.result:
            lines.append(f"  Result: {self.result}")
        return "\n".join(lines)


@dataclass
class Memory:
    budget_chars: int  # cap on the rendered block the planner/verifier/generator read
    result_chars: int  # cap on one tool result as stored
    records: list[TurnRecord] = field(default_factory=list)

    def add(self, sub_goal: str, tool: str, command: str, result: str, error: str = "",
            verdict: str = "", infra: bool = False) -> TurnRecord:
        """f_mem: append this turn's record. Deterministic: no clock, no randomness."""
        rec = TurnRecord(turn=len(self.records) + 1, sub_goal=cut(sub_goal.strip(), SUB_GOAL_CHARS), tool=tool,
                         command=cut(command.strip(), COMMAND_CHARS), result=cut(result.strip(), self.result_chars),
                         error=cut(error.strip(), ERROR_CHARS), verdict=verdict, infra=infra)
        self.records.append(rec)
        return rec

    def render(self) -> str:
        """The prompt block for M^t. Drops the oldest turns when over budget."""
        if not self.records:
            return EMPTY
        blocks = [r.render() for r in self.records]
        dropped = 0
        # Keep the newest turns whole; drop from the front until the block fits.
        while dropped < len(blocks) - 1 and _joined_len(blocks[dropped:], dropped) > self.budget_chars:
            dropped += 1
        text = "\n".join(blocks[dropped:])
        if dropped:
            text = f"[turns 1-{dropped} omitted]\n" + text
        # A single huge turn can still exceed the budget: cut it, visibly.
        return cut(text.strip(), self.budget_chars)


def _joined_len(blocks: list[str], dropped: int) -> int:
    header = len(f"[turns 1-{dropped} omitted]\n") if dropped else 0
    return header + sum(len(b) for b in blocks) + max(0, len(blocks) - 1)


# ----------------------------------------------------------------------------------------
# The planner's view of M^t: a registry, so that a fork can change what the policy reads
# without editing the core (@planner_view in a module listed in reward.modules).
# name -> fn(memory, tools: {name: tools.Tool}) -> the text the planner's prompt shows for M^t
PLANNER_VIEWS = Registry("agent.planner_view", "planner view", "memory.planner_view")


def planner_view(name: str):
    """Register fn(memory, tools) -> text as `name` (a decorator)."""
    return PLANNER_VIEWS.add(name)


@planner_view("found")
def found(memory: Memory, tools: dict) -> str:
    """One line per turn, what it did and what came back ("a search found: ..."), and after
    a turn the verifier continued, a line with what it found still open (v^t).

    The tool is named by what it did, not by its name: shown "Turn 1: Local_Search - ...",
    a 135M planner copies the last tool name into its reply and rarely samples a second
    step. The verifier's line: without it a trained planner searched again after a search
    on most two_step questions (docs/LOG.md)."""
    lines = []
    for r in memory.records:
        tool = tools.get(r.tool)
        lines.append(f"- {tool.found_as if tool else 'a step without a tool gave'}: {r.result or r.error}")
        if r.verdict == "continue":
            says = tool.check.continue_says if tool and tool.check else ""
            lines.append(f"- the check said: {says or 'the question is not answered yet'}")
    return cut("\n".join(lines), memory.budget_chars) if lines else "- nothing yet"


@planner_view("records")
def records(memory: Memory, tools: dict) -> str:
    """The whole memory block, as the other modules read it (Memory.render): the paper's
    planner reads M^t this way."""
    return memory.render()
