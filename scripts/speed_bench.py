"""Benchmark of the engine: how fast the hand-written sampler makes rollouts, and why.

    python -m scripts.speed_bench                                  # the full run
    python -m scripts.speed_bench --quick                          # sequential rollouts on 8, not 32
    python -m scripts.speed_bench --device cuda --dtype bfloat16   # the same code on a GPU
    python -m scripts.speed_bench --threads 1                      # when another job shares the CPU
    python -m scripts.speed_bench --only lora                      # one part (throughput, prefix, rollout,
                                                                   #   roofline, lora)

On-policy RL spends most of its time generating, so the engine's speed decides how many
Flow-GRPO steps a run gets. Measured
side by side in one run, on the default model (SmolLM2-135M), each figure as `name: value`:

  1. sampler vs `model.generate`: new tokens/s at batch 1, 8, 32, 64, exactly 64 new
     tokens per row on both sides (plain sampling, temperature 1, EOS
     made impossible), the same chat prompts of different lengths. Wall time includes
     the prefill, as it does in a rollout. Targets: >= 3x `generate` at b32 on CPU,
     >= 150 tokens/s at b64. Then the sampler once more with one of its speed ideas
     swapped for the generic way, to show what each idea earns (the engine keeps an
     idea worth about 10% or more): the model's own forward for each new token
     instead of engine.decode_step (b32); every idea swapped at once (b32); the prompts
     prefilled as one left-padded batch instead of in groups of similar length (b32,
     prefill only); torch.multinomial instead of the inverse-CDF engine.draw (b64);
     every row running its whole prompt instead of shared-text groups running their
     common system prompt once (b64); each new position concatenated onto the cache, as
     Hugging Face's DynamicLayer does, instead of written in place (b64); the stop rules
     decoding every row's tail after every token (b64, a stop string on every row).
     Each swap is timed in turns with the sampler as shipped, the fastest of three
     calls each.
  2. prefix reuse: prefill of 32 prompts that share a 300+-token system prompt (the
     planner's instructions with six tool cards), with the sampler's shared-prefix path
     on and off. Target: >= 5x.
  3. rollout: 32 trajectories (8 held-out queries x G=4, config.yaml's agent) in lockstep
     vs one at a time. Target: >= 8x.
  4. roofline: a large matmul gives the machine's GFLOP/s; a token costs ~2 * n_params
     FLOPs (one multiply-add per weight, attention over short contexts ignored), so
     GFLOP/s / (2 * n_params) is the most tokens/s any engine could reach here.
     A decode step does not run large matmuls, though: it runs the model's 211 linear
     layers on a batch of B rows. Timing exactly those (same weights, same shapes, no
     attention, no norms, no sampling) at B = 32 and 64 gives the tokens/s a decoder
     made of nothing but these matmuls would reach. With the prefill both sides pay
     (`prefill_s_b32`), that bounds the lead over `generate` any sampler built on these
     matmuls can have: `sampler_vs_generate_ceiling_b32`.

  5. LoRA (lora.py): the sampler at b32 with rank-16 adapters on every projection of the
     default's 4 trained blocks (and of all 30) against the same model without (B random, as
     after training: the adapters' arithmetic runs unmerged in every decode step), timed in
     turns. Goal: at most 15% slower. Then one update (flow_grpo.policy_update: 32 planner
     rows, the loss's forward and backward, AdamW) with those adapters against the full
     fine-tune of the same 4 blocks (config.yaml's).

Figures move with the machine's load: the '#' header says what it was.
"""

import argparse
import contextlib
import copy
import os
import time
from unittest.mock import patch

import torch
from transformers.cache_utils import Cache

import engine
import lora as lora_lib
from agentflow import PLANNER_SYSTEM
from engine import LLM, SamplingParams
from eval import build_agent
from flow_grpo import LossConfig, TurnRow, UpdateConfig, frozen_reference, policy_update
from support import batching
from support.batching import MIN_SHARED, common_prefix_len, shared_text_groups
from support.config import DEFAULTS, load_config
from support.datasets import read_jsonl
from support.kv_cache import PreallocatedLayer
from support.models import DEFAULT_MODEL, load_model
from support.optim import PlannerOptimizer
from support.provenance import cpu_name
from tools import TOOL_CLASSES, build_tools

NEW = 64  # new tokens per row in the throughput comparison
REPEAT = 2  # parts 1 and 2 time each call twice and keep the faster (swaps: three in turns; rollouts: once)
BATCHES = (1, 8, 32, 64)

# Chat prompts of different lengths for the throughput comparison. The system prompts
# begin differently, so the sampler finds no prefix shared by all rows: this part
# measures the decode loop, not prefix reuse (part 2 does that). Rows with the same
# system prompt do share its ~17 tokens, which the sampler runs once per shared-text group.
SYSTEMS = [
    "You are a helpful assistant.",
    "Answer in one short sentence.",
    "Be concise. Think about units and show the final number on its own line.",
    "As a careful research assistant, you read the question twice, name what is being "
    "asked, list the facts you know about it, say which are uncertain, and then give "
    "your best answer with a one-line justification.",
]


def header(args) -> None:
    print(f"# cpu {cpu_name()}")
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"device {args.device}, dtype {args.dtype}")
    print(f"# load average (1, 5, 15 min) at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
          f" on {os.cpu_count()} CPUs")
    if args.device == "cuda":
        print(f"# gpu {torch.cuda.get_device_name()}")


def clock(device: str, fn, repeat: int = 1) -> float:
    """Seconds one call of fn takes, the fastest of `repeat` calls (a busy machine slows
    single calls, never speeds them up); on a GPU, queued kernels are waited for."""
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def generate(llm: LLM, prompts: list[list[int]], new: int, seed: int = 0):
    """transformers' `generate`, left-padded, sampling exactly `new` tokens per row."""
    L = max(len(p) for p in prompts)
    ids = torch.tensor([[llm.pad_id] * (L - len(p)) + p for p in prompts], device=llm.device)  # [B, L]
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=llm.device)  # [B, L]
    torch.manual_seed(seed)
    with torch.no_grad():
        return llm.model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                  top_p=1.0, top_k=0, max_new_tokens=new, min_new_tokens=new,
                                  pad_token_id=llm.pad_id)


def throughput(llm: LLM, questions: list[str], device: str) -> dict:
    """Part 1: new tokens/s of our sampler and of `generate` at each batch size."""
    no_eos = copy.copy(llm)  # the same model and tokenizer; only the EOS set differs
    no_eos.eos_ids = [-1]  # an id no token has: every row runs the full NEW tokens
    params = SamplingParams(temperature=1.0, max_new_tokens=NEW)
    prompts = [llm.chat_ids(SYSTEMS[i % len(SYSTEMS)], questions[i % len(questions)])
               for i in range(max(BATCHES))]
    groups = shared_text_groups(prompts, [len(p) - 1 for p in prompts], 0)
    print(f"# throughput prompts: {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"shared prefix {common_prefix_len(prompts)} tokens (< {MIN_SHARED}: not "
          f"reused); at b64 {len(groups)} shared-text groups (one per system prompt) share "
          f"{[n for _, n in groups]} tokens")
    # Warm up each path once (allocator, kernels, lazy init) on a small batch.
    no_eos.sample(prompts[:4], replace_new(params, 8))
    generate(llm, prompts[:4], 8)
    out = {}
    # Prefill alone (the prompts and the first token), which both sides pay: part 4b's ceiling.
    out["prefill_s_b32"] = clock(device, lambda: no_eos.sample(prompts[:32], replace_new(params, 1)), REPEAT)
    show("prefill_s_b32", out["prefill_s_b32"])
    for B in BATCHES:
        t_ours = clock(device, lambda: no_eos.sample(prompts[:B], params, seed=B), REPEAT)
        t_hf = clock(device, lambda: generate(llm, prompts[:B], NEW, seed=B), REPEAT)
        out[f"sampler_tokens_per_s_b{B}"] = B * NEW / t_ours
        out[f"generate_tokens_per_s_b{B}"] = B * NEW / t_hf
        out[f"sampler_vs_generate_b{B}"] = t_hf / t_ours
        for k in ("sampler_tokens_per_s", "generate_tokens_per_s", "sampler_vs_generate"):
            show(f"{k}_b{B}", out[f"{k}_b{B}"])
    # Then the sampler with one of its parts swapped for the generic one (the module
    # docstring says what each swap replaces). Each swap is timed in turns with the sampler
    # as shipped (versus), so a slow spell of the machine hits both sides of a ratio.
    B = 32
    run_b32 = lambda: no_eos.sample(prompts[:B], params, seed=B)
    swapped(device, "decode_step", "sampler_hf_forward", B, run_b32, generic_forward)
    swapped(device, "all_ideas", "sampler_generic", B, run_b32, every_idea_swapped)
    t_groups, t_one = versus(device, lambda: no_eos.sample(prompts[:32], replace_new(params, 1)), one_padded_batch)
    show("prefill_one_batch_s_b32", t_one)
    show("prefill_groups_speedup_b32", t_one / t_groups)
    B = max(BATCHES)
    run_b64 = lambda: no_eos.sample(prompts[:B], params, seed=B)
    swapped(device, "draw", "sampler_multinomial", B, run_b64, multinomial_draw)
    swapped(device, "shared_groups", "sampler_no_shared_groups", B, run_b64, no_shared_groups)
    swapped(device, "kv_cache_in_place", "sampler_concat_cache", B, run_b64, concat_cache_swap)
    # A stop string no row ever writes ("|~"), so that every row still runs the full NEW tokens.
    stopped = SamplingParams(**{**vars(params), "stop": ("|~",)})
    swapped(device, "stop_look", "sampler_tail_every_token", B,
            lambda: no_eos.sample(prompts[:B], stopped, seed=B), tail_every_token)
    return out


# Each speed idea of the engine, swapped for the generic way (a context manager each).
generic_forward = lambda: patch.object(engine, "DECODE_STEP_MODELS", ())
one_padded_batch = lambda: patch.object(engine, "length_groups", lambda lengths: [list(range(len(lengths)))])
multinomial_draw = lambda: patch.object(engine, "draw", lambda w, gen: torch.multinomial(w, 1, generator=gen)[:, 0])
no_shared_groups = lambda: patch.object(batching, "shared_text_groups", lambda seqs, shareable, P: [])
concat_cache_swap = lambda: patch.object(engine, "preallocated_cache", concat_cache)


def tail_every_token():
    """LLM._hit_stop decoding the row's tail after every token, as before it looked first."""
    def hit(self, ids, stops):
        return any(s in self.tok.decode(ids[-8:], skip_special_tokens=True) for s in stops)
    return patch.object(LLM, "_hit_stop", hit)


@contextlib.contextmanager
def every_idea_swapped():
    with generic_forward(), one_padded_batch(), multinomial_draw(), no_shared_groups(), concat_cache_swap(), \
            tail_every_token():
        yield


def versus(device: str, fn, swap, repeat: int = 3) -> tuple[float, float]:
    """(seconds of fn as shipped, seconds of fn with the patch `swap()` in force), the
    fastest of `repeat` calls each, taken in turns."""
    ours, swapped_ = [], []
    for _ in range(repeat):
        ours.append(clock(device, fn))
        with swap():
            swapped_.append(clock(device, fn))
    return min(ours), min(swapped_)


def swapped(device: str, part: str, generic: str, B: int, fn, swap) -> None:
    """Print the generic part's tokens/s and what the shipped part brings over it."""
    t_ours, t_generic = versus(device, fn, swap)
    show(f"{generic}_tokens_per_s_b{B}", B * NEW / t_generic)
    show(f"{part}_speedup_b{B}", t_generic / t_ours)


class ConcatLayer(PreallocatedLayer):
    """The in-place cache's prefill, then each new position appended the way Hugging
    Face's DynamicLayer appends it: torch.cat of the whole cache and the new keys."""

    def update(self, key_states, value_states, *args, **kwargs):
        if self.k_live is None:  # the prefill, laid out as the sampler lays it out
            return super().update(key_states, value_states, *args, **kwargs)
        self.k_live = torch.cat([self.keys, key_states], dim=-2)  # [b, H, n+s, D], a new tensor
        self.v_live = torch.cat([self.values, value_states], dim=-2)
        self.length = self.k_live.shape[-2]
        self._views()
        return self.keys, self.values


def concat_cache(capacity: int = 0, rows: int = 0) -> Cache:
    """support.kv_cache.preallocated_cache's stand-in with ConcatLayer layers (the planned room unused)."""
    return Cache(layer_class_to_replicate=ConcatLayer)


def replace_new(params: SamplingParams, new: int) -> SamplingParams:
    return SamplingParams(**{**vars(params), "max_new_tokens": new})


def prefix_reuse(llm: LLM, questions: list[str], device: str) -> None:
    """Part 2: prefill of 32 prompts behind one long shared system prompt, reuse on/off."""
    cards = "\n".join(f"- {t.name}: {t.card}" for t in build_tools(sorted(TOOL_CLASSES)).values())
    system = PLANNER_SYSTEM.format(cards=cards)  # the planner's instructions, all six tool cards
    prompts = [llm.chat_ids(system, f"Question: {q}\nWhat is the next step?", "Tool:")
               for q in questions[:32]]
    shared = common_prefix_len(prompts)
    print(f"# prefix prompts: 32 x {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{shared} shared")
    one = SamplingParams(1.0, max_new_tokens=1)  # prefill + the first token, no decode step

    def unshared(ps):  # the sampler with its shared-text paths (prefix, shared-text groups) switched off
        with patch.object(batching, "common_prefix_len", lambda prompts: 0), no_shared_groups():
            llm.sample(ps, one)

    llm.sample(prompts[:4], one)  # warm up both paths
    unshared(prompts[:4])
    t_shared = clock(device, lambda: llm.sample(prompts, one), REPEAT)
    t_unshared = clock(device, lambda: unshared(prompts), REPEAT)
    show("prefill_shared_s", t_shared)
    show("prefill_unshared_s", t_unshared)
    show("prefix_reuse_speedup", t_unshared / t_shared)


def rollouts(args, questions: list[str]) -> None:
    """Part 3: one rollout of 8 queries x G=4 in lockstep vs the same 32 one at a time."""
    cfg = load_config("config.yaml", [f"model.device={args.device}", f"model.dtype={args.dtype}"])
    agent = build_agent(cfg)
    G = 4
    queries = [q for q in questions[:8] for _ in range(G)]  # grouped as train.py groups them
    agent.rollout(queries[:1], seed=99)  # warm-up: one trajectory, every module and tool
    batched = []
    t_batched = clock(args.device, lambda: batched.extend(agent.rollout(queries, seed=0)))
    # One at a time, trajectory k with seed k: the G copies of a query must differ, as the
    # rows of one batched call do (one seed there, different random draws per row).
    n_seq = 8 if args.quick else len(queries)
    sequential = []
    t_seq = clock(args.device, lambda: [sequential.extend(agent.rollout([q], seed=k))
                                        for k, q in enumerate(queries[:n_seq])])
    t_seq *= len(queries) / n_seq
    turns = lambda trajs: sum(len(t.turns) for t in trajs) / len(trajs)
    print(f"# rollout work: batched {turns(batched):.2f} planner turns per trajectory, "
          f"sequential {turns(sequential):.2f}")
    if args.quick:
        print(f"# --quick: sequential ran {n_seq} trajectories, time below extrapolated x{len(queries) // n_seq}")
    show("rollout_batched_s", t_batched)
    show("rollout_sequential_s", t_seq)
    show("rollout_batched_speedup", t_seq / t_batched)


def roofline(llm: LLM, args, sampler_b64: float) -> None:
    """Part 4: the matmul speed of this machine, and what fraction of it the sampler uses."""
    n = 4096 if args.device == "cuda" else 2048
    dtype = getattr(torch, args.dtype) if args.device == "cuda" else torch.float32
    a = torch.randn(n, n, device=args.device, dtype=dtype)
    b = torch.randn(n, n, device=args.device, dtype=dtype)
    a @ b  # warm-up
    reps = 50 if args.device == "cuda" else 5
    t = clock(args.device, lambda: [a @ b for _ in range(reps)])
    gflops = reps * 2 * n ** 3 / t / 1e9
    n_params = sum(p.numel() for p in llm.model.parameters())
    gflop_per_token = 2 * n_params / 1e9  # one multiply-add per weight per token
    print(f"# roofline: {n}x{n} @ {n}x{n} {dtype}, x{reps}; model {n_params / 1e6:.1f}M parameters, "
          f"~2 * n_params = {gflop_per_token:.3f} GFLOP per token")
    show("matmul_gflop_per_s", gflops)
    show("roofline_tokens_per_s", gflops / gflop_per_token)
    show("sampler_fraction_of_roofline_b64", sampler_b64 / (gflops / gflop_per_token))


def linear_only(llm: LLM, args, tp: dict) -> None:
    """Part 4b: one decode step's linear layers alone, at B = 32 and 64 rows."""
    linears = [m for m in llm.model.modules() if isinstance(m, torch.nn.Linear)]
    for B in (32, 64):
        xs = {k: torch.randn(B, k, device=args.device, dtype=linears[0].weight.dtype)
              for k in {m.in_features for m in linears}}  # [B, in] per input width
        with torch.no_grad():
            def step():  # every linear of one decode step: 30 x (q, k, v, o, gate, up, down) + lm_head
                for m in linears:
                    m(xs[m.in_features])  # [B, in] -> [B, out]

            step()  # warm-up
            t = clock(args.device, lambda: [step() for _ in range(3)]) / 3
        show(f"linear_only_tokens_per_s_b{B}", B / t)
        if B == 32:  # generate's time / (prefill + 63 steps of linears only)
            t_generate = B * NEW / tp["generate_tokens_per_s_b32"]
            show("sampler_vs_generate_ceiling_b32", t_generate / (tp["prefill_s_b32"] + (NEW - 1) * t))
    print(f"# linear-only: {len(linears)} linear layers per decode step, {linears[0].weight.dtype}")


def lora(llm: LLM, args, questions: list[str]) -> None:
    """Part 5: the sampler and the update with adapters against without."""
    no_eos = copy.copy(llm)
    no_eos.eos_ids = [-1]  # every row runs the full NEW tokens
    params, B = SamplingParams(temperature=1.0, max_new_tokens=NEW), 32
    prompts = [llm.chat_ids(SYSTEMS[i % len(SYSTEMS)], questions[i % len(questions)]) for i in range(B)]
    run_b32 = lambda: no_eos.sample(prompts, params, seed=B)
    for name, blocks in (("lora", 4), ("lora_all_blocks", 0)):
        adapted = copy.deepcopy(llm.model)
        lora_lib.add_adapters(adapted, 16, 32.0, DEFAULTS["train"]["lora_targets"], blocks, seed=0)
        with torch.no_grad():  # B = 0 would be the base's arithmetic plus zeros; make them count
            for layer in lora_lib.adapters(adapted).values():
                layer.lora_B.normal_(0, 0.01)
        t_base, t_lora = versus(args.device, run_b32, lambda: patch.object(no_eos, "model", adapted))
        show(f"{name}_sampler_tokens_per_s_b{B}", B * NEW / t_lora)
        show(f"{name}_sampler_slowdown_b{B}", t_lora / t_base)
    # One update of 32 planner rows: the default's full fine-tune of the top 4 blocks, then
    # rank-16 adapters on them, each from the untrained weights, each on its own model copy.
    planner = SamplingParams(1.0, max_new_tokens=16)
    rows = [TurnRow(p, s.ids, s.logprobs, (-1.0) ** k, 1 / B)
            for k, (p, s) in enumerate(zip(prompts, llm.sample(prompts, planner, seed=1)))]

    def update(rank: int):
        model = copy.deepcopy(llm.model)
        trained = lora_lib.trained_weights(model, {**DEFAULTS["train"], "train_layers": 4, "lora_rank": rank})
        ref, opt = frozen_reference(model, trained), PlannerOptimizer(trained, lr=1e-4)
        return lambda: policy_update(model, ref, opt, rows, planner, LossConfig(0.2, 0.3, 0.2),
                                     UpdateConfig(micro_batch=16), llm.pad_id)

    full, adapters = update(0), update(16)
    full(), adapters()  # warm-up
    t_full = min(clock(args.device, full) for _ in range(3))
    t_lora = min(clock(args.device, adapters) for _ in range(3))
    show("update_full_s_32_rows", t_full)
    show("update_lora_s_32_rows", t_lora)
    show("update_lora_vs_full", t_lora / t_full)


def show(name: str, value: float) -> None:
    print(f"{name}: {value:.3f}" if value < 10 else f"{name}: {value:.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.speed_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--quick", action="store_true", help="sequential rollouts on 8 trajectories, x4")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default); "
                    "1 if another torch job shares the cores: spinning threads then stall each other")
    ap.add_argument("--only", action="append", choices=("throughput", "prefix", "rollout", "roofline", "lora"),
                    help="run this part (repeatable); default all")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    header(args)
    model, tok = load_model(DEFAULT_MODEL, args.device, args.dtype)
    llm = LLM(model, tok)
    questions = [row["question"] for row in read_jsonl("data/heldout.jsonl", strict=True)][:64]
    t0 = time.perf_counter()
    parts = args.only or ["throughput", "prefix", "rollout", "roofline", "lora"]
    if "throughput" in parts or "roofline" in parts:  # the roofline's comparison needs part 1's figures
        tp = throughput(llm, questions, args.device)
    if "prefix" in parts:
        prefix_reuse(llm, questions, args.device)
    if "rollout" in parts:
        rollouts(args, questions)
    if "roofline" in parts:
        roofline(llm, args, tp["sampler_tokens_per_s_b64"])
        linear_only(llm, args, tp)
    if "lora" in parts:
        lora(llm, args, questions)
    print(f"# total {time.perf_counter() - t0:.0f} s; load average at end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
