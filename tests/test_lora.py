"""LoRA (lora.py): adapters off = the base exactly; the first update on-policy in fp32 and
bf16; the sampler and the trainer compute the same adapted policy; the export is a plain
Hugging Face model equal to the merged forward; resume is bit-exact; one copy of the base."""

import copy
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from engine import LLM
from flow_grpo import (LossConfig, UpdateConfig, frozen_reference, group_advantages, policy_update,
                       token_logprobs)
from lora import LoRALinear, adapters, add_adapters, merged_state_dict, without_adapters
from support.config import ConfigError
from support.optim import PlannerOptimizer
from test_flow_grpo import EPS_HI, EPS_LO, SAMPLING, make_trajectories, rows_of
from test_memory_plan import qwen7b  # noqa: F401 (a fixture)
from test_train import learnable_reward, run, tiny_cfg, weights  # noqa: F401 (a fixture)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapted(tiny_llm, dtype=torch.float32, trained_B=False, rank=4):
    """(LLM with adapters on every block, the plain base model) in `dtype`. trained_B: B
    random instead of 0, as after some updates, so that the adapters change the policy."""
    base = copy.deepcopy(tiny_llm.model).to(dtype)
    model = copy.deepcopy(base)
    params = add_adapters(model, rank, 8.0, TARGETS, 0, seed=3)
    if trained_B:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for layer in adapters(model).values():
                layer.lora_B.copy_(0.05 * torch.randn(layer.lora_B.shape, generator=g))
    return LLM(model, tiny_llm.tok), base, params


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_adapters_and_adapters_off_are_the_base_exactly(tiny_llm, dtype):
    """B = 0: the adapted model's forward is the base's bit for bit; the reference (the base
    with adapters off) too, after the adapters have moved; and it holds no tensor of its own."""
    llm, base, params = adapted(tiny_llm, dtype)
    ids = tiny_llm.chat_ids("Plan.", "What is 2 + 3?")
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)  # only A and B train, fp32
    assert len(params) == 2 * len(TARGETS) * len(base.model.layers)
    assert torch.equal(logits(llm.model, ids), logits(base, ids))
    with torch.no_grad():
        for layer in adapters(llm.model).values():
            layer.lora_B.normal_(0, 0.05)
    ref = frozen_reference(llm.model, params)
    assert not adapters(ref) and not torch.equal(logits(llm.model, ids), logits(ref, ids))
    assert torch.equal(logits(ref, ids), logits(base, ids))
    shared = {p.data_ptr() for p in llm.model.parameters()}
    assert all(p.data_ptr() in shared for p in ref.parameters()), "the reference must copy no weight"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_first_update_is_on_policy_with_kl_zero(tiny_llm, dtype):
    """The first update with fresh adapters: rho = 1 exactly and KL(pi || pi_ref) = 0
    exactly (the adapted policy IS the base there), in fp32 and in bf16; the step moves B."""
    llm, _, params = adapted(tiny_llm, dtype)
    ref = frozen_reference(llm.model, params)
    rows = rows_of(make_trajectories(llm, 2, 3, seed=10), group_advantages([1, 0, 1, 0, 0, 1], 3))
    opt = PlannerOptimizer(params, lr=1e-2)
    assert opt.masters is None  # fp32 adapters: AdamW steps them directly
    out = policy_update(llm.model, ref, opt, rows, SAMPLING, LossConfig(EPS_LO, EPS_HI, 0.05),
                        UpdateConfig(micro_batch=2), llm.pad_id)
    assert out["ratio_dev_first_step"] == 0.0 and out["clip_frac"] == 0.0
    assert out["kl"] == 0.0
    assert any(layer.lora_B.detach().abs().max() > 0 for layer in adapters(llm.model).values())


@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_the_sampler_and_the_trainer_score_the_same_adapted_policy(tiny_llm, dtype, bound):
    """With adapters that have moved, the sampler's log-probs (its prefill and written-out
    decode step) against the trainer's (flow_grpo.token_logprobs): float noise in fp32,
    bf16 rounding in bf16 (the bounds of the base's own gap, tests/test_flow_grpo.py). And
    the adapters act in both: the base scores the same tokens differently."""
    llm, base, _ = adapted(tiny_llm, dtype, trained_B=True)
    rows = rows_of(make_trajectories(llm, 2, 3, seed=6), [0.0] * 6)
    with torch.no_grad():
        logp, _, mask = token_logprobs(llm.model, rows, SAMPLING, llm.pad_id)
        plain = token_logprobs(base, rows, SAMPLING, llm.pad_id)[0]
    gap = moved = 0.0
    for i, r in enumerate(rows):
        cols = slice(mask.shape[1] - len(r.action_ids), None)
        gap = max(gap, float((logp[i, cols] - torch.tensor(r.sampler_logprobs, dtype=logp.dtype)).abs().max()))
        moved = max(moved, float((logp[i, cols] - plain[i, cols]).abs().max()))
    assert gap < bound, gap
    assert moved > 10 * bound, moved


def test_merged_weights_give_the_adapted_forward(tiny_llm):
    """merged_state_dict folds each adapter in: a plain copy of the model loaded with it
    computes what the adapted model computes (fp32: to float noise)."""
    llm, base, _ = adapted(tiny_llm, trained_B=True)
    merged = merged_state_dict(llm.model)
    assert not any("lora" in k for k in merged) and set(merged) == set(base.state_dict())
    plain = copy.deepcopy(base)
    plain.load_state_dict(merged)
    ids = tiny_llm.chat_ids("Plan.", "What is 2 + 3?")
    torch.testing.assert_close(logits(plain, ids), logits(llm.model, ids), rtol=0, atol=1e-4)


def test_a_target_no_block_has_is_refused(tiny_llm):
    with pytest.raises(ConfigError, match="lora_targets names qkv_proj.*q_proj"):
        add_adapters(copy.deepcopy(tiny_llm.model), 4, 8.0, ["qkv_proj"], 0, seed=0)
    with pytest.raises(ConfigError, match="lora_targets is empty"):
        tiny_cfg("x", "y", "train.lora_rank=4", "train.lora_targets=[]")


def test_adapters_only_on_the_trained_blocks(tiny_llm):
    model = copy.deepcopy(tiny_llm.model)
    add_adapters(model, 2, 4.0, ["q_proj", "down_proj"], 1, seed=0)
    names = sorted(adapters(model))
    last = len(model.model.layers) - 1
    assert names == [f"model.layers.{last}.mlp.down_proj", f"model.layers.{last}.self_attn.q_proj"]
    assert isinstance(model.model.layers[last].self_attn.q_proj, LoRALinear)
    assert without_adapters(copy.deepcopy(model)).model.layers[last].self_attn.q_proj.__class__ is torch.nn.Linear


LORA = ("train.lora_rank=4", "train.lora_alpha=8", "train.lr=5e-2")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_lora_run_exports_a_plain_model_and_its_adapters(tiny_model_dir, tmp_path, learnable_reward, dtype):
    """Two steps with adapters: the checkpoint holds the adapters and their AdamW state
    only; model/ loads in plain transformers and computes the adapted planner's logits
    (merged in fp32, then cast); adapter.safetensors holds A, B and the rank, alpha, targets;
    scripts.export_model rebuilds the same files from the checkpoint."""
    from scripts import export_model
    out = tmp_path / "run"
    cfg = tiny_cfg(tiny_model_dir, out, "train.steps=2", "train.eval_before_after=false", f"model.dtype={dtype}",
                   *LORA)
    run(cfg)
    state = torch.load(out / "checkpoints" / "step_2" / "trainer_state.pt", weights_only=False)
    assert state["trained"] and all(k.endswith((".lora_A", ".lora_B")) for k in state["trained"])
    assert state["masters"] is None  # fp32 adapters need no masters, in a bf16 run too
    exported = AutoModelForCausalLM.from_pretrained(out / "model")  # no project code involved
    assert exported.dtype == getattr(torch, dtype)
    start = {k: v.to(exported.dtype) for k, v in weights(tiny_model_dir).items()}  # the base in the run's dtype
    moved = [k for k, v in weights(out / "model").items() if not torch.equal(v, start[k])]
    assert moved and all(any(t in k for t in cfg["train"]["lora_targets"]) for k in moved)
    with safe_open(out / "model" / "adapter.safetensors", "pt") as f:
        meta = f.metadata()
        A = {k: f.get_tensor(k) for k in f.keys()}
    assert (meta["rank"], float(meta["alpha"]), set(meta["targets"].split(","))) == ("4", 8.0, set(TARGETS))
    assert all(torch.equal(A[k], state["trained"][k]) for k in A) and set(A) == set(state["trained"])
    # The merged export against the adapted model itself, rebuilt from the adapters.
    from support.models import load_model
    model, tok = load_model(tiny_model_dir, "cpu", dtype)
    add_adapters(model, 4, 8.0, TARGETS, 2, seed=0)
    model.load_state_dict(state["trained"], strict=False)
    ids = LLM(model, tok).chat_ids("Plan.", "What is 2 + 3?")
    atol = 1e-4 if dtype == "float32" else 0.1  # bf16: the merge rounds W + BA once, the adapted forward twice
    torch.testing.assert_close(logits(exported, ids).float(), logits(model, ids).float(), rtol=0, atol=atol)
    shutil_move(out / "model", tmp_path / "by_train")
    assert export_model.main([str(out)]) == 0
    a, b = weights(tmp_path / "by_train"), weights(out / "model")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def shutil_move(a, b):
    import shutil
    shutil.move(a, b)


def test_a_lora_run_resumes_bit_exactly(tiny_model_dir, tmp_path, learnable_reward):
    common = ("train.steps=3", "train.save_every=1", "train.eval_before_after=false", *LORA)
    run(tiny_cfg(tiny_model_dir, tmp_path / "full", *common))
    run(tiny_cfg(tiny_model_dir, tmp_path / "cut", "train.steps=2", "train.save_every=1",
                 "train.eval_before_after=false", *LORA))
    run(tiny_cfg(tiny_model_dir, tmp_path / "cut", *common))
    a, b = (torch.load(tmp_path / r / "checkpoints" / "step_3" / "trainer_state.pt", weights_only=False)
            for r in ("full", "cut"))
    assert a["trained"] and all(torch.equal(a["trained"][k], b["trained"][k]) for k in a["trained"])
    assert any(float(v.abs().max()) > 0 for k, v in a["trained"].items() if k.endswith("lora_B"))
    metrics = [[json.loads(x)["loss"] for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()]
               for r in ("full", "cut")]
    assert metrics[0] == metrics[1]


# ---- The memory plan with adapters (support/device_memory.py) ---------------------------

@pytest.mark.parametrize("gb, blocks", [(24, 28), (48, 28)])
def test_the_7b_lora_configs_fit_their_cards_by_plan(qwen7b, gb, blocks):
    """The shipped LoRA configs at the 7B shape, offline: one bf16 copy of the weights, no
    reference copy, no fp32 masters, fp32 adapters of r (in + out) per projection counted by
    hand, and "of N GB: fits"."""
    from support.device_memory import GB, plan_for, reserve_bytes
    from support.config import load_config
    from test_memory_plan import ROOT
    p = plan_for(load_config(str(ROOT / "configs" / f"qwen2.5-7b-lora-{gb}gb.yaml"), [f"model.name={qwen7b}"]))
    h, I, kv, r = 3584, 18944, 512, 16
    per_block = r * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + I) + (I + h))  # q, k, v, o, gate, up, down
    assert p.shape.trained == blocks * per_block and p.shape.trained_layers == blocks
    text = p.text()
    assert f"of {gb}.0 GB: fits" in text and p.peak <= gb * GB
    lines = {what: nbytes for what, nbytes, _ in p.items}
    assert lines["LoRA adapters, fp32 (%.1fM parameters)" % (blocks * per_block / 1e6)] == 4 * blocks * per_block
    assert lines["the reference: the same weights with the adapters off, no copy"] == 0.0
    assert lines["AdamW moments + gradients (fp32)"] == 12 * blocks * per_block  # no masters: fp32 weights
    assert "masters" not in text and "reference's copies" not in text
    weights = p.items[0][1]
    reserve = reserve_bytes(gb * GB, "cuda")
    assert 15.0 * GB < weights < 15.5 * GB and p.resident == weights + 16 * p.shape.trained + reserve  # one copy
    assert p.checkpoint_bytes == 12 * p.shape.trained  # the adapters and their two moments only
    checkpointed = [what for what in lines if what.startswith("update: activations")][0].endswith("one block's")
    assert checkpointed == (gb == 24)  # 24 GB: train.grad_checkpoint


def test_the_plan_of_checkpointed_blocks():
    """train.grad_checkpoint: each trained block keeps its input and its cached keys and
    values per token, and one block's activations exist at a time: the update's activation
    line is that, written out, and smaller than without."""
    from support.config import load_config
    from support.device_memory import plan_for, saved_per_token_layer
    from test_memory_plan import ROOT
    cfg = lambda *o: load_config(str(ROOT / "configs" / "qwen2.5-7b-lora-24gb.yaml"), ["train.micro_batch=2", *o])
    on, off = plan_for(cfg()), plan_for(cfg("train.grad_checkpoint=false"))
    line = lambda p: [(w, b) for w, b, _ in p.items if w.startswith("update: activations")][0]
    sh, s, seq, tokens = on.shape, 2, 2048 + 256, 2 * (2048 + 256)
    block = saved_per_token_layer(sh, s, seq) + 7 * 16 * s  # a block's, its adapters' r values too
    kept = s * sh.hidden + 2 * sh.kv_heads * sh.head_dim * s  # its input, its cached keys and values
    assert line(on)[1] == tokens * (28 * kept + block + (4 + s) * sh.hidden)
    assert line(off)[1] == tokens * (28 * block + (4 + s) * sh.hidden) > 5 * line(on)[1]
    assert "checkpointed" in line(on)[0] and "checkpointed" not in line(off)[0]


def test_the_plan_counts_the_adapters_add_adapters_makes(tiny_llm, qwen7b):
    """The plan's count (from config.json, no model) equals the parameters add_adapters
    really adds, on the tiny model, for a subset of targets on the top block."""
    from support.device_memory import model_shape
    model = copy.deepcopy(tiny_llm.model)
    params = add_adapters(model, 3, 6.0, ["q_proj", "up_proj"], 1, seed=0)
    shape = model_shape(model.config, 1, lora_rank=3, lora_targets=["q_proj", "up_proj"])
    assert shape.trained == sum(p.numel() for p in params)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_update_activations_with_adapters_bound_what_autograd_saves(dtype):
    """What autograd saves for the backward of a Qwen2 with adapters on its top 2 of 4
    blocks, counted for real, is within the plan's per-token figure (the full fine-tune's
    plus r values per adapted projection) and not loose by more than a fifth."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from support.device_memory import model_shape, saved_per_token_layer
    cfg = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    add_adapters(model, 16, 32.0, TARGETS, 2, seed=0)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    n, L = 2, 96
    ids = torch.randint(0, 256, (n, L))
    mask = torch.ones(n, L, dtype=torch.long)
    mask[0, :10] = 0
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.base_model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    measured = sum(saved.values()) / (n * L)
    s = torch.finfo(getattr(torch, dtype)).bits // 8
    shape = model_shape(cfg, 2, lora_rank=16, lora_targets=TARGETS)
    planned = 2 * (saved_per_token_layer(shape, s, L) + len(TARGETS) * 16 * s) + (4 + s) * shape.hidden
    assert measured <= planned <= 1.2 * measured, (measured, planned)


# ---- Activation checkpointing (train.grad_checkpoint, engine.checkpoint_blocks) ---------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lora", [False, True])
def test_checkpointed_blocks_give_the_same_loss_and_gradient(tiny_llm, dtype, lora):
    """The update with the trained blocks checkpointed against without: the same loss and
    the same gradient to the bit (the backward recomputes each block with the same
    arithmetic), for the full fine-tune and for adapters, in fp32 and bf16, on rows that
    share text (the trainer's caches are written twice: replay_cache); and the recompute
    really ran. The sampler is untouched: checkpointed blocks sample what they sampled."""
    from engine import checkpoint_blocks
    from flow_grpo import accumulate_gradients
    from lora import trained_weights
    from support.config import DEFAULTS

    t = {**DEFAULTS["train"], "train_layers": 2, "lora_rank": 4 if lora else 0, "lora_alpha": 8.0}
    base = copy.deepcopy(tiny_llm.model).to(dtype)
    rows = rows_of(make_trajectories(LLM(base, tiny_llm.tok), 2, 3, seed=2), [1.0, -1.0, 0.5, -0.5, 0.25, 0.0])
    results = []
    for checkpointed in (False, True):
        model = copy.deepcopy(base)
        params = trained_weights(model, t, seed=1)
        if lora:
            with torch.no_grad():
                for layer in adapters(model).values():
                    layer.lora_B.normal_(0, 0.05, generator=torch.Generator().manual_seed(7))
        ref = frozen_reference(model, params)
        if checkpointed:
            checkpoint_blocks(model, 2)
        calls = []  # MLP forwards (a module hook does not see the recompute: count in forward)
        for block in model.model.layers:
            block.mlp.forward = (lambda f: lambda *a: calls.append(1) or f(*a))(block.mlp.forward)
        figures = accumulate_gradients(model, ref, rows, SAMPLING, LossConfig(EPS_LO, EPS_HI, 0.1), tiny_llm.pad_id,
                                       micro_batch=2)
        results.append((figures, [p.grad.clone() for p in params], len(calls)))
        llm = LLM(model, tiny_llm.tok)
        results[-1] += (llm.sample([rows[0].prompt_ids], SAMPLING, seed=4)[0].ids,)
    (f0, g0, n0, s0), (f1, g1, n1, s1) = results
    assert all(torch.equal(a, b) for a, b in zip(g0, g1)) and any(float(g.abs().max()) > 0 for g in g0)
    assert f0["loss"] == f1["loss"]
    assert n1 > n0  # each checkpointed block ran its forward again in the backward pass
    assert s0 == s1


def test_checkpointing_a_model_whose_layers_cannot_is_refused(tiny_llm):
    from engine import checkpoint_blocks
    model = copy.deepcopy(tiny_llm.model)
    model.config.attention_dropout = 0.1
    with pytest.raises(ConfigError, match="train.grad_checkpoint=false"):
        checkpoint_blocks(model, 1)
