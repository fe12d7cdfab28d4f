"""The batched Flow-GRPO loss against a naive loop over trajectories, turns and tokens."""

import copy
import random

import pytest
import torch

from agentflow import LLM, PlannerTurn, SamplingParams, Trajectory
from flow_grpo import (LossConfig, TurnRow, accumulate_gradients, build_rows, flow_grpo_loss, group_advantages,
                       reference_objective, token_logprobs, zero_variance_groups)
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


def rows_for(llm, rewards, G=3, seed=0, perturb=0.0):
    trajs = make_trajectories(llm, len(rewards) // G, G, seed)
    adv = group_advantages(rewards, G)
    rows = build_rows(trajs, adv)
    if perturb:  # pretend the weights moved since sampling, so rho != 1 and clipping bites
        g = torch.Generator().manual_seed(seed)
        for r in rows:
            r.old_logprobs = [x + perturb * float(torch.randn((), generator=g)) for x in r.old_logprobs]
    return trajs, rows


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
    assert zero_variance_groups([1, 0, 0, 1, 1, 1, 1, 1], 4) == 1
    assert zero_variance_groups([1, 1, 0, 0, 1, 0], 2) == 2
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


def test_batched_loss_and_gradient_equal_naive_loop(policy):
    llm, ref = policy
    rewards = [1, 0, 1, 0, 0, 1]
    trajs, rows = rows_for(llm, rewards, perturb=0.3)
    # build_rows copied the perturbed old log-probs; mirror them into the trajectories.
    k = 0
    for tr in trajs:
        for turn in tr.turns:
            turn.logprobs = rows[k].old_logprobs
            k += 1
    adv = group_advantages(rewards, 3)
    llm.model.zero_grad()
    st = accumulate_gradients(llm.model, ref, rows, *loss_args(llm, beta=0.1), micro_batch=64)
    g_batched = grads(llm.model)
    llm.model.zero_grad()
    J = reference_objective(llm.model, ref, trajs, adv, SAMPLING, LossConfig(EPS_LO, EPS_HI, 0.1))
    (-J).backward()
    g_naive = grads(llm.model)
    assert st["loss"] == pytest.approx(-J.item(), rel=1e-4, abs=1e-6)
    assert st["clip_frac"] > 0  # the perturbation made clipping active somewhere
    assert_grads_close(g_batched, g_naive)


def test_micro_batching_changes_nothing(policy):
    llm, ref = policy
    _, rows = rows_for(llm, [1, 0, 0, 0, 1, 1], perturb=0.2, seed=1)
    results = []
    for mb in (1, 3, 64):
        llm.model.zero_grad()
        st = accumulate_gradients(llm.model, ref, rows, *loss_args(llm, beta=0.05), micro_batch=mb)
        results.append((st["loss"], grads(llm.model)))
    for loss, g in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-5, abs=1e-7)
        assert_grads_close(g, results[0][1])


def test_zero_variance_groups_give_zero_policy_gradient(policy):
    llm, ref = policy
    _, rows = rows_for(llm, [1, 1, 1, 0, 0, 0], seed=2)
    assert all(r.advantage == 0 for r in rows)
    llm.model.zero_grad()
    accumulate_gradients(llm.model, ref, rows, *loss_args(llm, beta=0.0))
    assert all(float(g.abs().max()) == 0.0 for g in grads(llm.model))


@pytest.mark.parametrize("fast", [False, True])
def test_only_action_tokens_get_gradient(policy, fast):
    """d(-J)/d logits is exactly zero at every position that does not score an action token."""
    llm, ref = policy
    _, rows = rows_for(llm, [1, 0, 0, 1, 0, 1], seed=3)
    outputs = []  # every output of the lm_head (logits), kept for their gradients

    def keep(module, inputs, out):
        if out.requires_grad:
            out.retain_grad()
        outputs.append(out)

    hook = llm.model.lm_head.register_forward_hook(keep)
    try:
        logp, _, mask = token_logprobs(llm.model, rows, SAMPLING, llm.pad_id, fast)
    finally:
        hook.remove()
    old = torch.zeros_like(logp)
    for i, r in enumerate(rows):
        old[i, mask.shape[1] - len(r.old_logprobs):] = torch.tensor(r.old_logprobs)
    loss, _ = flow_grpo_loss(logp, old, logp.detach(), torch.tensor([r.advantage for r in rows]),
                             torch.tensor([r.weight for r in rows]), mask, LossConfig(EPS_LO, EPS_HI, 0.0))
    loss.backward()
    # Per row, the gradient reaching each position's logits (the forwards that ran with
    # gradient: all of them on the plain path; the row groups on the fast path).
    got = sum(int((o.grad.abs().sum(-1) > 0).sum()) for o in outputs if o.grad is not None)
    assert (mask == 0).any(), "some rows must be shorter than the longest action"
    assert got == int(mask.sum()), "exactly one position per action token has a gradient"


def test_first_update_gradient_is_reinforce(policy):
    """With old = the current log-probs (rho = 1) and beta = 0, -J's gradient equals
    REINFORCE's: -sum w_ij A_i d log pi(a_ij)."""
    llm, ref = policy
    trajs, rows = rows_for(llm, [1, 0, 0, 0, 1, 0], seed=4)
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
    _, rows = rows_for(llm, [1, 0, 1, 1, 0, 0], seed=5)
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
    zero_adv = [TurnRow(r.prompt_ids, r.action_ids, r.old_logprobs, 0.0, r.weight) for r in rows]

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


def test_trainer_logprobs_equal_sampler_logprobs(tiny_llm):
    allowed = tuple(sorted(tiny_llm.tok.encode(" " + n, add_special_tokens=False)[0]
                           for n in ("Python_Coder", "Local_Search", "Base_Generator")))
    # plain; the tool restriction; the restriction with its own temperature (config.yaml's
    # exploration of tools); a first temperature alone (a larger model without the
    # restriction): the first token's logprob changes, and both sides agree.
    for first, t_first in (((), 0.0), (allowed, 0.0), (allowed, 2.5), ((), 2.5)):
        trajs = make_trajectories(tiny_llm, 2, 3, seed=6, first_tokens=first, first_temperature=t_first)
        rows = build_rows(trajs, [0.0] * len(trajs))
        sampling = SamplingParams(TEMP, 8, first_tokens=first, first_temperature=t_first)
        with torch.no_grad():
            logp, _, mask = token_logprobs(tiny_llm.model, rows, sampling, tiny_llm.pad_id)
            slow = token_logprobs(tiny_llm.model, rows, sampling, tiny_llm.pad_id, fast=False)[0]
            plain = token_logprobs(tiny_llm.model, rows, SamplingParams(TEMP, 8, first_tokens=first),
                                   tiny_llm.pad_id)[0]
        assert float((logp - slow).abs().max()) < 1e-4  # the fast path is the plain path
        for i, r in enumerate(rows):
            got = logp[i, mask.shape[1] - len(r.action_ids):].tolist()
            assert max(abs(a - b) for a, b in zip(got, r.old_logprobs)) < 1e-4
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
    rows = build_rows(trajs, adv)
    cfg = LossConfig(EPS_LO, EPS_HI, 0.1)
    llm.model.zero_grad()
    st = accumulate_gradients(llm.model, ref, rows, sampling, cfg, llm.pad_id)
    g_batched = grads(llm.model)
    llm.model.zero_grad()
    J = reference_objective(llm.model, ref, trajs, adv, sampling, cfg)
    (-J).backward()
    assert st["loss"] == pytest.approx(-J.item(), rel=1e-4, abs=1e-6)
    assert_grads_close(g_batched, grads(llm.model))
