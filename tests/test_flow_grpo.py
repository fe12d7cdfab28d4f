"""The batched Flow-GRPO loss against a naive loop over trajectories, turns and tokens."""

import copy
import importlib.util
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentflow import PlannerTurn, Trajectory
from engine import LLM, SamplingParams
from flow_grpo import (LossConfig, TurnRow, accumulate_gradients, flow_grpo_loss, group_advantages,
                       reference_objective, token_logprobs)
from memory import Memory

EPS_LO, EPS_HI, TEMP = 0.2, 0.3, 0.8


def make_trajectories(llm: LLM, n_groups=2, G=3, seed=0, first_tokens=(), first_temperature=0.0):
    """Real sampled actions on varied prompts; trajectories have 1-3 turns."""
    rnd = random.Random(seed)
    trajs = []
    for q in range(n_groups * G):
        tr = Trajectory(f"query {q // G}", Memory(1200, 400))
        for t in range(rnd.randint(1, 3)):
            prompt = llm.chat_ids("Plan the step.", f"Question {q // G}: " + "word " * rnd.randint(1, 12), "Tool:")
            s = llm.sample([prompt], SamplingParams(TEMP, max_new_tokens=rnd.randint(2, 7),
                                                     first_tokens=first_tokens, first_temperature=first_temperature),
                           seed=seed * 100 + q * 10 + t)[0]
            tr.turns.append(PlannerTurn(prompt, s.ids, s.logprobs, s.text))
        trajs.append(tr)
    return trajs


def rows_of(trajectories, advantages: list[float]) -> list[TurnRow]:
    """The rows of J for given advantages, every rollout kept: A_i broadcast to each of
    trajectory i's T_i turns, each row weighing 1 / (N T_i) (flow_grpo.kept_rows' rows when
    the advantages are its own; here any, as the loss tests need)."""
    N = len(trajectories)
    turns = [[t for t in traj.turns if t.action_ids] for traj in trajectories]
    return [TurnRow(t.prompt_ids, t.action_ids, t.logprobs, A_i, 1.0 / (N * len(ts)))
            for ts, A_i in zip(turns, advantages) for t in ts]


def rows_for(llm, rewards, G=3, seed=0, perturb=0.0):
    """(trajectories, rows, old): with `perturb`, old is pi_old per row, the sampler's
    log-probs moved by noise (as if the weights had moved since sampling, so rho != 1 and
    clipping bites); otherwise None (the on-policy first update)."""
    trajs = make_trajectories(llm, len(rewards) // G, G, seed)
    adv = group_advantages(rewards, G)
    rows = rows_of(trajs, adv)
    old = None
    if perturb:
        g = torch.Generator().manual_seed(seed)
        old = [[x + perturb * float(torch.randn((), generator=g)) for x in r.sampler_logprobs] for r in rows]
    return trajs, rows, old


def assert_grads_close(ga, gb, tol=1e-4):
    """Gradients equal up to float noise: each tensor's error is small next to its norm
    (padding and batch shape change the order of float sums, nothing more)."""
    for a, b in zip(ga, gb):
        scale = max(float(b.norm()), 1e-12)
        assert float((a - b).norm()) / scale < tol, (float((a - b).norm()), scale)


def grads(model):
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


SAMPLING = SamplingParams(TEMP, max_new_tokens=8)  # what make_trajectories sampled with (lengths aside)


def loss_args(llm, beta):
    """accumulate_gradients' (sampling, loss config, pad id) for these tests."""
    return SAMPLING, LossConfig(EPS_LO, EPS_HI, beta), llm.pad_id


@pytest.fixture()
def policy(tiny_llm):
    """A trainable copy of the tiny model and a slightly different frozen reference."""
    model = copy.deepcopy(tiny_llm.model)
    ref = copy.deepcopy(tiny_llm.model).requires_grad_(False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return LLM(model, tiny_llm.tok), ref


def test_group_advantages_by_hand():
    A = group_advantages([1, 0, 0, 1, 1, 1, 1, 1], group_size=4)
    # group 1: mean 0.5, population std 0.5 -> +-1; group 2: all equal -> 0
    assert A[:4] == pytest.approx([1, -1, -1, 1], abs=1e-5)
    assert A[4:] == [0, 0, 0, 0]
    A3 = group_advantages([1, 0, 0], 3)
    m, s = 1 / 3, (2 / 9) ** 0.5
    assert A3 == pytest.approx([(1 - m) / s, -m / s, -m / s], abs=1e-5)


def test_turn_row_normalisation_weighs_long_trajectories():
    # The official variant: trajectory 0 (reward 1) has 3 turns, so rows are [1,1,1,0]:
    # mean 0.75, std sqrt(3)/4.
    A = group_advantages([1, 0], 2, n_turns=[3, 1], mode="turn_rows")
    s = (3 ** 0.5) / 4
    assert A == pytest.approx([0.25 / s, -0.75 / s], abs=1e-5)
    assert group_advantages([1, 0], 2, n_turns=[3, 1]) == pytest.approx([1, -1], abs=1e-5)
    with pytest.raises(ValueError, match="advantage mode"):
        group_advantages([1, 0], 2, mode="rows")


@pytest.mark.parametrize("estimator", ["k3", "k2"])
def test_batched_loss_and_gradient_equal_naive_loop(policy, estimator):
    llm, ref = policy
    rewards = [1, 0, 1, 0, 0, 1]
    trajs, rows, old = rows_for(llm, rewards, perturb=0.3)
    adv = group_advantages(rewards, 3)
    cfg = LossConfig(EPS_LO, EPS_HI, 0.1, estimator)
    J = reference_objective(llm.model, ref, trajs, adv, SAMPLING, cfg, old=old)
    llm.model.zero_grad()
    (-J).backward()
    g_naive = grads(llm.model)
    for chunk in (5, 1024):  # chunks of 5 positions: several per batch; one chunk
        llm.model.zero_grad()
        st = accumulate_gradients(llm.model, ref, rows, SAMPLING, cfg, llm.pad_id, micro_batch=64, old=old,
                                  chunk=chunk)
        assert st["loss"] == pytest.approx(-J.item(), rel=1e-4, abs=1e-6)
        assert st["clip_frac"] > 0  # the perturbation made clipping active somewhere
        assert_grads_close(grads(llm.model), g_naive)


def test_micro_batching_changes_nothing(policy):
    llm, ref = policy
    _, rows, old = rows_for(llm, [1, 0, 0, 0, 1, 1], perturb=0.2, seed=1)
    results = []
    for mb in (1, 3, 64):
        llm.model.zero_grad()
        st = accumulate_gradients(llm.model, ref, rows, *loss_args(llm, beta=0.05), micro_batch=mb, old=old)
        results.append((st["loss"], grads(llm.model)))
    for loss, g in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-5, abs=1e-7)
        assert_grads_close(g, results[0][1])


def test_zero_variance_groups_give_zero_policy_gradient(policy):
    llm, ref = policy
    _, rows, _ = rows_for(llm, [1, 1, 1, 0, 0, 0], seed=2)
    assert all(r.advantage == 0 for r in rows)
    llm.model.zero_grad()
    accumulate_gradients(llm.model, ref, rows, *loss_args(llm, beta=0.0))
    assert all(float(g.abs().max()) == 0.0 for g in grads(llm.model))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_text_gradient_is_bit_exact_run_to_run(policy, dtype):
    """The G actions sampled from one planner state share its keys and values in
    token_logprobs' prefill, so that entry's gradient is a sum over rows. With two threads, the same backward
    three times must give the same gradients bit for bit (reading the entry with repeated
    indices, k[idx], did not: its backward adds with atomic float adds, in thread order)."""
    llm, _ = policy
    model = llm.model.to(dtype)
    rng = random.Random(0)
    words = lambda n: [rng.randrange(100, 20000) for _ in range(n)]
    system = words(300)  # a long shared prefix: the atomic-add kernel runs only on large tensors
    rows = []
    for _ in range(4):  # 4 planner states, G = 4 actions each: 16 rows in 4 shared-text groups
        prompt = system + words(rng.randint(5, 40))
        rows += [TurnRow(prompt, words(rng.randint(2, 6)), [], rng.choice([-1.0, 1.0]), 1 / 16) for _ in range(4)]
    adv = torch.tensor([r.advantage for r in rows])  # [16]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            logp, _, mask = token_logprobs(model, rows, SAMPLING, llm.pad_id)  # [16, La] each
            (-(logp * mask).sum(-1) * adv).sum().backward()  # a REINFORCE-shaped loss: -sum_i A_i log pi(a_i)
            runs.append(grads(model))
    finally:
        torch.set_num_threads(threads)
    assert any(g.abs().sum() > 0 for g in runs[0])
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_only_action_tokens_get_gradient(policy):
    """d(-J)/d h is exactly zero at every position whose hidden state h (the final norm's
    output, what the output layer reads) does not score an action token."""
    llm, ref = policy
    _, rows, _ = rows_for(llm, [1, 0, 0, 1, 0, 1], seed=3)
    outputs = []  # every output of the final norm, kept for their gradients

    def keep(module, inputs, out):
        if out.requires_grad:
            out.retain_grad()
        outputs.append(out)

    hook = llm.model.model.norm.register_forward_hook(keep)
    try:
        logp, _, mask = token_logprobs(llm.model, rows, SAMPLING, llm.pad_id)
    finally:
        hook.remove()
    loss, _ = flow_grpo_loss(logp, logp.detach(), logp.detach(), torch.tensor([r.advantage for r in rows]),
                             torch.tensor([r.weight for r in rows]), mask, LossConfig(EPS_LO, EPS_HI, 0.0))
    loss.backward()
    # Positions whose hidden state received a gradient, over every forward that ran with
    # gradient (the prefix, the shared parts, the batches of rests).
    got = sum(int((o.grad.abs().sum(-1) > 0).sum()) for o in outputs if o.grad is not None)
    assert (mask == 0).any(), "some rows must be shorter than the longest action"
    assert got == int(mask.sum()), "exactly one position per action token has a gradient"


def test_first_update_gradient_is_reinforce(policy):
    """With old = the current log-probs (rho = 1) and beta = 0, -J's gradient equals
    REINFORCE's: -sum w_ij A_i d log pi(a_ij)."""
    llm, ref = policy
    trajs, rows, _ = rows_for(llm, [1, 0, 0, 0, 1, 0], seed=4)
    llm.model.zero_grad()
    accumulate_gradients(llm.model, ref, rows, *loss_args(llm, beta=0.0))
    g_loss = grads(llm.model)
    llm.model.zero_grad()
    logp, _, mask = token_logprobs(llm.model, rows, SAMPLING, llm.pad_id)
    n_tok = mask.sum(-1)
    w = torch.tensor([r.weight * r.advantage for r in rows]) / n_tok  # [R]
    (-(w[:, None] * logp * mask).sum()).backward()
    assert_grads_close(g_loss, grads(llm.model))


def test_kl_is_zero_at_reference_and_its_gradient_matches_finite_differences(policy):
    llm, _ = policy
    torch.manual_seed(0)  # the reference's perturbation and the direction: the same whatever ran before
    _, rows, _ = rows_for(llm, [1, 0, 1, 1, 0, 0], seed=5)
    kl_only = (SAMPLING, LossConfig(EPS_LO, EPS_HI, 1.0), llm.pad_id)
    # Policy == reference: the KL term and its gradient vanish; only the policy term remains.
    same = copy.deepcopy(llm.model).requires_grad_(False)
    st = accumulate_gradients(llm.model, same, rows, *kl_only)
    assert abs(st["kl"]) < 1e-6
    # Finite difference of the KL term along one direction of one weight matrix.
    ref = copy.deepcopy(llm.model).requires_grad_(False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    zero_adv = [TurnRow(r.prompt_ids, r.action_ids, r.sampler_logprobs, 0.0, r.weight) for r in rows]

    def kl_value():
        with torch.no_grad():
            logp, _, mask = token_logprobs(llm.model, zero_adv, SAMPLING, llm.pad_id)
            ref_lp, _, _ = token_logprobs(ref, zero_adv, SAMPLING, llm.pad_id)
            loss, _ = flow_grpo_loss(logp, logp, ref_lp, torch.zeros(len(rows)),
                                     torch.tensor([r.weight for r in zero_adv]), mask, kl_only[1])
        return loss.double().item()  # = beta * KL with A = 0

    llm.model.zero_grad()
    accumulate_gradients(llm.model, ref, zero_adv, *kl_only)
    W = llm.model.model.layers[0].mlp.down_proj.weight
    direction = torch.randn_like(W)
    analytic = float((W.grad * direction).sum())
    h = 2e-3  # a step of ~0.2 in Frobenius norm; over seeds 1-5, analytic / numeric was 0.999-1.015
    with torch.no_grad():
        W.add_(h * direction)
        up = kl_value()
        W.sub_(2 * h * direction)
        down = kl_value()
        W.add_(h * direction)
    numeric = (up - down) / (2 * h)
    assert analytic == pytest.approx(numeric, rel=2e-2, abs=1e-6)
    assert abs(analytic) > 1e-6


def full_sequence_logprobs(model, rows, sampling, mask) -> torch.Tensor:
    """The reference for token_logprobs: each row's whole sequence through the model's own
    forward, alone (no cache, no padding, no shared text), its action tokens scored by
    flow_grpo._logprob: [n, La] laid out as token_logprobs lays them out."""
    from flow_grpo import _logprob

    out = torch.zeros(mask.shape)
    with torch.no_grad():
        for i, r in enumerate(rows):
            logits = model(torch.tensor([r.prompt_ids + r.action_ids])).logits[0].float()  # [S, V]
            for j, t in enumerate(r.action_ids):
                out[i, mask.shape[1] - len(r.action_ids) + j] = _logprob(logits[len(r.prompt_ids) - 1 + j], t, j,
                                                                           sampling)
    return out


def test_bf16_logprobs_are_those_of_a_full_sequence_forward(bf16_policy):
    """In bfloat16 the trainer's log-probs (shared text once, rows in batches, the output
    layer in chunks) against the model's own forward over each whole sequence in bfloat16:
    two summation orders of the same bf16 arithmetic. Bound: 0.1 nats, a few bf16
    roundings (2^-8 relative) of logits of magnitude ~10; a wrong position or temperature
    is off by whole nats."""
    llm16 = bf16_policy[0]
    rows = rows_of(make_trajectories(llm16, 2, 3, seed=4), [0.0] * 6)
    with torch.no_grad():
        logp, _, mask = token_logprobs(llm16.model, rows, SAMPLING, llm16.pad_id, chunk=5)
    ref = full_sequence_logprobs(llm16.model, rows, SAMPLING, mask)
    gap = float((logp - ref).abs().max())
    assert 0 < gap < 0.1, gap  # 0 would mean bf16 never ran


def test_trainer_logprobs_equal_sampler_logprobs(tiny_llm):
    allowed = tuple(sorted(tiny_llm.tok.encode(" " + n, add_special_tokens=False)[0]
                           for n in ("Python_Coder", "Local_Search", "Base_Generator")))
    # plain; the tool restriction; the restriction with its own temperature (config.yaml's
    # exploration of tools); a first temperature alone (a larger model without the
    # restriction): the first token's logprob changes, and both sides agree.
    for first, t_first in (((), 0.0), (allowed, 0.0), (allowed, 2.5), ((), 2.5)):
        trajs = make_trajectories(tiny_llm, 2, 3, seed=6, first_tokens=first, first_temperature=t_first)
        rows = rows_of(trajs, [0.0] * len(trajs))
        sampling = SamplingParams(TEMP, 8, first_tokens=first, first_temperature=t_first)
        with torch.no_grad():
            logp, _, mask = token_logprobs(tiny_llm.model, rows, sampling, tiny_llm.pad_id)
            plain = token_logprobs(tiny_llm.model, rows, SamplingParams(TEMP, 8, first_tokens=first),
                                   tiny_llm.pad_id)[0]
        assert float((logp - full_sequence_logprobs(tiny_llm.model, rows, sampling, mask)).abs().max()) < 1e-4
        for i, r in enumerate(rows):
            got = logp[i, mask.shape[1] - len(r.action_ids):].tolist()
            assert max(abs(a - b) for a, b in zip(got, r.sampler_logprobs)) < 1e-4
        first_col = [mask.shape[1] - len(r.action_ids) for r in rows]
        moved = max(abs(logp[i, c] - plain[i, c]).item() for i, c in enumerate(first_col))
        assert (moved > 1e-3) == (t_first > 0)


def test_reference_objective_scores_the_tool_restriction(policy):
    """The batched loss equals J written as loops also when the first token is restricted
    and drawn at its own temperature (the default config's planner)."""
    llm, ref = policy
    allowed = tuple(sorted(llm.tok.encode(" " + n, add_special_tokens=False)[0]
                           for n in ("Python_Coder", "Local_Search", "Base_Generator")))
    sampling = SamplingParams(TEMP, 8, first_tokens=allowed, first_temperature=2.0)
    trajs = make_trajectories(llm, 2, 3, seed=7, first_tokens=allowed, first_temperature=2.0)
    rewards = [1, 0, 0, 1, 1, 0]
    adv = group_advantages(rewards, 3)
    rows = rows_of(trajs, adv)
    cfg = LossConfig(EPS_LO, EPS_HI, 0.1)
    llm.model.zero_grad()
    st = accumulate_gradients(llm.model, ref, rows, sampling, cfg, llm.pad_id)
    g_batched = grads(llm.model)
    llm.model.zero_grad()
    J = reference_objective(llm.model, ref, trajs, adv, sampling, cfg)
    (-J).backward()
    assert st["loss"] == pytest.approx(-J.item(), rel=1e-4, abs=1e-6)
    assert_grads_close(g_batched, grads(llm.model))


@pytest.mark.parametrize("first", ["restricted", "free"])
def test_reference_objective_scores_a_first_temperature(policy, first):
    """The first token at its own temperature, with the tool restriction and without it
    (a larger model: constrain_tool false): batched loss == J written as loops, and the
    trainer's log-prob of token 0 is the sampler's."""
    llm, ref = policy
    allowed = tuple(sorted(llm.tok.encode(" " + n, add_special_tokens=False)[0]
                           for n in ("Python_Coder", "Local_Search", "Base_Generator"))) if first == "restricted" else ()
    sampling = SamplingParams(TEMP, 8, first_tokens=allowed, first_temperature=2.0)
    trajs = make_trajectories(llm, 1, 3, seed=7, first_tokens=allowed, first_temperature=2.0)
    adv = group_advantages([1, 0, 0], 3)
    rows = rows_of(trajs, adv)
    cfg = LossConfig(EPS_LO, EPS_HI, 0.1)
    J = reference_objective(llm.model, ref, trajs, adv, sampling, cfg)
    llm.model.zero_grad()
    (-J).backward()
    g_naive = grads(llm.model)
    llm.model.zero_grad()
    st = accumulate_gradients(llm.model, ref, rows, sampling, cfg, llm.pad_id)
    assert st["loss"] == pytest.approx(-J.item(), rel=1e-4, abs=1e-6)
    assert st["gap_max"] < 1e-4  # the sampler drew token 0 from the distribution scored here
    assert_grads_close(grads(llm.model), g_naive)


@pytest.mark.parametrize("estimator, direction", [("k3", "forward"), ("k2", "reverse")])
def test_which_kl_each_estimator_pulls_toward(estimator, direction):
    """On-policy, the expected gradient of a per-token KL term, sum_a pi(a) d kl(a) / d theta
    with the tokens a drawn from pi (so pi(a) is a constant weight), is the gradient of a
    true KL. k3's, (1 - pi_ref / pi) d log pi, sums to that of KL(pi_ref || pi), the
    forward one; k2's, (log pi - log pi_ref) d log pi, to that of KL(pi || pi_ref), the
    one the paper's objective names. Exact sums over a 5-token softmax, no sampling."""
    from flow_grpo import token_kl

    torch.manual_seed(0)
    z = (0.5 * torch.randn(5)).requires_grad_()  # the policy's logits; mild, so k3's clamp stays out
    ref = torch.log_softmax(0.5 * torch.randn(5), -1)  # log pi_ref
    logp = torch.log_softmax(z, -1)
    expected = torch.autograd.grad((logp.exp().detach() * token_kl(ref, logp, estimator)).sum(), z)[0]  # [5]
    logp = torch.log_softmax(z, -1)  # a fresh graph: autograd.grad freed the first
    pi, pi_ref = logp.exp(), ref.exp()
    kl = (pi * (logp - ref)).sum() if direction == "reverse" else (pi_ref * (ref - logp)).sum()
    torch.testing.assert_close(expected, torch.autograd.grad(kl, z)[0], rtol=1e-5, atol=1e-7)
    assert expected.abs().max() > 1e-3  # the two distributions differ: a real gradient


def test_kl_clamp_bounds_the_gradient():
    """k3 with verl's clamps: d k3 / d log pi = 1 - e^d inside, 0 beyond; at d = 10 (a token
    the policy finds e^10 times less likely than the reference) the unclamped gradient
    would be 1 - e^10 ~ -2.2e4; clamped it is 0. No d gives more than e^2.61 - 1 ~ 12.6
    or a NaN, not even d = 100 where e^d overflows float32."""
    from flow_grpo import k3_kl

    logp = torch.zeros(7, requires_grad=True)
    d = torch.tensor([10.0, 1.0, -1.0, 2.6, -12.0, 100.0, -100.0])  # d = log pi_ref - log pi
    kl = k3_kl(d, logp)  # log pi_ref = d, a constant; log pi = 0
    kl.sum().backward()
    g = logp.grad
    assert g[0] == 0 and kl[0] == 10  # beyond the clamp: the constant 10, no gradient
    # floats on both sides: pytest 9.2's approx cannot take a 0-d tensor as the expected value
    assert float(g[1]) == pytest.approx(1 - math.e, rel=1e-6) and float(g[2]) == pytest.approx(1 - math.exp(-1.0))
    assert float(g[3]) == pytest.approx(1 - math.exp(2.6), rel=1e-6) and kl[3] < 10  # just inside
    assert g[4] == 0 and g[5] == 0 and g[6] == 0 and torch.isfinite(kl).all()
    sweep = torch.linspace(-30, 30, 6001)
    x = torch.zeros_like(sweep, requires_grad=True)
    k3_kl(sweep, x).sum().backward()
    assert torch.isfinite(x.grad).all() and float(x.grad.abs().max()) <= torch.e ** 2.6111 - 1


def test_reference_objective_applies_the_same_clamp(policy):
    """With a reference far from the policy, some tokens' k3 exceeds 10 and is clamped:
    the batched loss and gradient still equal J written as loops."""
    llm, _ = policy
    ref = copy.deepcopy(llm.model).requires_grad_(False)
    with torch.no_grad():
        ref.lm_head.weight.mul_(-3.0)  # the reference dislikes what the policy likes
    trajs = make_trajectories(llm, 1, 3, seed=8)
    adv = group_advantages([1, 0, 0], 3)
    rows = rows_of(trajs, adv)
    cfg = LossConfig(EPS_LO, EPS_HI, 0.5)
    J = reference_objective(llm.model, ref, trajs, adv, SAMPLING, cfg)
    llm.model.zero_grad()
    (-J).backward()
    g_naive = grads(llm.model)
    llm.model.zero_grad()
    st = accumulate_gradients(llm.model, ref, rows, SAMPLING, cfg, llm.pad_id)
    assert st["kl_clamped"] > 0  # the clamp was active for some tokens
    assert st["loss"] == pytest.approx(-J.item(), rel=1e-4, abs=1e-6)
    assert_grads_close(grads(llm.model), g_naive)


@pytest.fixture()
def bf16_policy(policy):
    """The policy and the reference in bfloat16, and their float32 twins holding exactly
    the same (bf16-representable) weights: the yardstick for bf16 arithmetic."""
    llm, ref = policy
    m16, r16 = copy.deepcopy(llm.model).to(torch.bfloat16), copy.deepcopy(ref).to(torch.bfloat16)
    return LLM(m16, llm.tok), r16, copy.deepcopy(m16).float(), copy.deepcopy(r16).float()


def test_bf16_loss_and_gradient_match_the_fp32_reference(bf16_policy):
    """The batched loss in bf16 against J in float32 on the same weights. Tolerance: bf16
    keeps 8 significant bits (a relative rounding of up to 2^-9 per operation); through
    the layers, the softmax and the bf16 sum of the gradients of every row that shares a
    prefix, the gradient agrees with the fp32 one to ~3-4% in norm, with cosine > 0.999. The bound 8% leaves
    room for other seeds; a wrong term (a token weight, a sign, the KL) is off by O(1)."""
    llm16, r16, m32, r32 = bf16_policy
    trajs = make_trajectories(llm16, 2, 3, seed=0)
    adv = group_advantages([1, 0, 1, 0, 0, 1], 3)
    rows = rows_of(trajs, adv)
    cfg = LossConfig(EPS_LO, EPS_HI, 0.1)
    J = reference_objective(m32, r32, trajs, adv, SAMPLING, cfg)
    (-J).backward()
    g32 = torch.cat([p.grad.flatten() for p in m32.parameters()])
    llm16.model.zero_grad()
    st = accumulate_gradients(llm16.model, r16, rows, SAMPLING, cfg, llm16.pad_id, chunk=7)
    g16 = torch.cat([p.grad.float().flatten() for p in llm16.model.parameters()])
    assert float((g16 - g32).norm() / g32.norm()) < 0.08
    assert float((g16 @ g32) / (g16.norm() * g32.norm())) > 0.995
    assert st["loss"] == pytest.approx(-J.item(), rel=0.08)


def test_bf16_no_grad_and_grad_forwards_are_bit_identical(bf16_policy):
    """pi_old from a pass without gradient equals log pi of the pass with gradient, bit for
    bit: what makes rho exactly 1 on the first update when epochs x minibatches > 1."""
    llm16 = bf16_policy[0]
    rows = rows_of(make_trajectories(llm16, 1, 3, seed=9), [0.5, -1.0, 0.5])
    with torch.no_grad():
        a = token_logprobs(llm16.model, rows, SAMPLING, llm16.pad_id)[0]
    b = token_logprobs(llm16.model, rows, SAMPLING, llm16.pad_id)[0]
    assert b.requires_grad and torch.equal(a, b.detach())


@pytest.mark.parametrize("epochs, minibatches", [(1, 1), (2, 2)])
def test_first_update_is_exactly_on_policy_in_bf16(bf16_policy, epochs, minibatches):
    """In bf16 the sampler's log-probs differ from the trainer's by rounding (logprob_gap >
    0), yet rho == 1 exactly on the first optimizer step and nothing is clipped there:
    pi_old is the trainer's own forward. With several steps, the later ones see rho != 1."""
    from flow_grpo import UpdateConfig, policy_update
    from support.optim import PlannerOptimizer

    llm16, r16, _, _ = bf16_policy
    trajs = make_trajectories(llm16, 2, 3, seed=10)
    rows = rows_of(trajs, group_advantages([1, 0, 1, 0, 0, 1], 3))
    opt = PlannerOptimizer([p for p in llm16.model.parameters()], lr=1e-3)
    seen = []  # (ratio, mask) of every flow_grpo_loss call
    import flow_grpo

    real = flow_grpo.flow_grpo_loss

    def spy(logp, old_logp, *args):
        seen.append((torch.exp(logp - old_logp).detach(), args[-2]))
        return real(logp, old_logp, *args)

    flow_grpo.flow_grpo_loss = spy
    try:
        out = policy_update(llm16.model, r16, opt, rows, SAMPLING, LossConfig(EPS_LO, EPS_HI, 0.05),
                            UpdateConfig(epochs=epochs, minibatches=minibatches, micro_batch=2), llm16.pad_id)
    finally:
        flow_grpo.flow_grpo_loss = real
    first_rows = -(-len(rows) // minibatches)  # the first mini-batch: rows order[0::minibatches]
    first_step = seen[:len(flow_grpo.micro_batches(rows[:first_rows], 2))]
    for ratio, mask in first_step:
        assert torch.equal(ratio[mask.bool()], torch.ones_like(ratio[mask.bool()]))
    assert out["ratio_dev_first_step"] == 0.0
    assert out["logprob_gap"] > 1e-3  # bf16: the sampler's arithmetic is not the trainer's
    if epochs * minibatches == 1:
        assert out["clip_frac"] == 0.0
    else:
        ratio, mask = seen[-1]
        assert float((ratio - 1).abs()[mask.bool()].max()) > 0  # the weights moved: rho != 1 later


def test_entropy_is_that_of_the_distribution_sampled_from(tiny_llm):
    """The entropy metric: at token 0 the restricted softmax at the first temperature (the
    tool choice the planner drew), elsewhere the full softmax at the temperature."""
    allowed = tuple(sorted(tiny_llm.tok.encode(" " + n, add_special_tokens=False)[0]
                           for n in ("Python_Coder", "Local_Search", "Base_Generator")))
    sampling = SamplingParams(TEMP, 8, first_tokens=allowed, first_temperature=2.0)
    trajs = make_trajectories(tiny_llm, 1, 2, seed=11, first_tokens=allowed, first_temperature=2.0)
    rows = rows_of(trajs, [0.0, 0.0])
    with torch.no_grad():
        _, entropy, mask = token_logprobs(tiny_llm.model, rows, sampling, tiny_llm.pad_id, chunk=3)
    for i, r in enumerate(rows):
        with torch.no_grad():
            logits = tiny_llm.model(torch.tensor([r.prompt_ids + r.action_ids])).logits[0].float()  # [S, V]
        for j in range(len(r.action_ids)):
            z = logits[len(r.prompt_ids) - 1 + j] / sampling.temperature_at(j)
            if j == 0:
                z = z[list(allowed)]
            p = torch.softmax(z, -1)
            want = float(-(p * p.log()).sum())
            got = float(entropy[i, mask.shape[1] - len(r.action_ids) + j])
            assert got == pytest.approx(want, abs=1e-4), (i, j)


def _credit_by_hand(trajs, rewards, scores, G, mode, row_weight, eps=1e-6):
    """(A, w): the advantage and the weight of every turn (k, t), written from the formulas
    of kept_rows' docstring with plain Python, group by group."""
    A, w = {}, {}
    Q = len(trajs) // G
    for q in range(Q):
        g = range(q * G, q * G + G)
        T = {k: len(trajs[k].turns) for k in g}
        if mode == "per_turn":  # each turn row its own score, normalised over the group's rows
            xs = [scores[k][t] for k in g for t in range(T[k])]
            m = sum(xs) / len(xs)
            s = (sum((x - m) ** 2 for x in xs) / len(xs)) ** 0.5
            A.update({(k, t): (scores[k][t] - m) / (s + eps) for k in g for t in range(T[k])})
        else:  # R_i broadcast; turn_rows counts trajectory i T_i times in the mean and std
            c = {k: T[k] if mode == "turn_rows" else 1 for k in g}
            m = sum(c[k] * rewards[k] for k in g) / sum(c.values())
            s = (sum(c[k] * (rewards[k] - m) ** 2 for k in g) / sum(c.values())) ** 0.5
            A.update({(k, t): (rewards[k] - m) / (s + eps) for k in g for t in range(T[k])})
        n_rows = sum(T.values())
        w.update({(k, t): 1 / (Q * G * T[k]) if row_weight == "trajectory" else 1 / (Q * n_rows)
                  for k in g for t in range(T[k])})
    return A, w


@pytest.mark.parametrize("mode, row_weight", [("trajectory", "turn"), ("turn_rows", "trajectory"),
                                              ("per_turn", "trajectory"), ("per_turn", "turn")])
def test_each_credit_option_equals_its_loop_written_objective(policy, mode, row_weight):
    """kept_rows' rows under each credit option (the default's own test is the one above):
    the batched loss and gradient equal J written as a loop over trajectories, turns and
    tokens with each turn's advantage and weight computed by hand."""
    from flow_grpo import _logprob, kept_rows, token_kl
    llm, ref = policy
    G, rewards = 3, [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    trajs = make_trajectories(llm, 2, G, seed=5)
    rnd = random.Random(7)
    scores = [[rnd.choice([0.0, 0.5, 1.0]) for _ in tr.turns] for tr in trajs]  # a score per turn
    for tr, r in zip(trajs, rewards):
        tr.reward = r
    rows, _ = kept_rows(trajs, [True] * len(trajs), G, mode, None, scores if mode == "per_turn" else None, row_weight)
    A, w = _credit_by_hand(trajs, rewards, scores, G, mode, row_weight)
    assert [r.advantage for r in rows] == pytest.approx([A[kt] for kt in sorted(A)], abs=1e-9)
    assert [r.weight for r in rows] == pytest.approx([w[kt] for kt in sorted(w)], rel=1e-12)
    cfg = LossConfig(EPS_LO, EPS_HI, 0.1)
    J = 0.0
    for k, tr in enumerate(trajs):
        for t, turn in enumerate(tr.turns):
            seq = torch.tensor([turn.prompt_ids + turn.action_ids])
            logits = llm.model(seq).logits[0].float()
            with torch.no_grad():
                ref_logits = ref(seq).logits[0].float()
            for j, tok in enumerate(turn.action_ids):
                at = len(turn.prompt_ids) - 1 + j
                lp, lr = _logprob(logits[at], tok, j, SAMPLING), _logprob(ref_logits[at], tok, j, SAMPLING)
                rho = torch.exp(lp - lp.detach())  # the on-policy first update
                surrogate = torch.minimum(rho * A[k, t], rho.clamp(1 - EPS_LO, 1 + EPS_HI) * A[k, t])
                J = J + w[k, t] / len(turn.action_ids) * (surrogate - cfg.beta * token_kl(lr, lp, cfg.kl_estimator))
    llm.model.zero_grad()
    (-J).backward()
    g_loop = grads(llm.model)
    llm.model.zero_grad()
    st = accumulate_gradients(llm.model, ref, rows, SAMPLING, cfg, llm.pad_id, micro_batch=64)
    assert st["loss"] == pytest.approx(-J.item(), rel=1e-4, abs=1e-6)
    assert_grads_close(grads(llm.model), g_loop)


# ----------------------------------------------------------------------------------------
# Advantage estimators (train.advantage)


@pytest.mark.parametrize("name, rewards, want", [
    ("grpo", [1, 0], [1, -1]),  # (R - mean) / population std: +-1 for two different rewards
    ("grpo", [1, 1, 0, 0], [1, 1, -1, -1]),
    ("grpo", [1, 0, 0, 0], [3 / 3 ** 0.5, -1 / 3 ** 0.5, -1 / 3 ** 0.5, -1 / 3 ** 0.5]),  # mean 1/4, std sqrt(3)/4
    ("dr_grpo", [1, 0, 0, 0], [0.75, -0.25, -0.25, -0.25]),  # R - mean, no std
    ("dr_grpo", [0.5, 0.5], [0, 0]),
    ("rloo", [1, 0, 0, 0], [1, -1 / 3, -1 / 3, -1 / 3]),  # R_i - the mean of the other three
    ("rloo", [1, 1, 0], [0.5, 0.5, -1]),
    ("rloo", [2, 0], [2, -2]),
])
def test_estimators_by_hand(name, rewards, want):
    from flow_grpo import ADVANTAGE_ESTIMATORS
    assert ADVANTAGE_ESTIMATORS[name](rewards) == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("groups, want", [
    # c = R - the group's mean: [3/4, -1/4, -1/4, -1/4] and [0, 0]. Their mean is 0; the
    # batch's variance with Bessel's n - 1 over the n = 6 values: (9/16 + 3 * 1/16) / 5 = 3/20,
    # std sqrt(0.15 + 1e-8) = 0.3872984; A = c / std: 0.75 / 0.3872984 = 1.9364917 and
    # 0.25 / 0.3872984 = 0.6454972. (grpo divides by the group's own std, sqrt(3)/4:
    # 1.7320508 and -0.5773503.)
    ([[1, 0, 0, 0], [1, 1]], [[1.9364917, -0.6454972, -0.6454972, -0.6454972], [0, 0]]),
    # c = [1/2, -1/2] and [1/2, 1/2, -1/2, -1/2]: six squares of 1/4 over 5 = 0.3, std 0.5477226;
    # A = 0.5 / 0.5477226 = 0.9128709 (grpo: +-1 in each group).
    ([[1, 0], [1, 1, 0, 0]], [[0.9128709, -0.9128709], [0.9128709, 0.9128709, -0.9128709, -0.9128709]]),
    # No group with a signal: every c is 0, and so is every A (the 1e-8 keeps 0 / 0 away).
    ([[1, 1], [0, 0]], [[0, 0], [0, 0]]),
])
def test_reinforce_pp_baseline_by_hand(groups, want):
    from flow_grpo import reinforce_pp_baseline
    got = reinforce_pp_baseline(groups)
    assert [len(g) for g in got] == [len(g) for g in want]
    assert [a for g in got for a in g] == pytest.approx([a for g in want for a in g], abs=1e-6)


def estimator_gap(policy, name: str) -> tuple[float, float]:
    """(relative loss error, worst relative gradient error) of the batched loss over
    kept_rows(estimator=name) against J written as loops (reference_objective) with the
    advantages the estimator gives: each group's rewards alone, or, for an estimator over
    the batch (flow_grpo.ADVANTAGE_ESTIMATORS says which), all groups' at once."""
    from flow_grpo import ADVANTAGE_ESTIMATORS, kept_rows
    llm, ref = policy
    G, rewards = 3, [1, 0, 0, 1, 1, 0]
    trajs = make_trajectories(llm, 2, G, seed=12)
    for tr, r in zip(trajs, rewards):
        tr.reward = r
    fn, groups = ADVANTAGE_ESTIMATORS[name], [rewards[q:q + G] for q in range(0, len(rewards), G)]
    adv = [a for A in (fn(groups) if fn.over == "batch" else [fn(g) for g in groups]) for a in A]
    cfg = LossConfig(EPS_LO, EPS_HI, 0.05)
    llm.model.zero_grad()
    J = reference_objective(llm.model, ref, trajs, adv, SAMPLING, cfg)
    (-J).backward()
    g_ref = grads(llm.model)
    rows, _ = kept_rows(trajs, [True] * len(trajs), G, estimator=name)
    llm.model.zero_grad()
    st = accumulate_gradients(llm.model, ref, rows, SAMPLING, cfg, llm.pad_id)
    g = grads(llm.model)
    grad_err = max(float((a - b).norm()) / max(float(b.norm()), 1e-12) for a, b in zip(g, g_ref))
    return abs(st["loss"] + J.item()) / abs(J.item()), grad_err


def registered_estimators():
    from flow_grpo import ADVANTAGE_ESTIMATORS
    return sorted(ADVANTAGE_ESTIMATORS)


@pytest.mark.parametrize("name", registered_estimators())
def test_every_registered_estimator_through_the_batched_loss(policy, name):
    """Each estimator registered, per group or over the batch (the shipped ones and a fork's,
    once its module is imported: `python -m pytest -p MODULE tests/test_flow_grpo.py`)
    reaches the loss: the batched update over kept_rows equals J with its advantages."""
    loss_err, grad_err = estimator_gap(policy, name)
    assert loss_err < 1e-4 and grad_err < 1e-4, (loss_err, grad_err)


def test_the_estimator_check_sees_advantages_the_loss_ignores(policy, monkeypatch):
    """The check above fails where the rows' advantages are not the estimator's (here: the
    rows always get the paper's, whatever train.advantage names)."""
    import flow_grpo
    real = flow_grpo.kept_rows
    monkeypatch.setattr(flow_grpo, "kept_rows", lambda *a, estimator="grpo", **k: real(*a, **k))
    loss_err, grad_err = estimator_gap(policy, "rloo")
    assert loss_err > 1e-2 or grad_err > 1e-2


# REINFORCE++-baseline as a fork would write it, in a module of its own: the generic test
# above must take it as it is (an estimator over the batch, registered from outside).
FORK_ESTIMATOR = """import math
import flow_grpo


@flow_grpo.advantage_estimator("rpp_fork", over="batch")
def rpp_fork(groups):
    centred = [[r - sum(g) / len(g) for r in g] for g in groups]
    flat = [c for g in centred for c in g]
    std = math.sqrt(sum(c * c for c in flat) / (len(flat) - 1) + 1e-8)
    return [[c / std for c in g] for g in centred]
"""


def test_a_forks_batch_estimator_passes_the_generic_test_unchanged(tmp_path):
    """The fork's file, loaded as docs/FORKING.md says (`python -m pytest -p MODULE`), is run
    by the generic estimator test (only on it, here: the shipped ones run above); its
    advantages are the shipped reinforce_pp_baseline's."""
    from flow_grpo import ADVANTAGE_ESTIMATORS, reinforce_pp_baseline
    assert len(FORK_ESTIMATOR.splitlines()) <= 10
    (tmp_path / "my_rpp.py").write_text(FORK_ESTIMATOR)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "my_rpp", "-p", "no:cacheprovider",
                           "tests/test_flow_grpo.py", "-k", "every_registered_estimator and rpp_fork"],
                          cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "PASSED tests/test_flow_grpo.py::test_every_registered_estimator_through_the_batched_loss[rpp_fork]" \
        in done.stdout, done.stdout[-3000:]
    spec = importlib.util.spec_from_file_location("my_rpp", tmp_path / "my_rpp.py")
    try:  # here too, registered while it is compared
        spec.loader.exec_module(fork := importlib.util.module_from_spec(spec))
        groups = [[1, 0, 0, 0], [1, 1], [0.5, 0.25, 0]]
        assert fork.rpp_fork(groups) == reinforce_pp_baseline(groups)  # the same arithmetic, to the bit
    finally:
        ADVANTAGE_ESTIMATORS.pop("rpp_fork", None)
