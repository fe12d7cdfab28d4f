"""support/optim.py: bf16 weights train at the paper's lr through fp32 masters; float32 models
keep the plain AdamW. A tiny random Qwen2 with a 256-token vocabulary keeps each step
to milliseconds (the optimizer does not care what the tokens mean)."""

import copy

import pytest
import torch

from flow_grpo import optimizer_step
from support import optim

LR = 1e-6  # the paper's


@pytest.fixture(scope="module")
def bf16_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return Qwen2ForCausalLM(cfg).to(torch.bfloat16)


IDS = torch.randint(0, 256, (2, 2, 16), generator=torch.Generator().manual_seed(1))  # 2 micro-batches of [2, 16]


def backward(model):
    """One step's gradient: the LM loss of two micro-batches, each backward on its own."""
    for ids in IDS:
        model(input_ids=ids, labels=ids).loss.backward()


def train(model, steps, masters_too=True, max_grad_norm=1.0):
    """The optimizer after `steps` steps: ours, or (masters_too=False) AdamW stepping the
    model's own weights, whatever their dtype."""
    params = list(model.parameters())
    if masters_too:
        opt = optim.PlannerOptimizer(params, LR)
        step = lambda: optimizer_step(opt, max_grad_norm)
    else:
        opt = torch.optim.AdamW(params, lr=LR)
        step = lambda: (torch.nn.utils.clip_grad_norm_(params, max_grad_norm), opt.step(), opt.zero_grad())
    for _ in range(steps):
        backward(model)
        step()
    return opt


def test_fp32_models_keep_the_plain_adamw(bf16_model):
    model = copy.deepcopy(bf16_model).float()
    opt = optim.PlannerOptimizer(list(model.parameters()), LR)
    assert opt.masters is None and opt.adamw.param_groups[0]["params"][0] is next(model.parameters())


def test_bf16_weights_move_at_the_papers_lr(bf16_model):
    """60 steps at lr 1e-6: with masters every trained weight has moved (norm weights at
    1.0 too, whose bf16 step is 2^-7), and the bf16 weights are the masters rounded; plain
    bf16 AdamW moved a few percent of the matrix entries and no norm weight at all. (The
    embedding gets a gradient only in the rows of tokens in the batch; biases start at 0,
    where bf16 resolves any step, so they move either way.)"""
    start = {n: p.detach().clone() for n, p in bf16_model.named_parameters()}
    ours, plain = copy.deepcopy(bf16_model), copy.deepcopy(bf16_model)
    masters = train(ours, 60).masters
    train(plain, 60, masters_too=False)
    for (name, p), m, q in zip(ours.named_parameters(), masters.masters, plain.parameters()):
        if "embed" in name:
            continue
        assert m.dtype == torch.float32
        moved = float((m != start[name].float()).float().mean())
        assert moved > 0.99, (name, moved)
        assert torch.equal(p, m.to(torch.bfloat16)), name  # the weights are the masters, rounded
        plain_moved = float((q != start[name]).float().mean())
        if "bias" not in name:
            assert plain_moved < (0.001 if "norm" in name else 0.1), (name, plain_moved)
    assert float((next(iter(masters.masters)) != start["model.embed_tokens.weight"].float()).float().mean()) > 0


def test_the_master_update_is_the_fp32_adamw_update(bf16_model):
    """Given the same gradients, the masters follow float32 AdamW bit for bit, and the
    bf16 weights are its result rounded to nearest (within half a bf16 step, 2^-9 of the
    weight). So the update matches an fp32 reference exactly where it can: all that is
    lost is the final rounding into bf16."""
    model = copy.deepcopy(bf16_model)
    opt = optim.PlannerOptimizer(list(model.parameters()), LR)
    masters = opt.masters
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    ref_opt = torch.optim.AdamW(ref, lr=LR)
    for _ in range(5):
        backward(model)
        for r, m in zip(ref, masters.masters):
            r.grad = m.grad.clone()
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        optimizer_step(opt, 1.0)
    for p, m, r in zip(model.parameters(), masters.masters, ref):
        assert torch.equal(m, r)
        assert torch.equal(p, r.to(torch.bfloat16))


def test_the_update_follows_an_fp32_model(bf16_model):
    """Against a float32 model with the same starting weights, its own forward and plain
    AdamW: after 60 steps the two updates point the same way (cosine > 0.98 for every
    tensor, measured 0.991-0.9999). Not closer: the bf16 forward's gradients differ by
    ~1% and Adam's step, g / sqrt(v), amplifies that on entries whose gradient is noise."""
    ours, fp32 = copy.deepcopy(bf16_model), copy.deepcopy(bf16_model).float()
    masters = train(ours, 60).masters
    train(fp32, 60)
    for (name, p0), m, r in zip(bf16_model.named_parameters(), masters.masters, fp32.parameters()):
        dm, dr = (m - p0.float()).detach(), (r - p0.float()).detach()
        if "k_proj.bias" in name:  # its gradient is 0 in exact arithmetic (the same q.b is added to
            continue  # every key's score, and softmax ignores it): both updates are rounding noise
        cos = float((dm * dr).sum() / (dm.norm() * dr.norm()))
        assert cos > 0.98, (name, cos)


def test_gradients_accumulate_in_fp32_and_bf16_grads_are_freed(bf16_model):
    model = copy.deepcopy(bf16_model)
    opt = optim.PlannerOptimizer(list(model.parameters()), LR)
    masters = opt.masters
    params = list(model.parameters())
    parts = [torch.autograd.grad(model(input_ids=ids, labels=ids).loss, params) for ids in IDS]  # no hooks fire
    backward(model)  # the two micro-batches, through the hooks
    for p, m, g1, g2 in zip(params, masters.masters, *parts):
        assert p.grad is None
        assert torch.equal(m.grad, g1.float() + g2.float())
    # The clip acts on what the optimizer steps: the masters' gradients.
    norm = torch.cat([m.grad.flatten() for m in masters.masters]).norm()
    assert optimizer_step(opt, 1e-3) == pytest.approx(float(norm), rel=1e-5)
    assert all(m.grad is None for m in masters.masters)  # freed right after the step


def test_masters_round_trip(bf16_model, tmp_path):
    model = copy.deepcopy(bf16_model)
    opt = train(model, 3)
    torch.save(opt.state_dict(), tmp_path / "state.pt")
    fresh = copy.deepcopy(bf16_model)
    opt2 = optim.PlannerOptimizer(list(fresh.parameters()), LR)
    assert opt2.load_state_dict(torch.load(tmp_path / "state.pt")) == []  # the same settings: nothing to say
    for a, b, p, q in zip(opt.masters.masters, opt2.masters.masters, model.parameters(), fresh.parameters()):
        assert torch.equal(a, b) and torch.equal(p, q)
    assert opt2.adamw.state[opt2.masters.masters[0]]["exp_avg"].dtype == torch.float32
    assert opt2.lr == opt.lr and opt2.schedule.last_epoch == 3


def test_a_resume_steps_with_the_runs_lr_not_the_checkpoints(bf16_model, tmp_path):
    """AdamW's saved state carries the lr and weight decay it ran with; a resumed run set to
    others (train.lr=..., train.weight_decay=...) must step with its own, at the same point
    of the warmup, and say so."""
    model = copy.deepcopy(bf16_model)
    opt = optim.PlannerOptimizer(list(model.parameters()), LR, warmup_steps=10)
    for _ in range(3):
        backward(model)
        optimizer_step(opt, 1.0)
    assert opt.lr == pytest.approx(LR * 4 / 10)  # warmup: (k + 1) / 10 after 3 steps
    fresh = copy.deepcopy(model)
    opt2 = optim.PlannerOptimizer(list(fresh.parameters()), 2 * LR, weight_decay=0.1, warmup_steps=10)
    changed = opt2.load_state_dict(opt.state_dict())
    assert len(changed) == 2 and "train.lr 1e-06 in the checkpoint, 2e-06" in changed[0] and "weight_decay" in changed[1]
    assert opt2.lr == pytest.approx(2 * LR * 4 / 10)
    assert all(g["weight_decay"] == 0.1 for g in opt2.adamw.param_groups)
    backward(fresh)
    optimizer_step(opt2, 1.0)
    assert opt2.lr == pytest.approx(2 * LR * 5 / 10)  # the schedule goes on from the new base
