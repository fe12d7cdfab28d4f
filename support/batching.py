"""Token sequences as one batch: left padding, and the prefix they all share.

Both the plain path (agentflow.prefill, flow_grpo.action_logits) and the speed work
(support/speed.py) lay rows out this way: left padding puts every row's last token in
the last column, so the next token of every row lands in the same new column.
"""

import torch


def left_padded(seqs: list[list[int]], L: int, pad_id: int, dev):
    """ids [c, L] of the sequences left-padded to L, and their mask [c, L] (1 = a token)."""
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long, device=dev)  # [c, L]
    mask = torch.zeros((len(seqs), L), dtype=torch.long, device=dev)  # [c, L]
    for i, s in enumerate(seqs):
        if s:
            ids[i, L - len(s):] = torch.tensor(s, device=dev)
            mask[i, L - len(s):] = 1
    return ids, mask


def common_prefix_len(prompts: list[list[int]]) -> int:
    """How many leading tokens every sequence shares."""
    first, n = prompts[0], min(len(p) for p in prompts)
    for p in prompts[1:]:
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return n
