"""GPU check: the engine against its references, its speed, its memory plan and a real
training run, in one command, each check PASS or FAIL against a stated threshold.

    python -m scripts.gpu_check                  # on CUDA: a few minutes on one large GPU
    python -m scripts.gpu_check --device cpu     # the same checks at toy sizes (tests/test_gpu_check.py)
    python -m scripts.gpu_check --only train     # one part: sampler, stops, loss, onpolicy, speed, memory, train,
                                                 #   paper, lora24

Not part of the paper: what a machine with a GPU must confirm before
configs/qwen2.5-7b-1gpu.yaml is trusted there, since the tests run on CPUs. It builds
models of Qwen2.5's architecture (q/k/v biases, grouped KV heads, untied embeddings) from
a config with random weights (a GPU box may have no route to the model hub), and:

  sampler   greedy tokens and log-probs of engine.LLM.sample against naive
            recomputation of the whole sequence, in float32 and in bf16;
  stops     stop strings that really end rows, looked at every token and every 8 tokens
            (the GPU default): the same rows, tokens and texts;
  loss      flow_grpo's batched gradient on bf16 weights against
            flow_grpo.reference_objective (J as a loop) on float32 copies of the weights;
  onpolicy  over many rows of real temperature-1 draws: the trainer's log-probs against
            the sampler's (how far pi_theta / pi_sampler is from 1), and rho = 1 exactly
            on the first step of policy_update;
  speed     the sampler against model.generate on the same prompts: the same greedy
            tokens, tokens per second, and a floor on the ratio (and, on CUDA, its decode
            through the CUDA-graph block, engine.GraphStep, against the eager
            engine.decode_step: the same tokens, its speed-up);
  memory    on a model with Qwen2.5-7B's shape (on CUDA), a rollout big enough that the
            sampler must run several sub-batches, and an update: the peaks that torch
            allocates and that its allocator reserves, against support/device_memory.py's plan;
  train     `python train.py configs/smoke.yaml` on this device with a tiny random model
            (the real entry point: preflight, rollouts, update, checkpoint, export), then the
            same run stopped after step 1 and resumed: it must reach the same step-2 weights.
  paper     `python train.py configs/qwen2.5-7b-1gpu.yaml` as shipped, two steps, on a random
            model of Qwen2.5-7B's shape (offline stand-ins for the web tools and the data,
            evaluations off): it trains both steps, its start-up turns on expandable
            segments, its peaks stay within its plan. The part to run before trusting an
            hour of the paper's setup (tens of minutes: it writes and loads 15 GB).
  lora24    `python train.py configs/qwen2.5-7b-lora-24gb.yaml`, two steps at the 7B shape on
            random weights, in a process capped at 24 GB of GPU memory: the 24 GB card's
            claim, proven on a larger card (its peaks against its plan and the cap).

Prints `name: value` for each figure and `CHECK name: value <op> limit PASS|FAIL` for
each check; exits 1 if one fails. THRESHOLDS below is every limit, with why.
"""

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# As train.py runs: the allocator in expandable segments (read at CUDA's first allocation).
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

from support import device_memory
from support import optim
from agentflow import PlannerTurn, Trajectory
from engine import LLM, SamplingParams
from flow_grpo import (LossConfig, UpdateConfig, accumulate_gradients, frozen_reference, kept_rows, policy_update,
                       reference_objective, token_logprobs)
from memory import Memory

ROOT = Path(__file__).resolve().parents[1]

# Sizes per device. "model": the checks' own model (Qwen2.5's head layout at a fraction of
# its width on CUDA); "card": the memory check's model, Qwen2.5-7B's shape on CUDA; the
# rollout is the paper's 32 x 8 rows.
QWEN7B = dict(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064)
SIZES = {
    "cuda": dict(model=dict(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, vocab=32000),
                 card=QWEN7B, card_train_layers=8, card_prefix=1024, card_own=(64, 512), card_new=96,
                 rows=256, prefix=256, own=(64, 256), new=256, exact_rows=8, exact_new=32, speed_rows=64,
                 speed_new=128, loss_groups=4, loss_G=4, action=32, micro_batch=2, draw_rows=256, draw_new=64,
                 tiny=dict(hidden=256, intermediate=512, layers=4, heads=8, kv_heads=2)),
    "cpu": dict(model=dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512),
                card=dict(hidden=64, intermediate=128, layers=4, heads=4, kv_heads=2, vocab=512),
                card_train_layers=2, card_prefix=16, card_own=(4, 24), card_new=8,
                rows=8, prefix=16, own=(4, 24), new=8, exact_rows=4, exact_new=6, speed_rows=4,
                speed_new=8, loss_groups=1, loss_G=3, action=5, micro_batch=2, draw_rows=16, draw_new=12,
                tiny=dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)),
}

# Every limit, per device where they differ: (op, limit, why).
THRESHOLDS = {
    "sampler_fp32_logprob_max_diff": ("<", 1e-3, "the cached path and the recomputation differ by rounding only"),
    "sampler_fp32_not_argmax_tokens": ("==", 0, "greedy = the recomputation's argmax"),
    "sampler_bf16_logprob_max_diff": ("<", 0.15, "bf16 rounds the cached path and the recomputation differently"),
    "sampler_bf16_argmax_margin_max": ("<", 0.15, "a flipped greedy token must be a near-tie at bf16's resolution"),
    "stops_rows_ended_by_a_stop_string": (">=", 1, "the stop rule must really be exercised"),
    "stops_rows_differing_every_8_vs_every_1": ("==", 0, "looking every 8 tokens discards what ran past the stop"),
    "stops_texts_holding_their_stop": ("==", 0, "a row's text ends before its stop string"),
    "loss_bf16_grad_rel_err": ("<", 0.08, "bf16 weights against the fp32 objective"),
    "loss_bf16_grad_cosine": (">", 0.995, "the same direction"),
    "onpolicy_logratio_mean": ("<", 0.02, "mean |log pi_trainer - log pi_sampler| per token, bf16"),
    "onpolicy_logratio_p99": ("<", 0.15, "99th percentile of that over every drawn token"),
    "onpolicy_ratio_dev_first_step_1x1": ("==", 0.0, "pi_old is the trainer's own forward: rho = 1"),
    "onpolicy_ratio_dev_first_step_2x2": ("==", 0.0, "the same with 2 epochs x 2 mini-batches"),
    "speed_rows_differing_from_generate": ("==", 0, "greedy, fp32: the same tokens as transformers' generate"),
    "speed_sampler_over_generate": (">=", {"cuda": 2.0, "cpu": 0.3},
                                    "the sampler (CUDA: its graph decode) against generate (a CPU at toy size: a "
                                    "loose floor)"),
    "speed_static_rows_differing_from_step": ("==", 0, "the CUDA-graph decode: the same greedy tokens as the eager "
                                                       "step (fp32)"),
    "memory_sampler_sub_batches": (">=", 2, "the rollout must not fit one sub-batch, or the sub-batching is untested"),
    "memory_resident_over_plan": ("<=", 1.0, "allocated after an update / planned resident (less fp32 gradients)"),
    "memory_sampler_peak_over_plan": ("<=", 1.0, "allocated peak while sampling / planned"),
    "memory_update_peak_over_plan": ("<=", 1.0, "allocated peak while updating / planned"),
    "memory_reserved_peak_over_budget": ("<=", 1.0, "what the allocator reserved / the budget it was planned in"),
    "train_exit_codes_nonzero": ("==", 0, "train.py runs through, on this device"),
    "train_weights_moved": (">", 0.0, "max relative change of a weight: the planner trained"),
    "train_resumed_drift_over_training": ("<=", 0.01, "resume reaches the uninterrupted run's weights: the largest "
                                                       "difference, against the largest change training made"),
    "train_resumed_step2_reward_diff": ("==", 0.0, "and the same step-2 rollouts"),
    "paper_exit_code": ("==", 0, "train.py runs configs/qwen2.5-7b-1gpu.yaml through two steps"),
    "paper_steps_updated": ("==", 2, "both steps train: step 2 with AdamW's moments resident"),
    "paper_expandable_segments": ("==", 1, "train.py's own start-up turns them on (every segment is expandable)"),
    "paper_allocated_peak_over_plan": ("<=", 1.0, "the most the run's tensors held in a step / the plan's peak"),
    "paper_reserved_peak_over_budget": ("<=", 1.0, "the most its allocator reserved / the budget it was planned in"),
    "lora24_exit_code": ("==", 0, "train.py runs configs/qwen2.5-7b-lora-24gb.yaml through two steps, capped at 24 GB"),
    "lora24_steps_updated": ("==", 2, "both steps train the adapters"),
    "lora24_allocated_peak_over_plan": ("<=", 1.0, "the most the run's tensors held in a step / the plan's peak"),
    "lora24_reserved_peak_over_cap": ("<=", 1.0, "the most its allocator reserved / 24 GB"),
}
OPS = {"<": float.__lt__, "<=": float.__le__, "==": float.__eq__, ">=": float.__ge__, ">": float.__gt__}


class Report:
    def __init__(self, device: str):
        self.device, self.failed, self.checked = device, [], []

    def figure(self, name: str, value) -> None:
        print(f"{name}: {value:.6g}" if isinstance(value, float) else f"{name}: {value}", flush=True)

    def check(self, name: str, value) -> bool:
        op, limit, why = THRESHOLDS[name]
        limit = limit[self.device] if isinstance(limit, dict) else limit
        ok = OPS[op](float(value), float(limit))
        print(f"CHECK {name}: {float(value):.6g} {op} {limit:g} {'PASS' if ok else 'FAIL'}   ({why})", flush=True)
        self.checked.append(name)
        if not ok:
            self.failed.append(name)
        return ok


class IdTokenizer:
    """What the sampler asks of a tokenizer, for a model without one: ids as text."""

    def __init__(self, vocab: int):
        self.eos_token_id, self.pad_token_id = vocab - 1, 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def qwen2_config(s: dict, vocab: int | None = None, **extra):
    from transformers import Qwen2Config

    vocab = vocab or s["vocab"]
    return Qwen2Config(vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                       max_position_embeddings=8192, tie_word_embeddings=False, **{"eos_token_id": vocab - 1,
                                                                                   "pad_token_id": 0, **extra})


def build_model(s: dict, device: str, dtype):
    """A random Qwen2 of shape `s`, made on `device` (a 7B one in seconds on a GPU)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen2_config(s))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 2.0 / s["hidden"] ** 0.5)  # decisive greedy choices, varied samples
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model.to(dtype=dtype).eval()


def make_prompts(vocab: int, n: int, prefix: int, own: tuple[int, int], seed: int) -> list[list[int]]:
    """n prompts: a shared prefix (a module's instructions), then rows of their own length,
    the G = 8 copies of a query consecutive and identical (as at a rollout's first turn)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(1, vocab - 1, (prefix,), generator=g).tolist()
    out = []
    for i in range(0, n, 8):
        k = int(torch.randint(*own, (1,), generator=g))
        out += [head + torch.randint(1, vocab - 1, (k,), generator=g).tolist()] * min(8, n - i)
    return out


def prompts_for(z: dict, n: int, seed: int) -> list[list[int]]:
    return make_prompts(z["model"]["vocab"], n, z["prefix"], z["own"], seed)


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def naive(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """log-softmax [len(ids), V] of every sampled position, from one forward of the whole sequence."""
    seq = torch.tensor([prompt + ids], device=next(model.parameters()).device)
    logits = model(seq).logits[0, len(prompt) - 1:len(prompt) - 1 + len(ids)].float()  # [n, V]
    return torch.log_softmax(logits, -1)


def check_sampler(r: Report, z: dict, dev: str) -> None:
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        model = build_model(z["model"], dev, dtype)
        llm = LLM(model, IdTokenizer(z["model"]["vocab"]))
        prompts = prompts_for(z, z["exact_rows"], seed=1)
        worst_lp, worst_margin, not_argmax = 0.0, 0.0, 0
        for p, s in zip(prompts, llm.sample(prompts, SamplingParams(0.0, z["exact_new"]))):
            lsm = naive(model, p, s.ids)  # [n, V]
            got = lsm.gather(-1, torch.tensor(s.ids, device=lsm.device)[:, None])[:, 0]  # [n]
            worst_lp = max(worst_lp, float((got - torch.tensor(s.logprobs, device=lsm.device)).abs().max()))
            margin = lsm.max(-1).values - got  # [n] 0 where the sampled token is the argmax
            worst_margin, not_argmax = max(worst_margin, float(margin.max())), not_argmax + int((margin > 0).sum())
        r.check(f"sampler_{name}_logprob_max_diff", worst_lp)
        if dtype == torch.float32:
            r.check("sampler_fp32_not_argmax_tokens", not_argmax)
        else:
            r.check("sampler_bf16_argmax_margin_max", worst_margin)
        r.figure(f"sampler_decode_way_{name}", decode_way(llm))


def check_stops(r: Report, z: dict, dev: str) -> None:
    """Stop strings chosen from what the rows do say, so that rows really end on them.
    Greedy: a sampled row's tokens depend on which rows are still drawing (one uniform
    per live row and step), and looking every 8 tokens drops finished rows later."""
    model = build_model(z["model"], dev, torch.float32)
    tok = IdTokenizer(z["model"]["vocab"])
    prompts = prompts_for(z, z["exact_rows"], seed=7)
    free = LLM(model, tok).sample(prompts, SamplingParams(0.0, z["exact_new"]))
    # The token a third of the way into a few rows: those rows stop there or earlier.
    stops = tuple(sorted({" " + str(s.ids[len(s.ids) // 3]) for s in free[::3] if len(s.ids) > 3}))
    params = SamplingParams(0.0, z["exact_new"], stop=stops)
    every = [LLM(model, tok, check_every=k).sample(prompts, params) for k in (1, 8)]
    r.figure("stops_strings", list(stops))
    r.check("stops_rows_ended_by_a_stop_string", sum(s.finish == "stop" for s in every[0]))
    r.check("stops_rows_differing_every_8_vs_every_1",
            sum((a.ids, a.finish, a.text) != (b.ids, b.finish, b.text) for a, b in zip(*every)))
    r.check("stops_texts_holding_their_stop", sum(any(x in s.text for x in stops) for s in every[1]))


def rows_of(trajs: list, rewards: list[float], G: int) -> list:
    """The training rows train.py makes of these trajectories with these rewards, every
    rollout kept (flow_grpo.kept_rows, groups of G), with A_i = R_i - mean (dr_grpo): the
    advantages stay the size the rewards give them (+-0.5 for rewards 0 and 1)."""
    for tr, R in zip(trajs, rewards):
        tr.reward = R
    return kept_rows(trajs, [True] * len(trajs), G, estimator="dr_grpo")[0]


def trajectories(llm: LLM, prompts: list[list[int]], G: int, new: int, seed: int) -> list:
    """One planner turn per prompt, sampled at temperature 1: (prompt, action, log-probs)."""
    trajs = []
    for k, (p, s) in enumerate(zip(prompts, llm.sample(prompts, SamplingParams(1.0, new), seed=seed))):
        tr = Trajectory(f"query {k // G}", Memory(1000, 100))
        tr.turns.append(PlannerTurn(p, s.ids, s.logprobs, ""))
        trajs.append(tr)
    return trajs


def check_loss(r: Report, z: dict, dev: str) -> None:
    m16 = build_model(z["model"], dev, torch.bfloat16)
    ref16 = copy.deepcopy(m16).requires_grad_(False)
    with torch.no_grad():
        for p in ref16.parameters():
            p.add_(0.01 * torch.randn_like(p))
    llm = LLM(m16, IdTokenizer(z["model"]["vocab"]))
    G = z["loss_G"]
    trajs = trajectories(llm, prompts_for(z, z["loss_groups"] * G, seed=2), G, z["action"], seed=2)
    rows = rows_of(trajs, [(k % G) / G for k in range(len(trajs))], G)  # a spread of advantages per group
    adv = [tr.advantage for tr in trajs]
    sampling, cfg = SamplingParams(1.0, z["action"]), LossConfig(0.2, 0.3, 0.1)
    m32, ref32 = copy.deepcopy(m16).float(), copy.deepcopy(ref16).float()
    J = reference_objective(m32, ref32, trajs, adv, sampling, cfg)
    (-J).backward()
    g32 = torch.cat([p.grad.flatten() for p in m32.parameters()])
    del m32, ref32
    m16.zero_grad()
    st = accumulate_gradients(m16, ref16, rows, sampling, cfg, llm.pad_id, micro_batch=z["micro_batch"])
    g16 = torch.cat([p.grad.float().flatten() for p in m16.parameters()])
    r.check("loss_bf16_grad_rel_err", float((g16 - g32).norm() / g32.norm()))
    r.check("loss_bf16_grad_cosine", float(g16 @ g32 / (g16.norm() * g32.norm())))
    r.figure("loss_bf16_loss_rel_err", abs(st["loss"] + J.item()) / max(abs(J.item()), 1e-12))


def check_onpolicy(r: Report, z: dict, dev: str) -> None:
    """pi_theta / pi_sampler over every token of many real draws, then rho on the first step."""
    model = build_model(z["model"], dev, torch.bfloat16)
    ref = copy.deepcopy(model).requires_grad_(False)
    llm = LLM(model, IdTokenizer(z["model"]["vocab"]))
    trajs = trajectories(llm, prompts_for(z, z["draw_rows"], seed=8), 8, z["draw_new"], seed=8)
    rows = rows_of(trajs, [float(k % 2) for k in range(len(trajs))], 8)
    sampling = SamplingParams(1.0, z["draw_new"])
    gaps = []
    with torch.no_grad():
        for i in range(0, len(rows), 32):
            part = rows[i:i + 32]
            logp, _, mask = token_logprobs(model, part, sampling, llm.pad_id)  # [n, La] each
            for j, row in enumerate(part):
                n = len(row.action_ids)
                gaps.append((logp[j, -n:].float().cpu() - torch.tensor(row.sampler_logprobs)).abs())
    gaps = torch.cat(gaps)  # [every drawn token]
    r.figure("onpolicy_tokens", gaps.numel())
    r.check("onpolicy_logratio_mean", float(gaps.mean()))
    r.check("onpolicy_logratio_p99", float(gaps.quantile(0.99)))
    r.figure("onpolicy_logratio_max", float(gaps.max()))
    for epochs, minibatches in ((1, 1), (2, 2)):
        opt = optim.PlannerOptimizer(list(model.parameters()), 1e-6)
        out = policy_update(model, ref, opt, rows, sampling, LossConfig(0.2, 0.3, 0.001),
                            UpdateConfig(epochs=epochs, minibatches=minibatches, micro_batch=z["micro_batch"]),
                            llm.pad_id)
        r.check(f"onpolicy_ratio_dev_first_step_{epochs}x{minibatches}", out["ratio_dev_first_step"])
        opt.masters.remove()


def timed(dev: str, fn):
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t0


def generate(model, tok, prompts, new: int) -> list[list[int]]:
    """transformers' greedy generate on the same prompts, left-padded: each row's new tokens."""
    dev = next(model.parameters()).device
    L = max(map(len, prompts))
    ids = torch.zeros((len(prompts), L), dtype=torch.long, device=dev)
    mask = torch.zeros((len(prompts), L), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):], mask[i, L - len(p):] = torch.tensor(p, device=dev), 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, L:].tolist()
    return [row[:next((j + 1 for j, t in enumerate(row) if t == tok.eos_token_id), len(row))] for row in out]


def check_speed(r: Report, z: dict, dev: str) -> None:
    """The same greedy tokens as generate in float32 (in bf16 a near-tie may round either
    way: the count is a figure); the speed in bf16, as a run decodes."""
    tok = IdTokenizer(z["model"]["vocab"])
    prompts = prompts_for(z, z["speed_rows"], seed=3)
    new = z["speed_new"]
    greedy = SamplingParams(0.0, new)
    m32 = build_model(z["model"], dev, torch.float32)
    ours32, theirs32 = LLM(m32, tok).sample(prompts, greedy), generate(m32, tok, prompts, new)
    r.check("speed_rows_differing_from_generate", sum(s.ids != g for s, g in zip(ours32, theirs32)))
    del m32
    model = build_model(z["model"], dev, torch.bfloat16)
    llm = LLM(model, tok)
    llm.sample(prompts[:2], SamplingParams(0.0, 4))  # warm up
    out, t_ours = timed(dev, lambda: llm.sample(prompts, greedy))
    generate(model, tok, prompts[:2], 4)
    theirs, t_theirs = timed(dev, lambda: generate(model, tok, prompts, new))
    ours = sum(len(s.ids) for s in out) / t_ours
    r.figure("speed_sampler_tokens_per_s", ours)
    r.figure("speed_generate_tokens_per_s", sum(map(len, theirs)) / t_theirs)
    r.check("speed_sampler_over_generate", ours / (sum(map(len, theirs)) / t_theirs))
    r.figure("speed_bf16_rows_differing_from_generate", sum(s.ids != g for s, g in zip(out, theirs)))
    r.figure("speed_sampler_decode_way", decode_way(llm))
    if dev == "cuda":
        check_static(r, z, dev, llm, prompts, greedy)


def decode_way(llm: LLM) -> str:
    """How `llm` decodes: "graph" (engine.graph_step, CUDA's default) or "step" (engine.decode_step)."""
    return "graph" if llm.graphs else "step"


def check_static(r: Report, z: dict, dev: str, llm: LLM, prompts, greedy: SamplingParams) -> None:
    """The CUDA-graph decode (engine.GraphStep, the GPU's default: llm.graphs) against the
    eager engine.decode_step: the same greedy tokens in float32 (in bf16 its attention sums
    over more columns, and a near-tie may flip), and the speed of each in bf16."""
    m32 = build_model(z["model"], dev, torch.float32)
    eager, static = LLM(m32, llm.tok), LLM(m32, llm.tok)
    eager.graphs, static.graphs = False, True
    a, b = (x.sample(prompts, greedy) for x in (eager, static))
    r.check("speed_static_rows_differing_from_step", sum(x.ids != y.ids for x, y in zip(a, b)))
    del m32, eager, static
    took, base = {}, llm.graphs
    for way, graphs in (("step", False), ("static", True)):
        llm.graphs = graphs
        llm.sample(prompts[:2], SamplingParams(0.0, 4))
        out, took[way] = timed(dev, lambda: llm.sample(prompts, greedy))
        r.figure(f"speed_{way}_tokens_per_s", sum(len(s.ids) for s in out) / took[way])
    llm.graphs = base
    r.figure("speed_static_over_step", took["step"] / took["static"])


class CudaCounters:
    """torch's count of the bytes its tensors hold on the GPU, and of what its allocator reserved."""
    sync = staticmethod(torch.cuda.synchronize)
    now = staticmethod(torch.cuda.memory_allocated)
    peak = staticmethod(torch.cuda.max_memory_allocated)
    reserved_peak = staticmethod(torch.cuda.max_memory_reserved)
    reset = staticmethod(torch.cuda.reset_peak_memory_stats)

    total = staticmethod(lambda: float(torch.cuda.get_device_properties(0).total_memory))


def counters(dev: str):
    """The memory counters of `dev`, or None where torch keeps none (a CPU)."""
    return CudaCounters if dev == "cuda" else None


def card_plan(z: dict, shape, rows: int, prompts, total: float, dev: str):
    """The plan at the largest budget (at most the card) under which the rollout needs at
    least three sub-batches (the sub-batching is what the check is for), or, where the
    update needs more than that leaves, the smallest budget that still fits."""
    kw = dict(dtype="bfloat16", device=dev, max_prompt=max(map(len, prompts)), max_new=z["card_new"],
              planner_new=z["card_new"], rollout_rows=rows, eval_rows=rows, micro_batch=z["micro_batch"],
              prefill_tokens=8192, logits_chunk=1024)
    plan = lambda budget: device_memory.make_plan(shape, budget=budget, **kw)

    def boundary(above) -> tuple[float, float]:  # (lo, hi): above(plan) is false at lo, true at hi
        lo, hi = 0.0, total
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if above(plan(mid)) else (mid, hi)
        return lo, hi

    target = max(1, rows // 3)
    if plan(total).rows_per_sub_batch <= target:
        return plan(total)
    few = plan(boundary(lambda p: p.rows_per_sub_batch > target)[0])  # the largest budget with <= target rows
    return few if few.fits else plan(boundary(lambda p: p.fits)[1])  # else the smallest that fits


def check_memory(r: Report, z: dict, dev: str) -> None:
    """Peaks of a rollout-sized sampler call and of an update against the plan's figures,
    on a model of the card's size; and the time of each (the step-time breakdown)."""
    mem = counters(dev)
    if mem is None:
        r.figure("memory", "skipped (no CUDA: torch.cuda.max_memory_allocated needs a GPU)")
        return
    before_model = mem.now()  # what torch counts before the model exists (cuBLAS workspaces)
    model = build_model(z["card"], dev, torch.bfloat16)
    trained = optim.select_trainable(model, z["card_train_layers"])
    ref = frozen_reference(model, trained)
    opt = optim.PlannerOptimizer(trained, 1e-6)
    prompts = make_prompts(z["card"]["vocab"], z["rows"], z["card_prefix"], z["card_own"], seed=4)
    shape = device_memory.model_shape(model.config, z["card_train_layers"], name="gpu_check card model")
    plan = card_plan(z, shape, len(prompts), prompts, mem.total(), dev)
    for line in plan.text().splitlines():
        r.figure("plan", line.strip())
    llm = LLM(model, IdTokenizer(z["card"]["vocab"]))
    llm.sub_batch_bytes, llm.prefill_tokens = plan.sub_batch_bytes, plan.prefill_tokens
    GB = device_memory.GB
    # What torch's counters can see of the plan: everything but the allocator's slack (its
    # 1 GB for the CUDA context also covers the cuBLAS workspaces, which torch counts).
    resident_planned = plan.resident - device_memory.SLACK * plan.budget
    sampling = SamplingParams(1.0, z["card_new"])
    # An update first, so that AdamW's moments exist (they are resident), then measure each phase.
    trajs = [Trajectory("q", Memory(100, 10)) for _ in prompts]
    samples, t_first = timed(dev, lambda: llm.sample(prompts, sampling, seed=5))
    for tr, p, s in zip(trajs, prompts, samples):
        tr.turns.append(PlannerTurn(p, s.ids, s.logprobs, ""))
    rows = rows_of(trajs, [float(k % 2) for k in range(len(trajs))], 8)[:4 * z["micro_batch"]]
    update = lambda: policy_update(model, ref, opt, rows, sampling, LossConfig(0.2, 0.3, 0.001),
                                   UpdateConfig(micro_batch=z["micro_batch"], max_tokens=plan.update_tokens),
                                   llm.pad_id)
    update()
    mem.sync()
    resident = mem.now()
    r.figure("memory_resident_gb", resident / GB)
    r.figure("memory_counted_before_the_model_gb", before_model / GB)
    # after the step the fp32 gradients are gone; the plan counts them as resident
    r.check("memory_resident_over_plan", resident / (resident_planned - 4 * shape.trained))
    mem.reset()
    before = llm.sub_batches_run
    out, t_sample = timed(dev, lambda: llm.sample(prompts, sampling, seed=6))
    peak = mem.peak()
    r.check("memory_sampler_sub_batches", llm.sub_batches_run - before)
    r.figure("memory_sampler_peak_gb", peak / GB)
    r.check("memory_sampler_peak_over_plan", peak / (resident_planned + plan.sampler))
    r.figure("time_card_rollout_s", t_sample)
    r.figure("time_card_rollout_tokens_per_s", sum(len(s.ids) for s in out) / t_sample)
    r.figure("time_card_decode_way", decode_way(llm))
    if dev == "cuda":  # the same rollout with the other of the graph and eager decodes
        llm.graphs = not llm.graphs
        _, t_other = timed(dev, lambda: llm.sample(prompts, sampling, seed=6))
        r.figure(f"time_card_rollout_{decode_way(llm)}_s", t_other)
        llm.graphs = not llm.graphs
    mem.reset()
    _, t_update = timed(dev, update)
    peak = mem.peak()
    r.figure("memory_update_peak_gb", peak / GB)
    r.check("memory_update_peak_over_plan", peak / (resident_planned + plan.update))
    r.figure("time_card_update_s_per_row", t_update / len(rows))
    # Of that, the reference's forward (the KL term's log pi_ref), which recomputes the
    # frozen blocks the policy's forward has just run.
    with torch.no_grad():
        _, t_ref = timed(dev, lambda: [token_logprobs(ref, rows[i:i + z["micro_batch"]], sampling, llm.pad_id)
                                       for i in range(0, len(rows), z["micro_batch"])])
    r.figure("time_card_reference_s_per_row", t_ref / len(rows))
    r.check("memory_reserved_peak_over_budget", mem.reserved_peak() / plan.budget)
    r.figure("memory_reserved_peak_gb", mem.reserved_peak() / GB)


def tiny_model_dir(z: dict, folder: Path, tokenizer: str) -> str:
    """A small random Qwen2 with a real tokenizer and chat template, saved as a user's model is."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(qwen2_config(z["tiny"], vocab=len(tok), eos_token_id=tok.eos_token_id,
                                          pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id))
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.3)  # decisive greedy choices (see tests/conftest.py)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


REWARD_MODULE = """import judge


@judge.reward_term("action_tokens")
def action_tokens(traj, item, verdict):
    return float(sum(len(t.action_ids) for t in traj.turns))
"""

# (out_dir, steps, more overrides): one run straight through 2 steps; one stopped after
# step 1, then started again with steps=2, which resumes from its checkpoint.
TRAIN_RUNS = [("straight", 2, ()), ("resumed", 1, ()), ("resumed", 2, ())]


def check_train(r: Report, z: dict, dev: str, tokenizer: str | None = None, overrides: tuple = ()) -> None:
    """train.py on this device, as a user starts it; then interrupted after step 1 and resumed."""
    from safetensors.torch import load_file

    from support.models import DEFAULT_MODEL, resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tiny_model_dir(z, tmp / "tiny", tokenizer or resolve_model(DEFAULT_MODEL))
        # A random model answers nothing right: with the paper's reward alone every R would
        # be 0 and nothing would train. A reward term of our own (a fork's hook) scores the
        # length of the planner's sampled actions, which does vary between rollouts.
        (tmp / "gpu_check_reward.py").write_text(REWARD_MODULE)
        common = [f"model.name={model}", f"model.device={dev}", "train.save_every=1",
                  "reward.terms={correct: 1.0, action_tokens: 0.1}", "reward.modules=[gpu_check_reward]",
                  f"model.dtype={'bfloat16' if dev == 'cuda' else 'float32'}", *overrides]

        def train(out: str, steps: int, *extra: str) -> int:
            args = [sys.executable, "train.py", "configs/smoke.yaml", *common, f"out_dir={tmp / out}",
                    f"train.steps={steps}", *extra]
            t0 = time.perf_counter()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}
            p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
            r.figure(f"train_{out}_{steps}_steps_s", time.perf_counter() - t0)
            if p.returncode:
                print((p.stdout + p.stderr)[-3000:], flush=True)
            return p.returncode

        codes = [train(out, steps, *extra) for out, steps, extra in TRAIN_RUNS]
        r.check("train_exit_codes_nonzero", sum(c != 0 for c in codes))
        if any(codes):
            return
        start, a, b = (load_file(str(tmp / d / "model.safetensors"))
                       for d in ("tiny", "straight/model", "resumed/model"))
        # the largest change of any weight, relative to the largest weight
        rel = lambda x, y: (max(float((x[k].float() - y[k].float()).abs().max()) for k in x)
                            / max(float(x[k].float().abs().max()) for k in x))
        moved = rel(start, a)
        r.check("train_weights_moved", moved)
        r.check("train_resumed_drift_over_training", rel(a, b) / max(moved, 1e-30))
        step2 = [[json.loads(l) for l in (tmp / out / "metrics.jsonl").read_text().splitlines()][-1]
                 for out in ("straight", "resumed")]
        r.check("train_resumed_step2_reward_diff", abs(step2[0]["reward_mean"] - step2[1]["reward_mean"]))


# The paper part's stand-ins for what a GPU box may lack: the offline suite's data and its
# local search for the web tools, no evaluations (their cost is in the plan's output); the
# reward term that gives a random model's rollouts a signal, so step 1 updates and step 2
# runs with AdamW's moments resident. On a CPU also a tiny shape, 2 x 2 rollouts and short
# actions: the same entry point and config, in seconds.
PAPER_STAND_INS = ["agent.tools=[Base_Generator, Python_Coder, Local_Search]", "tools.corpus=data/corpus.jsonl",
                   "data.train=data/train.jsonl", "data.heldout=data/heldout.jsonl", "train.eval_before_after=false",
                   "train.eval_every=0", "train.steps=2", "reward.terms={correct: 1.0, action_tokens: 0.1}",
                   "reward.modules=[gpu_check_reward]"]
PAPER_CPU = ["model.device=cpu", "train.queries_per_step=2", "train.group_size=2", "train.train_layers=2",
             "agent.planner.max_new_tokens=8", "agent.executor.max_new_tokens=8", "agent.generator.max_new_tokens=8"]


def check_paper(r: Report, z: dict, dev: str, tokenizer: str | None = None, overrides: tuple = ()) -> None:
    """`python train.py configs/qwen2.5-7b-1gpu.yaml` as shipped (memory_gb 0: the card's
    total; micro_batch auto; 256/512-token actions; 32 x 8 rollouts) on a random model of
    Qwen2.5-7B's shape, two steps, with the stand-ins above. Its own start-up path must
    turn on expandable segments (the variable this script sets is not passed on); each
    step's peaks, from metrics.jsonl, against the plan. This process's own CUDA context
    (~0.5 GB) is outside the run's plan. Disk: the random model's 15 GB beside what the
    plan's disk line asks (45 GB as shipped; `--set train.train_layers=4`: 26 GB, where the
    disk is smaller; the run's preflight refuses a disk that cannot hold it)."""
    rows, plan = run_7b_config(r, z, dev, "paper", "configs/qwen2.5-7b-1gpu.yaml", tokenizer, overrides)
    if rows is None or dev != "cuda":
        return
    r.check("paper_expandable_segments", min(float(row["gpu_expandable_segments"]) for row in rows))
    r.check("paper_allocated_peak_over_plan", max(row["gpu_allocated_peak_gb"] for row in rows) * device_memory.GB
            / plan.peak)
    r.check("paper_reserved_peak_over_budget", max(row["gpu_reserved_peak_gb"] for row in rows) * device_memory.GB
            / plan.budget)


LORA24_GB = 24.0


def check_lora24(r: Report, z: dict, dev: str, tokenizer: str | None = None, overrides: tuple = ()) -> None:
    """`python train.py configs/qwen2.5-7b-lora-24gb.yaml` (LoRA, memory_gb 24) two steps on a
    random model of Qwen2.5-7B's shape, in a process whose allocator is capped at 24 GB
    (torch.cuda.set_per_process_memory_fraction): a larger card proves the 24 GB claim, since
    the run fails with out-of-memory past the cap. Its peaks against its plan and the cap."""
    rows, plan = run_7b_config(r, z, dev, "lora24", "configs/qwen2.5-7b-lora-24gb.yaml", tokenizer, overrides,
                               cap_gb=LORA24_GB if dev == "cuda" else None)
    if rows is None or dev != "cuda":
        return
    r.check("lora24_allocated_peak_over_plan", max(row["gpu_allocated_peak_gb"] for row in rows) * device_memory.GB
            / plan.peak)
    r.check("lora24_reserved_peak_over_cap", max(row["gpu_reserved_peak_gb"] for row in rows) / LORA24_GB)


# Runs train.py in a process whose CUDA allocator may hold at most argv[1] bytes. The
# allocator setting is train.main's own, made here because the cap starts CUDA first.
CAPPED_RUN = """import os, runpy, sys
from support.device_memory import use_expandable_segments
use_expandable_segments()
import torch
torch.cuda.set_per_process_memory_fraction(float(sys.argv[1]) / torch.cuda.get_device_properties(0).total_memory)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_7b_config(r: Report, z: dict, dev: str, part: str, yaml: str, tokenizer: str | None, overrides: tuple,
                  cap_gb: float | None = None):
    """Build a random bf16 model of the card's shape, run `yaml` on it through train.py for two
    steps with the stand-ins above (on a CPU at the shrunk shape), check `part`_exit_code and
    `part`_steps_updated; (metrics.jsonl's rows, the run's plan on CUDA), or (None, None)
    when it failed. cap_gb: the run's allocator capped at that many GB (CAPPED_RUN)."""
    from transformers import AutoTokenizer

    from support.config import load_config
    from support.models import DEFAULT_MODEL, resolve_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = AutoTokenizer.from_pretrained(tokenizer or resolve_model(DEFAULT_MODEL))
        # Qwen2.5's 152,064-entry vocabulary on CUDA, whatever the tokenizer (ids it lacks
        # decode to nothing); the tokenizer's own on a CPU.
        shape = z["card"] if dev == "cuda" else {**z["card"], "vocab": len(tok)}
        t0 = time.perf_counter()
        model = build_model(shape, dev, torch.bfloat16)
        model.config.update({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                             "pad_token_id": tok.pad_token_id})
        model.save_pretrained(tmp / "model")
        tok.save_pretrained(tmp / "model")
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()
        r.figure(f"{part}_model_built_s", time.perf_counter() - t0)
        (tmp / "gpu_check_reward.py").write_text(REWARD_MODULE)
        args = [f"model.name={tmp / 'model'}", f"out_dir={tmp / 'run'}", *PAPER_STAND_INS,
                *(PAPER_CPU if dev == "cpu" else []), *overrides]
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}
        env["PYTHONPATH"] = os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])
        launch = ["-c", CAPPED_RUN, str(cap_gb * device_memory.GB)] if cap_gb else []
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, *launch, "train.py", yaml, *args], cwd=ROOT,
                           capture_output=True, text=True, timeout=3600, env=env)
        r.figure(f"{part}_run_s", time.perf_counter() - t0)
        print("\n".join(line for line in p.stdout.splitlines() if line.startswith(("memory plan", "  ", "disk",
                                                                                   "evaluation", "whole run"))),
              flush=True)
        if p.returncode:
            print((p.stdout + p.stderr)[-3000:], flush=True)
        r.check(f"{part}_exit_code", p.returncode)
        if p.returncode:
            return None, None
        rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        r.check(f"{part}_steps_updated", sum(1 for row in rows if row["optimizer_steps"]))
        for row in rows:
            r.figure(f"{part}_step_{row['step']}_s", row["time_rollout"] + row["time_judge"] + row["time_update"])
        plan = device_memory.plan_for(load_config(str(ROOT / yaml), args)) if dev == "cuda" else None
        return rows, plan


PARTS = {"sampler": check_sampler, "stops": check_stops, "loss": check_loss, "onpolicy": check_onpolicy,
         "speed": check_speed, "train": check_train, "memory": check_memory, "paper": check_paper,
         "lora24": check_lora24}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--only", action="append", choices=list(PARTS), help="run this part (repeatable); default all")
    ap.add_argument("--tokenizer", help="a tokenizer folder for the train part (default: the offline default model's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for the train part's runs (repeatable), e.g. "
                         "tools.python_isolation=rlimits on a box without user namespaces")
    args = ap.parse_args(argv)
    dev, z = args.device, SIZES[args.device]
    r = Report(dev)
    r.figure("device", torch.cuda.get_device_name(0) if dev == "cuda" else "cpu")
    r.figure("torch", torch.__version__)
    t0 = time.time()
    for name in args.only or PARTS:
        start = time.time()
        try:  # one part's crash is its failure; the parts after it still run
            if name in ("train", "paper", "lora24"):
                PARTS[name](r, z, dev, args.tokenizer, args.set)
            else:
                PARTS[name](r, z, dev)
        except Exception:
            traceback.print_exc()
            r.failed.append(f"{name} (crashed)")
        r.figure(f"time_{name}_s", time.time() - start)
        if dev == "cuda":
            torch.cuda.empty_cache()
    r.figure("time_total_s", time.time() - t0)
    r.figure("checks", f"{sum(n not in r.failed for n in r.checked)} of {len(r.checked)} passed")
    r.figure("failed", ", ".join(r.failed) or "none")
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())
