"""Flow-GRPO: reward broadcast, group advantages, per-token log-probs and the loss.

Paper, section 2. Every symbol of the objective lives in this file:

    J(theta) = 1/G sum_i 1/T_i sum_t 1/|a_i^t| sum_j  min( rho_ij^t A_i^t , clip(rho_ij^t, 1-eps_low, 1+eps_high) A_i^t )
               - beta * KL(pi_theta || pi_ref)

    G          rollouts of one query (we average over all N = Q*G trajectories of a batch)
    T_i        planner turns of trajectory i                     -> build_rows, TurnRow.weight
    |a_i^t|    tokens of the planner's action at turn t          -> flow_grpo_loss, `n_tok`
    rho_ij^t   pi_theta(token) / pi_theta_old(token)             -> flow_grpo_loss, `ratio`
    A_i^t      = A_i = (R_i - mean_k R_k) / (std_k R_k + eps)    -> group_advantages
    eps_low, eps_high  the asymmetric clip range                 -> LossConfig, flow_grpo_loss
    beta       the KL coefficient, KL estimated per token by k3  -> LossConfig, flow_grpo_loss, `kl`

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
1/T_i average keeps a long trajectory from outweighing a short one.

What we simplify: pi_theta_old is the sampler's own log-probs (the weights that sampled
are the weights we update: on-policy, no stale copy), so no extra forward is spent on it.
"""

from dataclasses import dataclass

import torch

import speedups
from agentflow import SamplingParams


@dataclass
class TurnRow:
    """One planner turn as a training row: the state, the action, and its credit."""
    prompt_ids: list[int]  # (q, K, M^t) exactly as sampled
    action_ids: list[int]  # a_i^t
    old_logprobs: list[float]  # log pi_theta_old(a_ij^t | ...) from the sampler
    advantage: float  # A_i^t = A_i, broadcast from the trajectory
    weight: float  # 1 / (N * T_i): the trajectory and turn averages of J


@dataclass(frozen=True)
class LossConfig:
    eps_low: float  # clip range 1 - eps_low
    eps_high: float  # clip range 1 + eps_high
    beta: float  # KL coefficient


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


def zero_variance_groups(rewards: list[float], group_size: int) -> int:
    """How many groups got the same reward in every rollout (advantage 0: no signal)."""
    R = torch.tensor(rewards).view(-1, group_size)  # [Q, G]
    return int((R.max(1).values == R.min(1).values).sum())


def build_rows(trajectories, advantages: list[float]) -> list[TurnRow]:
    """Broadcast each trajectory's advantage to all its planner turns (A_i^t = A_i).

    weight = 1/(N * T_i) puts the 1/G (here 1/N over the whole batch of N = Q*G
    trajectories: the mean over groups of each group's 1/G average) and 1/T_i averages
    of J on the row; the 1/|a| average is applied per token in flow_grpo_loss. Because
    these are fixed before any micro-batching, splitting rows into micro-batches (and
    summing their losses) gives exactly the loss of the whole batch."""
    N = len(trajectories)
    rows = []
    for traj, A_i in zip(trajectories, advantages):
        turns = [t for t in traj.turns if t.action_ids]
        T_i = len(turns)
        for turn in turns:
            rows.append(TurnRow(turn.prompt_ids, turn.action_ids, turn.logprobs, A_i, 1.0 / (N * T_i)))
    return rows


# ----------------------------------------------------------------------------------------
# Per-token log-probs of the sampled actions under the current weights


def action_logits(model, rows: list[TurnRow], pad_id: int, fast: bool = True) -> torch.Tensor:
    """The logits that predicted each action token: [n, La, V] for n rows and La the
    longest action; row r's action fills the LAST |a_r| columns, like its tokens in the
    sequence.

    Plain (fast=False): every row is prompt + action, the rows left-padded into one
    batch, one forward; pads are masked out and skipped by the position ids. The logits
    at position p predict token p+1, so the last La+1 positions cover every action.
    fast=True runs the same rows through speedups.prefill, which computes text the rows
    share once (the module's instructions for all rows, the whole prompt for the G
    actions sampled from it); the logits are the same."""
    dev = next(model.parameters()).device
    seqs = [r.prompt_ids + r.action_ids for r in rows]
    La = max(len(r.action_ids) for r in rows)
    if fast:
        logits, _ = speedups.prefill(model, seqs, pad_id, None, logits_to_keep=La + 1,
                                     shareable=[len(r.prompt_ids) - 1 for r in rows])
    else:
        ids, mask = speedups.left_padded(seqs, max(map(len, seqs)), pad_id, dev)  # [n, S] each
        pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [n, S] each token's position in its own sequence
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=La + 1).logits
    return logits[:, :-1, :]  # [n, La, V]


def token_logprobs(model, rows: list[TurnRow], sampling: SamplingParams, pad_id: int, fast: bool = True):
    """log pi(a_ij | prompt, a_i<j) for every action token of every row, under exactly the
    distribution the sampler drew it from (agentflow.LLM.sample with `sampling`):
    softmax(logits / T_j) over the full vocabulary in float32, T_j =
    sampling.temperature_at(j), and for j = 0 with `first_tokens` (the planner's tool
    constraint) the softmax over those ids alone.

    Returns (logp [n, La], entropy [n, La] of that distribution, no gradient, mask [n, La]:
    1 on action tokens), laid out as in action_logits."""
    dev = next(model.parameters()).device
    n, La = len(rows), max(len(r.action_ids) for r in rows)
    mask = torch.zeros((n, La), dtype=torch.float32, device=dev)  # [n, La]
    targets = torch.zeros((n, La), dtype=torch.long, device=dev)  # [n, La]
    for i, r in enumerate(rows):
        mask[i, La - len(r.action_ids):] = 1
        targets[i, La - len(r.action_ids):] = torch.tensor(r.action_ids, device=dev)
    T = sampling.temperature
    z = action_logits(model, rows, pad_id, fast).float() / T  # [n, La, V] logits / T
    logp_all = torch.log_softmax(z, dim=-1)  # [n, La, V]
    logp = logp_all.gather(-1, targets[..., None])[..., 0]  # [n, La]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [n, La]
    if sampling.first_tokens or sampling.first_temperature > 0:
        # Token 0 of each action: its own temperature and the tool restriction.
        r = torch.arange(n, device=dev)  # [n]
        c = torch.tensor([La - len(row.action_ids) for row in rows], device=dev)  # [n] first action column
        z0 = z[r, c]  # [n, V] logits / T
        if sampling.first_temperature > 0:
            z0 = z0 * (T / sampling.first_temperature)  # logits / T_first
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
    return logp * mask, entropy * mask, mask


# ----------------------------------------------------------------------------------------
# The loss


def flow_grpo_loss(logp, old_logp, ref_logp, adv, row_weight, mask, cfg: LossConfig):
    """-J for a set of rows. Shapes: logp, old_logp, ref_logp, mask [n, La]; adv, row_weight [n].

    Returns (loss, stats) with loss a scalar whose gradient is -dJ/dtheta."""
    A = adv[:, None]  # [n, 1]  A_i^t, the same for every token of the action
    # rho = pi_theta / pi_theta_old. On the first update of a rollout batch the weights that
    # sampled are the weights being trained, so rho = 1 (up to float noise) and
    # d rho / d theta = rho * d log pi = d log pi: the surrogate's gradient is REINFORCE's,
    # sum_j A * d log pi(a_j). Clipping only bites from the second mini-batch / epoch on.
    ratio = torch.exp(logp - old_logp)  # [n, La]  rho_ij^t
    surrogate = torch.minimum(ratio * A, ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high) * A)  # [n, La]
    # KL(pi_theta || pi_ref) per token, the "k3" estimator: with d = log pi_ref - log pi,
    # k3 = e^d - d - 1 >= 0, unbiased for KL when tokens come from pi_theta, and 0 iff equal.
    d = ref_logp - logp  # [n, La]
    kl = torch.exp(d) - d - 1  # [n, La]
    # Token weight = 1/(N T_i) * 1/|a_i^t|: the three averages of J.
    n_tok = mask.sum(-1).clamp(min=1)  # [n]  |a_i^t|
    w = (row_weight / n_tok)[:, None] * mask  # [n, La]
    J = (w * (surrogate - cfg.beta * kl)).sum()
    with torch.no_grad():
        clipped = ((ratio < 1 - cfg.eps_low) & (A < 0)) | ((ratio > 1 + cfg.eps_high) & (A > 0))
        stats = {"kl": (w * kl).sum().item(), "clip_frac": (clipped.float() * mask).sum().item(),
                 "n_tokens": mask.sum().item()}
    return -J, stats


def reference_objective(model, ref_model, trajectories, advantages: list[float], sampling: SamplingParams,
                        cfg: LossConfig) -> torch.Tensor:
    """J exactly as the paper writes it: one Python loop per average, one forward per turn,
    no batching, no padding, no shared prefix. Slow; it is the yardstick that
    flow_grpo_loss over build_rows is checked against (tests/test_flow_grpo.py)."""
    N = len(trajectories)  # Q*G: 1/G over each group, averaged over the Q groups
    J = 0.0
    for traj, A_i in zip(trajectories, advantages):
        turns = [t for t in traj.turns if t.action_ids]
        T_i = len(turns)
        for turn in turns:  # 1/T_i sum_t
            seq = torch.tensor([turn.prompt_ids + turn.action_ids])
            logits = model(seq).logits[0].float()  # [S, V]
            with torch.no_grad():
                ref_logits = ref_model(seq).logits[0].float()
            size = len(turn.action_ids)  # |a_i^t|
            for j, tok in enumerate(turn.action_ids):  # 1/|a| sum_j
                at = len(turn.prompt_ids) - 1 + j  # the position whose logits predict token j
                lp, lr = (_logprob(x[at], tok, j, sampling) for x in (logits, ref_logits))
                rho = torch.exp(lp - turn.logprobs[j])
                surrogate = torch.minimum(rho * A_i, torch.clamp(rho, 1 - cfg.eps_low, 1 + cfg.eps_high) * A_i)
                kl = torch.exp(lr - lp) - (lr - lp) - 1  # k3
                J = J + (surrogate - cfg.beta * kl) / (N * T_i * size)
    return J


def _logprob(logits: torch.Tensor, tok: int, j: int, sampling: SamplingParams) -> torch.Tensor:
    """log pi of token j of an action, from the logits [V] that predict it (reference_objective)."""
    z = logits / sampling.temperature_at(j)
    if j == 0 and sampling.first_tokens:
        allowed = list(sampling.first_tokens)
        return z[tok] - torch.logsumexp(z[allowed], -1)
    return torch.log_softmax(z, -1)[tok]


def accumulate_gradients(model, ref_model, rows: list[TurnRow], sampling: SamplingParams, loss_cfg: LossConfig,
                         pad_id: int, *, micro_batch: int = 16, scale: float = 1.0, autocast_dtype=None,
                         fast: bool = True) -> dict:
    """Backward of `scale` * (-J) over `rows`, in micro-batches of `micro_batch` rows.

    Gradients add up in .grad. Since every token weight was fixed over the whole batch
    (build_rows), the sum over micro-batches is the same loss whatever the split: the
    micro-batch size trades memory for speed and changes nothing else."""
    dev = next(model.parameters()).device
    st = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "n_tokens": 0.0, "entropy": 0.0, "logprob_gap": 0.0}
    for k in range(0, len(rows), micro_batch):
        chunk = rows[k:k + micro_batch]
        with torch.autocast(dev.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            logp, entropy, mask = token_logprobs(model, chunk, sampling, pad_id, fast)  # [n, La]
            with torch.no_grad():
                ref_logp = (token_logprobs(ref_model, chunk, sampling, pad_id, fast)[0]
                            if loss_cfg.beta else logp.detach())  # [n, La]
        old = _pad_left([r.old_logprobs for r in chunk], mask.shape[1], dev)  # [n, La]
        adv = torch.tensor([r.advantage for r in chunk], device=dev)  # [n]
        wt = torch.tensor([r.weight for r in chunk], device=dev)  # [n]
        loss, s = flow_grpo_loss(logp, old, ref_logp, adv, wt, mask, loss_cfg)
        (loss * scale).backward()
        with torch.no_grad():
            # Before any update the sampler and this forward must agree on the log-probs
            # (only float noise apart); a large gap means the loss is not on-policy.
            st["logprob_gap"] = max(st["logprob_gap"], ((logp - old).abs() * mask).max().item())
            st["entropy"] += entropy.sum().item()
        st["loss"] += loss.item() * scale
        for key in ("kl", "clip_frac", "n_tokens"):
            st[key] += s[key] * (scale if key == "kl" else 1)
    return st


def policy_update(model, ref_model, optimizer, rows: list[TurnRow], sampling: SamplingParams,
                  loss_cfg: LossConfig, pad_id: int, *, epochs: int = 1, minibatches: int = 1,
                  max_grad_norm: float = 1.0, seed: int = 0, scheduler=None, **kw) -> dict:
    """`epochs` passes over one rollout batch, each split into `minibatches` optimizer
    steps (PPO style). With epochs = minibatches = 1 this is a single REINFORCE-like step
    (rho = 1, see flow_grpo_loss). A mini-batch's loss is scaled by `minibatches` so that
    every mini-batch estimates the same J as the whole batch (weights are batch-global).
    `sampling` is the planner's SamplingParams, the very object the sampler drew with.
    kw: micro_batch, autocast_dtype, fast (accumulate_gradients)."""
    gen = torch.Generator().manual_seed(seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    totals = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "n_tokens": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    gap = 0.0
    for epoch in range(epochs):
        order = torch.randperm(len(rows), generator=gen).tolist() if minibatches > 1 else list(range(len(rows)))
        for mb in range(minibatches):
            optimizer.zero_grad(set_to_none=True)
            st = accumulate_gradients(model, ref_model, [rows[i] for i in order[mb::minibatches]], sampling,
                                      loss_cfg, pad_id, scale=minibatches, **kw)
            if epoch == 0 and mb == 0:
                gap = st["logprob_gap"]  # measured before the first optimizer step
            totals["grad_norm"] += float(torch.nn.utils.clip_grad_norm_(trainable, max_grad_norm))
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            for key in ("loss", "kl", "clip_frac", "n_tokens", "entropy"):
                totals[key] += st[key]
    n_steps, n_tok = epochs * minibatches, max(totals["n_tokens"], 1.0)
    return {"loss": totals["loss"] / n_steps, "kl": totals["kl"] / n_steps,
            "clip_frac": totals["clip_frac"] / n_tok, "entropy": totals["entropy"] / n_tok,
            "grad_norm": totals["grad_norm"] / n_steps, "logprob_gap": gap,
            "planner_tokens": int(n_tok / epochs), "optimizer_steps": n_steps}


def _pad_left(values: list[list[float]], width: int, dev) -> torch.Tensor:
    out = torch.zeros((len(values), width), device=dev)  # [n, La]
    for i, v in enumerate(values):
        if v:
            out[i, width - len(v):] = torch.tensor(v, device=dev)
    return out
