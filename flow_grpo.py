"""Flow-GRPO: reward broadcast, group advantages, per-token log-probs and the loss.

Paper, section 2. Every symbol of the objective lives in this file:

    J(theta) = 1/G sum_i 1/T_i sum_t 1/|a_i^t| sum_j  min( rho_ij^t A_i^t , clip(rho_ij^t, 1-eps_low, 1+eps_high) A_i^t )
               - beta * KL(pi_theta || pi_ref)

    G          rollouts of one query (we average over all N = Q*G trajectories of a batch)
    T_i        planner turns of trajectory i                     -> TurnRow.weight
    |a_i^t|    tokens of the planner's action at turn t          -> the 1/|a| in TurnRow token weights
    rho_ij^t   pi_theta(token) / pi_theta_old(token)             -> flow_grpo_loss, `ratio`
    A_i^t      = A_i = (R_i - mean_k R_k) / (std_k R_k + eps)    -> group_advantages
    eps_low, eps_high  the asymmetric clip range                 -> flow_grpo_loss
    beta       the KL coefficient, KL estimated per token by k3  -> flow_grpo_loss, `kl`

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

from agentflow import prefill


@dataclass
class TurnRow:
    """One planner turn as a training row: the state, the action, and its credit."""
    prompt_ids: list[int]  # (q, K, M^t) exactly as sampled
    action_ids: list[int]  # a_i^t
    old_logprobs: list[float]  # log pi_theta_old(a_ij^t | ...) from the sampler
    advantage: float  # A_i^t = A_i, broadcast from the trajectory
    weight: float  # 1 / (N * T_i): the trajectory and turn averages of J


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
    R = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)  # [Q, G]
    if mode == "trajectory":
        w = torch.ones_like(R)  # [Q, G]
    elif mode == "turn_rows":
        w = torch.tensor(n_turns, dtype=torch.float64).view(-1, group_size).clamp(min=1)  # [Q, G]
    else:
        raise ValueError(f"advantage mode must be 'trajectory' or 'turn_rows', not {mode!r}")
    mean = (w * R).sum(1, keepdim=True) / w.sum(1, keepdim=True)  # [Q, 1]
    std = ((w * (R - mean) ** 2).sum(1, keepdim=True) / w.sum(1, keepdim=True)).sqrt()  # [Q, 1]
    A = (R - mean) / (std + eps)  # [Q, G]
    return A.view(-1).tolist()


def zero_variance_groups(rewards: list[float], group_size: int) -> int:
    """How many groups got the same reward in every rollout (advantage 0: no signal)."""
    R = torch.tensor(rewards).view(-1, group_size)  # [Q, G]
    return int((R.max(1).values == R.min(1).values).sum())


def build_rows(trajectories, advantages: list[float]) -> list[TurnRow]:
    """Broadcast each trajectory's advantage to all its planner turns (A_i^t = A_i).

    weight = 1/(N * T_i) puts the 1/G (here 1/N over the whole batch) and 1/T_i averages
    of J on the row; the 1/|a| average is applied per token in flow_grpo_loss. Because
    these are fixed before any micro-batching, splitting rows into micro-batches (and
    summing their losses) gives exactly the loss of the whole batch."""
    N = len(trajectories)
    rows = []
    for traj, A in zip(trajectories, advantages):
        turns = [t for t in traj.turns if t.action_ids]
        for turn in turns:
            rows.append(TurnRow(turn.prompt_ids, turn.action_ids, turn.logprobs, A, 1.0 / (N * len(turns))))
    return rows


# ----------------------------------------------------------------------------------------
# Per-token log-probs of the sampled actions under the current weights


def token_logprobs(model, rows: list[TurnRow], temperature: float, pad_id: int,
                   first_tokens: tuple[int, ...] = (), first_temperature: float = 0.0):
    """log pi(a_ij | prompt, a_i<j) / T for every action token of every row.

    Returns (logp [R, A], logits [R, A, V], mask [R, A]) where A = the longest action;
    row r's action fills the LAST |a_r| columns (mask 1), like its tokens in the
    sequence. Same distribution as the sampler: log_softmax(logits / T) in float32 over
    the full vocabulary. Rows run through the sampler's agentflow.prefill: text rows
    share is computed once (the module's instructions for all rows, the whole prompt for
    the G actions sampled from it), the rest left-padded in groups of similar length,
    and only action positions get logits.
    With `first_tokens` (the planner's tool constraint), each action's first token is
    scored under the softmax over those ids alone, as the sampler drew it; with
    `first_temperature`, at that temperature (the sampler's SamplingParams field).
    """
    dev = next(model.parameters()).device
    seqs = [r.prompt_ids + r.action_ids for r in rows]
    A = max(len(r.action_ids) for r in rows)
    mask = torch.zeros((len(rows), A), dtype=torch.float32, device=dev)  # [R, A]
    targets = torch.zeros((len(rows), A), dtype=torch.long, device=dev)  # [R, A]
    for i, r in enumerate(rows):
        mask[i, A - len(r.action_ids):] = 1
        targets[i, A - len(r.action_ids):] = torch.tensor(r.action_ids, device=dev)
    # The logits at position p predict token p+1: the last A+1 positions cover every action.
    # The shared prompt prefix (instructions, tool cards) is computed once for all rows.
    logits, _ = prefill(model, seqs, pad_id, None, logits_to_keep=A + 1,
                        shareable=[len(r.prompt_ids) - 1 for r in rows])
    logits = logits[:, :-1, :].float() / temperature  # [R, A, V]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None])[..., 0]  # [R, A]
    if first_tokens:
        r = torch.arange(len(rows), device=dev)  # [R]
        c = torch.tensor([A - len(row.action_ids) for row in rows], device=dev)  # [R] first action column
        first = logits[r, c]  # [R, V]  (already / T)
        if first_temperature > 0:
            first = first * (temperature / first_temperature)  # z / T_first
        allowed = torch.tensor(first_tokens, device=dev)
        # log p(a_0) = z[a_0] - logsumexp(z[allowed])
        lp0 = first.gather(-1, targets[r, c][:, None])[:, 0] - torch.logsumexp(first[:, allowed], -1)  # [R]
        logp = logp.index_put((r, c), lp0)
    return logp * mask, logits, mask


# ----------------------------------------------------------------------------------------
# The loss


def flow_grpo_loss(logp, old_logp, ref_logp, adv, row_weight, mask, eps_low: float, eps_high: float,
                   beta: float):
    """-J for a set of rows. Shapes: logp, old_logp, ref_logp, mask [R, A]; adv, row_weight [R].

    Returns (loss, stats) with loss a scalar whose gradient is -dJ/dtheta."""
    A = adv[:, None]  # [R, 1]  A_i^t, the same for every token of the action
    # rho = pi_theta / pi_theta_old. On the first update of a rollout batch the weights that
    # sampled are the weights being trained, so rho = 1 (up to float noise) and
    # d rho / d theta = rho * d log pi = d log pi: the surrogate's gradient is REINFORCE's,
    # sum_j A * d log pi(a_j). Clipping only bites from the second mini-batch / epoch on.
    ratio = torch.exp(logp - old_logp)  # [R, A]  rho_ij^t
    surrogate = torch.minimum(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)  # [R, A]
    # KL(pi_theta || pi_ref) per token, the "k3" estimator: with d = log pi_ref - log pi,
    # k3 = e^d - d - 1 >= 0, unbiased for KL when tokens come from pi_theta, and 0 iff equal.
    d = ref_logp - logp  # [R, A]
    kl = torch.exp(d) - d - 1  # [R, A]
    # Token weight = 1/(N T_i) * 1/|a_i^t|: the three averages of J.
    n_tok = mask.sum(-1).clamp(min=1)  # [R]  |a_i^t|
    w = (row_weight / n_tok)[:, None] * mask  # [R, A]
    J = (w * (surrogate - beta * kl)).sum()
    with torch.no_grad():
        clipped = ((ratio < 1 - eps_low) & (A < 0)) | ((ratio > 1 + eps_high) & (A > 0))
        stats = {"kl": (w * kl).sum().item(), "clip_frac": (clipped.float() * mask).sum().item(),
                 "n_tokens": mask.sum().item()}
    return -J, stats


def accumulate_gradients(model, ref_model, rows: list[TurnRow], *, temperature: float, pad_id: int,
                         eps_low: float, eps_high: float, beta: float, micro_batch: int = 16,
                         scale: float = 1.0, autocast_dtype=None, first_tokens: tuple[int, ...] = (),
                         first_temperature: float = 0.0) -> dict:
    """Backward of `scale` * (-J) over `rows`, in micro-batches of `micro_batch` rows.

    Gradients add up in .grad. Since every token weight was fixed over the whole batch
    (build_rows), the sum over micro-batches is the same loss whatever the split: the
    micro-batch size trades memory for speed and changes nothing else."""
    dev = next(model.parameters()).device
    st = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "n_tokens": 0.0, "entropy": 0.0, "logprob_gap": 0.0}
    for k in range(0, len(rows), micro_batch):
        chunk = rows[k:k + micro_batch]
        with torch.autocast(dev.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            logp, logits, mask = token_logprobs(model, chunk, temperature, pad_id, first_tokens,
                                                first_temperature)  # [R, A]
            with torch.no_grad():
                ref_logp = (token_logprobs(ref_model, chunk, temperature, pad_id, first_tokens, first_temperature)[0]
                            if beta else logp.detach())  # [R, A]
        old = _pad_left([r.old_logprobs for r in chunk], mask.shape[1], dev)  # [R, A]
        adv = torch.tensor([r.advantage for r in chunk], device=dev)  # [R]
        wt = torch.tensor([r.weight for r in chunk], device=dev)  # [R]
        loss, s = flow_grpo_loss(logp, old, ref_logp, adv, wt, mask, eps_low, eps_high, beta)
        (loss * scale).backward()
        with torch.no_grad():
            # Before any update the sampler and this forward must agree on the log-probs
            # (only float noise apart); a large gap means the loss is not on-policy.
            st["logprob_gap"] = max(st["logprob_gap"], ((logp - old).abs() * mask).max().item())
            ent = -(logits.softmax(-1) * torch.log_softmax(logits, -1)).sum(-1)  # [R, A]
            st["entropy"] += (ent * mask).sum().item()
        st["loss"] += loss.item() * scale
        for key in ("kl", "clip_frac", "n_tokens"):
            st[key] += s[key] * (scale if key == "kl" else 1)
    return st


def policy_update(model, ref_model, optimizer, rows: list[TurnRow], *, epochs: int = 1, minibatches: int = 1,
                  max_grad_norm: float = 1.0, seed: int = 0, scheduler=None, **loss_kw) -> dict:
    """`epochs` passes over one rollout batch, each split into `minibatches` optimizer
    steps (PPO style). With epochs = minibatches = 1 this is a single REINFORCE-like step
    (rho = 1, see flow_grpo_loss). A mini-batch's loss is scaled by `minibatches` so that
    every mini-batch estimates the same J as the whole batch (weights are batch-global).
    loss_kw: the keyword arguments of accumulate_gradients."""
    gen = torch.Generator().manual_seed(seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    totals = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "n_tokens": 0.0, "entropy": 0.0, "grad_norm": 0.0}
    gap = 0.0
    for epoch in range(epochs):
        order = torch.randperm(len(rows), generator=gen).tolist() if minibatches > 1 else list(range(len(rows)))
        for mb in range(minibatches):
            optimizer.zero_grad(set_to_none=True)
            st = accumulate_gradients(model, ref_model, [rows[i] for i in order[mb::minibatches]],
                                      scale=minibatches, **loss_kw)
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
    out = torch.zeros((len(values), width), device=dev)  # [R, A]
    for i, v in enumerate(values):
        if v:
            out[i, width - len(v):] = torch.tensor(v, device=dev)
    return out
