"""gpu_check.py runs on a CPU too (toy sizes, no memory counters), so it cannot rot between
the rare runs on a GPU; and each of its checks can fail: every test below breaks one thing
the way a real regression would and sees that check print FAIL."""

import re
import time
import types

import pytest
import torch

import engine
import flow_grpo
from scripts import gpu_check

Z = gpu_check.SIZES["cpu"]


def run(part: str, capsys, *args) -> dict:
    """Run one part on the CPU; {check name: "PASS" | "FAIL"} and the figures printed."""
    r = gpu_check.Report("cpu")
    if part in ("train", "paper", "lora24"):
        gpu_check.PARTS[part](r, Z, "cpu", *args)
    else:
        gpu_check.PARTS[part](r, Z, "cpu")
    out = capsys.readouterr().out
    return {m[0]: m[1] for m in re.findall(r"^CHECK (\w+): .* (PASS|FAIL) ", out, re.M)}


def test_gpu_check_runs_on_a_cpu_and_passes(capsys):
    assert gpu_check.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    verdicts = dict(re.findall(r"^CHECK (\w+): .* (PASS|FAIL) ", out, re.M))
    assert set(verdicts.values()) == {"PASS"}
    cuda_only = {n for n in gpu_check.THRESHOLDS if n.startswith(("memory_", "speed_static"))}
    cuda_only |= {"paper_expandable_segments", "paper_allocated_peak_over_plan", "paper_reserved_peak_over_budget",
                  "lora24_allocated_peak_over_plan", "lora24_reserved_peak_over_cap"}
    assert set(verdicts) == set(gpu_check.THRESHOLDS) - cuda_only  # every other check ran
    assert "failed: none" in out and "memory: skipped" in out


class Fake:
    """Memory counters for the CUDA-only part on a CPU; `scale` sets what they read."""
    scale = 1.0
    sync = reset = staticmethod(lambda: None)
    now = peak = staticmethod(lambda: 1e3 * Fake.scale)
    reserved_peak = staticmethod(lambda: 2e3 * Fake.scale)
    total = staticmethod(lambda: 1e9)


def test_the_memory_part_runs_on_fake_counters(monkeypatch, capsys):
    """With counters that read little, every memory check passes, and the rollout is split
    into several sub-batches (the plan's budget is lowered until it must be)."""
    monkeypatch.setattr(gpu_check, "counters", lambda dev: Fake)
    monkeypatch.setattr(Fake, "scale", 1.0)
    verdicts = run("memory", capsys)
    assert verdicts == {n: "PASS" for n in gpu_check.THRESHOLDS if n.startswith("memory_")}


def _second_best(pick):
    """A sampler whose greedy choice is the runner-up token: wrong tokens, wrong log-probs."""
    def broken(logits, temperature, gen):
        if temperature > 0:
            return pick(logits, temperature, gen)
        return pick(logits.scatter(-1, logits.argmax(-1, keepdim=True), float("-inf")), temperature, gen)
    return broken


def _scaled_logprobs(pick):
    """A sampler that reports its log-probs 10% off (say, at another temperature)."""
    def broken(logits, temperature, gen):
        tok, lp = pick(logits, temperature, gen)
        return tok, lp * 1.1
    return broken


def _late_look(sample):
    """Looking every 8 tokens, each stopped row loses its last token (an off-by-one)."""
    def broken(self, prompts, params, seed=0, row_stops=None):
        out = sample(self, prompts, params, seed, row_stops)
        if self.check_every == 8:
            for s in out:
                if s.finish == "stop":
                    s.ids = s.ids[:-1]
        return out
    return broken


def _flipped_advantages(loss):
    def broken(logp, old_logp, ref_logp, adv, row_weight, mask, cfg):
        return loss(logp, old_logp, ref_logp, adv.flip(0) * 1.5, row_weight, mask, cfg)
    return broken


def _sampler_as_pi_old(accumulate):
    """The official code's trap: pi_old taken from the sampler's (bf16, other kernels) log-probs."""
    def broken(model, ref, rows, *a, old=None, **kw):
        return accumulate(model, ref, rows, *a, old=[torch.tensor(r.sampler_logprobs) for r in rows], **kw)
    return broken


def _slow_decode(mp, seconds: float = 10.0):
    """A sampler whose decode step costs `seconds` more, on a clock of the check's own: every
    engine.decode_step (the CPU's decode, which LLM.decode looks up at each call) moves the
    clock that gpu_check times with forward by `seconds`, and sleeps not at all. generate
    never calls it, so the sampler is measured slower than generate by a margin no
    machine's speed or load can hide (generate at this toy size, milliseconds, would have to
    take seconds)."""
    late = [0.0]
    step = engine.decode_step

    def broken(*a, **kw):
        late[0] += seconds
        return step(*a, **kw)
    mp.setattr(engine, "decode_step", broken)
    mp.setattr(gpu_check, "time", types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + late[0],
                                                         time=time.time))


BREAKS = {
    # check: (part, what breaks it)
    "sampler_fp32_logprob_max_diff": ("sampler", lambda mp: mp.setattr(engine, "pick", _scaled_logprobs(engine.pick))),
    "sampler_bf16_logprob_max_diff": ("sampler", lambda mp: mp.setattr(engine, "pick", _scaled_logprobs(engine.pick))),
    "sampler_fp32_not_argmax_tokens": ("sampler", lambda mp: mp.setattr(engine, "pick", _second_best(engine.pick))),
    "sampler_bf16_argmax_margin_max": ("sampler", lambda mp: mp.setattr(engine, "pick", _second_best(engine.pick))),
    "stops_rows_ended_by_a_stop_string": ("stops", lambda mp: mp.setattr(engine.LLM, "_hit_stop", lambda *a: False)),
    "stops_rows_differing_every_8_vs_every_1": ("stops", lambda mp: mp.setattr(engine.LLM, "sample",
                                                                             _late_look(engine.LLM.sample))),
    "stops_texts_holding_their_stop": ("stops", lambda mp: mp.setattr(engine.LLM, "_text",
                                                                    lambda self, ids, stops: self.tok.decode(ids))),
    "loss_bf16_grad_rel_err": ("loss", lambda mp: mp.setattr(flow_grpo, "flow_grpo_loss",
                                                             _flipped_advantages(flow_grpo.flow_grpo_loss))),
    "loss_bf16_grad_cosine": ("loss", lambda mp: mp.setattr(flow_grpo, "flow_grpo_loss",
                                                            _flipped_advantages(flow_grpo.flow_grpo_loss))),
    "onpolicy_logratio_mean": ("onpolicy", lambda mp: mp.setattr(engine, "pick", _scaled_logprobs(engine.pick))),
    "onpolicy_logratio_p99": ("onpolicy", lambda mp: mp.setattr(engine, "pick", _scaled_logprobs(engine.pick))),
    "onpolicy_ratio_dev_first_step_1x1": ("onpolicy", lambda mp: mp.setattr(
        flow_grpo, "accumulate_gradients", _sampler_as_pi_old(flow_grpo.accumulate_gradients))),
    "speed_rows_differing_from_generate": ("speed", lambda mp: mp.setattr(engine, "pick", _second_best(engine.pick))),
    "speed_sampler_over_generate": ("speed", _slow_decode),
    "memory_resident_over_plan": ("memory", lambda mp: mp.setattr(Fake, "scale", 1e9)),
    "memory_sampler_peak_over_plan": ("memory", lambda mp: mp.setattr(Fake, "scale", 1e9)),
    "memory_update_peak_over_plan": ("memory", lambda mp: mp.setattr(Fake, "scale", 1e9)),
    "memory_reserved_peak_over_budget": ("memory", lambda mp: mp.setattr(Fake, "scale", 1e9)),
    "memory_sampler_sub_batches": ("memory", lambda mp: mp.setattr(engine, "sampler_sub_batches",
                                                                   lambda prompts, *a: [range(len(prompts))])),
    "train_exit_codes_nonzero": ("train", lambda mp: mp.setattr(gpu_check, "ROOT", gpu_check.ROOT / "docs")),
    "paper_exit_code": ("paper", lambda mp: mp.setattr(gpu_check, "ROOT", gpu_check.ROOT / "docs")),
    # a run that ends after its first step: step 2, with AdamW's moments resident, never runs
    "paper_steps_updated": ("paper", lambda mp: mp.setattr(gpu_check, "PAPER_STAND_INS", [
        "train.steps=1" if a == "train.steps=2" else a for a in gpu_check.PAPER_STAND_INS])),
    "lora24_exit_code": ("lora24", lambda mp: mp.setattr(gpu_check, "ROOT", gpu_check.ROOT / "docs")),
    "lora24_steps_updated": ("lora24", lambda mp: mp.setattr(gpu_check, "PAPER_STAND_INS", [
        "train.steps=1" if a == "train.steps=2" else a for a in gpu_check.PAPER_STAND_INS])),
}


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_each_check_can_fail(name, monkeypatch, capsys):
    part, breaks = BREAKS[name]
    monkeypatch.setattr(gpu_check, "counters", lambda dev: Fake)
    monkeypatch.setattr(Fake, "scale", 1.0)
    breaks(monkeypatch)
    assert run(part, capsys)[name] == "FAIL"


def test_a_resume_that_drifts_fails(monkeypatch, capsys):
    """The interrupted run draws other rollouts (another seed, in both legs: a resume under
    another config is refused): its weights are not the straight run's."""
    runs = [("straight", 2, ()), ("resumed", 1, ("seed=1",)), ("resumed", 2, ("seed=1",))]
    monkeypatch.setattr(gpu_check, "TRAIN_RUNS", runs)
    assert run("train", capsys)["train_resumed_drift_over_training"] == "FAIL"


def test_every_check_has_a_way_to_fail():
    """Each threshold is broken by a test above, or is named here with the reason it is not."""
    by_twin = {"onpolicy_ratio_dev_first_step_2x2": "the same break as 1x1",
               "train_resumed_drift_over_training": "test_a_resume_that_drifts_fails",
               "train_weights_moved": "checked by the train part itself: without it the drift check would be vacuous",
               "train_resumed_step2_reward_diff": "test_a_resume_that_drifts_fails (the same runs)",
               "speed_static_rows_differing_from_step": "CUDA only; tests/test_graph_decode.py holds the graph "
                                                        "block to the eager step on a CPU",
               **dict.fromkeys(("paper_expandable_segments", "paper_allocated_peak_over_plan",
                                "paper_reserved_peak_over_budget"), "test_the_paper_parts_cuda_checks_on_given_figures"),
               **dict.fromkeys(("lora24_allocated_peak_over_plan", "lora24_reserved_peak_over_cap"),
                               "test_the_lora24_parts_cuda_checks_on_given_figures")}
    assert set(gpu_check.THRESHOLDS) == set(BREAKS) | set(by_twin)


def test_the_paper_config_runs_two_steps_at_a_shrunk_shape(capsys):
    """The 7B YAML as shipped, through train.py, on a random model of the card part's CPU
    shape in bfloat16: both steps train; the run's plan and its evaluation line are shown."""
    r = gpu_check.Report("cpu")
    gpu_check.check_paper(r, Z, "cpu")
    out = capsys.readouterr().out
    assert r.checked == ["paper_exit_code", "paper_steps_updated"] and not r.failed, out[-3000:]
    assert "memory plan:" in out and "in bfloat16 on cpu" in out and "evaluation: none" in out
    assert re.search(r"^paper_step_2_s: ", out, re.M)


GB = 1e9
ON_CUDA = {"gpu_allocated_peak_gb": 9.0, "gpu_reserved_peak_gb": 19.0, "gpu_expandable_segments": True}


def on_the_gpu(monkeypatch, change: dict, command, budget: float) -> None:
    """A 7B part's CUDA branch on a CPU: the card-shaped model built at the CPU's size, the
    train.py run stood in for by two rows of metrics.jsonl (step 2's with `change`) after
    command(cmd, env) has checked how it was started, and the plan by a peak of 10 GB in
    `budget` bytes."""
    import json
    import subprocess
    from pathlib import Path

    build = gpu_check.build_model
    monkeypatch.setattr(gpu_check, "build_model", lambda shape, dev, dtype: build(Z["card"], "cpu", dtype))

    def run(cmd, cwd, capture_output, text, timeout, env):
        command(cmd, env)
        out = Path(next(a for a in cmd if a.startswith("out_dir=")).split("=", 1)[1])
        out.mkdir(parents=True)
        rows = [{"step": step, "optimizer_steps": 1, "time_rollout": 60.0, "time_judge": 1.0, "time_update": 30.0,
                 **ON_CUDA, **(change if step == 2 else {})} for step in (1, 2)]
        (out / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(gpu_check.subprocess, "run", run)
    monkeypatch.setattr(gpu_check.device_memory, "plan_for", lambda cfg: types.SimpleNamespace(peak=10 * GB,
                                                                                                budget=budget))


@pytest.mark.parametrize("change, failing", [
    ({}, None),
    ({"gpu_allocated_peak_gb": 11.0}, "paper_allocated_peak_over_plan"),
    ({"gpu_reserved_peak_gb": 21.0}, "paper_reserved_peak_over_budget"),
    ({"gpu_expandable_segments": False}, "paper_expandable_segments"),
])
def test_the_paper_parts_cuda_checks_on_given_figures(change, failing, monkeypatch, capsys):
    """The paper part's CUDA branch on a CPU: the model is built here, train.py's run on
    the GPU is stood in for by two rows of metrics.jsonl with the given peaks, and the plan
    by a peak of 10 GB in a budget of 20. The run must not be handed this script's
    allocator setting; each check fails when its figure is over."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as gpu_check sets it at import

    def command(cmd, env):
        assert "PYTORCH_CUDA_ALLOC_CONF" not in env  # only the run's own start-up may turn it on
        assert cmd[1:3] == ["train.py", "configs/qwen2.5-7b-1gpu.yaml"]
    on_the_gpu(monkeypatch, change, command, budget=20 * GB)
    r = gpu_check.Report("cuda")
    gpu_check.check_paper(r, Z, "cuda")
    assert r.checked == ["paper_exit_code", "paper_steps_updated", "paper_expandable_segments",
                         "paper_allocated_peak_over_plan", "paper_reserved_peak_over_budget"]
    assert r.failed == ([failing] if failing else [])
    assert "paper_step_2_s: 91" in capsys.readouterr().out


def test_a_part_that_crashes_fails_and_the_rest_still_run(monkeypatch, capsys):
    monkeypatch.setitem(gpu_check.PARTS, "stops", lambda *a: 1 / 0)
    assert gpu_check.main(["--device", "cpu", "--only", "stops", "--only", "loss"]) == 1
    out = capsys.readouterr().out
    assert "failed: stops (crashed)" in out and "CHECK loss_bf16_grad_rel_err" in out


@pytest.mark.parametrize("change, failing", [
    ({}, None),
    ({"gpu_allocated_peak_gb": 11.0}, "lora24_allocated_peak_over_plan"),
    ({"gpu_reserved_peak_gb": 24.5}, "lora24_reserved_peak_over_cap"),
])
def test_the_lora24_parts_cuda_checks_on_given_figures(change, failing, monkeypatch, capsys):
    """The lora24 part's CUDA branch on a CPU: train.py is started through the 24 GB cap
    (CAPPED_RUN, then train.py and the LoRA config), its run stood in for by two rows of
    metrics.jsonl, its plan by a peak of 10 GB; each check fails when its figure is over."""
    def command(cmd, env):
        assert cmd[1:4] == ["-c", gpu_check.CAPPED_RUN, str(24 * GB)]
        assert cmd[4:6] == ["train.py", "configs/qwen2.5-7b-lora-24gb.yaml"]
    on_the_gpu(monkeypatch, change, command, budget=24 * GB)
    r = gpu_check.Report("cuda")
    gpu_check.check_lora24(r, Z, "cuda")
    assert r.checked == ["lora24_exit_code", "lora24_steps_updated", "lora24_allocated_peak_over_plan",
                         "lora24_reserved_peak_over_cap"]
    assert r.failed == ([failing] if failing else [])


def test_the_capped_launcher_caps_then_runs_the_script(monkeypatch):
    """CAPPED_RUN: the allocator setting first, then the fraction cap / the card's total,
    then the script with its own arguments, as `python train.py ...` would run it."""
    import os
    import runpy
    import sys

    seen = {}
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80e9))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f: seen.update(fraction=f, conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF")))
    monkeypatch.setattr(runpy, "run_path", lambda path, run_name: seen.update(path=path, argv=list(sys.argv),
                                                                             name=run_name))
    monkeypatch.setattr(sys, "argv", ["-c", str(24 * GB), "train.py", "configs/x.yaml", "seed=1"])
    exec(gpu_check.CAPPED_RUN, {})
    assert seen == {"fraction": 0.3, "conf": "expandable_segments:True", "path": "train.py",
                    "argv": ["train.py", "configs/x.yaml", "seed=1"], "name": "__main__"}
