"""Flow-GRPO: group advantages, reward broadcast, per-token log-probs, the loss, the update.

Paper, section 2. Every symbol of the objective lives in this file:

    J(theta) = 1/G sum_i 1/T_i sum_t 1/|a_i^t| sum_j
                   min( rho_ij^t A_i^t , clip(rho_ij^t, 1-eps_low, 1+eps_high) A_i^t )
               - beta * KL(pi_theta || pi_ref)

    G          rollouts of one query (we average over all N = Q*G trajectories of a batch)
    T_i        planner turns of trajectory i                     -> kept_rows, TurnRow.weight
    |a_i^t|    tokens of the planner's action at turn t          -> flow_grpo_loss, `n_tok`
    rho_ij^t   pi_theta(token) / pi_theta_old(token)             -> flow_grpo_loss, `ratio`
               pi_theta_old: the trainer's own forward at the weights that sampled (policy_update)
    A_i^t      = A_i = (R_i - mean_k R_k) / (std_k R_k + eps)    -> group_advantages, kept_rows
    eps_low, eps_high  the asymmetric clip range                 -> LossConfig, flow_grpo_loss
    beta       the KL coefficient                                -> LossConfig, flow_grpo_loss, `kl`
    KL         per sampled token, d = log pi_ref - log pi:       -> token_kl (which KL each follows)
               k2 = d^2 / 2, or the paper's
               k3 = e^d - d - 1, CLAMPED                         -> k3_kl: d to [-20, 20], k3 <= 10
               (verl's "low_var_kl"). Its gradient per token, d k3 / d log pi = 1 - e^d,
               is then bounded: |1 - e^d| <= e^2.61 - 1 ~ 12.6 where k3 < 10, and exactly 0
               beyond the clamp (k3 = 10 at d ~ 2.61 and d ~ -11). Unclamped, a token at
               d = 10 pulled with 1 - e^10 ~ -2.2e4 and could outweigh a whole batch.

`reference_objective` writes J as one Python loop per average, exactly as above; the
batched `flow_grpo_loss` must equal it (tests/test_flow_grpo.py), and a reader can
check one against the other line by line.

Reward broadcast: the trajectory's single outcome reward R_i (0 or 1) is copied to every
one of its planner turns, so A_i^t = A_i for all t. This is valid because each turn's
state (q, K, M^t) is complete (memory.py): the multi-turn problem becomes a set of
single-turn updates, one per (prompt, action) row.

How this departs from the official code: advantages are normalised per trajectory over
the G rollouts of a query (the official code normalises over all turn rows of a query,
so long trajectories weigh more; `advantage_mode: turn_rows` reproduces that), and the
1/T_i average keeps a long trajectory from outweighing a short one. other_credit holds
the other credit choices: a score per turn instead of the broadcast, rows weighed alike.

pi_theta_old, exactly: the weights that sampled are the weights we update (no stale copy),
but the sampler's log-probs come from a different computation (a cached decode step)
than the trainer's forward; in bf16 the two differ by up to tenths of a nat. So pi_old is
the trainer's own forward at the sampling weights: with one update per batch (the
default) it is log pi itself, detached (rho = 1 bit for bit, no extra forward); with
several it is a no-grad pass before the first step, in the very micro-batches the first
step will use. The sampler's log-probs stay in TurnRow as a diagnostic (`logprob_gap`).

Simplified: no value model, no entropy bonus, one reference (the frozen initial weights).
The update's batching (UpdateConfig: micro-batches, a token cap, logits chunks) changes
how much memory and time a step takes, never what it computes (tests/test_flow_grpo.py).
"""

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import SamplingParams, last_hidden
from lora import adapters, without_adapters
from support.registry import Registry
from support.ranks import SINGLE


@dataclass
class TurnRow:
    """One planner turn as a training row: the state, the action, and its credit."""
    prompt_ids: list[int]  # (q, K, M^t) exactly as sampled
    action_ids: list[int]  # a_i^t
    sampler_logprobs: list[float]  # the sampler's log-probs of a_i^t: logprob_gap's, not pi_old
    advantage: float  # A_i^t = A_i, broadcast from the trajectory
    weight: float  # 1 / (Q' G_q T_i), 1 / (N T_i) if all are kept: J's trajectory and turn averages


@dataclass(frozen=True)
class LossConfig:
    """The constants of J (train.* in the config)."""
    eps_low: float  # clip range 1 - eps_low
    eps_high: float  # clip range 1 + eps_high
    beta: float  # KL coefficient
    kl_estimator: str = "k3"  # k3 (the paper's) | k2: see token_kl

    @classmethod
    def from_train(cls, t: dict) -> "LossConfig":
        return cls(t["eps_low"], t["eps_high"], t["beta"], t["kl_estimator"])


# Action positions per chunk of token_logprobs: the [chunk, V] float32 logits of
# one chunk are the largest tensor the loss makes (config train.logits_chunk).
LOGITS_CHUNK = 1024


@dataclass(frozen=True)
class UpdateConfig:
    """How one rollout batch becomes optimizer steps (train.* in the config). Only epochs
    and minibatches change what is computed; the rest trade memory for speed."""
    epochs: int = 1  # PPO epochs over the batch
    minibatches: int = 1  # optimizer steps per epoch
    max_grad_norm: float = 1.0
    micro_batch: int = 16  # rows per forward and backward
    max_tokens: int = 0  # rows x longest sequence per forward (the memory plan's; 0 = no cap)
    chunk: int = LOGITS_CHUNK  # action positions whose logits exist at once (token_logprobs)

    @classmethod
    def from_train(cls, t: dict, max_tokens: int = 0) -> "UpdateConfig":
        return cls(t["epochs"], t["minibatches"], t["max_grad_norm"], t["micro_batch"], max_tokens,
                   t["logits_chunk"])


# ----------------------------------------------------------------------------------------
# Rewards -> advantages -> rows


def group_advantages(rewards: list[float], group_size: int, n_turns: list[int] | None = None,
                     mode: str = "trajectory", eps: float = 1e-6) -> list[float]:
    """A_i for each trajectory. Trajectories come in consecutive groups of G = group_size
    rollouts of the same query.

    mode "trajectory" (the paper): A_i = (R_i - mean_k R_k) / (std_k R_k + eps) over the G
    rewards of the group. std is the population std, so for G=2 rewards {0, 1} A = +-1.
    mode "turn_rows" (the official code): the same, but mean and std are taken over all
    turn rows of the group, trajectory i counting T_i times (needs n_turns).
    A group whose rewards are all equal gets A = 0: it carries no learning signal."""
    G = group_size
    R = torch.tensor(rewards, dtype=torch.float64).view(-1, G)  # [Q, G] rewards
    if mode == "trajectory":
        w = torch.ones_like(R)  # [Q, G]
    elif mode == "turn_rows":
        w = torch.tensor(n_turns, dtype=torch.float64).view(-1, G).clamp(min=1)  # [Q, G] T_i
    else:
        raise ValueError(f"advantage mode must be 'trajectory' or 'turn_rows', not {mode!r}")
    mean = (w * R).sum(1, keepdim=True) / w.sum(1, keepdim=True)  # [Q, 1]
    std = ((w * (R - mean) ** 2).sum(1, keepdim=True) / w.sum(1, keepdim=True)).sqrt()  # [Q, 1]
    adv = (R - mean) / (std + eps)  # [Q, G]
    return adv.view(-1).tolist()


# How values become advantages: train.advantage names an estimator. The values are each
# kept group's rollouts' rewards (or, with credit per turn, its turn rows' scores). What
# one call of an estimator sees is its kind, `over` (advantage_estimator's argument):
#   "group" (the paper's "grpo" and most): fn(one group's values: list[float])
#            -> one advantage per value;
#   "batch": fn(every kept group's values of the step, on every rank, in rank order:
#            list[list[float]], never empty) -> each group's advantages, in that order.
# A fork registers its own with @advantage_estimator in a module listed in reward.modules;
# tests/test_flow_grpo.py runs every registered one, of either kind, through the loss.
ADVANTAGE_ESTIMATORS = Registry("train.advantage", "advantage estimator", "flow_grpo.advantage_estimator")
ESTIMATOR_KINDS = ("group", "batch")


def advantage_estimator(name: str, over: str = "group"):
    """Register fn as `name`, an estimator over one group or over the batch (a decorator)."""
    if over not in ESTIMATOR_KINDS:
        raise ValueError(f"advantage_estimator({name!r}): over must be 'group' or 'batch', not {over!r}")

    def add(fn):
        fn.over = over  # how estimate calls it
        return ADVANTAGE_ESTIMATORS.add(name)(fn)
    return add


def estimate(estimator: str, values: list[list[float]], world=SINGLE) -> list[list[float]]:
    """Each of this rank's kept groups' advantages from its values, by the estimator named:
    one of its kind "group" group by group; one of kind "batch" once over every rank's
    groups, gathered in rank order (so K ranks compute exactly what one process computes
    over the same groups), each rank keeping its own groups' share. Every rank calls this."""
    fn = ADVANTAGE_ESTIMATORS.named(estimator)
    if fn.over == "group":
        return [fn(v) for v in values]
    parts = world.all_gather(values)  # [rank 0's groups, rank 1's, ...]
    every = [v for part in parts for v in part]
    first = sum(len(part) for part in parts[:world.rank])  # where this rank's groups begin
    return fn(every)[first:first + len(values)] if every else []


@advantage_estimator("grpo")
def grpo(values: list[float]) -> list[float]:
    """The paper's: A_i = (R_i - mean) / (std + eps) over the group (group_advantages)."""
    return group_advantages(values, len(values))


@advantage_estimator("dr_grpo")
def dr_grpo(values: list[float]) -> list[float]:
    """Dr. GRPO (Liu et al., 2025): A_i = R_i - mean, without the division by the std, which
    weighs a group whose rewards barely differ as much as one split half and half."""
    mean = sum(values) / len(values)
    return [v - mean for v in values]


@advantage_estimator("rloo")
def rloo(values: list[float]) -> list[float]:
    """RLOO (Ahmadian et al., 2024): each rollout's baseline is the mean of the OTHER G-1,
    A_i = R_i - (sum_k R_k - R_i) / (G - 1) = G / (G - 1) * (R_i - mean): unbiased, since a
    rollout's baseline does not depend on its own reward."""
    total, G = sum(values), len(values)
    return [v - (total - v) / (G - 1) for v in values]


@advantage_estimator("reinforce_pp_baseline", over="batch")
def reinforce_pp_baseline(groups: list[list[float]]) -> list[list[float]]:
    """REINFORCE++-baseline (Hu et al., 2025), as verl defines it
    (compute_reinforce_plus_plus_baseline_outcome_advantage in verl/trainer/ppo/core_algos.py):
    each value minus its group's mean, c_i = R_i - mean_g, then every c_i divided by one
    std over the whole batch's centred values,
        A_i = c_i / sqrt(var + 1e-8),  var = sum_i (c_i - c_mean)^2 / (n - 1)
    over all n values of the step: Bessel's n - 1 and the 1e-8 inside the root are verl's
    (its masked_whiten). So a group's scale is the batch's, not its own: a group whose
    rewards barely differ keeps small advantages, where grpo would blow them up to +-1.
    One departure: verl whitens token by token, so a response counts once per token of it
    in the std and the mean; here each value counts once, as J weighs each rollout. The
    batch mean c_mean of the c_i is then 0 (each group's c_i sum to 0), so verl's second
    centring (subtracting it) is left out."""
    centred = [[v - sum(g) / len(g) for v in g] for g in groups]  # c_i = R_i - mean of its group
    flat = [c for g in centred for c in g]  # the n values of the step; their mean is 0
    std = math.sqrt(sum(c * c for c in flat) / (len(flat) - 1) + 1e-8)
    return [[c / std for c in g] for g in centred]


def kept_groups(usable: list[bool], G: int) -> list[list[int]]:
    """The trajectory indices of each group an update may use: its usable rollouts, if at
    least 2 (copies of a query are consecutive, G to a group)."""
    groups = [[k for k in range(q, q + G) if usable[k]] for q in range(0, len(usable), G)]
    return [g for g in groups if len(g) >= 2]


def kept_rows(trajs, usable: list[bool], G: int, mode: str = "trajectory",
              n_groups: int | None = None, turn_scores=None, row_weight: str = "trajectory",
              estimator: str = "grpo", world=SINGLE):
    """(rows, groups): the training rows of what an update may use, and the trajectory
    indices of each group kept; sets each trajectory's advantage (None if left out).

    The paper's case (the defaults), written out first: A_i over the group's rollouts,
    broadcast to each of trajectory i's T_i turns, each row weighing 1 / (Q' G_q T_i) (J's
    averages: each kept query 1/Q', each of its G_q kept rollouts 1/G_q, split over its T_i
    turns; 1 / (N T_i) when nothing is left out). Any other choice (train.advantage,
    advantage_mode, row_weight) is other_credit's.

    A trajectory that is not usable (an infrastructure failure) is left out, and its group's
    advantages are normalised over the rollouts that remain: those are still independent
    samples of pi_theta on that query, so A_i = (R_i - mean) / (std + eps) over them is the
    paper's advantage for a group of that size. A group left with fewer than 2 is dropped
    whole: one rollout alone has A = R - mean = 0 and would bring only its KL term, on a
    query the others no longer weigh. Q' counts the groups kept on all of `world`'s ranks
    (`trajs` are then this rank's share of the step), unless n_groups gives it."""
    groups = kept_groups(usable, G)
    Q_kept = sum(world.all_gather(len(groups))) if n_groups is None else n_groups  # Q'
    for tr in trajs:
        tr.advantage = None  # what is left out has none
    turns = [{k: [t for t in trajs[k].turns if t.action_ids] for k in g} for g in groups]  # its T_i acting turns
    paper = (mode, row_weight, estimator) == ("trajectory", "trajectory", "grpo")
    other = None if paper else other_credit(trajs, groups, turns, Q_kept, mode, turn_scores, row_weight,
                                            estimator, world)
    rows = []
    for q, g in enumerate(groups):
        if paper:  # the paper's
            A = group_advantages([trajs[k].reward for k in g], len(g))  # A_i = (R_i-mean)/(std+eps)
            adv = {k: [A_i] * len(turns[q][k]) for k, A_i in zip(g, A)}  # A_i^t = A_i: the broadcast
            weight = {k: 1.0 / (Q_kept * len(g) * len(turns[q][k])) for k in g}  # 1/Q' * 1/G_q * 1/T_i
        else:
            A, adv, weight = other[q]
        for k, A_i in zip(g, A):
            trajs[k].advantage = A_i
        rows += [TurnRow(t.prompt_ids, t.action_ids, t.logprobs, a, weight[k])
                 for k in g for t, a in zip(turns[q][k], adv[k])]
    return rows, groups


def other_credit(trajs, groups: list[list[int]], turns: list[dict], Q_kept: int, mode: str, turn_scores,
                 row_weight: str, estimator: str, world=SINGLE) -> list[tuple[list, dict, dict]]:
    """Each kept group's (A, adv, weight), as kept_rows names them, under the other credit
    choices (every rank calls this: a batch estimator gathers the groups of all):
      train.advantage      another estimator of A_i from the rewards (ADVANTAGE_ESTIMATORS,
                           per group, or over the whole step's groups: estimate);
      train.advantage_mode
        turn_rows          the official code's: the same broadcast A_i, with the group's mean
                           and std over its turn rows (trajectory i counts T_i times);
        per_turn           each turn its own A_i^t = (s_i^t - mean) / (std + eps) over the
                           group's turn rows (or train.advantage's estimator over them), s_i^t
                           a score per planner turn (judge.TURN_SCORES): turn_scores(k) for
                           trajectory k (or turn_scores[k], a list); its `advantage` is then
                           the mean of its turns', the turns' own in `turn_advantages`;
      train.row_weight: turn  each of the group's n_q turn rows weighs 1 / (Q' n_q): a long
                           trajectory weighs more. What a choice leaves is the paper's."""
    rewards = [[trajs[k].reward for k in g] for g in groups]
    if mode == "trajectory":
        A = estimate(estimator, rewards, world)  # A_i over each group's G_q rollouts
    elif mode == "turn_rows":
        A = [group_advantages(r, len(g), [len(trajs[k].turns) for k in g], mode) for r, g in zip(rewards, groups)]
    elif mode == "per_turn":
        score = turn_scores if callable(turn_scores) else turn_scores.__getitem__
        scores = [[s for k in g for t, s in zip(trajs[k].turns, score(k)) if t.action_ids] for g in groups]
        flat = [iter(a) for a in estimate(estimator, scores, world)]  # over each group's turn rows
        adv = [{k: [next(f) for _ in ts[k]] for k in g} for g, ts, f in zip(groups, turns, flat)]
        for g, adv_q in zip(groups, adv):
            for k in g:
                trajs[k].turn_advantages = adv_q[k]
        A = [[sum(adv_q[k]) / len(adv_q[k]) if adv_q[k] else 0.0 for k in g] for g, adv_q in zip(groups, adv)]
    else:
        raise ValueError(f"advantage mode must be 'trajectory', 'turn_rows' or 'per_turn', not {mode!r}")
    if mode != "per_turn":  # the paper's broadcast: A_i^t = A_i
        adv = [{k: [a] * len(ts[k]) for k, a in zip(g, A_q)} for g, ts, A_q in zip(groups, turns, A)]
    if row_weight == "turn":  # 1 / (Q' n_q) for each of the group's n_q turn rows
        weight = [dict.fromkeys(g, 1.0 / (Q_kept * sum(len(x) for x in ts.values()))) for g, ts in zip(groups, turns)]
    else:  # J's 1/(Q' G_q T_i)
        weight = [{k: 1.0 / (Q_kept * len(g) * len(ts[k])) for k in g} for g, ts in zip(groups, turns)]
    return list(zip(A, adv, weight))


# ----------------------------------------------------------------------------------------
# Per-token log-probs of the sampled actions under the current weights

def token_logprobs(model, rows: list[TurnRow], sampling: SamplingParams, pad_id: int, chunk: int = LOGITS_CHUNK):
    """log pi(a_ij | prompt, a_i<j) for every action token of every row, under exactly the
    distribution the sampler drew it from (engine.LLM.sample with `sampling`):
    softmax(logits / T_j) over the full vocabulary in float32, T_j =
    sampling.temperature_at(j), and for j = 0 with `first_tokens` (the planner's tool
    constraint) the softmax over those ids alone.

    Returns (logp [n, La], entropy [n, La] of that distribution, no gradient, mask [n, La]:
    1 on action tokens), La the longest action, row i's action in its LAST |a_i| columns.

    Every row is prompt + action. engine.last_hidden runs them through the decoder as the
    sampler's prefill does, so text the rows share runs once (the module's instructions
    for every row, the whole prompt for the G actions sampled from it), and returns the
    hidden state at each position that predicts an action token. The output layer then
    runs `chunk` positions at a time (ChunkedLogprobs): [n, La, V] logits in float32
    would be the largest tensor of the update with a 152k vocabulary."""
    dev = next(model.parameters()).device
    n, La = len(rows), max(len(r.action_ids) for r in rows)
    mask = torch.zeros((n, La), dtype=torch.float32, device=dev)  # [n, La]
    targets = torch.zeros((n, La), dtype=torch.long, device=dev)  # [n, La]
    for i, r in enumerate(rows):
        mask[i, La - len(r.action_ids):] = 1
        targets[i, La - len(r.action_ids):] = torch.tensor(r.action_ids, device=dev)
    T = sampling.temperature
    first = bool(sampling.first_tokens) or sampling.first_temperature > 0  # token 0: its own law
    r = torch.arange(n, device=dev)  # [n]
    c = torch.tensor([La - len(row.action_ids) for row in rows], device=dev)  # [n] its first column
    # The logits at position p predict token p+1: the last La+1 positions cover every action.
    h = last_hidden(model, [row.prompt_ids + row.action_ids for row in rows], pad_id, La + 1,
                    [len(row.prompt_ids) - 1 for row in rows])
    h = h[:, :-1]  # [n, La, d] the hidden state that predicts each action token
    scored = mask.bool()  # [n, La] the positions scored at temperature T (token 0 below if `first`)
    if first:
        scored[r, c] = False
    at = scored.nonzero(as_tuple=True)
    head = model.get_output_embeddings()
    if at[0].numel():
        lp, ent = ChunkedLogprobs.apply(h[at], head.weight, head.bias, targets[at], T, max(1, chunk))  # [M] each
    else:  # nothing scored at T (one-token actions): keep the graph for the backward
        lp = ent = h.new_zeros(0, dtype=torch.float32) + h.sum() * 0
    logp = torch.zeros((n, La), device=dev).index_put(at, lp)  # [n, La]
    entropy = torch.zeros((n, La), device=dev).index_put(at, ent.detach())
    if first:
        # Token 0 of each action: its own temperature and the tool restriction.
        z0 = head(h[r, c]).float() / sampling.temperature_at(0)  # [n, V] logits / T_0
        if sampling.first_tokens:
            allowed = torch.tensor(sampling.first_tokens, device=dev)
            norm = z0[:, allowed]  # [n, k] the softmax runs over the allowed ids only
        else:
            norm = z0  # [n, V]
        # log p(a_0) = z0[a_0] - logsumexp(z0[allowed])
        lp0 = z0.gather(-1, targets[r, c][:, None])[:, 0] - torch.logsumexp(norm, -1)  # [n]
        logp = logp.index_put((r, c), lp0)
        with torch.no_grad():
            p0 = torch.log_softmax(norm, -1)  # [n, k]
            entropy = entropy.index_put((r, c), -(p0.exp() * p0).sum(-1))
    return logp * mask, entropy.detach() * mask, mask


class ChunkedLogprobs(torch.autograd.Function):
    """log softmax(h W^T / T)[target] and the entropy of that softmax, for positions h
    [M, d], computed `chunk` positions at a time, so that no more than [chunk, V] logits
    ever exist. Backward recomputes each chunk's logits: with z = h W^T / T and
    p = softmax(z), d log p[target] / d z = onehot(target) - p, so
        d h = ((onehot - p) * g / T) @ W,    d W = ((onehot - p) * g / T)^T @ h,
    for g the incoming gradient of each position's log-prob. The logits are computed as
    nn.Linear does, in the model's dtype, then cast to float32 (the sampler's softmax is
    float32 too); the gradient goes back through that cast as autograd's would, rounded to
    the model's dtype before the two products. d W is summed over chunks in float32."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature: float, chunk: int):
        M = h.shape[0]
        logp = torch.empty(M, dtype=torch.float32, device=h.device)  # [M]
        entropy = torch.empty(M, dtype=torch.float32, device=h.device)  # [M]
        for start in range(0, M, chunk):
            end = start + chunk
            # z = h W^T / T is not kept: the log-softmax, its exp and their product (the
            # entropy's terms) are all a chunk holds at once (device_memory.chunk_bytes_per_logit)
            log_p = torch.log_softmax(F.linear(h[start:end], weight, bias).float() / temperature, dim=-1)  # [c, V]
            logp[start:end] = log_p.gather(-1, targets[start:end, None])[:, 0]
            entropy[start:end] = -(log_p.exp() * log_p).sum(-1)
            del log_p
        ctx.save_for_backward(h, weight, bias, targets)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        h, weight, bias, targets = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if want_h else None  # [M, d]
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None  # [V, d]
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_b else None  # [V]
        if g_logp is None:
            g_logp = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
        for start in range(0, h.shape[0], chunk):
            end = start + chunk
            h_chunk, target, g = h[start:end], targets[start:end], g_logp[start:end]
            z = F.linear(h_chunk, weight, bias).float() / T  # [c, V] recomputed
            dz = torch.softmax(z, dim=-1) * -g[:, None]  # [c, V] -p * g
            dz.scatter_add_(-1, target[:, None], g[:, None])  # (onehot - p) * g
            d_logits = (dz / T).to(h.dtype)  # [c, V] through z = logits / T and the float cast
            if want_h:
                grad_h[start:end] = d_logits @ weight  # [c, d]
            if want_w:
                grad_w += (d_logits.t() @ h_chunk).float()  # [V, d]
            if want_b:
                grad_b += d_logits.float().sum(0)
            del z, dz, d_logits  # [c, V] each: gone before the next chunk makes its own
        return (grad_h, grad_w.to(weight.dtype) if want_w else None,
                grad_b.to(bias.dtype) if want_b else None, None, None, None)


# ----------------------------------------------------------------------------------------
# The loss

# verl's clamps of the k3 estimator ("low_var_kl"): see k3_kl.
KL_LOG_RATIO_MAX = 20.0
KL_MAX = 10.0


def frozen_reference(model, trainable: list) -> torch.nn.Module:
    """pi_ref, the frozen initial weights, for the KL term below (and the frozen executor,
    verifier and generator). It SHARES every weight the policy does not train (one copy
    in memory: with train_layers 8 of Qwen2.5-7B's 28 blocks that is ~11 GB not
    duplicated) and owns copies of the trained ones only, which keep their initial
    values while the policy's move. With LoRA adapters (lora.py) the trained weights are the
    adapters, and pi_ref is the base without them: the same tensors, nothing copied."""
    if adapters(model):
        return without_adapters(model).requires_grad_(False)
    trained = {id(p) for p in trainable}
    shared = {id(p): p for p in model.parameters() if id(p) not in trained}  # deepcopy's memo
    return copy.deepcopy(model, shared).requires_grad_(False)


def k3_kl(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(pi_theta || pi_ref) per token, the "k3" estimator, clamped.

    With d = log pi_ref - log pi: k3 = e^d - d - 1 >= 0, unbiased for KL when tokens come
    from pi_theta, and 0 iff the two agree. Its gradient, d k3 / d log pi = 1 - e^d,
    grows like e^d: a token the policy made far less likely than the reference did
    (d = 10) would pull with ~2.2e4 and swamp the step. Hence two clamps:
      * k3 <= KL_MAX = 10: beyond it (d > ~2.61 or d < ~-11) the KL term of that token is
        the constant 10 and its gradient is exactly 0; inside it |1 - e^d| <= ~12.6, so
        no token's KL gradient exceeds that (times beta and its token weight);
      * d in [-20, 20] first: otherwise e^d overflows to inf for d > 88 and the zero
        gradient of the outer clamp times inf is NaN."""
    d = (ref_logp - logp).clamp(-KL_LOG_RATIO_MAX, KL_LOG_RATIO_MAX)  # no gradient beyond +-20
    return (torch.exp(d) - d - 1).clamp(max=KL_MAX)  # zero gradient where k3 > 10


def token_kl(ref_logp: torch.Tensor, logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """The KL term of J per sampled token: [n, La] from log pi_ref, log pi [n, La].

    Both estimators are ~0 where pi = pi_ref and have the same gradient to first order
    there; they differ in which KL their gradient follows once pi has moved away. With
    the tokens a drawn from pi (on-policy), d = log pi_ref - log pi:
      k3 = e^d - d - 1 (the paper's, verl's low_var_kl; k3_kl): gradient (1 - pi_ref/pi)
         d log pi, expected sum_a (pi - pi_ref) d log pi = -sum_a pi_ref d log pi, the
         gradient of the FORWARD KL(pi_ref || pi). Its value estimates KL(pi || pi_ref),
         but it pulls every action the reference likes back up with ~ beta * pi_ref(a),
         on every row, whether its group carried any signal or not.
      k2 = d^2 / 2: gradient (log pi - log pi_ref) d log pi, expected sum_a pi (log pi -
         log pi_ref) d log pi, the gradient of KL(pi || pi_ref), the KL the objective names:
         it penalises putting mass where the reference has little, and lets an action the
         reference liked fade once the rewards say it is wrong.
    tests/test_flow_grpo.py checks both expectations exactly. d is clamped to [-20, 20]
    for k2 too (|gradient| <= 20 per token)."""
    if estimator == "k3":
        return k3_kl(ref_logp, logp)
    if estimator != "k2":  # support/config.py checks train.kl_estimator; this, a LossConfig by hand
        raise ValueError(f"kl_estimator must be 'k3' or 'k2', not {estimator!r}")
    d = (ref_logp - logp).clamp(-KL_LOG_RATIO_MAX, KL_LOG_RATIO_MAX)
    return 0.5 * d * d


def flow_grpo_loss(logp, old_logp, ref_logp, adv, row_weight, mask, cfg: LossConfig):
    """-J for a set of rows. Shapes: logp, old_logp, ref_logp, mask [n, La]; adv, row_weight [n].

    Returns (loss, terms): loss a scalar whose gradient is -dJ/dtheta; terms J's per-token
    ratio, kl and weight and its A, without gradient, for the update's figures (add_figures)."""
    A = adv[:, None]  # [n, 1]  A_i^t, the same for every token of the action
    # rho = pi_theta / pi_theta_old. On the first update of a rollout batch old_logp is this
    # very forward's log pi, detached (policy_update), so rho = 1 exactly and
    # d rho / d theta = rho * d log pi = d log pi: the surrogate's gradient is REINFORCE's,
    # sum_j A * d log pi(a_j). Clipping only bites from the second mini-batch / epoch on.
    ratio = torch.exp(logp - old_logp)  # [n, La]  rho_ij^t
    surrogate = torch.minimum(ratio * A, ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * A)  # [n, La]
    kl = token_kl(ref_logp, logp, cfg.kl_estimator)  # [n, La]
    # Token weight = the row's 1/(Q' G_q T_i) (kept_rows) * 1/|a_i^t|: the three averages of J.
    n_tok = mask.sum(-1).clamp(min=1)  # [n]  |a_i^t|
    w = (row_weight / n_tok)[:, None] * mask  # [n, La]
    J = (w * (surrogate - cfg.beta * kl)).sum()
    return -J, {"ratio": ratio.detach(), "kl": kl.detach(), "weight": w, "A": A}


def reference_objective(model, ref_model, trajectories, advantages: list[float], sampling: SamplingParams,
                        cfg: LossConfig, old: list[list[float]] | None = None) -> torch.Tensor:
    """J exactly as the paper writes it: one Python loop per average, one forward per turn,
    no batching, no padding, no shared prefix. Slow; it is the yardstick that
    flow_grpo_loss over kept_rows' rows is checked against (tests/test_flow_grpo.py).

    pi_old is this forward's own log-prob, detached (the on-policy first update: rho = 1),
    unless `old` gives it: one list of log-probs per turn, in the rows' order."""
    N = len(trajectories)  # Q*G: 1/G over each group, averaged over the Q groups
    J, k, dev = 0.0, 0, next(model.parameters()).device
    for traj, A_i in zip(trajectories, advantages):
        turns = [t for t in traj.turns if t.action_ids]
        T_i = len(turns)
        for turn in turns:  # 1/T_i sum_t
            seq = torch.tensor([turn.prompt_ids + turn.action_ids], device=dev)
            logits = model(seq).logits[0].float()  # [S, V]
            with torch.no_grad():
                ref_logits = ref_model(seq).logits[0].float()
            size = len(turn.action_ids)  # |a_i^t|
            for j, tok in enumerate(turn.action_ids):  # 1/|a| sum_j
                at = len(turn.prompt_ids) - 1 + j  # the position whose logits predict token j
                lp, lr = (_logprob(x[at], tok, j, sampling) for x in (logits, ref_logits))
                lp_old = lp.detach() if old is None else old[k][j]
                rho = torch.exp(lp - lp_old)
                surrogate = torch.minimum(rho * A_i, torch.clamp(rho, 1 - cfg.eps_low, 1 + cfg.eps_high) * A_i)
                kl = token_kl(lr, lp, cfg.kl_estimator)
                J = J + (surrogate - cfg.beta * kl) / (N * T_i * size)
            k += 1
    return J


def _logprob(logits: torch.Tensor, tok: int, j: int, sampling: SamplingParams) -> torch.Tensor:
    """log pi of token j of an action, from the logits [V] that predict it (reference_objective)."""
    z = logits / sampling.temperature_at(j)
    if j == 0 and sampling.first_tokens:
        allowed = list(sampling.first_tokens)
        return z[tok] - torch.logsumexp(z[allowed], -1)
    return torch.log_softmax(z, -1)[tok]


# ----------------------------------------------------------------------------------------
# Gradients and the optimizer steps


def micro_batches(rows: list[TurnRow], micro_batch: int, max_tokens: int = 0) -> list[list[int]]:
    """Consecutive runs of row indices that run as one forward: at most `micro_batch` rows
    and, with max_tokens, at most max_tokens of rows x longest sequence (the memory plan's
    bound on the update's activations; a row longer than that still runs, alone)."""
    out, cur, longest = [], [], 0
    for i, r in enumerate(rows):
        length = len(r.prompt_ids) + len(r.action_ids)
        over_cap = max_tokens and (len(cur) + 1) * max(longest, length) > max_tokens
        if cur and (len(cur) == micro_batch or over_cap):
            out.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, length)
    return out + [cur] if cur else out


def accumulate_gradients(model, ref_model, rows: list[TurnRow], sampling: SamplingParams, loss_cfg: LossConfig,
                         pad_id: int, *, micro_batch: int = 16, max_tokens: int = 0, scale: float = 1.0,
                         old: list[torch.Tensor] | None = None, chunk: int = LOGITS_CHUNK) -> dict:
    """Backward of `scale` * (-J) over `rows`, in micro_batches(rows, micro_batch, max_tokens);
    returns their figures (add_figures).

    old: log pi_old per row (its action's log-probs), or None: pi_old is this forward at
    these weights, i.e. the on-policy first update, rho = 1 exactly.

    Gradients add up in .grad. Since every token weight was fixed over the whole batch
    (kept_rows), the sum over micro-batches is the same loss whatever the split: the
    micro-batch size trades memory for speed and changes nothing else."""
    dev = next(model.parameters()).device
    st = dict.fromkeys(("loss", "kl", "clip_frac", "kl_clamped", "ratio_dev", "n_tokens", "entropy",
                        "gap_max", "gap_sum"), 0.0)
    for idx in micro_batches(rows, micro_batch, max_tokens):
        part = [rows[i] for i in idx]
        logp, entropy, mask = token_logprobs(model, part, sampling, pad_id, chunk)  # [n, La]
        with torch.no_grad():
            ref_logp = (token_logprobs(ref_model, part, sampling, pad_id, chunk)[0]
                        if loss_cfg.beta else logp.detach())  # [n, La]
        old_logp = logp.detach() if old is None else _pad_left([old[i] for i in idx], mask.shape[1], dev)  # [n, La]
        adv = torch.tensor([r.advantage for r in part], device=dev)  # [n]
        wt = torch.tensor([r.weight for r in part], device=dev)  # [n]
        loss, terms = flow_grpo_loss(logp, old_logp, ref_logp, adv, wt, mask, loss_cfg)
        (loss * scale).backward()
        add_figures(st, loss, scale, terms, logp, ref_logp, entropy, mask, part, loss_cfg)
    return st


@torch.no_grad()
def add_figures(st: dict, loss, scale: float, terms: dict, logp, ref_logp, entropy, mask,
                rows: list[TurnRow], cfg: LossConfig) -> None:
    """Adds one micro-batch's figures to accumulate_gradients' `st` (none reaches the loss):
    loss and J's KL term, times `scale` as the backward; the tokens whose rho the clip held
    (clip_frac) or whose KL term a clamp held (kl_clamped); the largest |rho - 1| (ratio_dev:
    0 on an update's first step); the entropy sampled from; sampler_gap's max and sum."""
    ratio, kl, w, A = terms["ratio"], terms["kl"], terms["weight"], terms["A"]  # [n, La] x3, [n, 1]
    clipped = (ratio < 1 - cfg.eps_low) & (A < 0) | (ratio > 1 + cfg.eps_high) & (A > 0)  # [n, La]
    at_clamp = (kl >= KL_MAX if cfg.kl_estimator == "k3"
                else (ref_logp - logp).abs() >= KL_LOG_RATIO_MAX)  # [n, La] KL terms a clamp held
    gap_max, gap_sum = sampler_gap(logp, mask, rows)
    st["loss"] += loss.item() * scale
    st["kl"] += (w * kl).sum().item() * scale
    st["clip_frac"] += (clipped.float() * mask).sum().item()
    st["kl_clamped"] += (at_clamp.float() * mask).sum().item()
    st["ratio_dev"] = max(st["ratio_dev"], ((ratio - 1).abs() * mask).max().item())
    st["n_tokens"] += mask.sum().item()
    st["entropy"] += entropy.sum().item()
    st["gap_max"], st["gap_sum"] = max(st["gap_max"], gap_max), st["gap_sum"] + gap_sum


def sampler_gap(logp: torch.Tensor, mask: torch.Tensor, rows: list[TurnRow]) -> tuple[float, float]:
    """(max, sum) over action tokens of |trainer log-prob - sampler log-prob|: how far the
    sampler's arithmetic (cached decode, another summation order) is from the trainer's.
    Not used by the loss; in fp32 it is float noise, in bf16 rounding noise."""
    sampled = _pad_left([r.sampler_logprobs for r in rows], mask.shape[1], logp.device)  # [n, La]
    diff = (logp.detach() - sampled).abs() * mask  # [n, La]
    return diff.max().item(), diff.sum().item()


@torch.no_grad()
def old_logprobs(model, rows: list[TurnRow], split: list, sampling: SamplingParams, pad_id: int, *,
                 micro_batch: int = 16, max_tokens: int = 0, chunk: int = LOGITS_CHUNK) -> tuple[list, dict]:
    """log pi_old of every row's action ([|a_i|] each) and the sampler gap of the rows, from
    the trainer's forward without gradient: mini-batch by mini-batch of `split` (row indices),
    each in its micro_batches, as the first epoch's gradient passes will run them, so the
    first step computes these very numbers again and its rho is exactly 1."""
    old, gap = [None] * len(rows), [0.0, 0.0]  # gap: (max, sum) of sampler_gap
    for part in split:
        sub, part_gap = [rows[i] for i in part], [0.0, 0.0]
        for idx in micro_batches(sub, micro_batch, max_tokens):
            logp, _, mask = token_logprobs(model, [sub[j] for j in idx], sampling, pad_id, chunk)  # [n, La]
            for j, i in enumerate(idx):
                old[part[i]] = logp[j, mask.shape[1] - len(sub[i].action_ids):].clone()  # [|a_i|]
            g = sampler_gap(logp, mask, [sub[j] for j in idx])
            part_gap = [max(part_gap[0], g[0]), part_gap[1] + g[1]]
        gap = [max(gap[0], part_gap[0]), gap[1] + part_gap[1]]  # summed mini-batch by mini-batch
    return old, {"gap_max": gap[0], "gap_sum": gap[1]}


# The statistics of a step that takes no update (no group kept two rollouts on any rank).
NO_UPDATE = {"loss": None, "kl": None, "clip_frac": None, "entropy": None, "grad_norm": None,
             "logprob_gap": None, "planner_tokens": 0, "optimizer_steps": 0}


def policy_update(model, ref_model, optimizer, rows: list[TurnRow], sampling: SamplingParams, loss_cfg: LossConfig,
                  update: UpdateConfig, pad_id: int, seed: int = 0, world=SINGLE) -> dict:
    """`update.epochs` passes over one rollout batch, each split into `update.minibatches`
    optimizer steps (PPO style). With one of each this is a single REINFORCE-like step
    (rho = 1, see flow_grpo_loss). A mini-batch's loss is scaled by the number of
    mini-batches so that every mini-batch estimates the same J as the whole batch (the
    row weights are batch-global). `sampling` is the planner's SamplingParams, the very
    object the sampler drew with; `optimizer` a support.optim.PlannerOptimizer.

    world (support.ranks.World): with several ranks, `rows` are this rank's, weighted over
    the whole step's batch; every rank calls this, even with no rows. Mini-batches are
    dealt over all ranks' rows as one process would deal them (World.minibatches), each
    optimizer step sums the ranks' gradients first, and the statistics returned are the
    whole batch's."""
    if not sum(world.all_gather(len(rows))):
        return dict(NO_UPDATE)
    E, K = update.epochs, update.minibatches
    batching = dict(micro_batch=update.micro_batch, max_tokens=update.max_tokens, chunk=update.chunk)
    gen = torch.Generator().manual_seed(seed)  # the mini-batch order: the same on every rank
    split = world.minibatches(len(rows), K, gen)  # this rank's rows of each mini-batch of epoch 1
    # pi_old. The paper's case, one step: this very forward's log pi, detached (old None:
    # rho = 1 bit for bit, no extra pass). Several steps: a pass without gradient first.
    old, gap = (None, None) if E * K == 1 else old_logprobs(model, rows, split, sampling, pad_id, **batching)
    steps, grad_norm = [], 0.0  # each step's figures (accumulate_gradients'); the sum of norms
    for epoch in range(E):
        for idx in (split if epoch == 0 else world.minibatches(len(rows), K, gen)):
            pi_old = None if old is None else [old[i] for i in idx]
            steps.append(accumulate_gradients(model, ref_model, [rows[i] for i in idx], sampling,
                                              loss_cfg, pad_id, scale=K, old=pi_old, **batching))
            grad_norm += optimizer_step(optimizer, update.max_grad_norm, world)
    return update_figures(steps, gap, grad_norm, E, world)


def update_figures(steps: list[dict], gap: dict | None, grad_norm: float, E: int, world) -> dict:
    """metrics.jsonl's figures of one update, the whole batch's, from its optimizer steps'
    (accumulate_gradients'): per step, per planner token, the first step's ratio_dev (0:
    on-policy), and the sampler gap of pi_old's pass (`gap`), or with one step, that step's."""
    totals = dict.fromkeys(("loss", "kl", "clip_frac", "kl_clamped", "n_tokens", "entropy"), 0.0)
    for st in steps:
        for key in totals:
            totals[key] += st[key]
    gap = gap or steps[0]
    # Over all ranks (grad_norm already is: the gradients were summed over ranks).
    totals, peaks = world.merge({**totals, "gap_sum": gap["gap_sum"]},
                                {"gap_max": gap["gap_max"], "ratio_dev": steps[0]["ratio_dev"]})
    n_steps, n_tok = len(steps), max(totals["n_tokens"], 1.0)
    return {"loss": totals["loss"] / n_steps, "kl": totals["kl"] / n_steps,
            "clip_frac": totals["clip_frac"] / n_tok, "kl_clamped": totals["kl_clamped"] / n_tok,
            "entropy": totals["entropy"] / n_tok, "grad_norm": grad_norm / n_steps,
            "logprob_gap": peaks["gap_max"], "logprob_gap_mean": totals["gap_sum"] / max(n_tok / E, 1.0),
            "ratio_dev_first_step": peaks["ratio_dev"],
            "planner_tokens": int(n_tok / E), "optimizer_steps": n_steps}


def optimizer_step(optimizer, max_grad_norm: float, world=SINGLE) -> float:
    """One optimizer step of `optimizer` (a support.optim.PlannerOptimizer) on the gradients
    accumulated so far; returns their norm before clipping. Its four actions:"""
    stepped = optimizer.stepped  # trained weights, or bf16 ones' fp32 masters (support/optim.py)
    if world.size > 1:
        world.sum_grads(stepped)  # several processes: the whole batch's gradient, on every rank
    norm = float(torch.nn.utils.clip_grad_norm_(stepped, max_grad_norm))  # 1. clip to max_grad_norm
    optimizer.adamw.step()  # 2. AdamW, in fp32
    optimizer.copy_back()  # 3. the fp32 masters rounded into the weights sampler and trainer use
    optimizer.schedule.step()  # 4. the learning rate's warmup
    # Freed now, not at the next step's start: they would sit in memory through the next rollout.
    optimizer.adamw.zero_grad(set_to_none=True)
    return norm


def _pad_left(values: list, width: int, dev) -> torch.Tensor:
    """Per-row values (lists or 1-D tensors) right-aligned in a [n, width] float32 zero tensor."""
    out = torch.zeros((len(values), width), device=dev)  # [n, La]
    for i, v in enumerate(values):
        if len(v):
            out[i, width - len(v):] = torch.as_tensor(v, dtype=torch.float32, device=dev)
    return out
