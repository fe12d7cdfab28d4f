"""gpu_check.py runs on a CPU too (toy sizes, no memory figures), so it cannot rot
between the rare runs on a GPU."""

import re

import gpu_check


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
