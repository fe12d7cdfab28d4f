"""End to end on a tiny random model: full training steps, checkpoints transformers can
load, resume == uninterrupted, config validation, and eval on the official files."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import eval as evaluation
from support.config import ConfigError, load_config
import train
from support.datasets import draw_queries
from train import run

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "data" / "benchmarks"


def tiny_overrides(model_dir, out_dir, *extra) -> list[str]:
    """The config overrides of a run on the tiny random model that takes seconds."""
    return [f"model.name={model_dir}", "model.device=cpu", f"out_dir={out_dir}",
            f"tools.corpus={ROOT / 'data' / 'corpus.jsonl'}", f"data.train={ROOT / 'data' / 'train.jsonl'}",
            f"data.heldout={ROOT / 'data' / 'heldout.jsonl'}", f"data.paraphrase={ROOT / 'data' / 'paraphrase.jsonl'}",
            "train.queries_per_step=2", "train.group_size=2", "train.lr=1e-3", "agent.max_turns=2", "agent.planner.max_new_tokens=6",
            "agent.executor.max_new_tokens=8", "agent.generator.max_new_tokens=6", "agent.generator.temperature=1.0",
            "eval.limit=4", "eval.batch_size=4", "eval.max_turns=1", "tools.python_timeout_s=3.0",
            "train.train_layers=2", *extra]  # the tiny model has 2 blocks: all of them, as 4 would train


def tiny_cfg(model_dir, out_dir, *extra):
    return load_config(str(ROOT / "config.yaml"), tiny_overrides(model_dir, out_dir, *extra))


@pytest.fixture()
def learnable_reward(monkeypatch):
    """A random model never answers right, so every advantage would be 0 and nothing would
    train. Replace the judge (tested on its own in test_judge.py) by a deterministic
    reward the random model does earn sometimes: the answer's length is odd. (tiny_cfg
    samples the generator: a random model's greedy answer ignores the memory, so the G
    rollouts of a query would all get the same reward.)"""
    import judge
    monkeypatch.setattr(judge, "score_item", lambda answer, *item: {"correct": len(answer) % 2 == 1, "f1": 0.0,
                                                                     "extracted": answer})


def test_training_draws_from_every_file_of_data_train(tiny_model_dir, tmp_path):
    """data.train=[a, b]: one pool, in order; a step of two queries from two one-row files
    draws one of each."""
    rows = (ROOT / "data" / "train.jsonl").read_text().splitlines()[:2]
    files = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for f, row in zip(files, rows):
        f.write_text(row + "\n")
    run(tiny_cfg(tiny_model_dir, tmp_path / "run", "train.steps=1", f"data.train=[{files[0]}, {files[1]}]",
                 "train.eval_before_after=false"))
    asked = {json.loads(line)["query"] for line in (tmp_path / "run" / "trajectories" / "step_1.jsonl").open()}
    assert asked == {json.loads(row)["question"] for row in rows}


def weights(path):
    return load_file(str(Path(path) / "model.safetensors"))


def test_two_steps_end_to_end(tiny_model_dir, tmp_path, learnable_reward):
    cfg = tiny_cfg(tiny_model_dir, tmp_path / "run", "train.steps=2", "train.save_every=1")
    result = run(cfg)
    out = tmp_path / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("reward_mean", "accuracy", "zero_variance_groups", "mean_turns", "tool_shares",
                "tool_error_rate", "kl", "clip_frac", "entropy", "grad_norm", "planner_tokens",
                "time_rollout", "time_judge", "time_update", "logprob_gap", "logprob_gap_mean",
                "ratio_dev_first_step", "kl_clamped", "sampler_sub_batches"):
        assert key in rows[0], key
    assert all(r["logprob_gap"] < 1e-3 for r in rows)  # fp32: the sampler's arithmetic is the trainer's, to noise
    assert all(r["ratio_dev_first_step"] == 0.0 for r in rows)  # pi_old is the trainer's own forward
    assert rows[0]["planner_tokens"] > 0
    assert rows[0]["judge"] == {"rule": 4, "llm": 0, "llm_failed": 0}  # who decided each of the 2x2 rewards
    # The trained planner exported whole in Hugging Face format, loadable as is, with weights
    # that moved; the checkpoint holds what a resume needs, no model.
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert model.config.num_hidden_layers == 2
    assert [p.name for p in (out / "checkpoints" / "step_2").iterdir()] == ["trainer_state.pt"]
    before, after = weights(tiny_model_dir), weights(out / "model")
    moved = any(not torch.equal(before[k], after[k]) for k in before)
    assert any(r["zero_variance_groups"] < 1 for r in rows), "the test reward must give a signal"
    assert moved
    assert not list((out / "checkpoints").glob(".tmp*"))  # nothing half-written left
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_2"]  # only the newest is kept
    # Held-out evaluation before and after, and the learning table.
    learning = json.loads((out / "learning.json").read_text())
    for side in ("before", "after"):
        for key in ("accuracy", "n", "by_kind", "tool_shares", "tool_error_rate"):
            assert key in learning[side]
    assert learning["after"]["n"] == 4 and result["after"] == learning["after"]
    # ... and of the paraphrase set beside it, in a folder of its own, summarised alike
    assert learning["paraphrase"]["after"]["n"] == 4 and result["paraphrase"] == learning["paraphrase"]
    assert set(learning["paraphrase"]["before"]["by_kind"]) <= {"arithmetic", "lookup", "two_step"}
    assert (out / "eval" / "paraphrase" / "step_2" / "summary.json").is_file()
    assert learning["run"]["steps"] == 2 and learning["run"]["wall_s"] > 0
    assert len((out / "trajectories" / "step_1.jsonl").read_text().splitlines()) == 4
    proc = json.loads((out / "run.json").read_text())["processes"][0]  # provenance
    assert proc["seed"] == cfg["seed"] and proc["cpu"] and proc["torch"] == torch.__version__
    first = json.loads((out / "trajectories" / "step_1.jsonl").read_text().splitlines()[0])
    planned = next(e for e in first["log"] if e["module"] == "planner")
    assert {"tokens", "finish"} <= set(planned)
    # what the planner saw: its own part of the prompt per turn, the system prompts once
    assert planned["prompt"].startswith(f"Question: {first['query']}") and "Step 1 of at most 2" in planned["prompt"]
    assert "Available tools" in json.loads((out / "prompts.json").read_text())["planner"]
    html = (out / "report.html").read_text()
    assert json.dumps(planned["prompt"])[1:40] in html  # the trajectory browser shows it
    assert "5. Trajectory browser" in html and "2. Held-out evaluation" in html


def test_the_paraphrase_evaluation_changes_neither_training_nor_held_out(tiny_model_dir, tmp_path, learnable_reward):
    """data.paraphrase adds an evaluation with a seed and a folder of its own: the held-out
    results, the metrics and the trained weights are those of a run without it."""
    def outcome(name, paraphrase):
        out = tmp_path / name
        result = run(tiny_cfg(tiny_model_dir, out, "train.steps=1", f"data.paraphrase={paraphrase}",
                              "eval.planner_temperature=1.0"))  # sampled: the seeds matter
        held_out = [(out / "eval" / f"step_{step}" / "results.jsonl").read_text() for step in (0, 1)]
        metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith("time")}
                   for line in (out / "metrics.jsonl").read_text().splitlines()]
        return "paraphrase" in result, held_out, metrics, weights(out / "model")

    (on, *with_it), (off, *without) = outcome("with", ROOT / "data" / "paraphrase.jsonl"), outcome("without", "''")
    assert on and not off
    assert with_it[:2] == without[:2]
    assert all(torch.equal(with_it[2][k], without[2][k]) for k in with_it[2])


def test_resume_equals_uninterrupted(tiny_model_dir, tmp_path, learnable_reward):
    common = ("train.steps=3", "train.save_every=1", "train.eval_before_after=false")
    run(tiny_cfg(tiny_model_dir, tmp_path / "full", *common))
    # Interrupted after step 2 (simulate: run 2 steps), then resumed to 3.
    run(tiny_cfg(tiny_model_dir, tmp_path / "cut", "train.steps=2", "train.save_every=1",
                 "train.eval_before_after=false"))
    run(tiny_cfg(tiny_model_dir, tmp_path / "cut", *common))
    a = weights(tmp_path / "full" / "model")
    b = weights(tmp_path / "cut" / "model")
    start = weights(tiny_model_dir)
    assert any(not torch.equal(a[k], start[k]) for k in a), "training must have moved the weights"
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)
    rows = [json.loads(line)["step"] for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [1, 2, 3]


def test_a_resumed_run_reports_the_untrained_planner_as_before(tiny_model_dir, tmp_path, learnable_reward,
                                                              monkeypatch):
    """A resume whose eval/step_0 is gone (deleted, or copied without it) evaluates "before"
    again: with the untrained planner, not the checkpoint's, which it loads after. The
    planner's weights are taken at each evaluation (the frozen generator's answers of a
    random model may not change when the planner does)."""
    out = tmp_path / "run"
    evaluate, leg, seen = train.evaluate, ["first"], {}  # seen: (leg, eval folder) -> the planner's weights

    def spy(agent, items, folder, **kw):
        seen[(leg[0], folder.relative_to(out).as_posix())] = {k: v.clone() for k, v in
                                                             agent.planner.model.state_dict().items()}
        return evaluate(agent, items, folder, **kw)

    monkeypatch.setattr(train, "evaluate", spy)
    first = run(tiny_cfg(tiny_model_dir, out, "train.steps=2", "train.save_every=1"))
    shutil.rmtree(out / "eval")
    leg[0] = "resumed"
    again = run(tiny_cfg(tiny_model_dir, out, "train.steps=3", "train.save_every=1"))
    untrained = seen[("first", "eval/step_0")]
    trained = seen[("first", "eval/step_2")]
    assert any(not torch.equal(untrained[k], trained[k]) for k in untrained), "training must move the planner"
    for folder in ("eval/step_0", "eval/paraphrase/step_0"):
        for k in untrained:
            assert torch.equal(seen[("resumed", folder)][k], untrained[k]), (folder, k)
    assert again["before"] == first["before"] and again["paraphrase"]["before"] == first["paraphrase"]["before"]


def test_metrics_record_the_lr_each_step_updated_with(tiny_model_dir, tmp_path, learnable_reward):
    run(tiny_cfg(tiny_model_dir, tmp_path / "run", "train.steps=3", "train.eval_before_after=false",
                 "train.save_every=3", "train.warmup_steps=2"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == pytest.approx([5e-4, 1e-3, 1e-3])  # lr * min(1, step / warmup_steps)


def test_data_order_is_a_function_of_seed_and_step():
    items = list(range(10))
    first = [draw_queries(items, s, 4, seed=0) for s in range(5)]
    assert first == [draw_queries(items, s, 4, seed=0) for s in range(5)]
    assert sorted(first[0] + first[1] + first[2][:2]) == items  # an epoch covers every item once
    assert first != [draw_queries(items, s, 4, seed=1) for s in range(5)]


def test_draws_are_stratified_by_task_kind():
    """Every step's Q queries hold each kind in about its share of the data (here 40/40/20
    percent of 100 items, Q = 10: 4/4/2, give or take one), and an epoch still covers
    every item exactly once."""
    from support.datasets import Item

    items = [Item(id=f"{k}{i}", question=f"{k} {i}", gold=["1"], kind="number", meta={"task": k})
             for k, n in (("a", 40), ("b", 40), ("c", 20)) for i in range(n)]
    epoch = []
    for step in range(10):
        draw = draw_queries(items, step, 10, seed=3)
        counts = {k: sum(it.meta["task"] == k for it in draw) for k in "abc"}
        assert abs(counts["a"] - 4) <= 1 and abs(counts["b"] - 4) <= 1 and abs(counts["c"] - 2) <= 1, counts
        epoch += draw
    assert sorted(it.id for it in epoch) == sorted(it.id for it in items)


def test_task_shares_fix_each_steps_mix_and_each_kind_runs_through_its_items():
    """train.task_shares: 40/40/20 items. Equal weights at Q = 9 give 3 of every kind a step,
    and the small kind runs through all its 20 items (each once) in its first 20 draws while
    the big kinds are only half through; 2:1:1 at Q = 8 gives 4/2/2 a step whatever the
    data's mix. The stream depends on (seed, position) only."""
    from support.datasets import Item

    items = [Item(id=f"{k}{i}", question=f"{k} {i}", gold=["1"], kind="number", meta={"task": k})
             for k, n in (("a", 40), ("b", 40), ("c", 20)) for i in range(n)]
    equal = {"a": 1, "b": 1, "c": 1}
    draws = [draw_queries(items, step, 9, seed=3, shares=equal) for step in range(8)]
    for draw in draws:
        assert sorted(it.meta["task"] for it in draw) == ["a"] * 3 + ["b"] * 3 + ["c"] * 3
    seen = [it.id for d in draws for it in d]
    small = [i for i in seen if i.startswith("c")]
    assert sorted(small[:20]) == sorted(f"c{i}" for i in range(20))  # one epoch of c, no repeats
    assert len(set(i for i in seen if i.startswith("a"))) == 24  # a: 24 draws, none repeated yet
    assert draws == [draw_queries(items, step, 9, seed=3, shares=equal) for step in range(8)]
    assert draws != [draw_queries(items, step, 9, seed=4, shares=equal) for step in range(8)]
    leaning = [draw_queries(items, step, 8, seed=3, shares={"c": 2, "a": 1, "b": 1}) for step in range(10)]
    for draw in leaning:
        assert sorted(it.meta["task"] for it in draw) == ["a"] * 2 + ["b"] * 2 + ["c"] * 4
    c_seen = [it.id for d in leaning for it in d if it.id.startswith("c")]  # 40 draws: two epochs of c
    assert sorted(c_seen[:20]) == sorted(c_seen[20:]) == sorted(f"c{i}" for i in range(20))
    assert c_seen[:20] != c_seen[20:]  # each epoch its own shuffle
    # train.task_shares_from=4: steps 1-3 are the data's stream, steps 4 on the shares' stream
    curriculum = [draw_queries(items, step, 8, seed=3, shares={"c": 2, "a": 1, "b": 1}, shares_from=4)
                  for step in range(10)]
    assert curriculum[:3] == [draw_queries(items, step, 8, seed=3) for step in range(3)]
    assert curriculum[3:] == leaning[3:]


@pytest.mark.parametrize("override, words", [
    ("train.lrr=1", ["train.lrr", "allowed", "lr"]),
    ("train.lr=fast", ["train.lr", "float"]),
    ("train.group_size=1", ["group_size", ">= 2"]),
    ("agent.planner.top_p=0.9", ["agent.planner", "top_p"]),
    ("model.device=tpu", ["model.device", "cpu"]),
    ("steps", ["key=value"]),
    ("agent.force_tool=Wikipedia_Search", ["agent.force_tool", "Python_Coder"]),
    ("train.bf16_autocast=true", ["removed", "model.dtype=bfloat16"]),  # unscoreable: fp32 sampler, bf16 loss
    ("train.equal_task_shares=true", ["removed", "train.task_shares"]),
    ("train.task_shares={lookup: 0}", ["train.task_shares", "> 0"]),
    # the shipped config has shares; emptied, a curriculum start has nothing to switch to
    (["train.task_shares={}", "train.task_shares_from=3"], ["train.task_shares_from", "train.task_shares set"]),
    ("train.task_shares_from=0", ["train.task_shares_from", ">= 1"]),
])
def test_bad_config_names_the_key_and_the_fix(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(str(ROOT / "config.yaml"), [override] if isinstance(override, str) else override)
    for w in words:
        assert w in str(e.value)


def test_train_cli_reports_config_errors(capsys):
    from train import main
    assert main([str(ROOT / "config.yaml"), "train.nope=1"]) == 2
    assert "train.nope" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["gameof24", "bamboogle"])
def test_eval_on_official_files_writes_results_and_resumes(tiny_model_dir, tmp_path, name):
    out = tmp_path / name
    args = ["--benchmark", str(BENCH / f"{name}.json"), "--config", str(ROOT / "config.yaml"),
            "--limit", "3", "--max-turns", "1", "--out", str(out), f"model.name={tiny_model_dir}",
            "model.device=cpu", f"tools.corpus={ROOT / 'data' / 'corpus.jsonl'}",
            "agent.executor.max_new_tokens=8", "agent.generator.max_new_tokens=6", "agent.generator.temperature=1.0",
            "agent.planner.max_new_tokens=6"]
    assert evaluation.main(args) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        for key in ("question", "gold", "answer", "correct", "turns", "tools", "errors", "trajectory"):
            assert key in r
        assert r["turns"] == 1 and r["trajectory"]["log"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 3 and 0 <= summary["accuracy"] <= 1
    for key in ("mean_turns", "tool_shares", "tool_error_rate"):
        assert key in summary
    # Resume: a second run over 4 items only runs the missing one.
    assert evaluation.main(args[:5] + ["4"] + args[6:]) == 0
    rows2 = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows2) == 4 and rows2[:3] == rows


@pytest.mark.parametrize("path", [ROOT / "config.yaml", *sorted((ROOT / "configs").glob("*.yaml"))])
def test_shipped_configs_are_valid(path):
    cfg = load_config(str(path))
    assert cfg["train"]["group_size"] >= 2 and cfg["agent"]["tools"]


# ----------------------------------------------------------------------------- infrastructure failures

def fake_trajectories(turns_per_traj, rewards):
    from agentflow import PlannerTurn, Trajectory
    from memory import Memory
    trajs = []
    for k, (T, r) in enumerate(zip(turns_per_traj, rewards)):
        tr = Trajectory(f"q{k}", Memory(100, 100))
        tr.turns = [PlannerTurn([1, 2, k], [3 + t], [-0.5], "") for t in range(T)]
        tr.reward = r
        trajs.append(tr)
    return trajs


def test_kept_rows_keeps_the_weights_of_J_for_what_remains():
    from flow_grpo import group_advantages, kept_rows
    G, turns = 4, [1, 2, 3, 1, 2, 2, 1, 3, 1, 1, 2, 3]
    rewards = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    # Nothing left out: exactly the rows of the whole batch (the path every offline run takes),
    # A_i over each group of G broadcast to the T_i turns of trajectory i, each weighing 1 / (N T_i).
    trajs = fake_trajectories(turns, rewards)
    rows, groups = kept_rows(trajs, [True] * 12, G)
    A, N = group_advantages(rewards, G), len(trajs)
    expected = [(A[k], 1.0 / (N * turns[k]), t.action_ids) for k in range(N) for t in trajs[k].turns]
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert [(r.advantage, r.weight, r.action_ids) for r in rows] == expected  # equal floats, not just close
    # Trajectory 1 failed, and 4, 6, 7 of group 2: group 1 keeps three rollouts, group 2 one (dropped).
    trajs = fake_trajectories(turns, rewards)
    usable = [k not in (1, 4, 6, 7) for k in range(12)]
    rows, groups = kept_rows(trajs, usable, G)
    assert groups == [[0, 2, 3], [8, 9, 10, 11]]
    kept = [0, 2, 3, 8, 9, 10, 11]
    assert len(rows) == sum(turns[k] for k in kept)
    adv = group_advantages([rewards[k] for k in (0, 2, 3)], 3)  # normalised over the three that remain
    assert [trajs[k].advantage for k in (0, 2, 3)] == adv and trajs[1].advantage is None
    at = 0
    for g in groups:  # weight 1 / (Q' G_q T_i): each kept query weighs 1/Q', each trajectory in it 1/G_q
        for k in g:
            for row in rows[at:at + turns[k]]:
                assert row.weight == pytest.approx(1 / (2 * len(g) * turns[k]), rel=1e-15)
                assert row.advantage == trajs[k].advantage
            at += turns[k]
    assert sum(r.weight for r in rows) == pytest.approx(1.0)
    # A group left with one rollout carries nothing: A = 0 for it alone.
    assert group_advantages([1.0], 1) == [0.0]


def test_kept_rows_asks_for_the_turn_scores_of_kept_trajectories_only():
    """train.py gives credit per turn its scores as a function of the trajectory k: it is
    asked for the kept groups' trajectories alone, and the rows equal those a list gives."""
    from flow_grpo import kept_rows
    G, turns, rewards = 2, [1, 2, 2, 1, 3, 1], [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    scores = [[0.5 * t + R for t in range(T)] for T, R in zip(turns, rewards)]
    usable = [True, True, True, False, True, True]  # the second group keeps one rollout: dropped
    asked = []

    def score(k):
        asked.append(k)
        return scores[k]

    by_list = kept_rows(fake_trajectories(turns, rewards), usable, G, "per_turn", None, scores)[0]
    by_function = kept_rows(fake_trajectories(turns, rewards), usable, G, "per_turn", turn_scores=score)[0]
    assert asked == [0, 1, 4, 5]
    assert [(r.advantage, r.weight) for r in by_function] == [(r.advantage, r.weight) for r in by_list]
    assert len({r.advantage for r in by_list}) > 2  # each turn its own advantage


@pytest.fixture()
def search_down(monkeypatch):
    """Local_Search fails as the network would after its retries (an outage, a quota)."""
    from tools import LocalSearch, ToolError

    def down(self, command):
        raise ToolError("HTTP 503 from search.example (gave up after 4 tries)", infra=True)
    monkeypatch.setattr(LocalSearch, "_run", down)


@pytest.fixture()
def search_flaky(monkeypatch):
    """Local_Search fails as the network would for about half of the commands (those of
    even length: the same command fails every time, whatever the thread order)."""
    from tools import LocalSearch, ToolError

    real = LocalSearch._run

    def flaky(self, command):
        if len(command) % 2 == 0:
            raise ToolError("HTTP 503 from search.example (gave up after 4 tries)", infra=True)
        return real(self, command)
    monkeypatch.setattr(LocalSearch, "_run", flaky)


def test_infrastructure_failures_are_left_out_of_the_update(tiny_model_dir, tmp_path, learnable_reward, search_flaky,
                                                           monkeypatch):
    updates = []
    real = train.policy_update
    monkeypatch.setattr(train, "policy_update", lambda model, ref, opt, rows, *a, **kw:
                        updates.append(rows) or real(model, ref, opt, rows, *a, **kw))
    cfg = tiny_cfg(tiny_model_dir, tmp_path / "run", "train.steps=1", "train.queries_per_step=4",
                   "train.group_size=3", "eval.limit=8")
    run(cfg)
    out = tmp_path / "run"
    (metrics,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trajs = [json.loads(line) for line in (out / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    failed = [any(r["infra"] for r in t["memory"]) for t in trajs]
    assert 0 < sum(failed) < 10, "the seed must give some failures and keep some groups"
    for t, f in zip(trajs, failed):  # a failure is never scored
        assert (t["reward"] is None) == f and t["infra_failures"] == (sum(r["infra"] for r in t["memory"]))
    groups = [[k for k in range(q, q + 3) if not failed[k]] for q in range(0, 12, 3)]
    groups = [g for g in groups if len(g) >= 2]
    kept = [k for g in groups for k in g]
    assert metrics["infra_failures"] == sum(t["infra_failures"] for t in trajs)
    assert metrics["excluded_trajectories"] == 12 - len(kept) and metrics["excluded_groups"] == 4 - len(groups)
    assert metrics["judge"]["rule"] == 12 - sum(failed)  # the failed ones were not judged
    assert all(t["advantage"] is None for k, t in enumerate(trajs) if k not in kept)
    (rows,) = updates
    assert len(rows) == sum(trajs[k]["n_turns"] for k in kept) and sum(r.weight for r in rows) == pytest.approx(1.0)
    judged = [t["reward"] for t in trajs if t["reward"] is not None]
    assert metrics["reward_mean"] == pytest.approx(sum(judged) / len(judged))  # over what was judged
    assert all(trajs[k]["reward"] in (0.0, 1.0) for k in kept)
    # The model's own tool errors are counted apart from these.
    model_errors = sum(1 for t in trajs for r in t["memory"] if r["tool"] and r["error"] and not r["infra"])
    calls = sum(len(t["tools"]) for t in trajs)
    assert metrics["tool_error_rate"] == pytest.approx(model_errors / calls)
    # Held-out: failed items are reported as such and stay in the denominator.
    summary = json.loads((out / "eval" / "step_1" / "summary.json").read_text())
    rows_eval = [json.loads(line) for line in (out / "eval" / "step_1" / "results.jsonl").read_text().splitlines()]
    hit = [r for r in rows_eval if r["infra_failures"]]
    assert summary["n"] == 8 and summary["infra_failures"] == len(hit)
    clean = [r for r in rows_eval if not r["infra_failures"]]
    assert summary["accuracy_without_infra"] == (sum(r["correct"] for r in clean) / len(clean) if clean else None)


def test_a_step_where_every_rollout_failed_does_not_update(tiny_model_dir, tmp_path, learnable_reward, search_down,
                                                          capsys):
    cfg = tiny_cfg(tiny_model_dir, tmp_path / "run", "train.steps=1", "agent.force_tool=Local_Search",
                   "train.eval_before_after=false")
    run(cfg)
    (metrics,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics["excluded_trajectories"] == 4 and metrics["excluded_groups"] == 2
    assert metrics["reward_mean"] is None and metrics["kl"] is None and metrics["optimizer_steps"] == 0
    assert "no update" in capsys.readouterr().err
    before, after = weights(tiny_model_dir), weights(tmp_path / "run" / "model")
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing moved
def test_the_reference_shares_every_frozen_weight(tiny_model_dir):
    """One copy of each frozen weight: pi_ref holds the policy's own tensors for them and
    copies only the trained ones, which keep their initial values while the policy's move."""
    from support.models import load_model
    from flow_grpo import frozen_reference, optimizer_step
    from support.optim import PlannerOptimizer, select_trainable

    model, _ = load_model(tiny_model_dir, "cpu", "float32")
    trained = select_trainable(model, 1)
    ref = frozen_reference(model, trained)
    ids = {id(p) for p in trained}
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.data_ptr() == q.data_ptr()) == (id(p) not in ids), name
        assert not q.requires_grad
    opt = PlannerOptimizer(trained, lr=1e-2)
    x = torch.randint(0, 100, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    optimizer_step(opt, max_grad_norm=1e9)
    for (name, q), p in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(q, start[name]), name  # the reference did not move
        if id(p) in ids:
            assert not torch.equal(p, q), name  # the policy's trained weights did


def test_a_bf16_checkpoint_restores_the_masters(tiny_model_dir, tmp_path):
    """trainer_state.pt holds the fp32 masters: a resume continues from them, not from
    their bf16 rounding (which would lose every update below half a bf16 step)."""
    from flow_grpo import optimizer_step
    from support.checkpoints import resume, save_checkpoint
    from support.models import load_model
    from support.optim import PlannerOptimizer, select_trainable

    def build():
        model, tok = load_model(tiny_model_dir, "cpu", "bfloat16")
        return model, tok, PlannerOptimizer(select_trainable(model, 1), lr=1e-4)

    model, tok, opt = build()
    x = torch.randint(0, 100, (2, 8))
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        optimizer_step(opt, 1.0)
    save_checkpoint(tmp_path, 2, model, opt)
    model2, _, opt2 = build()
    assert resume(tmp_path, model2, opt2) == 2
    masters, masters2 = opt.masters, opt2.masters
    for a, b in zip(masters.masters, masters2.masters):
        assert torch.equal(a, b) and a.dtype == torch.float32
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in masters2.masters)  # finer than bf16
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_out_of_memory_in_the_held_out_evaluation_stops_the_run(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """Not a crashed item that lowers accuracy: the run stops, with the plan and the knob."""
    from agentflow import AgentSystem

    def oom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(AgentSystem, "rollout", oom)
    cfg = tiny_cfg(tiny_model_dir, tmp_path / "run", "train.steps=1")
    args = [str(ROOT / "config.yaml")] + [f"{k}" for k in (
        f"model.name={tiny_model_dir}", "model.device=cpu", f"out_dir={tmp_path / 'run'}",
        f"tools.corpus={ROOT / 'data' / 'corpus.jsonl'}", f"data.train={ROOT / 'data' / 'train.jsonl'}",
        f"data.heldout={ROOT / 'data' / 'heldout.jsonl'}", "eval.limit=2", "train.train_layers=2")]
    assert cfg["train"]["eval_before_after"]
    assert train.main(args) == 3
    err = capsys.readouterr().err
    assert "out of memory during the held-out evaluation" in err and "model.memory_gb" in err
    assert "memory plan:" in err  # the plan, printed with the error
    results = tmp_path / "run" / "eval" / "step_0" / "results.jsonl"
    assert not results.exists() or "crashed" not in results.read_text()


def test_a_two_turn_trajectory_trains_both_planner_turns_with_its_advantage(tiny_model_dir, tmp_path,
                                                                             learnable_reward, monkeypatch):
    """The reward broadcast of Flow-GRPO end to end: every trajectory runs two turns (search,
    then code; the verifier never stops it), and the update receives two rows per trajectory,
    the ids each planner turn sampled, both with the trajectory's group advantage A_i and the
    weight 1/(N * T_i) = 1/(N * 2)."""
    import agentflow
    from flow_grpo import group_advantages
    real_init = agentflow.AgentSystem.__init__

    def never_stop(self, *a, **k):
        real_init(self, *a, **k)
        self.stop_token, self.check_system = -1, {}

    monkeypatch.setattr(agentflow.AgentSystem, "__init__", never_stop)
    seen = {}
    real_update = train.policy_update

    def recording_update(model, ref, optimizer, rows, *a, **k):
        seen["rows"] = rows
        return real_update(model, ref, optimizer, rows, *a, **k)

    monkeypatch.setattr(train, "policy_update", recording_update)
    cfg = tiny_cfg(tiny_model_dir, tmp_path / "run", "train.steps=1", "train.eval_before_after=false",
                   "agent.force_tool='Local_Search,Python_Coder'", "train.queries_per_step=3")
    run(cfg)
    trajs = [json.loads(line) for line in (tmp_path / "run" / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    assert all(t["tools"] == ["Local_Search", "Python_Coder"] for t in trajs)
    rewards = [t["reward"] for t in trajs]
    adv = group_advantages(rewards, 2)
    assert any(a != 0 for a in adv), "the test reward must give a signal"
    rows, N = seen["rows"], len(trajs)
    assert len(rows) == 2 * N
    for i, t in enumerate(trajs):
        first, second = rows[2 * i], rows[2 * i + 1]
        assert [len(first.action_ids), len(second.action_ids)] == [e["tokens"] for e in t["log"]
                                                                   if e["module"] == "planner"]
        assert first.prompt_ids != second.prompt_ids  # turn 2's state holds turn 1's record
        assert first.advantage == second.advantage == pytest.approx(adv[i]) == pytest.approx(t["advantage"])
        assert first.weight == second.weight == pytest.approx(1 / (N * 2))


def test_eval_sweeps_the_turn_budget_for_frozen_and_trained(tiny_model_dir, tmp_path, capsys):
    """eval.py --sweep 1,2 --model CK: each planner at each budget, the table printed and
    OUT_DIR/turn_sweep.json written (the report reads it). Given the frozen weights as the
    'trained' checkpoint, both rows must agree item for item; no trajectory runs past its budget."""
    out = tmp_path / "run"
    args = ["--benchmark", str(ROOT / "data" / "heldout.jsonl"), "--config", str(ROOT / "config.yaml"),
            "--limit", "3", "--sweep", "1,2", "--model", tiny_model_dir, f"model.name={tiny_model_dir}",
            "model.device=cpu", f"out_dir={out}", f"tools.corpus={ROOT / 'data' / 'corpus.jsonl'}",
            "agent.executor.max_new_tokens=8", "agent.generator.max_new_tokens=6", "agent.planner.max_new_tokens=6"]
    assert evaluation.main(args) == 0
    sweep = json.loads((out / "turn_sweep.json").read_text())
    assert sweep["budgets"] == [1, 2]
    (frozen, f), (trained, t) = sweep["planners"].items()
    assert frozen == "frozen" and trained.startswith("trained")
    assert f == t  # the same weights: the same table
    assert f["1"]["mean_turns"] == 1.0 and 1.0 <= f["2"]["mean_turns"] <= 2.0
    assert all(f[b]["n"] == 3 and set(f[b]["by_kind"]) <= {"arithmetic", "lookup", "two_step"} for b in "12")
    table = capsys.readouterr().out
    assert "mean turns" in table and table.count("\nfrozen") == 2


def test_a_shaped_reward_flows_through_advantages_metrics_and_report(tiny_model_dir, tmp_path):
    """reward.terms = correct + 0.25 format - 0.1 turns: R_i is each trajectory's weighted
    sum of its terms, not 0/1; the group advantage normalises it; metrics log each term's
    mean while accuracy stays the judge's; the report and a comparison with a 0/1 run render."""
    from support.report.compare import write_comparison
    from support.report.page import write_report
    out = tmp_path / "shaped"
    run(tiny_cfg(tiny_model_dir, out, "train.steps=1", "train.eval_before_after=false",
                 "reward.terms={correct: 1.0, format: 0.25, turns: -0.1}"))
    m = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    trajs = [json.loads(line) for line in (out / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    for tr in trajs:
        t = tr["reward_terms"]
        assert set(t) == {"correct", "format", "turns"} and t["correct"] == float(tr["correct"])
        assert tr["reward"] == pytest.approx(t["correct"] + 0.25 * t["format"] - 0.1 * t["turns"])
    assert any(tr["reward"] not in (0.0, 1.0) for tr in trajs)
    for g in range(0, len(trajs), 2):  # G = 2: A = (R - mean) / (std + eps), whatever R is
        r = [tr["reward"] for tr in trajs[g:g + 2]]
        mean, std = sum(r) / 2, (sum((x - sum(r) / 2) ** 2 for x in r) / 2) ** 0.5
        assert [tr["advantage"] for tr in trajs[g:g + 2]] == pytest.approx([(x - mean) / (std + 1e-6) for x in r])
    assert m["accuracy"] == sum(tr["correct"] for tr in trajs) / len(trajs)
    assert m["reward_mean"] == pytest.approx(sum(tr["reward"] for tr in trajs) / len(trajs))
    assert m["reward_terms"]["turns"] == pytest.approx(sum(tr["reward_terms"]["turns"] for tr in trajs) / len(trajs))
    plain = tmp_path / "plain"
    run(tiny_cfg(tiny_model_dir, plain, "train.steps=1", "train.eval_before_after=false"))
    assert "Reward terms" in write_report(out).read_text()
    assert write_comparison([out, plain]).exists()


def test_reward_terms_are_checked_before_a_model_loads(tmp_path, capsys):
    base = [str(ROOT / "config.yaml"), f"out_dir={tmp_path}"]
    assert train.main(base + ["reward.terms={correct: 1.0, brevity: 0.5}"]) == 2
    assert "unknown term(s) brevity" in capsys.readouterr().err
    assert train.main(base + ["reward.modules=[no_such_reward_module]"]) == 2
    assert "reward.modules" in capsys.readouterr().err


def test_credit_per_turn_runs_a_step_and_records_each_turns_advantage(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "per_turn"
    run(tiny_cfg(tiny_model_dir, out, "train.steps=1", "train.eval_before_after=false",
                 "train.advantage_mode=per_turn", "train.turn_score=tool_errors", "train.row_weight=turn"))
    trajs = [json.loads(line) for line in (out / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    assert all(len(tr["turn_advantages"]) == tr["n_turns"] for tr in trajs)
    assert all(tr["advantage"] == pytest.approx(sum(tr["turn_advantages"]) / tr["n_turns"]) for tr in trajs)
    assert json.loads((out / "metrics.jsonl").read_text())["optimizer_steps"] == 1
    assert train.main([str(ROOT / "config.yaml"), f"out_dir={tmp_path}", "train.advantage_mode=per_turn",
                       "train.turn_score=hindsight"]) == 2
    assert "unknown turn score 'hindsight'" in capsys.readouterr().err


def test_the_planner_and_the_frozen_modules_may_be_different_models(tiny_model_dir, tmp_path, capsys):
    """model.planner trains its own model while executor, verifier and generator run
    model.name: the checkpoint is the planner's architecture, the frozen model is another
    object that never moves, the memory plan counts both; a planner whose tokenizer is not
    the frozen model's is refused in one line before a model loads."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    torch.manual_seed(3)
    other = tmp_path / "frozen_modules"  # three blocks, the same tokenizer
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)).save_pretrained(other)
    tok.save_pretrained(other)
    before = load_file(str(other / "model.safetensors"))
    out = tmp_path / "run"
    seen = {}
    real = train.AgentSystem.__init__

    def spy(self, planner, frozen, *a, **k):
        seen["planner"], seen["frozen"] = planner.model, frozen.model
        real(self, planner, frozen, *a, **k)

    train.AgentSystem.__init__ = spy
    try:
        run(tiny_cfg(tiny_model_dir, out, f"model.planner={tiny_model_dir}", f"model.name={other}", "train.steps=1",
                     "train.eval_before_after=false"))
    finally:
        train.AgentSystem.__init__ = real
    assert seen["planner"].config.num_hidden_layers == 2 and seen["frozen"].config.num_hidden_layers == 3
    assert "the frozen modules' own model" in capsys.readouterr().out  # the plan counts it
    trained = AutoModelForCausalLM.from_pretrained(out / "model")
    assert trained.config.num_hidden_layers == 2  # the planner is what trains
    assert all(torch.equal(before[k], v) for k, v in seen["frozen"].state_dict().items())  # never moved
    odd = tmp_path / "odd_tokenizer"
    shutil.copytree(tiny_model_dir, odd)
    t2 = AutoTokenizer.from_pretrained(odd)
    t2.add_tokens(["<only_here>"])
    t2.save_pretrained(odd)
    assert train.main([str(ROOT / "config.yaml"), *tiny_overrides(tiny_model_dir, tmp_path / "r2"),
                       f"model.planner={odd}"]) == 2
    assert "different tokenizers" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_checkpoint_exports_the_model_train_exports(tiny_model_dir, tmp_path, dtype):
    """The checkpoint holds what a resume needs (bf16 weights as their fp32 masters);
    scripts/export_model rebuilds from it the very model train.py exported at the end."""
    from scripts import export_model
    out = tmp_path / "run"
    run(tiny_cfg(tiny_model_dir, out, "train.steps=1", "train.eval_before_after=false", f"model.dtype={dtype}"))
    shutil.move(out / "model", tmp_path / "exported_by_train")
    assert export_model.main([str(out)]) == 0
    a, b = weights(tmp_path / "exported_by_train"), weights(out / "model")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert export_model.main([str(tmp_path / "no_run")]) == 2


def test_a_run_whose_checkpoints_would_not_fit_on_disk_stops_before_loading(tmp_path, monkeypatch, capsys):
    """The preflight holds the plan's disk need against out_dir's free space."""
    import collections

    from support import checkpoints
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda p: collections.namedtuple("U", "total used free")(
        10 ** 9, 10 ** 9 - 10 ** 6, 10 ** 6))
    monkeypatch.setattr(train, "load_model", lambda *a, **k: pytest.fail("the preflight must refuse first"))
    assert train.main([str(ROOT / "config.yaml"), f"out_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "out_dir: 0.0 GB free" in err and "--plan" in err


def test_a_run_executes_the_functions_a_learner_reads(tiny_model_dir, tmp_path, learnable_reward, monkeypatch):
    """What a learner reads is what train.py runs: patch the sampler's draw (engine.draw) and
    a step samples other actions; patch the trainer's log-probs (flow_grpo.ChunkedLogprobs)
    and the same actions get another gradient."""
    import engine
    import flow_grpo

    def one_step(name):
        run(tiny_cfg(tiny_model_dir, tmp_path / name, "train.steps=1", "train.eval_before_after=false"))
        out = tmp_path / name
        actions = [[e["output"] for e in json.loads(line)["log"] if e["module"] == "planner"]
                   for line in (out / "trajectories" / "step_1.jsonl").read_text().splitlines()]
        return actions, json.loads((out / "metrics.jsonl").read_text())["grad_norm"]

    actions, grad_norm = one_step("as_shipped")
    assert grad_norm
    real_draw, real_logprobs = engine.draw, flow_grpo.ChunkedLogprobs.apply
    monkeypatch.setattr(engine, "draw", lambda w, gen: real_draw(w.flip(-1), gen).neg() + w.shape[-1] - 1)
    assert one_step("other_draw")[0] != actions  # the mirror-image draw: other tokens
    monkeypatch.setattr(engine, "draw", real_draw)
    monkeypatch.setattr(flow_grpo.ChunkedLogprobs, "apply", lambda *a: tuple(x * 3 for x in real_logprobs(*a)))
    same_actions, other_norm = one_step("other_logprobs")
    assert same_actions == actions and other_norm != pytest.approx(grad_norm)


def test_the_allocator_setting_is_in_force_before_cuda_starts(tiny_model_dir, tmp_path, monkeypatch):
    """train.py's start-up path on a faked CUDA device: its first CUDA call (the memory plan
    asking the device's size) already sees expandable segments in the environment, which
    torch reads when CUDA starts (set later, it is silently off)."""
    import os

    class FirstCudaCall(Exception):
        pass

    def device_properties(*a):
        seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        raise FirstCudaCall

    seen = []
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", device_properties)
    with pytest.raises(FirstCudaCall):
        train.main([str(ROOT / "config.yaml"), *tiny_overrides(tiny_model_dir, tmp_path / "run"), "model.device=cuda"])
    assert seen == ["expandable_segments:True"]


def test_steps_that_train_on_nothing_stop_the_run_with_the_cause(tiny_model_dir, tmp_path, learnable_reward,
                                                                  search_down, capsys):
    """Every search down for good: after train.max_infra_steps steps in a row without an
    update, train.py stops, says why and where the errors are, and keeps the steps' metrics."""
    out = tmp_path / "run"
    args = [str(ROOT / "config.yaml"), *tiny_overrides(tiny_model_dir, out), "train.steps=5", "train.max_infra_steps=2",
            "agent.force_tool=Local_Search", "train.eval_before_after=false"]
    assert train.main(args) == 4
    err = capsys.readouterr().err
    assert "steps 1-2 trained on nothing" in err and "trajectories/step_2.jsonl" in err and "max_infra_steps=0" in err
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_an_answer_the_judge_could_not_reach_gets_no_reward():
    """A served judge that fails (its infrastructure, not its reply) leaves the trajectory
    out, as a tool's outage does: no reward, so no group counts it; the rules' verdict stays
    for the counts."""
    from judge import Reward
    from train import judge_rollouts

    class DownJudge:
        def score_batch(self, answers, items):
            return [{"correct": False, "f1": 0.0, "extracted": a, "judge": "rule", "judge_error": "HTTP 503",
                     "judge_infra": k == 0} for k, a in enumerate(answers)]

    trajs = fake_trajectories([1, 1], [0.0, 0.0])
    item = type("Item", (), {"question": "q", "gold": ["1"], "kind": "number", "options": None, "numbers": None})()
    verdicts = judge_rollouts(trajs, [item], 2, DownJudge(), Reward.from_config({"terms": {"correct": 1.0},
                                                                                  "modules": []}))
    assert trajs[0].reward is None and trajs[1].reward == 0.0
    assert verdicts[0]["judge_error"] == "HTTP 503"  # still counted as a failed judge call


def test_beta_0_with_a_planner_of_its_own_builds_no_reference(tiny_model_dir, tmp_path, monkeypatch, capsys,
                                                              learnable_reward):
    """Nothing reads pi_ref there (no KL term; the frozen modules run model.name): the run
    trains without building it, reports its KL as 0.0 (as any beta-0 run), and its plan has
    no line for the reference's copies."""
    from scripts.tiny_model import build
    planner = build(str(tmp_path / "planner"), seed=1)  # the tiny model's shape and tokenizer
    monkeypatch.setattr(train, "frozen_reference", lambda *a: pytest.fail("beta 0 must not build pi_ref"))
    seen = {}
    real = train.build_run
    monkeypatch.setattr(train, "build_run", lambda cfg: seen.setdefault("run", real(cfg)))
    out = tmp_path / "run"
    assert train.main([str(ROOT / "config.yaml"), *tiny_overrides(tiny_model_dir, out, "train.steps=1",
                                                                  "train.eval_before_after=false", "train.beta=0",
                                                                  f"model.planner={planner}")]) == 0
    printed = capsys.readouterr().out  # the plan, printed at the start
    assert seen["run"].ref is None and "the frozen modules' own model" in printed
    assert "the reference's copies" not in printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["optimizer_steps"] > 0 and rows[0]["kl"] == 0.0


def test_a_model_folder_without_tokenizer_files_is_refused_before_loading(tiny_model_dir, tmp_path, monkeypatch,
                                                                          capsys):
    """A qwen2 folder without its tokenizer's files: transformers would build a tokenizer of
    one token from it, silently. As model.name or model.planner the preflight refuses it,
    naming the folder and the files, before any weights load (not as 'different tokenizers')."""
    from scripts.tiny_model import build
    from support.models import TOKENIZER_FILES
    bare = Path(build(str(tmp_path / "bare"), family="qwen2", seed=1))
    for f in bare.iterdir():
        if "token" in f.name or f.name in ("chat_template.jinja", "vocab.json", "merges.txt"):
            f.unlink()
    monkeypatch.setattr(train, "load_model", lambda *a, **k: pytest.fail("the preflight must refuse first"))
    for key, extra in (("model.name", []), ("model.planner", [f"model.planner={bare}"])):
        model = bare if key == "model.name" else tiny_model_dir
        assert train.main([str(ROOT / "config.yaml"), *tiny_overrides(model, tmp_path / key, *extra)]) == 2
        err = capsys.readouterr().err
        assert f"{key}: {bare} has no tokenizer files" in err and TOKENIZER_FILES[0] in err
        assert "different tokenizers" not in err
