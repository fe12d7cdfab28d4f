"""How rows become batches: left padding, the text rows share, and which rows run together.

Planning only, no model: the engine (the sampler's prefill and the trainer's forward,
through engine._plan) asks these functions which tokens every row shares, which groups
of rows share more, and how to split the rest into batches of similar length, and then
runs the forwards. Left padding puts every row's last token in the last column, so the
next token of every row lands in the same new column.
"""

from dataclasses import dataclass

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


def unique_prompts(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """(the distinct prompts in order of first appearance, each row's index among them)."""
    first_of: dict[tuple[int, ...], int] = {}
    src = [first_of.setdefault(tuple(p), len(first_of)) for p in prompts]  # row -> its unique prompt
    return [list(p) for p in first_of], src


@dataclass
class Layout:
    """How the engine lays out its rows (engine._plan): each row holds
    [prefix | pads, its group's shared part | pads, its own rest], right-aligned in each
    block, so a row is width = prefix_len + shared_width + longest rest positions."""
    prefix_len: int  # P: the tokens every row starts with, run once at batch 1 (0: none)
    shared_groups: list[tuple[list[int], int]]  # (rows, n_shared): rows that share n_shared more tokens
    shared_parts: list[list[int]]  # each shared group's n_shared tokens, run once for the group
    group_of: list[int]  # each row's shared group; len(shared_groups) for a row in none
    rest: list[list[int]]  # each row's own tokens after its prefix and shared part
    shared_width: int  # the longest shared part (0 without shared groups)

    @property
    def width(self) -> int:
        return self.prefix_len + self.shared_width + max(len(r) for r in self.rest)


def layout(seqs: list[list[int]], shareable: list[int]) -> Layout:
    n = len(seqs)
    P = min(common_prefix_len(seqs), min(shareable)) if n > 1 else 0
    if P < MIN_SHARED:  # too short to be worth a separate forward
        P = 0
    groups = shared_text_groups(seqs, shareable, P)  # [(rows, n_shared)]: rows share seqs[rows[0]][P:P+n_shared]
    parts = [seqs[rows[0]][P:P + n_shared] for rows, n_shared in groups]
    group_of, rest = [len(groups)] * n, [s[P:] for s in seqs]  # in no group: one past the last, an empty part
    for g, (rows, n_shared) in enumerate(groups):
        for r in rows:
            group_of[r], rest[r] = g, seqs[r][P + n_shared:]
    return Layout(prefix_len=P, shared_groups=groups, shared_parts=parts, group_of=group_of, rest=rest,
                  shared_width=max(map(len, parts), default=0))


def capped(rows: list[int], width: int, max_tokens: int | None) -> list[list[int]]:
    """`rows` in runs of at most max_tokens // width rows (at least one); without
    max_tokens, all in one run."""
    per_run = max(1, max_tokens // max(width, 1) if max_tokens else len(rows))
    return [rows[i:i + per_run] for i in range(0, len(rows), per_run)]


# Shared text shorter than this runs with each row: a separate forward costs more.
MIN_SHARED = 8


def shared_text_groups(seqs: list[list[int]], shareable: list[int], P: int) -> list[tuple[list[int], int]]:
    """Rows that share at least MIN_SHARED tokens beyond the common prefix P, as
    (rows, n_shared): the rows' next n_shared tokens are the same (and within each row's
    `shareable`).

    Sorted, rows sharing a beginning are neighbours, and a run's shared length only
    shrinks as it grows; a run grows while it keeps MIN_SHARED tokens in common."""
    order = sorted(range(len(seqs)), key=lambda r: seqs[r][P:])
    groups, i = [], 0
    while i < len(order):
        first, n_shared, j = seqs[order[i]], shareable[order[i]] - P, i + 1
        while j < len(order):
            other, end = seqs[order[j]], P
            while end < min(len(first), len(other)) and first[end] == other[end]:
                end += 1  # first[P:end] == other[P:end]
            shared = min(n_shared, end - P, shareable[order[j]] - P)
            if shared < MIN_SHARED:
                break
            n_shared, j = shared, j + 1
        if j - i > 1:
            groups.append((sorted(order[i:j]), n_shared))
        i = j
    return groups


# What one more forward costs beyond its tokens, counted in tokens of prefill: reading
# every weight once more, ~10 small ops per layer, smaller matmuls. The split is not
# sensitive to it (docs/LOG.md has the timings that chose it).
GROUP_COST_TOKENS = 48


def length_groups(lengths: list[int], group_cost: int = GROUP_COST_TOKENS) -> list[list[int]]:
    """Split rows into groups that run as separate left-padded batches: the split with
    the least work, counted as sum over groups of (rows x longest row) + group_cost.

    Sorted by length, the best groups are runs of neighbours, so this is a 1-D dynamic
    program: best[j] = min over i < j of best[i] + (j - i) * len_j + group_cost, the
    cheapest way to run the j shortest rows with the last group holding rows i..j-1."""
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    sorted_lengths = [lengths[r] for r in order]
    n = len(sorted_lengths)
    best, cut = [0] + [float("inf")] * n, [0] * (n + 1)  # cut[j]: where the last group of the best split starts
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (j - i) * sorted_lengths[j - 1] + group_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]
