"""gpu_check.py runs on a CPU too (toy sizes, no memory figures), so it cannot rot
between the rare runs on a GPU."""

import re

from scripts import gpu_check


def test_gpu_check_runs_on_a_cpu(capsys):
    assert gpu_check.main(["--device", "cpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    figures = dict(l.split(": ", 1) for l in lines if re.match(r"^[a-z0-9_]+: ", l))
    assert figures["failed"] == "none"
    for name in ("sampler_fp32_logprob_max_diff", "sampler_bf16_argmax_margin_max", "sampler_check_every_8_equals_1",
                 "loss_bf16_fast_grad_rel_err_vs_fp32_reference", "on_policy_ratio_dev_first_step_2x2",
                 "speed_sampler_tokens_per_s", "speed_generate_tokens_per_s", "memory"):
        assert name in figures, name
    assert all(v == "True" for k, v in figures.items() if k.endswith("_ok"))


def test_the_memory_part_runs_on_fake_counters(monkeypatch, capsys):
    """The CUDA-only part (the peaks against the plan) with made-up counters on a CPU: it
    must run through and print its figures (their values mean nothing here)."""
    class Fake:
        sync = reset = staticmethod(lambda: None)
        now = peak = staticmethod(lambda: 1e6)
        total = staticmethod(lambda: 1e9)

    monkeypatch.setattr(gpu_check, "counters", lambda dev: Fake)
    r = gpu_check.Report()
    gpu_check.check_memory(r, gpu_check.SIZES["cpu"], "cpu")
    out = capsys.readouterr().out
    for name in ("plan: memory plan", "memory_sampler_peak_planned_gb", "memory_update_peak_planned_gb",
                 "memory_sampler_sub_batches", "memory_resident_within_plan_ok"):
        assert name in out, name
