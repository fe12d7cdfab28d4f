"""What a training run writes as it goes: at its start config.json, run.json and the memory
plan (start_run), each step's trajectories and metrics row, the report, the before/after
table (learning.json). Under torchrun rank 0 alone writes, and every figure is
computed from all ranks' rollouts, concatenated in rank order (= query order), so it is
the one a single process with all of those rollouts would compute.

    out_dir/trajectories/step_N.jsonl   every rollout of step N: memory, reward, advantage
    out_dir/metrics.jsonl               one row per step (the README lists its fields)
    out_dir/report.html                 rewritten at every checkpoint and at the end
"""

import json
import sys
from collections import Counter
from pathlib import Path

import torch

from support import ranks
from support.device_memory import Plan, PlanError, device_peaks, plan_for
from support.provenance import record_run
from support.ranks import SINGLE
from support.report.page import write_report
from support.seeds import seed_everything


def start_run(cfg: dict, web_tools) -> tuple[ranks.World, Path, Plan]:
    """A training run's start, before anything is built: the ranks, out_dir's config.json and
    run.json (support/provenance.py), the seeds and threads, and the memory plan from the
    model's config.json (web_tools(cfg): the tools that call the web, tools.network_tools),
    printed; a run that cannot fit stops here (PlanError). (world, out_dir, plan)."""
    world = ranks.init(cfg["model"]["device"])  # ranks.SINGLE without torchrun
    out = Path(cfg["out_dir"])
    if world.main:  # rank 0 alone writes; the others may run on machines that cannot see out_dir
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        record_run(out, cfg)  # run.json: seed, commit, versions, CPU, threads; wall time at exit
    seed_everything(cfg["seed"])  # the same on every rank: the ranks' own seeds are derived from it
    if cfg["model"]["threads"]:
        torch.set_num_threads(cfg["model"]["threads"])
    # Each rank plans for all of the run but its share of the rollouts.
    plan = plan_for(cfg, ranks=world.size, web_tools=web_tools(cfg))
    if world.main:
        print(plan.text(), flush=True)
    if not plan.fits:
        raise PlanError("; ".join(plan.problems))
    cfg["train"]["micro_batch"] = plan.micro_batch  # "auto": the plan's choice
    return world, out, plan


def engine_counters(agent) -> tuple[int, int]:
    """(tool replies answered from a cache, sampler sub-batches run) so far, over the
    agent's tools and both engines: a step's own are the difference (step_metrics)."""
    hits = sum(tool.cache.hits for tool in agent.tools.values() if tool.cache)
    return hits, agent.planner.sub_batches_run + agent.frozen.sub_batches_run


def infra_failures(traj) -> int:
    """Tool calls of a trajectory that failed for infrastructure reasons (tools.ToolResult.infra)."""
    return sum(r.infra for r in traj.memory.records)


def write_trajectories(out: Path, step: int, trajs, queries, G: int, first_group: int, verdicts,
                       world=SINGLE) -> None:
    """out_dir/trajectories/step_{step}.jsonl: every rollout of the step with its query's id,
    task kind, gold answer and who judged it; trajectory k of this rank is rollout k % G
    of query k // G, the step's query first_group + k // G."""
    lines = [json.dumps({"group": first_group + k // G, "id": queries[k // G].id,
                         "task": queries[k // G].meta.get("task", ""), "gold": queries[k // G].gold,
                         "judge": (verdicts[k] or {}).get("judge", ""),
                         "correct": None if verdicts[k] is None else bool(verdicts[k]["correct"]),
                         "infra_failures": infra_failures(tr),
                         **tr.to_dict()}) + "\n" for k, tr in enumerate(trajs)]
    lines = world.gather(lines)  # every rank's, in rank order: the groups in query order
    if world.main:
        folder = out / "trajectories"
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / f"step_{step}.jsonl", "w") as f:
            f.writelines(line for rank_lines in lines for line in rank_lines)


def step_metrics(step: int, trajs, verdicts, groups, n_queries: int, update: dict, lr: float, times: tuple,
                 counters_before: tuple[int, int], agent, world=SINGLE) -> dict:
    """The metrics row of a step, the same on every rank: rewards, their terms and the
    accuracy (the judge's verdicts) of the judged rollouts, groups without signal, turns,
    tool shares and errors, what infrastructure failures kept out of the update, the
    judges, the update's statistics, times (a step waits for its slowest rank)."""
    hits, sub_batches = (now - before for now, before in zip(engine_counters(agent), counters_before))
    per_rank = world.all_gather({
        "rewards": [tr.reward for tr in trajs if tr.reward is not None],
        "correct": [bool(v["correct"]) for v in verdicts if v is not None],
        "terms": [tr.reward_terms for tr in trajs if tr.reward is not None],
        "group_rewards": [[trajs[k].reward for k in g] for g in groups],
        "turns": [len(tr.turns) for tr in trajs], "tools": [tr.tools_used for tr in trajs],
        "infra": [infra_failures(tr) for tr in trajs],
        "model_errors": sum(1 for tr in trajs for r in tr.memory.records if r.tool and r.error and not r.infra),
        "verdicts": [{k: v[k] for k in ("judge", "judge_error") if k in v} for v in verdicts if v is not None],
        "hits": hits, "sub_batches": sub_batches, "times": times, "gpu": device_peaks()})
    every = lambda key: [x for p in per_rank for x in p[key]]
    rewards, group_rewards, turns = every("rewards"), every("group_rewards"), every("turns")
    correct, terms = every("correct"), every("terms")
    tool_calls = Counter(tool for used in every("tools") for tool in used)
    n_calls = sum(tool_calls.values())
    model_errors = sum(p["model_errors"] for p in per_rank)
    times = [max(p["times"][j] for p in per_rank) for j in range(3)]
    if not update["optimizer_steps"] and world.main:
        print(f"warning: step {step + 1}: no group kept two rollouts free of infrastructure failures "
              f"({sum(map(bool, every('infra')))} of {len(turns)} hit one); no update", file=sys.stderr)
    return {"step": step + 1, "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "accuracy": sum(correct) / len(correct) if correct else None,
            "reward_terms": {k: sum(t[k] for t in terms) / len(terms) for k in (terms[0] if terms else {})},
            "zero_variance_groups": (sum(len(set(rs)) == 1 for rs in group_rewards) / len(group_rewards)
                                     if group_rewards else None),
            "mean_turns": sum(turns) / len(turns),
            "tool_shares": {k: v / n_calls for k, v in sorted(tool_calls.items())},
            "top_tool": tool_calls.most_common(1)[0][0] if tool_calls else "-",
            # the model's tool-call errors; failures of the infrastructure are counted apart
            "tool_error_rate": model_errors / n_calls if n_calls else 0.0,
            "infra_failures": sum(every("infra")), "excluded_trajectories": len(turns) - sum(map(len, group_rewards)),
            "excluded_groups": n_queries - len(group_rewards),
            "tool_cache_hits": sum(p["hits"] for p in per_rank),  # each rank has its own cache
            "judge": judge_counts(every("verdicts")), **update, "lr": lr,
            "sampler_sub_batches": sum(p["sub_batches"] for p in per_rank),
            "time_rollout": times[0], "time_judge": times[1], "time_update": times[2],
            # the fullest card's peaks; expandable segments only where every card has them
            **{k: (min if k == "gpu_expandable_segments" else max)(p["gpu"][k] for p in per_rank)
               for k in per_rank[0]["gpu"]}}


def judge_counts(verdicts: list[dict]) -> dict:
    """How many verdicts each judge decided ("rule" or "llm"), and how many LLM calls gave
    no verdict (for metrics.jsonl and summary.json)."""
    return {"rule": sum(v.get("judge", "rule") == "rule" for v in verdicts),
            "llm": sum(v.get("judge") == "llm" for v in verdicts),
            "llm_failed": sum(bool(v.get("judge_error")) for v in verdicts)}


def append_metrics(out: Path, row: dict) -> None:
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def refresh_report(out: Path):
    """Rewrite out_dir/report.html; a report that cannot be written never stops training."""
    try:
        return write_report(out)
    except OSError as e:
        print(f"warning: could not write the report: {e}", file=sys.stderr)
        return None


def write_learning(out: Path, result: dict) -> None:
    """learning.json: held-out (and the paraphrase set, where it ran) before vs after; and its
    tables printed."""
    (out / "learning.json").write_text(json.dumps(result, indent=2) + "\n")
    print_learning_table(result)
    if "paraphrase" in result:
        print_learning_table(result["paraphrase"], "Paraphrase set (new wordings, never trained on)")


def print_learning_table(result: dict, title: str = "Held-out") -> None:
    """The before/after table of learning.json: accuracy, tool shares per task kind,
    tool-call error rate, mean turns, and per kind the mean turns and the commonest plans.
    `title` names the set (learning.json's "paraphrase" entry has the same two summaries)."""
    b, a = result["before"], result["after"]
    blocks = [("overall", b, a)] + [(k, b["by_kind"][k], a["by_kind"][k]) for k in sorted(a.get("by_kind", {}))]
    print(f"\n{title}, frozen planner (before) vs Flow-GRPO planner (after)")
    print(f"{'':22s}{'n':>4s}{'before':>9s}{'after':>9s}{'change':>9s}")
    for name, x, y in blocks:
        print(f"{'accuracy ' + name:22.22s}{y['n']:4d}{x['accuracy']:9.3f}{y['accuracy']:9.3f}"
              f"{y['accuracy'] - x['accuracy']:+9.3f}")
    for key, label in (("tool_error_rate", "tool-call errors"), ("mean_turns", "mean turns")):
        print(f"{label:22s}{'':4s}{b[key]:9.3f}{a[key]:9.3f}{a[key] - b[key]:+9.3f}")
    print("tool shares, before -> after:")
    for name, x, y in blocks:
        tools = sorted(set(x["tool_shares"]) | set(y["tool_shares"]))
        print(f"  {name:12s}" + "   ".join(f"{t} {x['tool_shares'].get(t, 0):.2f} -> {y['tool_shares'].get(t, 0):.2f}"
                                          for t in tools))
    # Whether the planner learned to plan over turns shows in the sequences of tools, per
    # kind: on the built-in suite a two_step question needs "Local_Search > Python_Coder".
    print("mean turns and plans (the tools in order: share of items), before -> after:")
    for name, x, y in blocks[1:] or blocks:
        xp, yp = x.get("plans", {}), y.get("plans", {})
        top = sorted(set(xp) | set(yp), key=lambda p: (-yp.get(p, 0), -xp.get(p, 0), p))[:3]
        print(f"  {name:12s}turns {x['mean_turns']:.2f} -> {y['mean_turns']:.2f}   "
              + "   ".join(f"{p} {xp.get(p, 0):.2f} -> {yp.get(p, 0):.2f}" for p in top))
