"""Evaluation: run the agent on a benchmark file, score every item, summarise.

    python eval.py --benchmark data/benchmarks/bamboogle.json [--config config.yaml]
                   [--limit N] [--max-turns T] [--out DIR] [--model PATH] [--force-tool NAME]
                   [--sweep 1,2,3]
    python eval.py --suite paper [--model PATH] [--limit N] [--out DIR]    Table 1, see below
    torchrun --nproc_per_node K eval.py --benchmark ...      the items shared by K processes

Paper, section 3 (Table 1): accuracy of the whole system per benchmark, and the
analyses of tool usage and tool-call errors. Differences from the official code: an
item that crashes counts as wrong, with the reason recorded (the official code drops
crashed problems from the denominator), and scoring is rule-based first, with an LLM
judge for what the rules reject when the config's judge.llm is on (judge.py); each
result row says which judge decided.

An item whose trajectory met an infrastructure failure (a tool that failed after its
retries for reasons the model did not cause: tools.py) keeps its verdict and stays in
the denominator: leaving it out would drop exactly the items where the tools failed and
flatter the accuracy, as dropping crashed problems does. Its row counts the failures
(infra_failures), and the summary gives how many items had one and the accuracy over
the others (accuracy_without_infra), so a reader sees what the outage cost.

Output: DIR/results.jsonl, one row per item (question, gold, answer, correct, turns,
tools, errors, the full trajectory), DIR/summary.json, DIR/seconds.txt (wall time) and
DIR/made_by.json: what produced the rows (the planner's weights, the settings). A run
resumes: items whose id is already in results.jsonl are skipped, so an interrupted
evaluation loses nothing; a folder made by another planner or setup is refused, naming
the difference, so no evaluation passes another's rows off as its own. DIR defaults to
OUT_DIR/eval/<benchmark>, with the --model path appended for a trained planner.

`--suite paper` is the paper's Table 1, frozen vs trained planner beside the paper's figures
(paper_suite); DIR defaults to OUT_DIR/eval/paper, where the run's report.html shows it.

Under torchrun (support/ranks.py) the batches are dealt to the ranks in turn, each batch
exactly the one a single process would run, with the same seed; rank 0 gathers every
round's rows and writes them in item order. So K ranks write the rows one process writes (the same
rows, when the ranks compute as that process does: same weights, threads and kernels),
and an interrupted evaluation resumes under any number of ranks.
"""

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from agentflow import AgentSystem, agent_config, longest_prompts, prompts_with
from engine import LLM
from judge import Judge, Reward
from memory import PLANNER_VIEWS
from support import ranks
from support.config import ConfigError, check_run, load_config
from support.datasets import BENCHMARKS, PAPER_TABLE_1, Item, load_benchmark, paper_benchmarks, read_jsonl
from support.device_memory import CaptureError, use_expandable_segments
from support.models import load_model, planner_name
from support.provenance import claim, judge_label, made_by
from support.run_log import judge_counts
from support.sandbox import SandboxError
from support.report.page import sweep_table, table_markdown, write_report
from support.report.stats import wilson
from support.seeds import derive_seed
from support.text import plan_of
from tools import build_tools, check_toolset, network_tools


def evaluate(agent, items: list[Item], out_dir: str | Path, *, batch_size: int = 32, max_turns: int = 3,
             seed: int = 0, planner_temperature: float | None = None, desc: str = "eval",
             judge: Judge | None = None, world=ranks.SINGLE) -> dict:
    """Run `agent` (an agentflow.AgentSystem) on `items` in lockstep batches; write and
    return the summary. Every batch is appended to results.jsonl as soon as it is done
    (under torchrun: every round of one batch per rank, by rank 0; every rank returns
    the summary).

    planner_temperature: if given, the planner samples at this temperature here instead
    of its training one; 0 = greedy, the policy's most likely action (config eval.*)."""
    if planner_temperature is not None:
        agent = agent.with_planner_temperature(planner_temperature)
    judge = judge or Judge()
    out = Path(out_dir)
    results_path = out / "results.jsonl"
    record = made_by(agent, judge, max_turns=max_turns, seed=seed, batch_size=batch_size)  # every rank: same weights
    refusal = claim(out, record, items) if world.main else None
    if world.broadcast(refusal):
        raise ConfigError(refusal)
    done = world.broadcast({r["id"] for r in read_jsonl(results_path)} if world.main else None)  # rank 0's file
    t0 = time.time()
    todo = [(k, it) for k, it in enumerate(items) if it.id not in done]
    # Seeded by the item's place in the file, so a resumed run samples what the
    # uninterrupted one would have.
    batches = [todo[start:start + batch_size] for start in range(0, len(todo), batch_size)]
    with tqdm(total=len(items), initial=len(items) - len(todo), desc=desc, unit="item", disable=not world.main) as bar:
        for first in range(0, len(batches), world.size):  # a round: batch first + r on rank r
            b = first + world.rank
            batch_seed = derive_seed("eval_batch", seed, batches[b][0][0]) if b < len(batches) else None
            rows = (_run_batch(agent, [it for _, it in batches[b]], max_turns, batch_seed, judge)
                    if b < len(batches) else [])
            rounds = world.gather(rows)  # in rank order: the round's batches in item order
            if world.main:
                with open(results_path, "a") as f:
                    for row in (row for rank_rows in rounds for row in rank_rows):
                        f.write(json.dumps(row) + "\n")
                bar.update(sum(map(len, rounds)))
    summary = None
    if world.main:
        rows = [r for r in read_jsonl(results_path) if r["id"] in {it.id for it in items}]
        summary = summarize(rows)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        # Wall time, this call's added to the earlier ones' (a resume's), kept apart from the
        # rows and the summary, which are the same from every run of the same setup.
        clock = out / "seconds.txt"
        clock.write_text(f"{(float(clock.read_text()) if clock.exists() else 0.0) + time.time() - t0:.1f}\n")
    return world.broadcast(summary)


def _run_batch(agent, batch: list[Item], max_turns: int, seed: int, judge: Judge) -> list[dict]:
    try:
        trajs = agent.rollout([it.question for it in batch], seed=seed, max_turns=max_turns)
    except Exception as e:  # a crash costs the batch, not the run; each item says why
        if isinstance(e, (torch.OutOfMemoryError, CaptureError)):  # not the items' fault: stop and say so
            raise
        trajs, verdicts, crash = [None] * len(batch), None, f"crashed: {type(e).__name__}: {e}"
    else:
        try:
            verdicts, crash = judge.score_batch([tr.answer for tr in trajs], batch), ""
        except Exception as e:  # a judge bug costs the batch's verdicts (all wrong), not the run
            verdicts, crash = None, f"judge crashed: {type(e).__name__}: {e}"
    verdicts = verdicts or [{"correct": False, "f1": 0.0, "extracted": ""} for _ in batch]
    return [_row(it, tr, v, crash) for it, tr, v in zip(batch, trajs, verdicts)]


def _row(item: Item, traj, verdict: dict, crash: str) -> dict:
    records = traj.memory.records if traj else []
    return {"id": item.id, "question": item.question, "gold": item.gold, "kind": item.kind,
            "task": item.meta.get("task", ""), "answer": traj.answer if traj else "",
            "extracted": verdict["extracted"], "correct": bool(verdict["correct"]), "f1": verdict["f1"],
            "judge": verdict.get("judge", "rule"), "judge_error": verdict.get("judge_error", ""),
            "turns": len(records), "tools": [r.tool for r in records if r.tool],
            "tool_calls": sum(1 for r in records if r.tool),
            "tool_errors": sum(1 for r in records if r.tool and r.error and not r.infra),  # the model's
            # tool calls that failed for infrastructure reasons, and the judge's own such failure
            "infra_failures": sum(1 for r in records if r.infra) + int(bool(verdict.get("judge_infra"))),
            "errors": [r.error for r in records if r.error] + ([crash] if crash else []),
            "trajectory": traj.to_dict() if traj else None}


def summarize(rows: list[dict]) -> dict:
    """accuracy, n, mean turns, tool-usage shares, the plans (share of items per sequence of
    tools, most common first), tool-call error rate, items with an infrastructure failure;
    overall and per task kind."""
    def block(rs):
        n = len(rs)
        hit = [r for r in rs if r.get("infra_failures")]  # items whose tools failed us (rows of older runs lack it)
        clean = [r for r in rs if not r.get("infra_failures")]
        calls = Counter(t for r in rs for t in r["tools"])
        n_calls = sum(calls.values())
        plans = Counter(plan_of(r["tools"]) for r in rs)
        return {"accuracy": sum(r["correct"] for r in rs) / n if n else 0.0, "n": n,
                "mean_f1": sum(r["f1"] for r in rs) / n if n else 0.0,
                "mean_turns": sum(r["turns"] for r in rs) / n if n else 0.0,
                "tool_calls_per_item": sum(len(r["tools"]) for r in rs) / n if n else 0.0,
                "tool_shares": {t: c / n_calls for t, c in sorted(calls.items())},
                "plans": {p: c / n for p, c in sorted(plans.items(), key=lambda pc: (-pc[1], pc[0]))},
                "tool_error_rate": sum(r["tool_errors"] for r in rs) / n_calls if n_calls else 0.0,
                "crashed": sum(1 for r in rs if any(e.startswith(("crashed", "judge crashed")) for e in r["errors"])),
                "infra_failures": len(hit), "accuracy_without_infra": sum(r["correct"] for r in clean) / len(clean)
                if clean else None}
    summary = block(rows)
    summary["judge"] = judge_counts(rows)  # who decided: rules, the LLM, LLM calls with no verdict
    tasks = sorted({r.get("task") or "" for r in rows} - {""})
    if tasks:
        summary["by_kind"] = {t: block([r for r in rows if r.get("task") == t]) for t in tasks}
    return summary


def turn_sweep(planners: dict, items: list[Item], budgets: list[int], out_dir: Path, **kw) -> dict:
    """Accuracy as a function of the test-time turn budget (paper, Sec. 4: accuracy rises
    with the budget), for each planner: {"budgets", "planners": {label: {budget: summary}}}.
    kw: evaluate's batch_size, seed, planner_temperature, judge, world."""
    result = {"budgets": budgets, "planners": {}}
    for label, agent in planners.items():
        name = label.split(" ")[0]
        result["planners"][label] = {str(T): evaluate(agent, items, out_dir / name / f"turns_{T}", max_turns=T,
                                                      desc=f"{name}, {T} turns", **kw) for T in budgets}
    return result


SEARCH_BENCHMARKS = ("bamboogle", "2wiki", "hotpotqa", "musique", "gaia")  # answered by looking facts up


def paper_suite(args, cfg: dict, out: Path, agent, judge: Judge, world) -> int:
    """`--suite paper`: every Table 1 benchmark present in data/benchmarks/ (GAIA and GPQA come
    from scripts/prepare_data.py), for the frozen planner and, with --model, the trained one,
    each into out/<frozen|trained>/<benchmark>/ (resumable like any evaluation); then
    out/table.json and out/table.md: per benchmark the items, each planner's accuracy with its
    95% interval, the gain, tool calls per item, items with an infrastructure failure, wall
    time, the paper's figures beside ours, and what makes the two comparable or not."""
    e = cfg["eval"]
    present = paper_benchmarks()
    absent = [b for b in PAPER_TABLE_1 if b not in present]
    if absent and world.main:
        print(f"not in {BENCHMARKS}: {', '.join(absent)} (gated on the hub: `python -m scripts.prepare_data "
              f"gaia` / `gpqa` writes them there)")
    rows = {b: {"n": 0, "planners": {}, "paper": dict(zip(("untrained", "trained"), PAPER_TABLE_1[b]))}
            for b in present}  # the paper's figures in table.json too, for whoever reads it alone
    for label, planner in planners(cfg, agent, args.model).items():
        tag = label.split(" ")[0]  # frozen, trained
        for b in present:
            items = load_benchmark(str(present[b]), limit=args.limit or None)
            s = evaluate(planner, items, out / tag / b, batch_size=args.batch_size or e["batch_size"],
                         max_turns=args.max_turns or e["max_turns"], seed=e["seed"], desc=f"{tag}, {b}",
                         planner_temperature=e["planner_temperature"], judge=judge, world=world)
            if not world.main:
                continue
            k = round(s["accuracy"] * s["n"])
            rows[b]["n"] = s["n"]
            rows[b]["planners"][tag] = {"accuracy": s["accuracy"], "ci95": wilson(k, s["n"]),
                                        "tool_calls_per_item": s["tool_calls_per_item"],
                                        "infra_failures": s["infra_failures"],
                                        "seconds": float((out / tag / b / "seconds.txt").read_text())}
    if not world.main:
        return 0
    tools, turns = cfg["agent"]["tools"], args.max_turns or e["max_turns"]
    notes = [f"Comparable with the paper's figures only as far as the setup matches. The paper: Qwen2.5-7B-Instruct "
             f"as every module, a GPT-4o judge, Google, Wikipedia and web search, up to 10 turns, every item. Here: "
             f"planner {args.model or planner_name(cfg['model'])}, other modules {cfg['model']['name']}, judge: "
             f"{judge_label(judge)}, tools {', '.join(tools)}, a turn budget of {turns}, "
             f"{f'the first {args.limit} items of each file' if args.limit else 'every item'}."]
    if not network_tools(cfg):
        searched = ", ".join(b for b in SEARCH_BENCHMARKS if b in present)
        notes.append(f"No web search in agent.tools: the facts {searched}"
                     " ask about are not in the local corpus, so their scores here say what the model knows unaided.")
    notes.append("infra: items where a tool (or the judge) failed after its retries for reasons the model did not "
                 "cause; they keep their verdict and stay in the accuracy (never counted as the model's tool error).")
    table = {"benchmarks": rows, "absent": absent, "notes": notes}
    (out / "table.json").write_text(json.dumps(table, indent=2) + "\n")
    (out / "table.md").write_text(table_markdown(table))
    print((out / "table.md").read_text())
    run = Path(cfg["out_dir"])
    if (run / "config.json").exists() and out == run / "eval" / "paper":  # a training run's folder: its report
        write_report(run)
    return 0


def build_agent(cfg: dict, model_path: str | None = None, world=ranks.SINGLE):
    """An AgentSystem from a config: the planner from `model_path` (a trained checkpoint)
    or the configured planner (model.planner, else model.name); executor, verifier and
    generator always model.name."""
    m = cfg["model"]
    if m["threads"]:
        torch.set_num_threads(m["threads"])
    tools = build_tools(cfg["agent"]["tools"], cfg["tools"])  # first: a sandbox that cannot work stops us early
    with world.local_first():  # the default model's one-time conversion: once per machine
        frozen_model, tok = load_model(m["name"], m["device"], m["dtype"])
        name = model_path or planner_name(m)
        planner_model = frozen_model if name == m["name"] else load_model(name, m["device"], m["dtype"])[0]
        planner, frozen = LLM(planner_model, tok), LLM(frozen_model, tok)
    return AgentSystem(planner, frozen, tools, agent_config(cfg["agent"]))


def arguments(description: str, prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of eval.py and of the commands that probe a planner on a benchmark
    file (scripts/probe_tools.py): the file, the config and its overrides, the planner."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--benchmark", help="a JSON benchmark file or a JSONL task file")
    if prog is None:  # eval.py itself
        what.add_argument("--suite", choices=["paper"], help="paper: every benchmark of the paper's Table 1 in "
                          "data/benchmarks/, frozen and (with --model) trained planner, into table.md / table.json")
    ap.add_argument("--config", default="config.yaml")
    ap.add_argument("--limit", type=int, default=0, help="only the first N items (0 = all)")
    ap.add_argument("--max-turns", type=int, default=0, help="turn budget (0 = eval.max_turns of the config)")
    ap.add_argument("--model", default=None, help="a trained planner checkpoint (default: the config's model)")
    ap.add_argument("--out", default=None, help="output folder (default: OUT_DIR/eval/<benchmark name>)")
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    return ap


def check_eval_names(cfg: dict) -> list[str]:
    """What an evaluation's config names, before any model loads (support/config.check_run
    calls this beside its own checks): the tools (tools.check_toolset: a line per problem,
    returned), the reward's terms, the planner's view of the memory, the replaced prompts;
    an unknown one raises ConfigError."""
    problems = check_toolset(cfg)
    Reward.from_config(cfg["reward"])  # its terms are known; first, as their modules may add views
    PLANNER_VIEWS.named(cfg["agent"]["planner_view"])  # perhaps one of those modules'
    prompts_with(cfg["agent"]["prompts"])  # replaced prompts name a prompt and keep its fields
    return problems


def load_run(args, extra_overrides: list[str] = ()) -> tuple[dict, list[Item], str]:
    """(config, items, output folder) of a command line made by `arguments`; a bad config,
    toolset or benchmark file raises ConfigError, FileNotFoundError or ValueError."""
    cfg = load_config(args.config, args.overrides + list(extra_overrides))
    check_run(cfg, check_eval_names, training=False, model_path=args.model, longest_prompts=longest_prompts)
    if not args.benchmark:  # --suite: each file is read in its turn
        return cfg, [], args.out or str(Path(cfg["out_dir"]) / "eval" / "paper")
    items = load_benchmark(args.benchmark, limit=args.limit or None)
    # By default each planner has a folder of its own (evaluate refuses to resume another's).
    name = Path(args.benchmark).stem + ("_" + "_".join(Path(args.model).parts).strip("_/") if args.model else "")
    return cfg, items, args.out or str(Path(cfg["out_dir"]) / "eval" / name)


def planners(cfg: dict, agent, model_path: str | None) -> dict:
    """The planners a comparison runs: the frozen one (the configured planner, untrained)
    and, given a trained checkpoint, `agent`'s, which samples from it; by label."""
    m = cfg["model"]
    if planner_name(m) == m["name"]:
        initial = agent.frozen
    elif not model_path:
        initial = agent.planner
    else:
        initial = LLM(load_model(planner_name(m), m["device"], m["dtype"])[0], agent.frozen.tok)
    out = {"frozen": AgentSystem(initial, agent.frozen, agent.tools, agent.cfg)}
    if model_path:
        out[f"trained ({Path(model_path).name})"] = agent
    return out


def main(argv=None) -> int:
    ap = arguments("Run the AgentFlow agent on a benchmark file and score it.")
    ap.add_argument("--batch-size", type=int, default=0, help="trajectories in lockstep (0 = config)")
    ap.add_argument("--force-tool", default="", help="every planner action picks this tool: what "
                    "each tool choice is worth (docs/RESULTS.md, what stays frozen)")
    ap.add_argument("--sweep", default="", help="turn budgets, e.g. 1,2,3: the paper's test-time analysis. "
                    "Evaluates the configured (frozen) planner and, with --model, the trained one at each "
                    "budget; prints the table and writes OUT_DIR/turn_sweep.json (the run's report shows it)")
    args = ap.parse_args(argv)
    use_expandable_segments()  # before the preflight's memory plan or anything else touches CUDA
    try:
        cfg, items, out = load_run(args, [f"agent.force_tool={args.force_tool}"] if args.force_tool else [])
    except (ConfigError, FileNotFoundError, ValueError) as e:
        for line in str(e).splitlines():
            print(f"error: {line}", file=sys.stderr)
        return 2
    world = ranks.init(cfg["model"]["device"])  # ranks.SINGLE without torchrun
    try:
        return _main(args, cfg, items, out, build_agent(cfg, args.model, world), world)
    except (ConfigError, SandboxError) as e:  # the toolset against the tokenizer; a machine that cannot sandbox
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        ranks.shutdown()


def _main(args, cfg: dict, items: list[Item], out: str, agent, world) -> int:
    judge = Judge.from_config(cfg["judge"], engine=agent.frozen)  # rules, then the LLM if judge.llm
    e = cfg["eval"]
    if args.suite:
        return paper_suite(args, cfg, Path(out), agent, judge, world)
    if args.sweep:
        budgets = [int(b) for b in args.sweep.split(",")]
        sweep = turn_sweep(planners(cfg, agent, args.model), items, budgets,
                           Path(out).parent / f"sweep_{Path(args.benchmark).stem}",
                           batch_size=args.batch_size or e["batch_size"], seed=e["seed"],
                           planner_temperature=e["planner_temperature"], judge=judge, world=world)
        if world.main:
            path = Path(cfg["out_dir"]) / "turn_sweep.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(sweep, indent=2) + "\n")
            print(sweep_table(sweep))
            print(f"written to {path}")
        return 0
    t0 = time.time()
    summary = evaluate(agent, items, out, batch_size=args.batch_size or e["batch_size"],
                       max_turns=args.max_turns or e["max_turns"], seed=e["seed"],
                       planner_temperature=e["planner_temperature"], judge=judge, world=world)
    if not world.main:
        return 0
    print(json.dumps(summary, indent=2))
    print(f"accuracy {summary['accuracy']:.3f} on {summary['n']} items in {time.time() - t0:.0f}s; "
          f"results in {out}/results.jsonl")
    if summary["infra_failures"]:
        print(f"note: {summary['infra_failures']} items met an infrastructure failure (a tool failed after its "
              f"retries; they count, as scored); accuracy without them "
              f"{summary['accuracy_without_infra'] if summary['accuracy_without_infra'] is not None else '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
