"""Probes of a planner's tool choice that run no rollouts: how far each question is from its
decision, and how question-specific a step on that decision is.

    python -m scripts.probe_tools --benchmark data/heldout.jsonl --tool-probs [--model CK]
    python -m scripts.probe_tools --benchmark data/heldout.jsonl --tool-gradients Local_Search,Python_Coder [--model CK]
    python -m scripts.probe_tools --benchmark data/paraphrase.jsonl --check

--tool-probs: each planner's turn-1 distribution over the tools, per task kind (what the
held-out accuracy hides: a question decided at 0.51 and one at 0.99 look the same there).
--tool-gradients A,B: how far a step that favours tool A over B on one task kind's
questions moves the other kinds' margins (why the default's two_step follows arithmetic:
docs/LOG.md). Both compare the frozen planner with, given --model, the trained one, print
a table and write OUT/tool_probs.json or OUT/tool_gradients.json.
--check: not the planner but the frozen verifier: after a search that found the fact, does
its check say what each lookup and two_step question still needs (a calculation on
two_step, nothing on lookup)? Accuracy per kind and the questions it gets wrong, printed and
written to OUT/check.json.
"""

import json
import re
import sys
from pathlib import Path

import torch

import eval as evaluation
from agentflow import Trajectory
from engine import prefill_prompts
from memory import Memory
from support.config import ConfigError
from support.datasets import Item
from support.optim import select_trainable
from support.sandbox import SandboxError


@torch.no_grad()
def first_tool_probs(agent, queries: list[str], max_turns: int | None = None, batch: int = 32) -> torch.Tensor:
    """pi_theta's choice of the first tool, read off without sampling: for each query's
    turn-1 state (empty memory), the softmax at temperature 1 over the first tokens of
    the tool names, the restriction the sampler applies to the action's first token.
    [n, K], columns in agent.tool_names order; the greedy planner takes the argmax."""
    T_max = max_turns or agent.cfg.max_turns
    tokens = [agent.first_token[n] for n in agent.tool_names]  # [K]
    if len(set(tokens)) < len(tokens):
        raise ValueError("two tools' names begin with the same token: the first token does not say "
                         "which tool the planner chose")
    out = []
    for i in range(0, len(queries), batch):
        prompts = [agent.planner_prompt(q, Memory(agent.cfg.memory_budget_chars, agent.cfg.result_chars), 1, T_max)
                   for q in queries[i:i + batch]]
        logits = prefill_prompts(agent.planner.model, prompts, agent.planner.pad_id)[0]  # [b, V]
        out.append(torch.softmax(logits.float()[:, tokens], dim=-1))  # [b, K]
    return torch.cat(out)


def tool_probs(planners: dict, items: list[Item], max_turns: int) -> dict:
    """Each planner's turn-1 distribution over the tools (first_tool_probs), per task kind:
    the mean probability of each tool and the share of questions where it is the greedy
    choice. {"tools", "planners": {label: {kind: {...}}}, "items": [...]}"""
    kinds = sorted({it.meta.get("task") or "all" for it in items})
    result = {"tools": [], "planners": {}, "items": [{"id": it.id, "task": it.meta.get("task", "")} for it in items]}
    for label, agent in planners.items():
        p = first_tool_probs(agent, [it.question for it in items], max_turns)  # [n, K]
        result["tools"] = agent.tool_names
        for row, probs in zip(result["items"], p.tolist()):
            row[label] = [round(x, 4) for x in probs]
        per = result["planners"][label] = {}
        for kind in kinds:
            rows = [k for k, it in enumerate(items) if (it.meta.get("task") or "all") == kind]
            q = p[rows]  # [n_kind, K]
            greedy = q.argmax(-1)  # [n_kind]
            per[kind] = {"n": len(rows), "mean": dict(zip(agent.tool_names, q.mean(0).tolist())),
                         "greedy": {n: (greedy == k).float().mean().item() for k, n in enumerate(agent.tool_names)}}
    return result


def print_tool_probs(probs: dict) -> None:
    tools = probs["tools"]
    print(f"\n{'planner':24s}{'kind':>12s}{'n':>5s}" + "".join(f"{t:>18s}" for t in tools))
    print(f"{'':41s}" + "".join(f"{'mean p / greedy':>18s}" for _ in tools))
    for label, per in probs["planners"].items():
        for kind, s in per.items():
            print(f"{label:24.24s}{kind:>12s}{s['n']:5d}" +
                  "".join(f"{s['mean'][t]:11.2f} / {s['greedy'][t]:4.2f}" for t in tools))


def tool_gradients(agent, items: list[Item], max_turns: int, train_layers: int, tools: tuple[str, str]) -> dict:
    """How question-specific the planner's update of its first tool is, per task kind.

    For each question q, the turn-1 margin m(q) = log p(A|q) - log p(B|q) (the softmax at
    temperature 1 over the tools' first tokens, as the sampler restricts it; A, B = `tools`)
    and its gradient g_q over the weights training updates (optim.select_trainable with
    `train_layers`). Each kind's questions are dealt alternately into two halves. A step
    along U_K = mean of g_q over the first half of kind K raises m on question q by
    eta * g_q . U_K to first order; on the second half of each kind J that is
    effect[K][J] = mean g_q . U_K, and ratio[K][J] = effect[K][J] / effect[K][K]. Ratios near
    1 everywhere say a step moves every kind's margin alike: training can then only shift
    the margins together, the boundary settles between the kinds whose rewards pull apart,
    and a kind keeps the side its starting margin puts it on. That is the default's
    two_step: its margin starts next to arithmetic's (docs/LOG.md, 2026-12-03). Gradients in
    the model's dtype, products in float32. {"tools", "kinds", "n", "margin", "effect", "ratio"}"""
    model = agent.planner.model
    params = select_trainable(model, train_layers)
    first = [agent.first_token[n] for n in agent.tool_names]  # the restricted softmax's ids
    a, b = agent.tool_names.index(tools[0]), agent.tool_names.index(tools[1])
    by_kind: dict[str, list[str]] = {}
    for it in items:
        by_kind.setdefault(it.meta.get("task") or "all", []).append(it.question)
    kinds = sorted(k for k, qs in by_kind.items() if len(qs) >= 2)
    margins: dict[str, list[float]] = {k: [] for k in kinds}  # m(q), both halves

    def grad(q: str, kind: str) -> torch.Tensor:
        """g_q, flat float32 [n_trained]; m(q) goes to margins[kind]."""
        ids = agent.planner_prompt(q, Memory(agent.cfg.memory_budget_chars, agent.cfg.result_chars), 1, max_turns)
        model.zero_grad(set_to_none=True)
        with torch.enable_grad():
            logits = model(torch.tensor([ids], device=agent.planner.device)).logits[0, -1, first]  # [K]
            lp = torch.log_softmax(logits.float(), dim=-1)  # [K]
            (lp[a] - lp[b]).backward()
        margins[kind].append((lp[a] - lp[b]).item())
        return torch.cat([p.grad.float().flatten() for p in params])  # [n_trained]

    update = {}  # U_K, [n_trained] each
    for kind in kinds:
        qs = by_kind[kind][0::2]
        update[kind] = sum(grad(q, kind) for q in qs) / len(qs)
    effect = {k: {} for k in kinds}
    for kind in kinds:
        qs = by_kind[kind][1::2]
        dots = torch.zeros(len(kinds))
        for q in qs:
            g = grad(q, kind)
            dots += torch.stack([g @ update[k] for k in kinds]).cpu()
        for k, d in zip(kinds, (dots / len(qs)).tolist()):
            effect[k][kind] = d
    model.zero_grad(set_to_none=True)
    return {"tools": list(tools), "kinds": kinds, "n": {k: len(by_kind[k]) for k in kinds},
            "margin": {k: sum(v) / len(v) for k, v in margins.items()}, "effect": effect,
            "ratio": {k: {j: effect[k][j] / effect[k][k] for j in kinds} for k in kinds}}


def print_tool_gradients(label: str, g: dict) -> None:
    kinds = g["kinds"]
    a, b = g["tools"]
    print(f"\n{label}: turn-1 margin log p({a}) - log p({b}), mean per kind: " +
          "   ".join(f"{k} {g['margin'][k]:+.2f}" for k in kinds))
    print("a step that raises it on the kind of the row moves each kind's margin (the row's own = 1):")
    print(f"{'':14s}" + "".join(f"{k:>12s}" for k in kinds))
    for k in kinds:
        print(f"{k:14.14s}" + "".join(f"{g['ratio'][k][j]:12.2f}" for j in kinds))


# What the check should say after a search on each kind: two_step still needs its
# multiplication (continue), a lookup is answered by the passage (stop).
CHECK_RIGHT = {"two_step": "continue", "lookup": "stop"}


def check_accuracy(agent, items: list[Item], tool: str = "Local_Search") -> dict:
    """The verifier's check at the point a two-step plan turns on: after turn 1 searched.

    For each lookup and two_step item, the memory a planner has after a correct search turn:
    one `tool` record whose result is the real tool's output for the question (BM25 on the
    question ranks the entity's passage first on the built-in suite: tests/test_tasks.py).
    Items whose result does not hold the fact (the gold answer, or on two_step a number that
    times the question's factor gives it) are counted apart as misses. The check is then
    asked exactly as the rollout asks it after turn 1 (AgentSystem._verify: the tool's output
    and the question; sub-goal and command are not in its prompt), at seed 0 (the default
    verifier is greedy: the seed does not matter).
    {"kinds": {kind: {"n", "right", "accuracy", "said"}}, "misses", "wrong": [...]}"""
    def holds_fact(it, output):
        found, gold = [int(x) for x in re.findall(r"\d+", output)], [int(g) for g in it.gold if g.isdigit()]
        factors = [int(x) for x in re.findall(r"\d+", it.question)] if it.meta.get("task") == "two_step" else [1]
        return any(n * k in gold for n in found for k in factors)

    asked, trajs, misses = [], [], []
    for it in items:
        if it.meta.get("task") not in CHECK_RIGHT:
            continue
        res = agent.tools[tool].run(it.question)
        if res.error or not holds_fact(it, res.output):
            misses.append(it.question)
            continue
        tr = Trajectory(it.question, Memory(agent.cfg.memory_budget_chars, agent.cfg.result_chars))
        tr.memory.add("", tool, it.question, res.output)
        asked.append(it)
        trajs.append(tr)
    verdicts = ["stop" if s else "continue" for s in (agent._verify(trajs, seed=0) if trajs else [])]
    result = {"kinds": {}, "misses": misses}
    for kind, right in CHECK_RIGHT.items():
        said = [v for it, v in zip(asked, verdicts) if it.meta["task"] == kind]
        n_right = said.count(right)
        result["kinds"][kind] = {"n": len(said), "right": n_right, "accuracy": n_right / len(said) if said else None,
                                 "said": {w: said.count(w) for w in ("stop", "continue")}}
    result["wrong"] = [{"task": it.meta["task"], "question": it.question, "said": v}
                       for it, v in zip(asked, verdicts) if v != CHECK_RIGHT[it.meta["task"]]]
    return result


def print_check(check: dict) -> None:
    print(f"\n{'kind':12s}{'n':>5s}{'right':>8s}{'accuracy':>10s}   the check should say")
    for kind, s in check["kinds"].items():
        acc = "-" if s["accuracy"] is None else f"{s['accuracy']:.3f}"
        print(f"{kind:12s}{s['n']:5d}{s['right']:8d}{acc:>10s}   {CHECK_RIGHT[kind]}")
    if check["misses"]:
        print(f"left out, the search did not find the fact: {len(check['misses'])}")
    for w in check["wrong"]:
        print(f"  wrong ({w['task']}, said {w['said']}): {w['question']}")


def main(argv=None) -> int:
    ap = evaluation.arguments("Probe a planner's choice of its first tool, or the verifier's check, without "
                              "rollouts.",
                              prog="python -m scripts.probe_tools")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--tool-probs", action="store_true", help="each planner's turn-1 probabilities over the "
                      "tools per task kind; writes OUT/tool_probs.json")
    what.add_argument("--tool-gradients", default="", metavar="A,B", help="how far a step that favours tool A over "
                      "B on one task kind's questions moves the others' (tool_gradients), e.g. "
                      "Local_Search,Python_Coder; writes OUT/tool_gradients.json")
    what.add_argument("--check", action="store_true", help="the frozen verifier's check after a search that "
                      "found the fact, per task kind: right = continue on two_step, stop on lookup; "
                      "writes OUT/check.json")
    args = ap.parse_args(argv)
    try:
        cfg, items, out = evaluation.load_run(args)
        pair = tuple(n.strip() for n in args.tool_gradients.split(",")) if args.tool_gradients else ()
        if pair and (len(pair) != 2 or pair[0] == pair[1] or not set(pair) <= set(cfg["agent"]["tools"])):
            raise ValueError(f"--tool-gradients takes two different tools of agent.tools "
                             f"({', '.join(cfg['agent']['tools'])}) as A,B; got {args.tool_gradients!r}")
        if args.check and "Local_Search" not in cfg["agent"]["tools"]:
            raise ValueError("--check asks the check after Local_Search, which agent.tools lacks")
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        agent = evaluation.build_agent(cfg, args.model)
    except SandboxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    planners = evaluation.planners(cfg, agent, args.model)
    max_turns = args.max_turns or cfg["eval"]["max_turns"]
    Path(out).mkdir(parents=True, exist_ok=True)
    if args.check:
        result = check_accuracy(agent, items)
        print_check(result)
        name = "check.json"
    elif args.tool_probs:
        result = tool_probs(planners, items, max_turns)
        print_tool_probs(result)
        name = "tool_probs.json"
    else:
        result = {label: tool_gradients(p, items, max_turns, cfg["train"]["train_layers"], pair)
                  for label, p in planners.items()}
        for label, g in result.items():
            print_tool_gradients(label, g)
        name = "tool_gradients.json"
    (Path(out) / name).write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {out}/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
