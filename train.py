"""Train the planner with Flow-GRPO, on-policy, inside the live agent loop.

    python train.py config.yaml [key=value ...]            e.g. train.steps=2 out_dir=runs/try
    python train.py config.yaml [key=value ...] --plan     print the memory plan only
    torchrun --nproc_per_node K train.py config.yaml [...]  K processes, one device each (docs/SCALING.md)

Paper, section 2. One step, top to bottom in `train_step` below:

    1. draw Q queries and repeat each G times;
    2. rollout: all Q*G trajectories run the four-module loop in lockstep, the planner
       sampling from the CURRENT weights (agentflow.AgentSystem.rollout);
    3. reward: one 0/1 reward R_i per trajectory from its final answer (judge.py); a
       trajectory whose tool failed for infrastructure reasons (tools.py) is left out,
       never scored 0;
    4. advantage: A_i normalised over the G rollouts of the same query, broadcast to every
       planner turn of trajectory i (flow_grpo.kept_rows);
    5. update: the clipped, KL-penalised Flow-GRPO loss over planner tokens only, AdamW
       (flow_grpo.policy_update). The next step samples from the updated weights.

Everything a run makes lands in out_dir: metrics.jsonl (one row per step),
trajectories/step_N.jsonl (every rollout), eval/ (held-out evaluations; the paraphrase
set's in eval/paraphrase/),
checkpoints/step_N/ (what a resume needs; the newest only), model/ (the trained planner,
whole, at the end), learning.json (held-out and paraphrase before vs after), run.json (where it ran)
and report.html. An interrupted run resumes from its checkpoint
and reaches the weights an uninterrupted one does: the data order and every seed are
functions of (seed, step) (support/seeds.py). It resumes under its own config only, but for
what may change on a resume (support/config.py, RESUMABLE); an out_dir that holds another run,
or this one under another config, is refused before any model loads.

Before any weight is loaded, the memory plan (support/device_memory.py) is printed, and
a run that cannot fit `model.memory_gb` stops there, naming the knob to turn.

Under torchrun (support/ranks.py) each rank rolls out its share of the step's queries, by
whole groups, with a seed of its own; the row weights count the whole step's kept groups,
the gradients are summed over ranks before clipping, and every rank takes the same
optimizer step. Rank 0 alone writes, with metrics over all ranks. Without torchrun none
of this runs: `world` is ranks.SINGLE, whose collectives return their input.

What we simplify against the official code: no Ray / vLLM / verl, only torch's own
runtime for several devices; the reference policy is the frozen initial weights (sharing
the policy's frozen part), which also run the executor, verifier and generator.
"""

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from agentflow import AgentSystem, agent_config, longest_prompts
from engine import LLM, checkpoint_blocks
from eval import check_eval_names, evaluate
from flow_grpo import ADVANTAGE_ESTIMATORS, LossConfig, UpdateConfig, frozen_reference, kept_rows, policy_update
from judge import TURN_SCORES, Judge, Reward
from lora import export, trained_weights
from support import ranks
from support.checkpoints import check_out_dir, resume, save_checkpoint
from support.config import ConfigError, check_run, load_config
from support.datasets import draw_queries, load_benchmark
from support.device_memory import Plan, PlanError, plan_for, use_expandable_segments
from support.models import load_model, planner_name, reference_needed
from support.optim import PlannerOptimizer
from support.run_log import (append_metrics, engine_counters, refresh_report, start_run, step_metrics,
                             write_learning, write_trajectories)
from support.sandbox import SandboxError
from support.seeds import derive_seed
from tools import build_tools, network_tools


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print(__doc__.split("\n\n")[1])
        return 2
    use_expandable_segments()  # before the plan or anything else touches CUDA
    plan_only = "--plan" in argv
    argv = [a for a in argv if a != "--plan"]
    try:
        cfg = load_config(argv[0], argv[1:])
        if plan_only:  # the model's config.json is all it reads: no data, no tools, no weights
            try:
                plan = plan_for(cfg, ranks=ranks.env_size(), web_tools=network_tools(cfg))
            except OSError as e:  # no config.json there, or a hub id without network
                print(f"error: cannot read the config.json of model.name={cfg['model']['name']}: {e}", file=sys.stderr)
                return 2
            print(plan.text())
            return 0 if plan.fits else 3
        check_run(cfg, check_train_names, longest_prompts=longest_prompts)  # data, ..., prompts, disk: all at once
        if ranks.env_main():  # rank 0's: the others could see it writing there; if it stops, torchrun stops them
            check_out_dir(cfg)  # out_dir is new, or this config's run to resume: no other run is overwritten
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"config error: {line}", file=sys.stderr)
        return 2
    try:
        run(cfg)
    except ConfigError as e:  # what only the model's tokenizer can show (agentflow.tool_first_tokens)
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except SandboxError as e:  # raised only while the tools are built: this machine cannot run them
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PlanError as e:
        print(f"memory plan error: {e}", file=sys.stderr)
        return 3
    except InfrastructureStop as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    finally:
        ranks.shutdown()  # under torchrun: leave the process group (nothing without it)
    return 0


def check_train_names(cfg: dict) -> list[str]:
    """What a training config names (support/config.check_run calls this beside its own
    checks, before minutes of loading): what an evaluation's names (eval.check_eval_names:
    training evaluates), the turn score (with credit per turn) and the advantage estimator."""
    problems = check_eval_names(cfg)
    if cfg["train"]["advantage_mode"] == "per_turn":
        TURN_SCORES.named(cfg["train"]["turn_score"])
    ADVANTAGE_ESTIMATORS.named(cfg["train"]["advantage"])
    return problems


def run(cfg: dict) -> dict:
    """The whole job: build everything (build_run), evaluate the untrained planner, resume
    if out_dir holds a checkpoint, the training loop, then evaluate and report (finish)."""
    started = time.time()
    r = build_run(cfg)
    t, out, world = cfg["train"], r.out, r.world
    # "Before" is the untrained planner's, so it runs before a resume loads trained weights
    # (a resumed run reads it back from eval/step_0; an unfinished one completes it).
    before = r.held_out_eval(0) if t["eval_before_after"] else None
    paraphrase_before = r.paraphrase_eval(0) if r.paraphrase else None
    start = resume(out, r.model, r.optimizer, world) if cfg["resume"] else 0
    if start and world.main:
        print(f"resumed from {out}/checkpoints/step_{start}"
              + (": nothing left to train (raise train.steps to go on)" if start == t["steps"] else ""),
              flush=True)
    bar = tqdm(range(start, t["steps"]), initial=start, total=t["steps"], desc="train", unit="step",
               disable=not world.main)
    dry = 0  # steps in a row that trained on nothing, the infrastructure's fault (tools or judge)
    for step in bar:
        with r.plan.guard(f"in training step {step + 1}"):
            metrics = train_step(cfg, step, r.agent, r.model, r.ref, r.optimizer, r.train_items, r.judge,
                                 r.reward, out, update_tokens=r.plan.update_tokens, world=world)
        failed = metrics["infra_failures"] or metrics["judge"]["llm_failed"]  # tools' or judge's
        dry = dry + 1 if not metrics["optimizer_steps"] and failed else 0
        if t["max_infra_steps"] and dry >= t["max_infra_steps"]:
            if world.main:
                append_metrics(out, metrics)
            raise InfrastructureStop(
                f"steps {step + 2 - dry}-{step + 1} trained on nothing: infrastructure failures "
                f"(network, keys, quotas) left no group two rollouts ({metrics['infra_failures']} "
                f"failed tool calls and {metrics['judge']['llm_failed']} failed judge calls in step "
                f"{step + 1}; their errors are in {out}/trajectories/step_{step + 1}.jsonl). Fix the "
                f"tools' or the judge's access, or set train.max_infra_steps=0 to go on regardless; "
                f"the run resumes from its last checkpoint")
        if t["eval_every"] and (step + 1) % t["eval_every"] == 0 and step + 1 < t["steps"]:
            metrics["heldout_accuracy"] = r.held_out_eval(step + 1)["accuracy"]
        if not world.main:
            continue  # rank 0's weights (tests/test_dist.py): nothing of its own to save
        append_metrics(out, metrics)
        bar.set_postfix(reward="-" if metrics["reward_mean"] is None else f"{metrics['reward_mean']:.2f}",
                        kl="-" if metrics["kl"] is None else f"{metrics['kl']:.4f}",
                        tools=metrics["top_tool"])
        if (step + 1) % t["save_every"] == 0 or step + 1 == t["steps"]:
            save_checkpoint(out, step + 1, r.model, r.optimizer)  # what a resume needs
            refresh_report(out)
    return finish(r, before, paraphrase_before, started)


@dataclass
class Run:
    """What a run is made of (build_run), shared by the loop and the evaluations."""
    cfg: dict
    world: ranks.World  # ranks.SINGLE without torchrun
    out: Path  # out_dir
    plan: Plan  # the memory plan: its sizes, and the guard that names what overflows it
    model: torch.nn.Module  # pi_theta, the trained planner
    tok: object  # the tokenizer all modules share
    ref: torch.nn.Module | None  # pi_ref, the frozen initial weights; None where unread (reference_needed)
    optimizer: PlannerOptimizer
    agent: AgentSystem
    judge: Judge
    reward: Reward
    train_items: list  # data.train, every file in order
    heldout: list  # data.heldout (its first eval.limit items)
    paraphrase: list  # data.paraphrase where the before/after evaluation runs, else []

    def held_out_eval(self, step: int, items=None, where="", seed=None, what="held-out") -> dict:
        """heldout at `step`, in eval/step_N; paraphrase_eval passes its own set, folder
        and seed."""
        e = self.cfg["eval"]
        with self.plan.guard(f"during the {what} evaluation at step {step}"):
            return evaluate(self.agent, self.heldout if items is None else items,
                            self.out / "eval" / where / f"step_{step}", batch_size=e["batch_size"],
                            max_turns=e["max_turns"], seed=e["seed"] if seed is None else seed,
                            planner_temperature=e["planner_temperature"],
                            desc=f"{what} eval @ step {step}", judge=self.judge, world=self.world)

    def paraphrase_eval(self, step: int) -> dict:
        """The paraphrase set at `step`: a folder and a seed of its own, so heldout's results
        stay as they were."""
        seed = derive_seed("paraphrase", self.cfg["eval"]["seed"])
        return self.held_out_eval(step, self.paraphrase, "paraphrase", seed, "paraphrase")


def build_run(cfg: dict) -> Run:
    """The run's pieces, in this order: its start (support/run_log.start_run: out_dir's
    files, the seeds, the memory plan), the tools, the models, the optimizer, the reward,
    the agent, the judge, the data."""
    world, out, plan = start_run(cfg, web_tools=network_tools)
    t, e, m = cfg["train"], cfg["eval"], cfg["model"]
    # The tools first: where the Python sandbox cannot work, the run stops before the model loads.
    tools = build_tools(cfg["agent"]["tools"], cfg["tools"])
    # The policy pi_theta (trainable planner) and the frozen initial weights, which are
    # pi_ref for the KL term and also run the executor, verifier and generator (unless
    # model.planner gives the planner a model of its own). The reference shares the
    # policy's frozen weights and copies only the trained ones; with adapters it is the base
    # itself, the adapters off, and nothing is copied.
    with world.local_first():  # the default model's one-time conversion: once per machine
        model, tok = load_model(planner_name(m), m["device"], m["dtype"])
        # The weights that train: the top train.train_layers blocks themselves, or with
        # train.lora_rank > 0 low-rank adapters on their projections, the base frozen (lora.py).
        params = trained_weights(model, t, seed=derive_seed("lora", cfg["seed"]))
        ref = frozen_reference(model, params) if reference_needed(cfg) else None
        own = planner_name(m) != m["name"]  # model.planner: the modules run model.name
        modules = load_model(m["name"], m["device"], m["dtype"])[0] if own else ref
        if t["grad_checkpoint"]:  # after pi_ref is made: its blocks run as they are
            checkpoint_blocks(model, t["train_layers"])
        planner, frozen = LLM(model, tok), LLM(modules, tok)
    for llm in (planner, frozen):  # sub-batches and prefill forwards stay inside the plan
        llm.sub_batch_bytes, llm.prefill_tokens = plan.sub_batch_bytes, plan.prefill_tokens
    # AdamW, through fp32 masters for bf16 weights; the warmup counts optimizer steps.
    warmup = t["warmup_steps"] * t["epochs"] * t["minibatches"]
    optimizer = PlannerOptimizer(params, t["lr"], t["weight_decay"], warmup)
    reward = Reward.from_config(cfg["reward"])  # R: the judge's verdict, and reward.terms' others
    # After the reward: reward.modules may register planner views of one's own.
    agent = AgentSystem(planner, frozen, tools, agent_config(cfg["agent"]))
    if world.main:
        (out / "prompts.json").write_text(json.dumps(agent.system_prompts(), indent=1) + "\n")
    judge = Judge.from_config(cfg["judge"], engine=agent.frozen)  # rules, then the LLM if judge.llm
    train_items = [item for path in cfg["data"]["train"] for item in load_benchmark(path)]
    heldout = load_benchmark(cfg["data"]["heldout"], limit=e["limit"] or None)
    # The paraphrase set (data.paraphrase): held-out entities in wordings no other file uses,
    # evaluated beside heldout before and after training only.
    paraphrase = (load_benchmark(cfg["data"]["paraphrase"], limit=e["limit"] or None)
                  if cfg["data"]["paraphrase"] and t["eval_before_after"] else [])
    return Run(cfg, world, out, plan, model, tok, ref, optimizer, agent, judge, reward, train_items,
               heldout, paraphrase)


def finish(r: Run, before: dict | None, paraphrase_before: dict | None, started: float) -> dict:
    """After the last step: the trained planner exported whole, evaluated on heldout (and the
    paraphrase set) beside `before`, learning.json, the report; learning.json's content."""
    t, e, out, world = r.cfg["train"], r.cfg["eval"], r.out, r.world
    if world.main:  # the trained planner, whole, for eval.py --model and from_pretrained
        export(out / "model", r.model, r.tok)  # with adapters: merged, and adapter.safetensors beside it
    result = {"before": before}
    if t["eval_before_after"]:
        result["after"] = r.held_out_eval(t["steps"])
        if r.paraphrase:  # the same summaries (accuracy, turns, plans per kind) for that set
            result["paraphrase"] = {"before": paraphrase_before, "after": r.paraphrase_eval(t["steps"])}
        # What reproduces the table; wall_s is this process's time (a resumed run's own part).
        result["run"] = {"seed": r.cfg["seed"], "steps": t["steps"], "eval_seed": e["seed"],
                         "wall_s": round(time.time() - started, 1)}
        if world.size > 1:
            result["run"]["ranks"] = world.size
        if world.main:
            write_learning(out, result)  # learning.json, and its tables printed
    if world.main:
        print(f"report: {refresh_report(out)}")
    return result


class InfrastructureStop(RuntimeError):
    """train.max_infra_steps steps in a row took no update: the tools or the judge, not the model, failed."""


def train_step(cfg, step, agent, model, ref, optimizer, items, judge, reward, out, update_tokens: int = 0,
               world=ranks.SINGLE) -> dict:
    """One Flow-GRPO step: draw -> rollout -> reward -> advantage -> update. Under torchrun
    this rank takes its share of the queries (whole groups); the metrics row it returns,
    the same on every rank, is the whole step's."""
    t, G = cfg["train"], cfg["train"]["group_size"]
    step_seed = derive_seed("step", cfg["seed"], step)

    # 1. Draw Q queries (the same on every rank: seeded, stratified shuffles, support/datasets.py);
    # this rank takes a block of whole groups.
    queries = draw_queries(items, step, t["queries_per_step"], cfg["seed"],
                           t["task_shares"], t["task_shares_from"])
    share = world.shard(len(queries))  # all of them in one process
    my_queries = queries[share.start:share.stop]

    # 2. Rollout: G copies of each query, consecutive (a group), all in lockstep.
    counters, t0 = engine_counters(agent), time.time()
    trajs = agent.rollout([q.question for q in my_queries for _ in range(G)],
                          seed=derive_seed("rank", step_seed, world.rank))
    t1 = time.time()

    # 3. Reward R_i from the judge's verdict on the final answer (the paper's 0/1, unless
    #    reward.terms adds others); None where the network failed.
    verdicts = judge_rollouts(trajs, my_queries, G, judge, reward)
    t2 = time.time()

    # 4. Advantage A_i over each group's kept rollouts, broadcast to every planner turn of
    #    trajectory i as its rows; J's mean over queries runs over the groups kept on all ranks.
    #    The other credit choices are flow_grpo.other_credit's; credit per turn asks it for
    #    trajectory k's score of each turn (train.turn_score).
    rows, groups = kept_rows(
        trajs, [tr.reward is not None for tr in trajs], G, t["advantage_mode"], row_weight=t["row_weight"],
        estimator=t["advantage"], world=world,
        turn_scores=lambda k: TURN_SCORES.named(t["turn_score"])(trajs[k], my_queries[k // G], verdicts[k]))

    # 5. Update on planner tokens only, scored under the very SamplingParams the planner
    #    sampled with (temperatures, tool restriction), with pi_old from the trainer's own
    #    forward at the weights that sampled: exactly on-policy in any dtype. Every rank
    #    takes part, with or without rows of its own: the gradient is summed over all.
    lr = optimizer.lr  # what this step updates with (the schedule moves on after it)
    update = policy_update(model, ref, optimizer, rows, agent.planner_params, LossConfig.from_train(t),
                           UpdateConfig.from_train(t, max_tokens=update_tokens), agent.planner.pad_id,
                           seed=step_seed, world=world)
    t3 = time.time()

    write_trajectories(out, step + 1, trajs, my_queries, G, share.start, verdicts, world)
    return step_metrics(step, trajs, verdicts, groups, len(queries), update, lr, (t1 - t0, t2 - t1, t3 - t2),
                        counters, agent, world)


def judge_rollouts(trajs, queries, G: int, judge: Judge, reward: Reward) -> list[dict | None]:
    """Each trajectory's reward R_i (tr.reward, its terms in tr.reward_terms) and the
    judge's verdict on it: trajectory k answers queries[k // G]. A judge that fails says
    wrong, never right. A trajectory whose tool failed for infrastructure reasons after its
    retries (a quota, an outage, a missing key: tools.ToolResult.infra) is not judged: its
    outcome says how the network did, not how the policy did. Its reward and verdict stay
    None. One whose LLM judge failed to answer for the same reasons keeps its verdict (the
    rules', for the counts) but gets no reward: it is left out of the update too."""
    judged = [k for k, tr in enumerate(trajs) if not any(r.infra for r in tr.memory.records)]
    verdicts = [None] * len(trajs)
    for k, v in zip(judged, judge.score_batch([trajs[k].answer for k in judged], [queries[k // G] for k in judged])):
        verdicts[k] = v
    for k, (tr, v) in enumerate(zip(trajs, verdicts)):
        judged_here = v is not None and not v.get("judge_infra")
        tr.reward, tr.reward_terms = reward(tr, queries[k // G], v) if judged_here else (None, {})
    return verdicts


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
