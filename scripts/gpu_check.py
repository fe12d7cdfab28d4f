"""GPU check: the engine against its references, its speed and its memory plan, in one run.

    python -m scripts.gpu_check                  # on CUDA: a few minutes on one large GPU
    python -m scripts.gpu_check --device cpu     # the same checks at toy sizes, in seconds (tests/test_gpu_check.py)

Not part of the paper: what a machine with a GPU must confirm before
configs/qwen2.5-7b-1gpu.yaml is trusted there, since the tests run on CPUs. It builds a
small model of Qwen2.5's architecture (q/k/v biases, grouped KV heads, untied
embeddings) from a config with random weights (the GPU machine has no internet), and:

  1. sampler: greedy tokens and log-probs of agentflow.LLM.sample against naive
     recomputation of the whole sequence, in float32 (to 1e-3) and in bf16 (each sampled
     token must be the recomputation's argmax up to a bf16-sized logit margin); stop
     rules looked at every 8 tokens give what every token gives;
  2. loss: flow_grpo.accumulate_gradients on bf16 weights against
     flow_grpo.reference_objective on float32 copies of the same weights, and rho == 1
     exactly on the first step of flow_grpo.policy_update;
  3. speed: sampler vs model.generate, tokens per second, greedy, the same prompts;
  4. memory: the peak of torch.cuda.max_memory_allocated during a rollout-sized sampler
     call and during an update, against what support/device_memory.py predicts for them.

Prints one `name: value` line per figure; exits 1 if a check fails.
"""

import argparse
import copy
import sys
import time

import torch

from support import device_memory
from support import optim
from agentflow import LLM, PlannerTurn, SamplingParams, Trajectory
from flow_grpo import LossConfig, UpdateConfig, accumulate_gradients, build_rows, policy_update, reference_objective
from memory import Memory

# Sizes per device: the model and the work. On CUDA the model has Qwen2.5's head layout at
# a fraction of its width; the rollout is the paper's 32 x 8 rows.
SIZES = {
    "cuda": dict(hidden=1024, intermediate=2816, layers=8, heads=16, kv_heads=4, vocab=32000,
                 rows=256, prefix=256, own=(64, 256), new=256, exact_rows=8, exact_new=32, speed_rows=64,
                 speed_new=128, loss_groups=4, loss_G=4, action=32, micro_batch=4),
    "cpu": dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=512,
                rows=8, prefix=16, own=(4, 24), new=8, exact_rows=4, exact_new=6, speed_rows=4,
                speed_new=8, loss_groups=1, loss_G=3, action=5, micro_batch=2),
}


class IdTokenizer:
    """What the sampler asks of a tokenizer, for a model without one: ids as text."""

    def __init__(self, vocab: int):
        self.eos_token_id, self.pad_token_id = vocab - 1, 0

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == self.eos_token_id))


def build_model(z: dict, device: str, dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=z["vocab"], hidden_size=z["hidden"], intermediate_size=z["intermediate"],
                      num_hidden_layers=z["layers"], num_attention_heads=z["heads"],
                      num_key_value_heads=z["kv_heads"], max_position_embeddings=8192, tie_word_embeddings=False,
                      eos_token_id=z["vocab"] - 1, pad_token_id=0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 2.0 / z["hidden"] ** 0.5)  # decisive greedy choices, varied samples
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model.to(device=device, dtype=dtype).eval()


def make_prompts(z: dict, n: int, seed: int) -> list[list[int]]:
    """n prompts: a shared prefix (a module's instructions), then rows of their own length,
    the G copies of a query consecutive and identical (as at a rollout's first turn)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, z["vocab"] - 1, (z["prefix"],), generator=g).tolist()
    out = []
    for i in range(0, n, 8):
        own = torch.randint(1, z["vocab"] - 1, (int(torch.randint(*z["own"], (1,), generator=g)),), generator=g).tolist()
        out += [prefix + own] * min(8, n - i)
    return out


@torch.no_grad()
def naive(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """log-softmax [len(ids), V] of every sampled position, from one forward of the whole sequence."""
    seq = torch.tensor([prompt + ids], device=next(model.parameters()).device)
    logits = model(seq).logits[0, len(prompt) - 1:len(prompt) - 1 + len(ids)].float()  # [n, V]
    return torch.log_softmax(logits, -1)


class Report:
    def __init__(self):
        self.failed = []

    def figure(self, name: str, value) -> None:
        print(f"{name}: {value:.6g}" if isinstance(value, float) else f"{name}: {value}", flush=True)

    def check(self, name: str, ok: bool, value) -> None:
        self.figure(name, value)
        self.figure(name + "_ok", bool(ok))
        if not ok:
            self.failed.append(name)


def check_sampler(r: Report, z: dict, dev: str) -> None:
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, None)):
        name = "fp32" if dtype == torch.float32 else "bf16"
        model = build_model(z, dev, dtype)
        llm = LLM(model, IdTokenizer(z["vocab"]))
        prompts = make_prompts(z, z["exact_rows"], seed=1)
        out = llm.sample(prompts, SamplingParams(0.0, z["exact_new"]))
        worst_lp, worst_margin = 0.0, 0.0
        for p, s in zip(prompts, out):
            lsm = naive(model, p, s.ids)  # [n, V]
            got = lsm.gather(-1, torch.tensor(s.ids, device=lsm.device)[:, None])[:, 0]  # [n]
            worst_lp = max(worst_lp, float((got - torch.tensor(s.logprobs, device=lsm.device)).abs().max()))
            worst_margin = max(worst_margin, float((lsm.max(-1).values - got).max()))  # 0 = it is the argmax
        if tol is not None:
            r.check(f"sampler_{name}_logprob_max_diff", worst_lp < tol and worst_margin == 0.0, worst_lp)
        else:  # bf16 rounds the cached path and the recomputation differently: near-ties may flip
            r.check(f"sampler_{name}_logprob_max_diff", worst_lp < 0.15, worst_lp)
            r.check(f"sampler_{name}_argmax_margin_max", worst_margin < 0.15, worst_margin)
        if dtype == torch.float32:
            every = [LLM(model, llm.tok, check_every=k).sample(prompts, SamplingParams(0.0, z["exact_new"]))
                     for k in (1, 8)]
            same = all(a.ids == b.ids and a.finish == b.finish for a, b in zip(*every))
            r.check("sampler_check_every_8_equals_1", same, same)
        r.figure(f"sampler_decode_way_{name}", getattr(llm.decode, "__name__", str(llm.decode)))
        del model, llm


def trajectories(llm: LLM, z: dict, seed: int) -> list:
    """Q x G planner turns sampled at temperature 1: (prompt, action, log-probs)."""
    prompts = make_prompts(z, z["loss_groups"] * z["loss_G"], seed)
    trajs = []
    for k, (p, s) in enumerate(zip(prompts, llm.sample(prompts, SamplingParams(1.0, z["action"]), seed=seed))):
        tr = Trajectory(f"query {k // z['loss_G']}", Memory(1000, 100))
        tr.turns.append(PlannerTurn(p, s.ids, s.logprobs, ""))
        trajs.append(tr)
    return trajs


def check_loss(r: Report, z: dict, dev: str) -> None:
    m16 = build_model(z, dev, torch.bfloat16)
    ref16 = copy.deepcopy(m16).requires_grad_(False)
    with torch.no_grad():
        for p in ref16.parameters():
            p.add_(0.01 * torch.randn_like(p))
    llm = LLM(m16, IdTokenizer(z["vocab"]))
    trajs = trajectories(llm, z, seed=2)
    G = z["loss_G"]
    adv = [((k % G) - (G - 1) / 2) / G for k in range(len(trajs))]  # a spread of advantages per group
    rows = build_rows(trajs, adv)
    sampling, cfg = SamplingParams(1.0, z["action"]), LossConfig(0.2, 0.3, 0.1)
    m32, ref32 = copy.deepcopy(m16).float(), copy.deepcopy(ref16).float()
    J = reference_objective(m32, ref32, trajs, adv, sampling, cfg)
    (-J).backward()
    g32 = torch.cat([p.grad.flatten() for p in m32.parameters()])
    del m32, ref32
    for fast in (True, False):
        m16.zero_grad()
        st = accumulate_gradients(m16, ref16, rows, sampling, cfg, llm.pad_id, fast=fast, micro_batch=z["micro_batch"])
        g16 = torch.cat([p.grad.float().flatten() for p in m16.parameters()])
        rel = float((g16 - g32).norm() / g32.norm())
        cos = float(g16 @ g32 / (g16.norm() * g32.norm()))
        way = "fast" if fast else "plain"
        r.check(f"loss_bf16_{way}_grad_rel_err_vs_fp32_reference", rel < 0.08 and cos > 0.995, rel)
        r.figure(f"loss_bf16_{way}_grad_cosine", cos)
        r.figure(f"loss_bf16_{way}_loss_rel_err", abs(st["loss"] + J.item()) / max(abs(J.item()), 1e-12))
    m16.zero_grad(set_to_none=True)
    for epochs, minibatches in ((1, 1), (2, 2)):
        opt = optim.PlannerOptimizer(list(m16.parameters()), 1e-6)
        out = policy_update(m16, ref16, opt, rows, sampling, cfg,
                            UpdateConfig(epochs=epochs, minibatches=minibatches, micro_batch=z["micro_batch"]),
                            llm.pad_id)
        r.check(f"on_policy_ratio_dev_first_step_{epochs}x{minibatches}", out["ratio_dev_first_step"] == 0.0,
                out["ratio_dev_first_step"])
        r.figure(f"on_policy_logprob_gap_sampler_vs_trainer_{epochs}x{minibatches}", out["logprob_gap"])
        opt.masters.remove()


def check_speed(r: Report, z: dict, dev: str) -> None:
    model = build_model(z, dev, torch.bfloat16)
    tok = IdTokenizer(z["vocab"])
    llm = LLM(model, tok)
    prompts = make_prompts(z, z["speed_rows"], seed=3)
    n, new = len(prompts), z["speed_new"]
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    llm.sample(prompts[:2], SamplingParams(0.0, 4))  # warm up
    sync()
    t0 = time.perf_counter()
    out = llm.sample(prompts, SamplingParams(0.0, new))
    sync()
    ours = sum(len(s.ids) for s in out) / (time.perf_counter() - t0)
    L = max(map(len, prompts))
    ids = torch.zeros((n, L), dtype=torch.long, device=dev)
    mask = torch.zeros((n, L), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):], mask[i, L - len(p):] = torch.tensor(p, device=dev), 1
    gen = lambda k: model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=k, do_sample=False,
                                   pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    gen(4)
    sync()
    t0 = time.perf_counter()
    seqs = gen(new)[:, L:]
    sync()
    made = 0
    for row in seqs.tolist():
        made += next((j + 1 for j, t in enumerate(row) if t == tok.eos_token_id), len(row))
    theirs = made / (time.perf_counter() - t0)
    r.figure("speed_sampler_tokens_per_s", ours)
    r.figure("speed_generate_tokens_per_s", theirs)
    r.figure("speed_sampler_over_generate", ours / theirs)
    same = [s.ids for s in out] == [row[:len(s.ids)] for s, row in zip(out, seqs.tolist())]
    r.figure("speed_same_greedy_tokens_as_generate", same)


class CudaCounters:
    """torch's own count of the bytes its tensors hold on the GPU (not the allocator's cache)."""
    sync = staticmethod(torch.cuda.synchronize)
    now = staticmethod(torch.cuda.memory_allocated)
    peak = staticmethod(torch.cuda.max_memory_allocated)
    reset = staticmethod(torch.cuda.reset_peak_memory_stats)

    @staticmethod
    def total() -> float:
        return float(torch.cuda.get_device_properties(0).total_memory)


def counters(dev: str):
    """The memory counters of `dev`, or None where torch keeps none (a CPU)."""
    return CudaCounters if dev == "cuda" else None


def check_memory(r: Report, z: dict, dev: str) -> None:
    """Peaks of a rollout-sized sampler call and of an update against the plan's figures."""
    mem = counters(dev)
    if mem is None:
        r.figure("memory", "skipped (no CUDA: torch.cuda.max_memory_allocated needs a GPU)")
        return
    model = build_model(z, dev, torch.bfloat16)
    train_layers = max(1, z["layers"] // 2)
    trained = optim.select_trainable(model, train_layers)
    ref = optim.frozen_reference(model, trained)
    opt = optim.PlannerOptimizer(trained, 1e-6)
    prompts = make_prompts(z, z["rows"], seed=4)
    budget = mem.total()
    shape = device_memory.model_shape(model.config, train_layers, name="gpu_check model")
    plan = device_memory.make_plan(shape, dtype="bfloat16", device="cuda", budget=budget,
                                 max_prompt=max(map(len, prompts)), max_new=z["new"], planner_new=z["new"],
                                 rollout_rows=z["rows"], eval_rows=z["rows"], micro_batch=z["micro_batch"],
                                 prefill_tokens=8192, logits_chunk=1024)
    for line in plan.text().splitlines():
        r.figure("plan", line.strip())
    llm = LLM(model, IdTokenizer(z["vocab"]))
    llm.sub_batch_bytes, llm.prefill_tokens = plan.sub_batch_bytes, plan.prefill_tokens
    GB = device_memory.GB
    resident_planned = plan.resident - device_memory.reserve_bytes(budget, "cuda")
    # An update first, so that AdamW's moments exist (they are resident), then measure each phase.
    trajs = [Trajectory("q", Memory(100, 10)) for _ in prompts]
    samples = llm.sample(prompts, SamplingParams(1.0, z["new"]), seed=5)
    for tr, p, s in zip(trajs, prompts, samples):
        tr.turns.append(PlannerTurn(p, s.ids, s.logprobs, ""))
    rows = build_rows(trajs, [float(k % 2) - 0.5 for k in range(len(trajs))])[:4 * z["micro_batch"]]
    update = lambda: policy_update(model, ref, opt, rows, SamplingParams(1.0, z["new"]), LossConfig(0.2, 0.3, 0.001),
                                   UpdateConfig(micro_batch=z["micro_batch"], max_tokens=plan.update_tokens),
                                   llm.pad_id)
    update()
    mem.sync()
    resident = mem.now()
    r.figure("memory_resident_gb", resident / GB)
    r.figure("memory_resident_planned_gb", resident_planned / GB)
    mem.reset()
    before = llm.sub_batches_run
    llm.sample(prompts, SamplingParams(1.0, z["new"]), seed=6)
    mem.sync()
    peak = mem.peak()
    r.figure("memory_sampler_sub_batches", llm.sub_batches_run - before)
    r.figure("memory_sampler_peak_gb", peak / GB)
    r.figure("memory_sampler_peak_planned_gb", (resident_planned + plan.sampler) / GB)
    r.check("memory_sampler_within_plan", peak <= resident_planned + plan.sampler, (peak - resident) / GB)
    mem.reset()
    update()
    mem.sync()
    peak = mem.peak()
    r.figure("memory_update_peak_gb", peak / GB)
    r.figure("memory_update_peak_planned_gb", (resident_planned + plan.update) / GB)
    r.check("memory_update_within_plan", peak <= resident_planned + plan.update, (peak - resident) / GB)
    r.check("memory_resident_within_plan", resident <= resident_planned, resident / GB)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    args = ap.parse_args(argv)
    dev, z = args.device, SIZES[args.device]
    r = Report()
    r.figure("device", torch.cuda.get_device_name(0) if dev == "cuda" else "cpu")
    r.figure("torch", torch.__version__)
    t0 = time.time()
    for part in (check_sampler, check_loss, check_speed, check_memory):
        start = time.time()
        part(r, z, dev)
        r.figure(f"time_{part.__name__}_s", time.time() - start)
        if dev == "cuda":
            torch.cuda.empty_cache()
    r.figure("time_total_s", time.time() - t0)
    r.figure("failed", ", ".join(r.failed) or "none")
    return 1 if r.failed else 0


if __name__ == "__main__":
    sys.exit(main())
