"""Two ranks under torchrun (gloo, one CPU thread each) on the tiny random model: the step
they take together is the step one process takes on the same rollouts; a sharded
evaluation writes what one process writes, and resumes; a resumed 2-rank run reaches
the uninterrupted one's weights.

"The same rollouts": rank r rolls out its whole groups (ranks.World.shard) with seed
derive_seed("rank", step seed, r) (support/seeds.py). The sampler's random stream depends on which rows share
a batch, so one process given all Q queries in one batch draws other tokens; the
reference process here rolls out the same two parts, each with its rank's seed, and
then trains on all of them at once, as one process does (tests/dist_runner.py runs the
ranks). Every rollout must then be the same to the bit, and the weights the same up to
the order in which float gradients are summed."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support import ranks
import eval as evaluation
import train
from agentflow import AgentSystem
from support.config import load_config
from support.seeds import derive_seed
from test_train import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
G = 2
EQUAL = ("train.steps=1", "train.eval_before_after=false", "model.threads=1", "train.queries_per_step=4",
         f"train.group_size={G}", "train.minibatches=2")  # two optimizer steps: the mini-batch split is global
# bf16 with fp32 masters: the sum runs over the masters' gradients. bf16 rounding depends on
# which rows share a forward pass (padding, shared prefixes), so both sides run one row per
# micro-batch: the same forwards, and again only the fp32 order of the sum differs.
BF16 = ("train.steps=1", "train.eval_before_after=false", "model.threads=1", "train.queries_per_step=4",
        f"train.group_size={G}", "model.dtype=bfloat16", "train.micro_batch=1")
LONE = ("train.steps=1", "train.eval_before_after=false", "model.threads=1", "train.queries_per_step=1",
        f"train.group_size={G}")  # rank 0 has no query: it still sums (zeros) and steps
INFRA = ("train.steps=1", "train.eval_before_after=false", "model.threads=1", "train.queries_per_step=4",
         "train.group_size=3", "agent.force_tool=Local_Search",  # with flaky(): groups lose rollouts, or all
         # a sampled executor, so that the rollouts of a group search for different commands
         "agent.executor.temperature=1.0", "agent.max_turns=1")
# An estimator over the batch (REINFORCE++-baseline: one std over every group of the step):
# each rank's advantages must be those of all ranks' groups at once, not of its own alone.
BATCH = (*EQUAL, "train.advantage=reinforce_pp_baseline")
# LoRA (lora.py): the adapters' gradients summed over ranks like any trained weight's.
LORA = (*EQUAL, "train.lora_rank=4", "train.lora_alpha=8")
RESUME = ("train.save_every=1", "train.eval_before_after=false", "model.threads=1", "train.queries_per_step=3")
# Two ranks sum the gradient in another order than one process (per rank, then across),
# so gradients agree to float rounding, not to the bit. AdamW divides each gradient by its
# own running size: where the two optimizer steps nearly cancel, that rounding moves a
# weight by a small fraction of a step. A wrong row weight or a lost rank's gradient moves
# weights by whole steps (and a wrong overall scale, which Adam and the clip would hide
# from the weights, shows in the loss and the gradient norm of the metrics row).
LR = 1e-3  # tiny_overrides' train.lr
WEIGHT_ATOL = LR / 100


def alternating_verdicts(judge, answers: list[str], items: list) -> list[dict]:
    """Judge.score_batch for these tests: right, wrong, right, ... along each run of the
    same item (a group's judged rollouts). A random model never answers right; this gives
    every group a signal whatever was sampled, and the same verdicts on one process as on
    two ranks (a group and its judged rollouts are all on one rank)."""
    out, prev, j = [], None, 0
    for a, it in zip(answers, items):
        j = j + 1 if it is prev else 0
        prev = it
        out.append({"correct": j % 2 == 0, "f1": 0.0, "extracted": a, "judge": "rule", "judge_error": ""})
    return out


def flaky(real_run):
    """Local_Search._run failing as the network would for the commands of even length (so
    the same command fails on every rank and in every process)."""
    from tools import ToolError

    def run(self, command):
        if len(command) % 2 == 0:
            raise ToolError("HTTP 503 from search.example (gave up after 4 tries)", infra=True)
        return real_run(self, command)
    return run


def eval_args(model_dir, out):
    return ["--benchmark", str(ROOT / "data" / "heldout.jsonl"), "--config", str(ROOT / "config.yaml"),
            "--limit", "6", "--batch-size", "2", "--max-turns", "1", "--out", str(out),
            *tiny_overrides(model_dir, out.parent / "eval_run", "model.threads=1", "eval.planner_temperature=1.0")]


def torchrun(jobs: list, work: Path, name: str) -> None:
    (work / f"{name}.json").write_text(json.dumps({"dumps": str(work), "jobs": jobs}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(ROOT / "tests" / "dist_runner.py"), str(work / f"{name}.json")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def trained(path) -> dict:
    return torch.load(path)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Everything the tests below compare: the one-process references first (they run in
    this process), then the 2-rank runs, in two launches: the second resumes the first's."""
    work = tmp_path_factory.mktemp("dist")
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        import judge
        mp.setattr(judge.Judge, "score_batch", alternating_verdicts)
        # One process, the rollouts of two ranks: the same parts with the same seeds.
        real = AgentSystem.rollout

        def as_two_ranks(self, queries, seed=0, max_turns=None):
            out = []
            for r in range(2):
                part = ranks.World(rank=r, size=2).shard(len(queries) // G)
                out += real(self, queries[part.start * G:part.stop * G], seed=derive_seed("rank", seed, r),
                            max_turns=max_turns)
            return out
        with pytest.MonkeyPatch.context() as split:
            split.setattr(AgentSystem, "rollout", as_two_ranks)
            for name, extra in (("one", EQUAL), ("bf16_one", BF16), ("lone_one", LONE), ("batch_one", BATCH),
                                ("lora_one", LORA)):
                train.run(load_config(str(ROOT / "config.yaml"), tiny_overrides(tiny_model_dir, work / name, *extra)))
            from tools import LocalSearch
            split.setattr(LocalSearch, "_run", flaky(LocalSearch._run))
            train.run(load_config(str(ROOT / "config.yaml"), tiny_overrides(tiny_model_dir, work / "infra_one", *INFRA)))
        assert evaluation.main(eval_args(tiny_model_dir, work / "eval_one")) == 0
    torch.set_num_threads(threads)
    # An evaluation interrupted after its first batch (its folder's made_by.json, then a batch's
    # rows): the 2 ranks resume it.
    (work / "eval_two").mkdir()
    first = (work / "eval_one" / "results.jsonl").read_text().splitlines(keepends=True)[:2]
    (work / "eval_two" / "results.jsonl").write_text("".join(first))
    shutil.copy(work / "eval_one" / "made_by.json", work / "eval_two" / "made_by.json")

    run_args = lambda out, *extra: tiny_overrides(tiny_model_dir, work / out, *RESUME, *extra)
    torchrun([{"train": tiny_overrides(tiny_model_dir, work / "two", *EQUAL)},
              {"train": tiny_overrides(tiny_model_dir, work / "bf16_two", *BF16)},
              {"train": tiny_overrides(tiny_model_dir, work / "lone_two", *LONE)},
              {"train": tiny_overrides(tiny_model_dir, work / "batch_two", *BATCH)},
              {"train": tiny_overrides(tiny_model_dir, work / "lora_two", *LORA)},
              {"train": tiny_overrides(tiny_model_dir, work / "infra_two", *INFRA), "flaky": True},
              {"train": run_args("full", "train.steps=2")},
              {"train_main": [str(ROOT / "config.yaml"), *run_args("cut", "train.steps=1")]},  # as a user starts it
              {"eval_main": eval_args(tiny_model_dir, work / "eval_two")}], work, "first")
    torchrun([{"train_main": [str(ROOT / "config.yaml"), *run_args("cut", "train.steps=2")]}], work, "resume")
    return work


def lines(path) -> list[str]:
    return Path(path).read_text().splitlines()


@pytest.mark.parametrize("one, two", [("one", "two"), ("bf16_one", "bf16_two"), ("lone_one", "lone_two"),
                                      ("infra_one", "infra_two"), ("batch_one", "batch_two")])
def test_two_ranks_take_the_step_one_process_takes(runs, one, two):
    """4 queries, 2 on each rank, in 2 mini-batches (2 optimizer steps); the same in one
    step in bf16 with fp32 masters; 1 query, on rank 1, rank 0 taking the step with nothing of its
    own; 4 queries whose searches fail half the time, so that J averages over the groups
    and rollouts kept on both ranks; the first case again with an estimator over the batch,
    whose advantages (in the trajectories) are the one process's to the bit."""
    name, one, two = two, runs / one, runs / two
    # The union of the ranks' rollouts is the reference's, to the bit: tokens, tools, answers,
    # rewards, advantages (the group index is the global one).
    assert lines(two / "trajectories" / "step_1.jsonl") == lines(one / "trajectories" / "step_1.jsonl")
    rank0, rank1 = trained(runs / f"{name}_rank0_step1.pt"), trained(runs / f"{name}_rank1_step1.pt")
    reference = load_file(str(one / "model" / "model.safetensors"))
    assert rank0.keys() == rank1.keys() and rank0
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key  # one optimizer step, taken on each rank
        if rank0[key].dtype == torch.float32:
            torch.testing.assert_close(rank0[key], reference[key], rtol=0, atol=WEIGHT_ATOL)
    if rank0[key].dtype == torch.bfloat16:  # what the step moved: the fp32 masters (a bf16 rounding may flip)
        masters = [torch.load(path / "checkpoints" / "step_1" / "trainer_state.pt", weights_only=False)["masters"]
                   for path in (one, two)]
        assert len(masters[0]) == len(rank0)
        for a, b in zip(*masters):
            assert a.dtype == torch.float32
            torch.testing.assert_close(b, a, rtol=0, atol=WEIGHT_ATOL)
    # The checkpoint rank 0 wrote holds those weights.
    written = load_file(str(two / "model" / "model.safetensors"))
    assert all(torch.equal(written[key], rank0[key]) for key in rank0)

    (m1,), (m2,) = [json.loads(x) for x in lines(one / "metrics.jsonl")], [json.loads(x) for x in lines(two / "metrics.jsonl")]
    assert m1.keys() == m2.keys() and m2["optimizer_steps"] == m1["optimizer_steps"] > 0
    floats = ("loss", "kl", "clip_frac", "kl_clamped", "entropy", "grad_norm", "logprob_gap", "logprob_gap_mean")
    for key in m1:
        if key.startswith("time_") or key == "tool_cache_hits":  # each rank has its own clock and search cache
            continue
        if key in floats:
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key
        else:
            assert m2[key] == m1[key], key  # counts, rewards, tool shares: the same rollouts
    assert not list(two.glob("*rank*")) and (two / "run.json").exists()  # rank 0 alone writes in out_dir


def test_two_ranks_train_the_adapters_one_process_trains(runs):
    """With LoRA: the same rollouts; both ranks hold the same adapters after the step, the
    one process's up to the order of the float sums; the merged exports agree alike."""
    one, two = runs / "lora_one", runs / "lora_two"
    assert lines(two / "trajectories" / "step_1.jsonl") == lines(one / "trajectories" / "step_1.jsonl")
    rank0, rank1 = trained(runs / "lora_two_rank0_step1.pt"), trained(runs / "lora_two_rank1_step1.pt")
    reference = torch.load(one / "checkpoints" / "step_1" / "trainer_state.pt", weights_only=False)["trained"]
    assert rank0 and all(k.endswith((".lora_A", ".lora_B")) for k in rank0) and rank0.keys() == reference.keys()
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
        torch.testing.assert_close(rank0[key], reference[key], rtol=0, atol=WEIGHT_ATOL)
    assert all(float(rank0[k].abs().max()) > 0 for k in rank0 if k.endswith(".lora_B")), "every B must have moved"
    merged = [load_file(str(path / "model" / "model.safetensors")) for path in (one, two)]
    for key in merged[0]:
        torch.testing.assert_close(merged[1][key], merged[0][key], rtol=0, atol=WEIGHT_ATOL)


@pytest.mark.parametrize("name", ["two", "bf16_two", "lone_two", "infra_two", "batch_two"])
def test_the_compared_steps_learn(runs, tiny_model_dir, name):
    """The steps compared above carry a signal and move every trained tensor (in the lone
    case through rank 1's gradient alone): the comparison is not of runs that did nothing.
    In the flaky case some rollouts were left out, and some groups kept."""
    (m,) = [json.loads(x) for x in lines(runs / name / "metrics.jsonl")]
    assert m["zero_variance_groups"] == 0 and m["grad_norm"] > 0
    if name == "infra_two":
        assert m["excluded_trajectories"] > 0 and m["excluded_groups"] < 4, "the sample path must exclude some"
    start, after = load_file(str(Path(tiny_model_dir) / "model.safetensors")), trained(runs / f"{name}_rank0_step1.pt")
    if name == "bf16_two":  # a step of lr moves the fp32 masters; their bf16 rounding may not move
        masters = torch.load(runs / name / "checkpoints" / "step_1" / "trainer_state.pt", weights_only=False)["masters"]
        after = dict(zip(after, masters))  # the masters follow the trainable weights' order
    assert all(not torch.equal(start[k].to(after[k].dtype), after[k]) for k in after)


def test_an_estimator_over_the_batch_sees_both_ranks_groups(runs):
    """REINFORCE++-baseline on 2 ranks: the advantages written are those of the 4 groups'
    rewards at once, which differ from each rank normalising its own 2 groups."""
    from flow_grpo import reinforce_pp_baseline
    trajs = [json.loads(x) for x in lines(runs / "batch_two" / "trajectories" / "step_1.jsonl")]
    groups = [[tr["reward"] for tr in trajs[q:q + G]] for q in range(0, len(trajs), G)]
    written = [tr["advantage"] for tr in trajs]
    assert len(groups) == 4 and written == [a for A in reinforce_pp_baseline(groups) for a in A]
    alone = [a for A in reinforce_pp_baseline(groups[:2]) + reinforce_pp_baseline(groups[2:]) for a in A]
    assert alone != written


def test_a_sharded_evaluation_resumes_and_writes_what_one_process_writes(runs):
    # 6 items in batches of 2: the resumed part is batches 2 and 3, one on each rank.
    assert lines(runs / "eval_two" / "results.jsonl") == lines(runs / "eval_one" / "results.jsonl")
    one = json.loads((runs / "eval_one" / "summary.json").read_text())
    assert json.loads((runs / "eval_two" / "summary.json").read_text()) == one and one["n"] == 6


def test_resume_under_two_ranks_equals_the_uninterrupted_run(runs):
    assert [json.loads(x)["step"] for x in lines(runs / "cut" / "metrics.jsonl")] == [1, 2]
    full = trained(runs / "full_rank0_step2.pt")
    start = trained(runs / "full_rank0_step1.pt")
    assert any(not torch.equal(full[n], start[n]) for n in full), "the second step must move the weights"
    for rank in (0, 1):
        resumed = trained(runs / f"cut_rank{rank}_step2.pt")
        for name in full:
            torch.testing.assert_close(resumed[name], full[name], rtol=0, atol=1e-6)
    full_ck = load_file(str(runs / "full" / "model" / "model.safetensors"))
    cut_ck = load_file(str(runs / "cut" / "model" / "model.safetensors"))
    for name in full_ck:
        torch.testing.assert_close(cut_ck[name], full_ck[name], rtol=0, atol=1e-6)
