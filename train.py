"""Train the planner with Flow-GRPO, on-policy, inside the live agent loop.

    python train.py config.yaml [key=value ...]      e.g. train.steps=2 out_dir=runs/try
    python train.py config.yaml [key=value ...] --plan    print the memory plan only
    torchrun --nproc_per_node K train.py config.yaml [...]  K processes, one device each (README)

Paper, section 2. One step, top to bottom in `train_step` below:

    1. draw Q queries and repeat each G times;
    2. rollout: all Q*G trajectories run the four-module loop in lockstep, the planner
       sampling from the CURRENT weights (agentflow.AgentSystem.rollout);
    3. judge: one 0/1 reward R_i per trajectory from its final answer (judge.py); a
       trajectory whose tool failed for infrastructure reasons (tools.py) is left out,
       never scored 0 (kept_rows);
    4. advantage: A_i normalised over the G rollouts of the same query, broadcast to every
       planner turn of trajectory i (flow_grpo.group_advantages, build_rows);
    5. update: the clipped, KL-penalised Flow-GRPO loss over planner tokens only, AdamW
       (flow_grpo.policy_update). The next step samples from the updated weights.

Everything a run makes lands in out_dir: metrics.jsonl (one row per step),
trajectories/step_N.jsonl (every rollout, for the report), eval/ (held-out
evaluations), checkpoints/step_N/ (the newest only: Hugging Face format +
trainer_state.pt) and learning.json (held-out before vs after). A run that is
interrupted resumes from its checkpoint and reaches the same weights as one that was
not: data order, sampling seeds and mini-batch order are all functions of (seed, step).

Before any weight is loaded, the memory plan (memory_plan.py) is printed, and a run that
cannot fit `model.memory_gb` stops there, naming the knob to turn.

Under torchrun (ranks.py) each rank rolls out its share of the step's queries, by whole
groups, with a seed of its own (rollout_seed); the row weights count the whole step's
kept groups, the gradients are summed over ranks before clipping, and every rank takes
the same optimizer step. Rank 0 alone writes, with metrics over all ranks. Without
torchrun (or with one rank) none of this runs: the one-process code is unchanged.

What we simplify against the official code: no Ray / vLLM / verl, only torch's own
runtime for several devices; the reference policy is the frozen initial weights (sharing
the policy's frozen part), which also run the executor, verifier and generator.
"""

import json
import os
import random
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from support import ranks
from agentflow import LLM, AgentSystem, agent_config
from support.datasets import load_benchmark
from support.config import ConfigError, load_config, preflight
from eval import evaluate
from flow_grpo import LossConfig, build_rows, group_advantages, policy_update
from judge import Judge, judge_counts
from support.device_memory import PlanError, plan_for
from support.optim import frozen_reference, make_optimizer, select_trainable
from support.provenance import note_run, record_run
from support.report.page import write_report
from support.sandbox import SandboxError
from support.models import load_model
from tools import build_tools, check_toolset


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__.split("\n\n")[1])
        return 2
    plan_only = "--plan" in argv
    argv = [a for a in argv if a != "--plan"]
    try:
        cfg = load_config(argv[0], argv[1:])
        if plan_only:  # the model's config.json is all it reads: no data, no tools, no weights
            try:
                plan = plan_for(cfg, ranks=ranks.env_size())
            except OSError as e:  # no config.json there, or a hub id without network
                print(f"error: cannot read the config.json of model.name={cfg['model']['name']}: {e}", file=sys.stderr)
                return 2
            print(plan.text())
            return 0 if plan.fits else 3
        preflight(cfg)  # data paths, model name, judge: before minutes of model loading
        check_toolset(cfg)  # tool names and settings, their keys, corpus, contact
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    # Fewer, larger blocks of GPU memory: the plan's slack assumes the allocator can reuse
    # freed cache and activations for tensors of other sizes (no effect on a CPU).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        run(cfg)
    except SandboxError as e:  # raised only while the tools are built: this machine cannot run them
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PlanError as e:
        print(f"memory plan error: {e}", file=sys.stderr)
        return 3
    finally:
        ranks.shutdown()  # under torchrun: leave the process group (nothing without it)
    return 0


def run(cfg: dict) -> dict:
    """The whole job: build everything, (resume,) evaluate, train, evaluate, report."""
    started = time.time()
    world = ranks.init(cfg["model"]["device"])  # ranks.SINGLE without torchrun
    out = Path(cfg["out_dir"])
    if world.main:  # rank 0 alone writes; the others may run on machines that cannot see out_dir
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        run_entry = record_run(out, cfg)  # run.json: seed, commit, versions, CPU, threads; wall time at exit
    t = cfg["train"]
    seed_everything(cfg["seed"])  # the same on every rank: the ranks' own seeds are rollout_seed's
    if cfg["model"]["threads"]:
        torch.set_num_threads(cfg["model"]["threads"])

    # The memory plan, from the model's config.json: a run that cannot fit stops here.
    # Each rank holds all of it, for its share of the rollouts.
    plan = plan_for(cfg, ranks=world.size)
    if world.main:
        print(plan.text(), flush=True)
    if not plan.fits:
        raise PlanError("; ".join(plan.problems))
    # The tools first: where the Python sandbox cannot work, the run stops before the model loads.
    tools = build_tools(cfg["agent"]["tools"], cfg["tools"])
    # The policy pi_theta (trainable planner) and the frozen initial weights, which are
    # pi_ref for the KL term and also run the executor, verifier and generator. The
    # reference shares the policy's frozen weights and copies only the trained ones.
    with world.local_first():  # the default model's one-time conversion: once per machine
        model, tok = load_model(cfg["model"]["name"], cfg["model"]["device"], cfg["model"]["dtype"])
    params = select_trainable(model, t["train_layers"])
    ref = frozen_reference(model, params)
    # AdamW; with bf16 weights it steps fp32 masters (optim.py), and so does the schedule.
    optimizer, masters = make_optimizer(params, t["lr"], t["weight_decay"])
    warm = max(1, t["warmup_steps"] * t["epochs"] * t["minibatches"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / warm))
    with world.local_first():  # the decode step measured once per machine, the other ranks read it
        planner, frozen = LLM(model, tok), LLM(ref, tok)
    world.agree_decode([planner, frozen])  # and rank 0's choice on every machine
    if world.main:  # a run's sample path depends on it: run.json says which it was
        note_run(out, run_entry, decode=planner.decode_name)
    for llm in (planner, frozen):  # the sampler's sub-batches and prefill forwards stay inside the plan
        llm.sub_batch_bytes, llm.prefill_tokens = plan.sub_batch_bytes, plan.prefill_tokens
    agent = AgentSystem(planner, frozen, tools, agent_config(cfg["agent"]))
    judge = Judge.from_config(cfg["judge"], engine=agent.frozen)  # rules, then the LLM if judge.llm
    train_items = load_benchmark(cfg["data"]["train"])
    heldout = load_benchmark(cfg["data"]["heldout"], limit=cfg["eval"]["limit"] or None)

    start = resume(out, model, optimizer, scheduler, masters, world) if cfg["resume"] else 0
    if start and world.main:
        print(f"resumed from {out}/checkpoints/step_{start}", flush=True)
    e = cfg["eval"]

    def held_out_eval(step: int) -> dict:
        try:
            return evaluate(agent, heldout, out / "eval" / f"step_{step}", batch_size=e["batch_size"],
                            max_turns=e["max_turns"], seed=e["seed"], planner_temperature=e["planner_temperature"],
                            desc=f"held-out eval @ step {step}", judge=judge, world=world)
        except torch.OutOfMemoryError as err:  # the plan was wrong for this machine: say so, stop
            raise PlanError(f"out of memory during the held-out evaluation at step {step} ({err}); "
                            f"the plan was:\n{plan.text()}\nlower model.memory_gb (the sampler then runs "
                            f"smaller sub-batches) or model.prefill_tokens") from err

    before = held_out_eval(0) if t["eval_before_after"] else None
    bar = tqdm(range(start, t["steps"]), initial=start, total=t["steps"], desc="train", unit="step",
               disable=not world.main)
    for step in bar:
        try:
            metrics = train_step(cfg, step, agent, model, ref, optimizer, scheduler, train_items, tok, out, judge,
                                 masters=masters, update_tokens=plan.update_tokens, world=world)
        except torch.OutOfMemoryError as err:
            raise PlanError(f"out of memory in training step {step + 1} ({err}); the plan was:\n{plan.text()}\n"
                            f"lower model.memory_gb, train.micro_batch or model.prefill_tokens") from err
        if t["eval_every"] and (step + 1) % t["eval_every"] == 0 and step + 1 < t["steps"]:
            metrics["heldout_accuracy"] = held_out_eval(step + 1)["accuracy"]
        if not world.main:
            continue  # the same weights as rank 0's (tests/test_dist.py): nothing of its own to save
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        bar.set_postfix(reward="-" if metrics["reward_mean"] is None else f"{metrics['reward_mean']:.2f}",
                        kl="-" if metrics["kl"] is None else f"{metrics['kl']:.4f}", tools=metrics["top_tool"])
        if (step + 1) % t["save_every"] == 0 or step + 1 == t["steps"]:
            save_checkpoint(out, step + 1, model, tok, optimizer, scheduler, masters)
            refresh_report(out)

    result = {"before": before}
    if t["eval_before_after"]:
        result["after"] = held_out_eval(t["steps"])
        # What reproduces the table; wall_s is this process's time (a resumed run's own part).
        result["run"] = {"seed": cfg["seed"], "steps": t["steps"], "eval_seed": e["seed"],
                         "wall_s": round(time.time() - started, 1)}
        if world.size > 1:
            result["run"]["ranks"] = world.size
        if world.main:
            (out / "learning.json").write_text(json.dumps(result, indent=2) + "\n")
            print_learning_table(result)
    if world.main:
        print(f"report: {refresh_report(out)}")
    return result


def refresh_report(out: Path):
    """Rewrite out_dir/report.html; a report that cannot be written never stops training."""
    try:
        return write_report(out)
    except OSError as e:
        print(f"warning: could not write the report: {e}", file=sys.stderr)
        return None


def train_step(cfg, step, agent, model, ref, optimizer, scheduler, items, tok, out, judge=None, masters=None,
               update_tokens: int = 0, world=ranks.SINGLE) -> dict:
    """One Flow-GRPO step: draw -> rollout -> judge -> advantage -> update. Under torchrun
    this rank takes its share of the queries (whole groups); the metrics row it returns,
    the same on every rank, is the whole step's."""
    t, G = cfg["train"], cfg["train"]["group_size"]
    # All Q queries, the same on every rank.
    queries = draw_queries(items, step, t["queries_per_step"], cfg["seed"], t["equal_task_shares"])
    seed = cfg["seed"] * 1_000_003 + step
    part = world.shard(len(queries))  # this rank's groups (all of them in one process)
    mine = queries[part.start:part.stop]

    # 2. Rollout: this rank's groups in lockstep; copies of a query are consecutive (a group).
    t0 = time.time()
    hits_before = sum(tool.cache.hits for tool in agent.tools.values() if tool.cache)
    sub_batches = agent.planner.sub_batches_run + agent.frozen.sub_batches_run
    trajs = agent.rollout([it.question for it in mine for _ in range(G)], seed=rollout_seed(seed, world.rank))
    sub_batches = agent.planner.sub_batches_run + agent.frozen.sub_batches_run - sub_batches  # sampler sub-batches (> calls when memory-bound)
    t1 = time.time()

    # 3. Judge: R_i in {0, 1} from the final answer alone. A judge that fails gives 0, never 1.
    #    A trajectory whose tool failed for infrastructure reasons (after retries: a quota,
    #    an outage, a missing key; tools.ToolResult.infra) is not judged: its outcome says
    #    how the network did, not how the policy did. Its reward stays None.
    infra = [sum(r.infra for r in tr.memory.records) for tr in trajs]  # failed tool calls per trajectory
    judged = [k for k in range(len(trajs)) if not infra[k]]
    verdicts = (judge or Judge()).score_batch([trajs[k].answer for k in judged], [mine[k // G] for k in judged])
    for tr in trajs:
        tr.reward = None
    for k, v in zip(judged, verdicts):
        trajs[k].reward = float(v["correct"])
    rewards = [trajs[k].reward for k in judged]
    t2 = time.time()

    # 4. Advantage A_i over each group, broadcast to every planner turn of trajectory i;
    #    J's mean over queries runs over the groups kept on all ranks.
    usable = [not n for n in infra]
    n_kept = sum(world.all_gather(len(kept_groups(usable, G))))
    rows, groups = kept_rows(trajs, usable, G, t["advantage_mode"], n_groups=n_kept)
    any_rows = sum(world.all_gather(len(rows))) > 0  # on some rank: then every rank takes the step

    # 5. Update on planner tokens only, scored under the very SamplingParams the planner
    #    sampled with (temperatures, tool restriction), with pi_old from the trainer's own
    #    forward at the weights that sampled: exactly on-policy in any dtype. Every rank
    #    takes part, with or without rows of its own: the gradient is summed over all.
    lr = scheduler.get_last_lr()[0]  # what this step updates with (the scheduler moves on after it)
    upd = {"loss": None, "kl": None, "clip_frac": None, "entropy": None, "grad_norm": None, "logprob_gap": None,
           "planner_tokens": 0, "optimizer_steps": 0}
    if any_rows:
        upd = policy_update(model, ref, optimizer, rows, agent.planner_params,
                            LossConfig(t["eps_low"], t["eps_high"], t["beta"], t["kl_estimator"]), agent.planner.pad_id,
                            epochs=t["epochs"], minibatches=t["minibatches"], max_grad_norm=t["max_grad_norm"],
                            seed=seed, scheduler=scheduler, masters=masters, micro_batch=t["micro_batch"],
                            max_tokens=update_tokens, chunk=t["logits_chunk"], world=world)
    t3 = time.time()

    verdict_of = dict(zip(judged, verdicts))
    lines = [json.dumps({"group": part.start + k // G, "id": mine[k // G].id, "task": mine[k // G].meta.get("task", ""),
                         "gold": mine[k // G].gold, "judge": verdict_of.get(k, {}).get("judge", ""),
                         "infra_failures": infra[k], **tr.to_dict()}) + "\n" for k, tr in enumerate(trajs)]
    lines = world.gather(lines)  # every rank's, in rank order: the groups in query order
    if world.main:
        with open(_mkdir(out / "trajectories") / f"step_{step + 1}.jsonl", "w") as f:
            f.writelines(line for rank_lines in lines for line in rank_lines)

    # The metrics row from what every rank saw, concatenated in rank order (= query order),
    # so each figure is the one a process with all of these rollouts would compute.
    hits = sum(tool.cache.hits for tool in agent.tools.values() if tool.cache) - hits_before
    parts = world.all_gather({
        "rewards": rewards, "group_rewards": [[trajs[k].reward for k in g] for g in groups],
        "turns": [len(tr.turns) for tr in trajs], "tools": [tr.tools_used for tr in trajs], "infra": infra,
        "model_errors": sum(1 for tr in trajs for r in tr.memory.records if r.tool and r.error and not r.infra),
        "verdicts": [{k: v[k] for k in ("judge", "judge_error") if k in v} for v in verdicts],
        "hits": hits, "sub_batches": sub_batches, "times": (t1 - t0, t2 - t1, t3 - t2)})
    every = lambda key: [x for p in parts for x in p[key]]
    rewards, group_rewards, turns = every("rewards"), every("group_rewards"), every("turns")
    tool_calls = Counter(tool for used in every("tools") for tool in used)
    n_calls = sum(tool_calls.values())
    model_errors = sum(p["model_errors"] for p in parts)
    times = [max(p["times"][j] for p in parts) for j in range(3)]  # a step waits for its slowest rank
    if not any_rows and world.main:
        print(f"warning: step {step + 1}: no group kept two rollouts free of infrastructure failures "
              f"({sum(map(bool, every('infra')))} of {len(turns)} hit one); no update", file=sys.stderr)
    return {"step": step + 1, "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "accuracy": sum(r > 0 for r in rewards) / len(rewards) if rewards else None,
            "zero_variance_groups": (sum(len(set(rs)) == 1 for rs in group_rewards) / len(group_rewards)
                                     if group_rewards else None),
            "mean_turns": sum(turns) / len(turns),
            "tool_shares": {k: v / n_calls for k, v in sorted(tool_calls.items())},
            "top_tool": tool_calls.most_common(1)[0][0] if tool_calls else "-",
            # the model's tool-call errors; failures of the infrastructure are counted apart
            "tool_error_rate": model_errors / n_calls if n_calls else 0.0,
            "infra_failures": sum(every("infra")), "excluded_trajectories": len(turns) - sum(map(len, group_rewards)),
            "excluded_groups": len(queries) - len(group_rewards),
            "tool_cache_hits": sum(p["hits"] for p in parts),  # each rank has its own cache
            "judge": judge_counts(every("verdicts")), **upd, "lr": lr,
            "sampler_sub_batches": sum(p["sub_batches"] for p in parts),
            "time_rollout": times[0], "time_judge": times[1], "time_update": times[2]}


# Rank r's rollouts draw from seed + r * RANK_SEED_STRIDE: rank 0's is the one-process
# seed, and no rank's stream is another step's (step seeds differ by 1 per step).
RANK_SEED_STRIDE = 2 ** 32


def rollout_seed(step_seed: int, rank: int) -> int:
    """The seed of rank `rank`'s rollout in the step seeded `step_seed` (train_step)."""
    return step_seed + rank * RANK_SEED_STRIDE


def kept_groups(usable: list[bool], G: int) -> list[list[int]]:
    """The trajectory indices of each group an update may use: its usable rollouts, if at
    least 2 (copies of a query are consecutive, G to a group)."""
    groups = [[k for k in range(q, q + G) if usable[k]] for q in range(0, len(usable), G)]
    return [g for g in groups if len(g) >= 2]


def kept_rows(trajs, usable: list[bool], G: int, mode: str = "trajectory", n_groups: int | None = None):
    """(rows, groups): the training rows of what an update may use, and the trajectory
    indices of each group kept; sets each trajectory's advantage (None if left out).
    Copies of a query are consecutive, G to a group.

    A trajectory that is not usable (an infrastructure failure) is left out, and its group's
    advantages are normalised over the rollouts that remain: those are still independent
    samples of pi_theta on that query, so A_i = (R_i - mean) / (std + eps) over them is the
    paper's advantage for a group of that size. A group left with fewer than 2 is dropped
    whole: one rollout alone has A = R - mean = 0 and would bring only its KL term, on a
    query the others no longer weigh. J's averages then run over what remains: the row
    weight is 1 / (Q' * G_q * T_i), for Q' groups kept and G_q rollouts kept in group q
    (the 1/G average within each query, then the mean over queries), which is build_rows'
    1 / (N * T_i) exactly when nothing is left out. n_groups: Q' when `trajs` are one
    rank's share of the step (the groups kept on all ranks); by default the groups here."""
    groups = kept_groups(usable, G)
    Q_kept = len(groups) if n_groups is None else n_groups
    for tr in trajs:
        tr.advantage = None  # what is left out has none
    rows = []
    for g in groups:
        adv = group_advantages([trajs[k].reward for k in g], len(g), [len(trajs[k].turns) for k in g], mode)
        for k, a in zip(g, adv):
            trajs[k].advantage = a
            turn_rows = build_rows([trajs[k]], [a])  # its T_i planner turns, A_i broadcast to each
            for row in turn_rows:
                row.weight = 1.0 / (Q_kept * len(g) * len(turn_rows))
            rows += turn_rows
    return rows, groups


def draw_queries(items: list, step: int, Q: int, seed: int, equal_shares: bool = False) -> list:
    """Queries step*Q .. step*Q+Q-1 of an endless stream of seeded, stratified shuffles.

    Stratified: each epoch shuffles every task kind (item.meta["task"]) on its own and
    interleaves the kinds in proportion, so any Q consecutive queries hold each kind in
    about its share of the data. With plain shuffling and Q = 8, one step can draw six
    arithmetic queries and no lookup; the update then pushes every question towards
    one tool and the next step swings back (we saw this on the default run). Data
    without a task field is one kind, i.e. a plain shuffle. A resumed run draws the same
    stream: it depends only on (seed, position).

    equal_shares (train.equal_task_shares): the kinds take turns instead, so each holds
    1/K of every step whatever its share of the data; each kind runs through its own
    shuffles, a small kind's sooner. The default's two-step questions are 20% of its
    data, one or two a step; in equal shares, three (measured in docs/LOG.md)."""
    by_kind = _by_kind(items)
    kinds = sorted(by_kind)
    out = []
    for k in range(step * Q, step * Q + Q):
        if equal_shares:
            idx = by_kind[kinds[k % len(kinds)]]
            epoch, pos = divmod(k // len(kinds), len(idx))
            order = list(idx)
            random.Random(f"{seed}/{kinds[k % len(kinds)]}/{epoch}").shuffle(order)
            out.append(items[order[pos]])
        else:
            epoch, pos = divmod(k, len(items))
            out.append(items[_epoch_order(by_kind, seed, epoch)[pos]])
    return out


def _by_kind(items: list) -> dict[str, list[int]]:
    by_kind: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        by_kind.setdefault(getattr(it, "meta", {}).get("task", ""), []).append(i)
    return by_kind


def _epoch_order(by_kind: dict[str, list[int]], seed: int, epoch: int) -> list[int]:
    rng = random.Random(seed * 7919 + epoch)
    keyed = []  # (place in [0, 1) within its kind's shuffled list, item index)
    for kind in sorted(by_kind):
        idx = list(by_kind[kind])
        rng.shuffle(idx)
        keyed += [((j + rng.random()) / len(idx), i) for j, i in enumerate(idx)]
    return [i for _, i in sorted(keyed)]


# ----------------------------------------------------------------------------------------
# Checkpoints: what transformers loads (the model, save_pretrained, and its tokenizer) and
# what a resume needs (trainer_state.pt: optimizer state, fp32 masters, schedule, RNG), no
# more; only the newest. Written to a temporary folder and renamed, so a crash mid-write
# never leaves a checkpoint that looks complete; the older one goes only after that.


def save_checkpoint(out: Path, step: int, model, tok, optimizer, scheduler, masters=None) -> Path:
    ckdir = _mkdir(out / "checkpoints")
    final = ckdir / f"step_{step}"
    tmp = ckdir / f".tmp_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "masters": masters.state_dict() if masters is not None else None,
                "rng": rng_state()}, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old_step, path in _checkpoints(out):
        if old_step != step:
            shutil.rmtree(path)
    return final


def resume(out: Path, model, optimizer, scheduler, masters=None, world=ranks.SINGLE) -> int:
    """Load the latest complete checkpoint; return its step (0 if there is none).

    Under torchrun every rank loads the checkpoint rank 0 found (it wrote it), from
    out_dir, which every rank must therefore see (one machine, or a shared filesystem);
    a rank that cannot stops the run, on every rank, rather than train from other weights."""
    cks = sorted(_checkpoints(out)) if world.main else []
    step = world.broadcast(cks[-1][0] if cks else 0)
    if not step:
        return 0
    path = out / "checkpoints" / f"step_{step}"
    blind = [r for r, ok in enumerate(world.all_gather((path / "trainer_state.pt").exists())) if not ok]
    if blind:
        raise RuntimeError(f"rank(s) {blind} cannot read {path}, the checkpoint rank 0 resumes from: under "
                           f"torchrun out_dir must be a folder every rank sees (a shared filesystem)")
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=next(model.parameters()).dtype)
    model.load_state_dict(loaded.state_dict())
    del loaded
    # Onto the CPU first: saved from rank 0's GPU, the tensors would otherwise all land on
    # GPU 0 on every rank; load_state_dict moves them to each weight's device.
    state = torch.load(path / "trainer_state.pt", weights_only=False, map_location="cpu")
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if masters is not None:  # the fp32 weights the bf16 checkpoint is a rounding of
        if state.get("masters") is None:
            raise RuntimeError(f"{path} holds no fp32 master weights; it was not written by a bf16 run")
        masters.load_state_dict(state["masters"])
    set_rng_state(state["rng"])  # rank 0's; every rank seeded the same and draws from its own generators
    # Metrics rows written after this checkpoint belong to steps that will run again.
    metrics = out / "metrics.jsonl"
    if world.main and metrics.exists():
        rows = [r for r in metrics.read_text().splitlines() if r.strip() and json.loads(r)["step"] <= step]
        metrics.write_text("".join(r + "\n" for r in rows))
    return step


def _checkpoints(out: Path) -> list[tuple[int, Path]]:
    ckdir = out / "checkpoints"
    if not ckdir.exists():
        return []
    return [(int(p.name.split("_")[1]), p) for p in ckdir.glob("step_*")
            if (p / "trainer_state.pt").exists()]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def print_learning_table(result: dict) -> None:
    """The before/after table of learning.json: accuracy, tool shares per task kind,
    tool-call error rate, mean turns, and per kind the mean turns and the commonest plans."""
    b, a = result["before"], result["after"]
    blocks = [("overall", b, a)] + [(k, b["by_kind"][k], a["by_kind"][k]) for k in sorted(a.get("by_kind", {}))]
    print(f"\nHeld-out, frozen planner (before) vs Flow-GRPO planner (after)")
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
