"""The engine's speed work: what makes sampling and the update fast on a CPU, behind
the plain path of agentflow.py, which is the reference (tests/test_sampler.py and
tests/test_flow_grpo.py prove the two give the same tokens, log-probs and gradients).

Nothing here changes WHAT is computed; each part changes how much work it takes:

  * PreallocatedLayer: the sampler's KV cache is allocated once, at its final size, and
    filled in place instead of being re-concatenated at every step; finished rows move
    down inside the same buffer.
  * prefill: beyond the prefix all rows share, rows that share more (a shared-text
    group: the G rollouts of a query share its question; the trainer's G actions share
    their whole prompt) run that part once; the rest runs in batches of similar length,
    so padding costs little (length_groups). prefill_prompts also runs identical prompts
    once.
  * decode_step: one decode position written out for Llama and Qwen2 decoders, without
    the general forward's per-step overhead; its linears as W @ x^T or x @ W^T,
    whichever this machine runs faster (choose_decode measures it once). On a GPU:
    decode_step_static, the same step on fixed shapes, replayed as a CUDA graph.
  * draw: inverse-CDF sampling, one uniform per row instead of torch.multinomial's
    random number per vocabulary entry.

Measured effects, machine by machine, are in the output of `python -m scripts.speed_bench`
and in docs/LOG.md.
"""

import functools
import json
import os
import platform
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from support.batching import common_prefix_len, left_padded
from support.models import cache_home

# ----------------------------------------------------------------------------------------
# The cache


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in a buffer allocated with room to grow (the sampler's cache).

    Hugging Face's DynamicLayer appends each new token with torch.cat, which copies the
    WHOLE cache of every layer at every decode step: for a small model at a large batch
    that is as much memory traffic as reading the weights. Here the buffer [rows, H,
    capacity, D] (k_buffer, v_buffer) is written in place, and attention reads a view of
    its first `length` positions and live rows (k_live, v_live). The sampler knows the
    final size up front (its longest laid out prompt + max_new_tokens, for every row of
    the call) and passes it as `capacity` and `rows`: the buffer is then allocated once,
    at that size, and never copied (without a capacity it starts at twice the first
    update and doubles when full, O(1) per token amortised). The prefix run once is
    repeated to every row, identical prompts are spread to their copies, and finished
    rows are dropped, all by moving rows inside the same buffer. Masks and positions are
    untouched: to the model this is a DynamicLayer whose tensors happen to live inside a
    bigger buffer.
    """

    def __init__(self, capacity: int = 0, rows: int = 0):
        super().__init__()
        self.capacity, self.rows = capacity, rows  # planned positions and rows; 0 = grow as needed
        self.length, self.k_live, self.v_live = 0, None, None

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length, self.k_live, self.v_live = 0, None, None

    def _allocate(self, live_rows: int, like_k: torch.Tensor, like_v: torch.Tensor, need: int) -> None:
        """Buffers for max(self.rows, live_rows) rows and the planned capacity (or twice
        `need` positions), of which the first live_rows rows are live."""
        H, D, Dv = like_k.shape[1], like_k.shape[3], like_v.shape[3]
        cap = max(self.capacity, need) if self.capacity else 2 * need
        rows = max(self.rows, live_rows)
        self.k_buffer = like_k.new_empty((rows, H, cap, D))
        self.v_buffer = like_v.new_empty((rows, H, cap, Dv))
        self.k_live, self.v_live = self.k_buffer[:live_rows], self.v_buffer[:live_rows]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, new = self.length, key_states.shape[-2]
        if self.k_live is None:  # first call (the prefill)
            self._allocate(key_states.shape[0], key_states, value_states, new)
        elif start + new > self.k_live.shape[-2]:  # more than planned: grow
            self._move(2 * (start + new))
        self.k_live[:, :, start:start + new] = key_states  # [b, H, new, D] into the free slots
        self.v_live[:, :, start:start + new] = value_states
        self.length = start + new
        self._views()
        return self.keys, self.values  # [b, H, start+new, D] views, no copy

    def put(self, rows: torch.Tensor | slice, start: int, keys: torch.Tensor, values: torch.Tensor,
            n_rows: int, length: int) -> None:
        """Write keys, values [c, H, s, D] of `rows` at positions start..start+s of a cache
        of n_rows rows and `length` positions (allocated on first use): how the prefill
        lays out rows that ran in separate forwards, straight into the final buffer."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        if self.k_live is None:
            self._allocate(n_rows, keys, values, length)
        self.k_live[rows, :, start:start + keys.shape[2]] = keys
        self.v_live[rows, :, start:start + values.shape[2]] = values
        self.length = length
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self.k_live[:, :, :self.length], self.v_live[:, :, :self.length]

    def _move(self, capacity: int, rows: torch.Tensor | None = None) -> None:
        """Copy the cached positions (of `rows` only, if given) into new buffers."""
        k, v = self.k_live[:, :, :self.length], self.v_live[:, :, :self.length]
        if rows is not None:
            k, v = k[rows], v[rows]
        self.k_buffer = self.k_live = k.new_empty((k.shape[0], k.shape[1], capacity, k.shape[3]))
        self.v_buffer = self.v_live = v.new_empty((v.shape[0], v.shape[1], capacity, v.shape[3]))
        self.k_live[:, :, :self.length], self.v_live[:, :, :self.length] = k, v
        self._views()

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_repeat_interleave(self, repeats: int) -> None:  # the shared prefix -> every row
        if self.get_seq_length() == 0:
            return
        live, n = self.k_live.shape[0], self.length
        if live == 1 and self.k_buffer.shape[0] >= repeats:  # in place: row 0 copied into the rows planned
            self.k_live, self.v_live = self.k_buffer[:repeats], self.v_buffer[:repeats]
            self.k_live[1:, :, :n], self.v_live[1:, :, :n] = self.k_live[:1, :, :n], self.v_live[:1, :, :n]
            self._views()
            return
        rows = torch.arange(live, device=self.k_live.device).repeat_interleave(repeats)
        self._move(self.k_live.shape[-2], rows)

    def spread(self, src: list[int]) -> None:
        """Row j becomes a copy of row src[j], for src[j] <= j (the unique prompts of a
        call, in order of first appearance, spread to all their copies), in place when
        the buffer has room for len(src) rows: from the last row down, so that every row
        is read before it is overwritten."""
        if self.get_seq_length() == 0:
            return
        if self.k_buffer.shape[0] < len(src) or any(r > j for j, r in enumerate(src)):
            self._move(self.k_live.shape[-2], torch.tensor(src, device=self.k_live.device))
            return
        n = self.length
        self.k_live, self.v_live = self.k_buffer[:len(src)], self.v_buffer[:len(src)]
        for j in range(len(src) - 1, -1, -1):
            if src[j] != j:
                self.k_live[j, :, :n], self.v_live[j, :, :n] = self.k_live[src[j], :, :n], self.v_live[src[j], :, :n]
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:  # drop finished rows, copy duplicates
        if self.get_seq_length() == 0:
            return
        keep = indices.tolist()
        if any(a >= b for a, b in zip(keep, keep[1:])):  # not a subset in order: new buffers
            self._move(self.k_live.shape[-2], indices)
            return
        # Dropping finished rows: keep[j] >= j, so row keep[j] moves down to slot j in place.
        # Rows before the first dropped one stay where they are; only the rest is copied,
        # and no new buffer is allocated (first touching a fresh buffer of hundreds of MB
        # costs page faults on every page, more than the copy itself).
        first = next((j for j, r in enumerate(keep) if r != j), len(keep))
        n = self.length
        if first < len(keep):
            src = indices[first:]  # [m - first] rows that move down
            self.k_live[first:len(keep), :, :n] = self.k_live[src, :, :n]
            self.v_live[first:len(keep), :, :n] = self.v_live[src, :, :n]
        self.k_live, self.v_live = self.k_live[:len(keep)], self.v_live[:len(keep)]
        self._views()


def preallocated_cache(capacity: int = 0, rows: int = 0) -> Cache:
    """A cache for the sampler whose layers live in buffers of `capacity` positions and
    `rows` rows (0: grow in place as needed), see PreallocatedLayer."""
    return Cache(layer_class_to_replicate=functools.partial(PreallocatedLayer, capacity, rows))


def _cache_layer(cache: Cache, i: int) -> PreallocatedLayer:
    """Layer i of `cache`, created first if the cache has no layer i yet."""
    while len(cache.layers) <= i:  # what Cache.update does for a new layer index
        cache.layers.append(cache.layer_class_to_replicate())
    return cache.layers[i]


# ----------------------------------------------------------------------------------------
# Prefill: shared text once, the rest in batches of similar length


def unique_prompts(prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """(the distinct prompts in order of first appearance, each row's index among them)."""
    first_of: dict[tuple[int, ...], int] = {}
    src = [first_of.setdefault(tuple(p), len(first_of)) for p in prompts]  # row -> its unique prompt
    return [list(p) for p in first_of], src


def prefill_prompts(model, prompts: list[list[int]], pad_id: int, extra: int = 0, max_tokens: int | None = None):
    """The sampler's prefill: (logits [n, V] of each prompt's last token, mask [n, S], the
    cache, allocated once with room for `extra` more positions per row). Identical
    prompts (the G rollouts of a query at turn one) run once; their rows are copied
    afterwards and then draw their own tokens. max_tokens caps what one forward holds
    (prefill)."""
    dev = next(model.parameters()).device
    unique, src = unique_prompts(prompts)
    shareable = [len(p) - 1 for p in unique]
    cache = preallocated_cache(layout(unique, shareable).width + extra, len(prompts))
    logits, mask = prefill(model, unique, pad_id, cache, logits_to_keep=1, shareable=shareable,
                           max_tokens=max_tokens)
    logits = logits[:, -1, :]  # [u, V]
    if len(unique) < len(prompts):
        for layer in cache.layers:
            layer.spread(src)  # [u, H, S, D] -> [n, H, S, D] in every layer
        rows = torch.tensor(src, device=dev)  # [n]
        logits, mask = logits[rows], mask[rows]  # [n, V], [n, S]
    return logits, mask, cache


@dataclass
class Layout:
    """How prefill lays out its rows (see there): each row holds
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


def prefill(model, seqs: list[list[int]], pad_id: int, cache, logits_to_keep: int,
            shareable: list[int], hidden: bool = False, max_tokens: int | None = None):
    """Run token sequences as one batch; return (logits [n, logits_to_keep, V], mask [n, S]).
    hidden=True returns the last hidden states [n, logits_to_keep, d] instead (what the
    output layer would turn into those logits: chunked_logprobs does it piece by piece).

    Rows share text, and shared text is computed once (keys and values of a token depend
    only on the tokens before it). `shareable[r]` is how many leading tokens of row r may
    be computed with other rows: the rest need their own logits (the sampler: the last
    token; the trainer: the last prompt token and the action). Two levels:
      * the prefix ALL rows start with (a module's instructions and tool cards) runs once
        at batch 1: P positions;
      * a shared group, rows that share more than that (the G rollouts of a query share
        the question; the trainer's G actions share their whole prompt), runs its shared
        part once: the groups' parts run together as one left-padded batch behind the
        prefix;
    then every row's own rest runs behind its prefix and shared part. Each row is laid out
      [prefix (P) | pads, shared part | pads, own rest (L)],   S = P + shared_width + L,
    with its tokens in the last columns of each block (shared_width: the longest shared
    part). Pads are masked out and skipped by the position ids, so each row computes
    exactly what it would alone. The sampler and the trainer (flow_grpo.token_logprobs)
    both lay rows out through this one function; it is differentiable, so the trainer's
    shared text is computed once too. The plain version (agentflow.prefill) runs the
    common prefix once and the rest as one batch.

    Padding is work too: a pad runs through every layer like a token. When the rests'
    lengths differ a lot (a 30-token question beside an 80-token one, an empty memory
    beside a full one), the rows are split into batches of similar length
    (`length_groups`) and each batch runs as its own left-padded forward; the batches'
    keys and values are then laid out as if they had run together. `cache` (empty on
    entry; None if only the logits are wanted, as in the trainer) ends up holding every
    row's keys and values; the sampler's cache is a preallocated_cache, into which each
    batch's keys and values are written as soon as it has run.

    max_tokens (the sampler under a memory plan) caps one forward: rows x (cached + new
    positions) <= max_tokens, by splitting batches of rests and of shared parts into
    fewer rows and running a single row's long text in pieces. It changes which forwards
    run, not what each row computes.
    """
    n, dev = len(seqs), next(model.parameters()).device
    row_layout = layout(seqs, shareable)
    P, rest, shared_width = row_layout.prefix_len, row_layout.rest, row_layout.shared_width
    shared_groups, shared_parts, group_of = row_layout.shared_groups, row_layout.shared_parts, row_layout.group_of
    # Each row's mask over the positions it finds cached: [prefix | its group's shared part].
    pre_mask = torch.ones((n, P + shared_width), dtype=torch.long, device=dev)  # 1 = real token
    part_masks = left_padded(shared_parts + [[]], shared_width, pad_id, dev)[1]  # [groups+1, shared_width]
    pre_mask[:, P:] = part_masks[group_of]  # [n, shared_width] each row's shared part (in no group: all pads)
    batches = length_groups([len(s) for s in rest])
    if max_tokens:
        batches = [run for rows in batches
                   for run in _capped(rows, P + shared_width + max(len(rest[r]) for r in rows), max_tokens)]

    one_batch = len(batches) == 1 and not shared_groups
    work = cache if one_batch and cache is not None else DynamicCache()
    if P:
        if max_tokens and P > max_tokens:
            _run_rest(model, [seqs[0][:P]], pre_mask.new_ones(1, 0), pad_id, work, 1, max_tokens=max_tokens)
        else:
            prefix = torch.tensor([seqs[0][:P]], device=dev)  # [1, P]
            model(input_ids=prefix, cache=work, use_cache=True, logits_to_keep=1)  # work: [1, H, P, D] a layer
    if one_batch:  # one batch: run it in the caller's cache
        if P:
            work.batch_repeat_interleave(n)  # [1, H, P, D] -> [n, H, P, D] in every layer
        logits, suffix_mask = _run_rest(model, rest, pre_mask, pad_id, work, logits_to_keep, hidden, max_tokens)
        return logits, torch.cat([pre_mask, suffix_mask], dim=-1)
    if cache is not None:
        return _prefill_into(model, row_layout, pre_mask, batches, work, cache, pad_id, logits_to_keep, hidden,
                             max_tokens)
    # The trainer: keys and values each row finds before its rest: one entry per shared
    # group, and a last one (prefix, then shared_width pads) for rows in no group. Per
    # layer: ([groups+1, H, P+shared_width, D], same); without shared groups that is the
    # prefix alone, [1, H, P, D], and every row's entry is 0.
    cached_kv = [(layer.keys, layer.values) for layer in work.layers] if P else []  # [1, H, P, D] each
    if shared_groups:
        shared_cache = DynamicCache()
        for i, (k, v) in enumerate(cached_kv):  # the prefix, copied to every shared group
            shared_cache.update(k.expand(len(shared_parts), -1, -1, -1), v.expand(len(shared_parts), -1, -1, -1), i)
        _run_rest(model, shared_parts, pre_mask.new_ones(len(shared_parts), P), pad_id, shared_cache, 1,
                  hidden)  # [groups, H, P+shared_width, D] a layer
        no_group = lambda t: F.pad(t[:1, :, :P], (0, 0, 0, shared_width))  # [1, H, P+shared_width, D]: prefix, zeros
        cached_kv = [(torch.cat([layer.keys, no_group(layer.keys)]), torch.cat([layer.values, no_group(layer.values)]))
                     for layer in shared_cache.layers]
    # Rows of one shared group read the same entry. k[idx] with repeated indices would do,
    # but on a CPU with more than one thread its backward sums those rows' gradients with
    # atomic float adds, in whatever order the threads get there, so the same step would
    # give other weights in the 7th digit from run to run. stack's backward hands each
    # row its own slice, and autograd adds the slices of one entry in a fixed order.
    cached_kv = [(k.unbind(0), v.unbind(0)) for k, v in cached_kv]  # per layer: groups+1 entries [H, P+shared_width, D]
    logits = []
    for rows in batches:
        batch_cache = DynamicCache()
        for i, (k, v) in enumerate(cached_kv):  # what the batch's rows find cached: [c, H, P+shared_width, D]
            batch_cache.update(torch.stack([k[group_of[r]] for r in rows]),
                               torch.stack([v[group_of[r]] for r in rows]), i)
        out, _ = _run_rest(model, [rest[r] for r in rows], pre_mask[rows], pad_id, batch_cache,
                           logits_to_keep, hidden)  # [c, k<=keep, V]
        logits.append(F.pad(out, (0, 0, logits_to_keep - out.shape[1], 0)))  # [c, keep, V]
    back = torch.argsort(torch.tensor([r for rows in batches for r in rows], device=dev))  # batch order -> row order
    L = max(len(s) for s in rest)
    suffix_mask = left_padded(rest, L, pad_id, dev)[1]  # [n, L] each row's rest, right-aligned
    return torch.cat(logits)[back], torch.cat([pre_mask, suffix_mask], dim=-1)


def _capped(rows: list[int], width: int, max_tokens: int) -> list[list[int]]:
    """`rows` in runs of at most max_tokens // width rows (at least one)."""
    per_run = max(1, max_tokens // max(width, 1))
    return [rows[i:i + per_run] for i in range(0, len(rows), per_run)]


@torch.no_grad()
def _prefill_into(model, row_layout: Layout, pre_mask, batches, work, cache, pad_id: int, logits_to_keep: int,
                  hidden: bool, max_tokens: int | None):
    """prefill's layout written straight into the sampler's cache, allocated once at its
    final size: first every row's [prefix | shared part], then each batch's rests right
    after the batch has run, so that besides the final cache only one batch of shared
    parts or of rests has its keys and values at a time."""
    n, dev = len(row_layout.rest), pre_mask.device
    P, shared_width = row_layout.prefix_len, row_layout.shared_width
    K = P + shared_width  # the positions before each row's rest
    L = max(len(s) for s in row_layout.rest)
    S = K + L
    if P:  # every row: the prefix, then zeros where a shared part would go (masked pads)
        for i, src in enumerate(work.layers):
            k, v = src.keys[:1, :, :P], src.values[:1, :, :P]  # [1, H, P, D]
            layer = _cache_layer(cache, i)
            layer.put(slice(None), 0, k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1), n, S)
            if shared_width:
                layer.put(slice(None), P, k.new_zeros(n, k.shape[1], shared_width, k.shape[3]),
                          v.new_zeros(n, v.shape[1], shared_width, v.shape[3]), n, S)
    if row_layout.shared_groups:
        all_groups = list(range(len(row_layout.shared_groups)))
        for chunk in (_capped(all_groups, K, max_tokens) if max_tokens else [all_groups]):
            shared_cache = DynamicCache()
            for i, src in enumerate(work.layers):  # the prefix, copied to every shared group of the chunk
                shared_cache.update(src.keys[:1, :, :P].expand(len(chunk), -1, -1, -1),
                                    src.values[:1, :, :P].expand(len(chunk), -1, -1, -1), i)
            _run_rest(model, [row_layout.shared_parts[g] for g in chunk], pre_mask.new_ones(len(chunk), P), pad_id,
                      shared_cache, 1, hidden, max_tokens)  # [c, H, P+width_c, D] a layer
            for i, src in enumerate(shared_cache.layers):
                layer = _cache_layer(cache, i)
                k, v = src.keys[:, :, P:], src.values[:, :, P:]  # [c, H, width_c, D] the shared parts
                if layer.k_live is None:  # no prefix: zeros first, as masked pads before short parts
                    layer.put(slice(None), 0, k.new_zeros(n, k.shape[1], shared_width, k.shape[3]),
                              v.new_zeros(n, v.shape[1], shared_width, v.shape[3]), n, S)
                at = K - k.shape[2]  # right-aligned in [P, K), like one batch padded to shared_width
                for j, g in enumerate(chunk):
                    rows = torch.tensor(row_layout.shared_groups[g][0], device=dev)
                    layer.put(rows, at, k[j:j + 1].expand(len(rows), -1, -1, -1),
                              v[j:j + 1].expand(len(rows), -1, -1, -1), n, S)
            del shared_cache
    logits = []
    for rows in batches:
        idx = torch.tensor(rows, device=dev)  # [c]
        batch_cache = DynamicCache()
        for i, layer in enumerate(cache.layers if K else []):  # what the batch's rows find cached: [c, H, K, D]
            batch_cache.update(layer.k_live[idx, :, :K], layer.v_live[idx, :, :K], i)
        out, rest_mask = _run_rest(model, [row_layout.rest[r] for r in rows], pre_mask[rows], pad_id, batch_cache,
                                   logits_to_keep, hidden, max_tokens)  # [c, k<=keep, V], [c, L_c]
        logits.append(F.pad(out, (0, 0, logits_to_keep - out.shape[1], 0)))  # [c, keep, V]
        Lc = rest_mask.shape[1]  # the batch's longest rest
        for i, src in enumerate(batch_cache.layers):  # [cached | zeros as extra pads | batch's pads, rest]
            layer = _cache_layer(cache, i)
            k, v = src.keys[:, :, K:], src.values[:, :, K:]  # [c, H, L_c, D]
            if Lc < L:
                layer.put(idx, K, k.new_zeros(len(rows), k.shape[1], L - Lc, k.shape[3]),
                          v.new_zeros(len(rows), v.shape[1], L - Lc, v.shape[3]), n, S)
            layer.put(idx, S - Lc, k, v, n, S)
        del batch_cache
    back = torch.argsort(torch.tensor([r for rows in batches for r in rows], device=dev))  # batch order -> row order
    suffix_mask = left_padded(row_layout.rest, L, pad_id, dev)[1]  # [n, L]
    return torch.cat(logits)[back], torch.cat([pre_mask, suffix_mask], dim=-1)


def _run_rest(model, rest: list[list[int]], pre_mask: torch.Tensor, pad_id: int, cache, logits_to_keep: int,
              hidden: bool = False, max_tokens: int | None = None):
    """Left-padded forward of `rest` behind the K positions already in `cache` (pre_mask
    [c, K]: which of them are real tokens): logits [c, min(logits_to_keep, L), V] (hidden:
    the last hidden states [c, min(logits_to_keep, L), d]) and the mask [c, L] of the rest,
    for L the longest. With max_tokens, columns run in pieces of at most max_tokens // c
    tokens a row (each piece attends to the cache and the pieces before it)."""
    ids, mask = left_padded(rest, max(len(s) for s in rest), pad_id, next(model.parameters()).device)  # [c, L] each
    K, L = pre_mask.shape[1], ids.shape[1]
    full = torch.cat([pre_mask, mask], dim=-1)  # [c, K+L]
    pos = (full.cumsum(-1) - 1).clamp(min=0)[:, K:]  # [c, L] each token's position in its sequence
    piece = max(1, max_tokens // len(rest)) if max_tokens else L  # columns per forward
    for start in range(0, L, piece):
        end = min(L, start + piece)
        keep = min(logits_to_keep, end - start)
        if hidden:  # the decoder without its output layer (Llama, Qwen2, GPT-2 all expose it as base_model)
            out = model.base_model(input_ids=ids[:, start:end], attention_mask=full[:, :K + end],
                                   position_ids=pos[:, start:end], cache=cache, use_cache=True)
            last = out.last_hidden_state[:, -keep:]
        else:
            last = model(input_ids=ids[:, start:end], attention_mask=full[:, :K + end], position_ids=pos[:, start:end],
                         cache=cache, use_cache=True, logits_to_keep=keep).logits
    return last, mask


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


# ----------------------------------------------------------------------------------------
# The decode step


# Decoders whose layers are exactly what decode_step writes out: pre-norm blocks of RMSNorm,
# attention with rotary embeddings and grouped KV heads, and a gated MLP. (Qwen2 adds
# biases to q/k/v; the module's own bias is used. Sliding-window attention is not
# written out: Qwen2.5 configs leave it off.) Anything else uses the HF forward.
DECODE_STEP_MODELS = ("llama", "qwen2")


def choose_decode(model) -> str:
    """The name of the fastest way this machine decodes one token for `model`: "forward"
    (the model's own forward, agentflow.decode), "step" (decode_step, its linears as
    nn.Linear computes them, x @ W^T) or "step_transposed" (decode_step with every linear
    as W @ x^T). A layout that wins on one CPU loses on another, so it is measured: once
    per machine, torch version, thread count, device, dtype and model shape, then
    remembered in the cache folder (engine.json), so every later run on this machine
    takes the same path and stays repeatable. The AGENTFLOW_DECODE environment variable
    (forward | step | step_transposed | step_static) overrides the measurement. On a GPU
    the choice is the static step (decode_step_static, a CUDA graph), unmeasured; on a
    CPU, where it only adds attention over empty columns, it is never chosen unless asked."""
    names = ("forward", *DECODE_STEPS)
    forced = os.environ.get("AGENTFLOW_DECODE", "")
    if forced and forced not in names:
        raise ValueError(f"AGENTFLOW_DECODE must be one of {', '.join(names)}, not {forced!r}")
    covered = model.config.model_type in DECODE_STEP_MODELS and not getattr(model.config, "use_sliding_window", False)
    if not covered:
        return "forward"
    if forced:
        return forced
    if next(model.parameters()).device.type == "cuda":
        # A GPU's eager step is bound by launching its ~2,000 kernels, not by running them:
        # the static step (one graph replay) wins at every size measured (docs/LOG.md).
        return "step_static"
    key = _machine_key(model)
    if _CHOICES.get(key) not in names:
        _CHOICES.update(_read_choices())
    if _CHOICES.get(key) not in names:  # never measured here (or under an older name)
        _CHOICES[key] = _measure_decode(model)
        _write_choices()
        print(f"decode step measured on this machine: {_CHOICES[key]} ({key}); "
              f"remembered in {_choices_path()}", flush=True)
    return _CHOICES[key]


_CHOICES: dict[str, str] = {}  # machine key -> the decode way it measured fastest


def _choices_path() -> Path:
    return cache_home() / "engine.json"


def cpu_name() -> str:
    """The model name of this machine's first CPU (what decides, e.g., which matmul layout
    its BLAS runs faster), or what the platform says where /proc/cpuinfo has none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _machine_key(model) -> str:
    param = next(model.parameters())
    cpu = cpu_name()
    if param.device.type == "cuda":
        cpu = torch.cuda.get_device_name(param.device)
    cfg = model.config
    return (f"{cpu} | torch {torch.__version__} | threads {torch.get_num_threads()} | "
            f"{param.device.type} {param.dtype} | "
            f"{cfg.model_type} h{cfg.hidden_size} L{cfg.num_hidden_layers} V{cfg.vocab_size}")


def _read_choices() -> dict:
    try:
        return json.loads(_choices_path().read_text())
    except (OSError, ValueError):
        return {}


def _write_choices() -> None:
    path = _choices_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**_read_choices(), **_CHOICES}, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:  # a read-only home: measure again next time, nothing else changes
        pass


@torch.no_grad()
def _measure_decode(model, rows: int = 32, context: int = 8, rounds: int = 5) -> str:
    """Time one decode step of `rows` rows behind a short cache with each way, the ways
    interleaved round by round and each way's fastest round kept (a busy machine slows
    single calls, never speeds them up); the fastest way wins, and a step within 3% of
    the model's own forward loses to it."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (rows, context + 1), generator=gen).to(dev)  # [b, c+1]
    cache = DynamicCache()
    model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
    tok, pos = ids[:, context], torch.full((rows, 1), context, device=dev)  # [b], [b, 1]
    mask = torch.ones((rows, context + 1), dtype=torch.long, device=dev)  # [b, c+1]
    forward = lambda model, tok, pos, mask, cache: model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos,
                                                         cache=cache, use_cache=True)
    ways = {"forward": forward, **{name: DECODE_STEPS[name] for name in MEASURED_DECODE_STEPS}}
    best = {name: float("inf") for name in ways}
    for r in range(rounds + 1):  # round 0 warms every way up
        for name, fn in ways.items():
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(model, tok, pos, mask, cache)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if r:
                best[name] = min(best[name], time.perf_counter() - t0)
            cache.crop(-1)  # drop the new position: back to the prefix for the next timing
    fastest = min(best, key=best.get)
    return fastest if best[fastest] < 0.97 * best["forward"] else "forward"


def decode_step(model, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache,
                linear=lambda x, lin: lin(x)) -> torch.Tensor:
    """One new token per row through a Llama or Qwen2 decoder: logits [b, V].

    tok [b] the previous token of each row, pos [b, 1] its position, mask [b, S] the
    key mask (1 = a real token; the last column is tok itself), cache the rows' keys and
    values so far. This is the model's own forward for a single position, with its own
    weights and modules (norms, rotary table, activation), minus what a general forward
    pays at every step: building a 4-D mask, dispatching attention, wrapping outputs.
    Two things can make it faster than the same arithmetic in the HF forward:
      * `linear` computes one linear layer: nn.Linear's x @ W^T by default, W @ x^T in
        decode_step_transposed: the same product, but some CPUs' BLAS runs the [out, in]
        x [in, b] shape much faster for a few dozen rows, and others much slower
        (`python -m scripts.speed_bench`, its `linear_only_*` figures); choose_decode picks;
      * attention groups the query heads by their KV head ([b, kv, g, D] against
        [b, kv, S, D]), so grouped keys and values are read as they are in the cache,
        never repeated per query head.
    Same math as the HF forward, but not the same summation order: log-probs agree to
    ~1e-5 in fp32 (tests/test_sampler.py), greedy tokens are the same.
    """
    dtype = model.model.embed_tokens.weight.dtype  # the residual stream's
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)  # [b, S]
    bias = bias.masked_fill(mask == 0, torch.finfo(dtype).min)[:, None, None, :]  # [b, 1, 1, S]
    return _decode_layers(model, tok, pos, bias, lambda i, k, v: cache.update(k, v, i), linear)


def _decode_layers(model, tok: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor, write_kv,
                   linear=lambda x, lin: lin(x)) -> torch.Tensor:
    """The arithmetic of decode_step, shared with the static step (StaticDecoder), so that
    both run the same modules in the same order: logits [b, V]. bias [b, 1, 1, S] is 0
    where a row may attend and the dtype's minimum elsewhere; write_kv(i, k, v) stores
    layer i's new keys and values [b, kv, 1, D] and returns the keys and values to attend
    over, [b, kv, S, D] each."""
    decoder = model.model
    b = tok.shape[0]
    x = decoder.embed_tokens(tok)  # [b, h] the residual stream
    cos, sin = decoder.rotary_emb(x, pos)  # [b, 1, D] each
    for i, layer in enumerate(decoder.layers):
        attn = layer.self_attn
        D, kv_heads = attn.head_dim, attn.config.num_key_value_heads
        h = layer.input_layernorm(x)  # [b, h]
        q = linear(h, attn.q_proj).view(b, -1, 1, D)  # [b, H, 1, D]
        k = linear(h, attn.k_proj).view(b, kv_heads, 1, D)  # [b, kv, 1, D]
        v = linear(h, attn.v_proj).view(b, kv_heads, 1, D)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        keys, values = write_kv(i, k, v)  # [b, kv, S, D]: the new position written in place
        q = q.view(b, kv_heads, -1, D)  # [b, kv, g, D]: the g query heads that share each KV head
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=bias,
                                                               scale=attn.scaling)  # [b, kv, g, D]
        x = x + linear(out.reshape(b, -1), attn.o_proj)  # [b, h]
        h = layer.post_attention_layernorm(x)
        mlp = layer.mlp
        x = x + linear(mlp.act_fn(linear(h, mlp.gate_proj)) * linear(h, mlp.up_proj), mlp.down_proj)
    return linear(decoder.norm(x), model.lm_head)  # [b, V]


def decode_step_transposed(model, tok, pos, mask, cache) -> torch.Tensor:
    """decode_step with every linear computed as W @ x^T (linear_transposed)."""
    return decode_step(model, tok, pos, mask, cache, linear=linear_transposed)


def linear_transposed(x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    """lin(x) for x [b, in] -> [b, out], computed as (W [out, in] @ x^T [in, b])^T."""
    y = torch.mm(lin.weight, x.t()).t()  # [b, out], a transposed view
    return (y + lin.bias if lin.bias is not None else y).contiguous()


# ----------------------------------------------------------------------------------------
# The static decode step: one CUDA graph per step on a GPU


class StaticDecoder:
    """decode_step on fixed shapes and fixed addresses, so that on a GPU a step is one CUDA
    graph replay instead of ~2,000 kernel launches (a 7B model: 28 layers x ~70 small
    kernels), which at a few dozen rows take longer to launch than to run.

    A graph replays the kernels it recorded, with the same shapes and pointers; whatever
    decode_step decides with Python values has to become data in fixed buffers:
      * the new keys and values go into the cache's own buffers [rows, kv, capacity, D]
        (k_buffer, v_buffer: the sampler's prefill allocates them at their final size, so
        they never move) at the column held in a device tensor, `col`, by index_copy_;
      * attention reads ALL `capacity` columns of the first B rows, with a bias [B, 1, 1,
        capacity] that masks pads and the columns not written yet (those are zeroed once
        here: a masked key still enters the sum as exp(min) x value = 0 only if the value
        is finite, and fresh memory can hold NaN);
      * the batch has B rows, fixed. The sampler's b <= B live rows are the first b rows
        of the buffers (batch_select_indices moves kept rows down in place); rows b..B-1
        compute garbage that nobody reads, until b <= B / 2, when decode_step_static makes
        a new StaticDecoder of b rows (a new capture).
    tok, pos, bias and col are copied into their static buffers before each step; the
    logits come out of a static buffer. On a CPU the same step runs eagerly, step by step
    (what tests/test_graph_decode.py compares with decode_step); on a GPU it is captured
    once and replayed. A StaticDecoder serves one cache: its graph holds that cache's
    buffer addresses (decode_step_static keeps one per cache and forgets it with the cache).
    """

    runs = 0  # static steps run, all instances together (tests: proof the static way ran)
    setups = 0  # StaticDecoders made (on a GPU: graphs captured)
    WARMUP = 3  # eager runs on a side stream before a capture, as torch.cuda.graph's docs ask

    def __init__(self, model, layers: list[PreallocatedLayer], rows: int):
        first = layers[0]
        if any(layer.k_live.data_ptr() != layer.k_buffer.data_ptr() for layer in layers):
            raise RuntimeError("the live rows must be the first rows of the cache's buffers")
        dev, capacity, written = first.k_buffer.device, first.k_buffer.shape[2], first.length
        dtype = model.model.embed_tokens.weight.dtype  # the residual stream's, as in decode_step
        self.model, self.rows, self.min = model, rows, torch.finfo(dtype).min
        self.buffers = [(layer.k_buffer, layer.v_buffer) for layer in layers]  # to notice a move (_move)
        self.tok = torch.zeros(rows, dtype=torch.long, device=dev)  # [B] each row's previous token
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=dev)  # [B, 1] its position
        self.bias = torch.full((rows, 1, 1, capacity), self.min, dtype=dtype, device=dev)  # [B, 1, 1, C] 0 = attend
        self.col = torch.zeros(1, dtype=torch.long, device=dev)  # [1] the column the new position goes to
        self.k = [k[:rows] for k, _ in self.buffers]  # [B, kv, C, D] views: fixed addresses
        self.v = [v[:rows] for _, v in self.buffers]
        for k, v in zip(self.k, self.v):  # not written yet: finite (see above)
            k[:, :, written:].zero_()
            v[:, :, written:].zero_()
        self.graph, self.logits = None, None  # logits [B, V]: the output of the last step
        StaticDecoder.setups += 1

    def _step(self) -> torch.Tensor:
        """decode_step's arithmetic on the static buffers: logits [B, V]."""
        def write_kv(i, k, v):  # k, v [B, kv, 1, D] into column col; attend over all C columns
            return self.k[i].index_copy_(2, self.col, k), self.v[i].index_copy_(2, self.col, v)  # [B, kv, C, D]
        return _decode_layers(self.model, self.tok, self.pos, self.bias, write_kv)

    def __call__(self, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """decode_step(tok [b], pos [b, 1], mask [b, S]) for b <= B rows: logits [b, V].
        Writes the new position into column S - 1 of the buffers' first B rows."""
        b, S = mask.shape
        self.tok[:b].copy_(tok)
        self.pos[:b].copy_(pos)
        bias = torch.zeros(mask.shape, dtype=self.bias.dtype, device=mask.device)  # [b, S]
        self.bias[:b, 0, 0, :S] = bias.masked_fill_(mask == 0, self.min)  # columns S.. stay masked
        self.col.fill_(S - 1)  # a kernel with a scalar argument: no wait for the device
        if self.tok.device.type == "cuda":
            if self.graph is None:
                self._capture()
            self.graph.replay()
        else:
            self.logits = self._step()
        StaticDecoder.runs += 1
        return self.logits[:b].clone()  # the next step overwrites self.logits

    def _capture(self) -> None:
        """Record one step as a CUDA graph; self.logits becomes its output buffer. The
        warm-up runs first, on a side stream (cuBLAS workspaces, lazy initialisation and
        kernel choices happen there, never inside the capture). Every run writes the same
        keys and values into column col as the replay will: repeating a step changes
        nothing."""
        with torch.cuda.device(self.tok.device):
            current, side = torch.cuda.current_stream(), torch.cuda.Stream()
            side.wait_stream(current)  # the inputs copied above are ready
            with torch.cuda.stream(side):
                for _ in range(self.WARMUP):
                    self._step()
            current.wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._step()  # [B, V] in the graph's own memory pool, rewritten by each replay


# The StaticDecoder of each cache: weakly keyed, so that it goes with its cache (and its
# graph with it): a graph never outlives the buffers it writes, and a new cache (a new
# sub-batch, a new sample call) always gets a new one.
_STATIC: "weakref.WeakKeyDictionary[Cache, StaticDecoder]" = weakref.WeakKeyDictionary()


def decode_step_static(model, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
    """decode_step through the cache's StaticDecoder: a CUDA graph on a GPU, the same step
    run eagerly on a CPU; logits [b, V]. `cache` is the sampler's (speed.prefill_prompts's
    preallocated_cache, planned with room for every new token). choose_decode's choice on
    a GPU; on a CPU only when asked (AGENTFLOW_DECODE=step_static or LLM.use_decode)."""
    layers = cache.layers
    if not layers or not all(isinstance(layer, PreallocatedLayer) and layer.k_live is not None for layer in layers):
        raise TypeError("step_static decodes from the fast prefill's cache (speed.preallocated_cache) only")
    b, S = mask.shape  # S - 1 positions cached; the new one goes to column S - 1
    if layers[0].length != S - 1:
        raise ValueError(f"the cache holds {layers[0].length} positions, the mask {S - 1}")
    if S > layers[0].k_buffer.shape[2]:  # more positions than planned: grow (new buffers: a new capture below)
        for layer in layers:
            layer._move(2 * S)
    static = _STATIC.get(cache)
    if (static is None or not b <= static.rows < 2 * b  # first step, or half the rows or fewer left
            or any(layer.k_buffer is not k for layer, (k, _) in zip(layers, static.buffers))):  # moved
        static = _STATIC[cache] = StaticDecoder(model, layers, b)
    logits = static(tok, pos, mask)  # [b, V]
    for layer in layers:  # one position more, as cache.update leaves it (batch_select_indices reads length)
        layer.length = S
        layer._views()
    return logits


# The written-out decode steps by name (choose_decode, AGENTFLOW_DECODE, run.json's "decode").
# choose_decode measures MEASURED_DECODE_STEPS on a CPU; on a GPU it takes step_static.
DECODE_STEPS = {"step": decode_step, "step_transposed": decode_step_transposed, "step_static": decode_step_static}
MEASURED_DECODE_STEPS = ("step", "step_transposed")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [b, heads, 1, D] at each row's position (cos, sin [b, 1, D]):
    the pairs (x_j, x_{j+D/2}) are rotated by the position's angle for that frequency."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]



# ----------------------------------------------------------------------------------------
# The trainer's log-probs, chunk by chunk


class _ChunkedLogprobs(torch.autograd.Function):
    """log softmax(h W^T / T)[target] and the entropy of that softmax, for positions h
    [M, d], computed `chunk` positions at a time, so that no more than [chunk, V] logits
    ever exist. Backward recomputes each chunk's logits: with z = h W^T / T and
    p = softmax(z), d log p[target] / d z = onehot(target) - p, so
        d h = ((onehot - p) * g / T) @ W,    d W = ((onehot - p) * g / T)^T @ h,
    for g the incoming gradient of each position's log-prob. The logits are computed as
    nn.Linear does, in the model's dtype, then cast to float32 (as the plain path's
    `.float()`); the gradient goes back through that cast as autograd's would, rounded to
    the model's dtype before the two products. d W is summed over chunks in float32."""

    @staticmethod
    def forward(ctx, h, weight, bias, targets, temperature: float, chunk: int):
        M = h.shape[0]
        logp = torch.empty(M, dtype=torch.float32, device=h.device)  # [M]
        entropy = torch.empty(M, dtype=torch.float32, device=h.device)  # [M]
        for start in range(0, M, chunk):
            end = start + chunk
            z = F.linear(h[start:end], weight, bias).float() / temperature  # [c, V]
            log_p = torch.log_softmax(z, dim=-1)  # [c, V]
            logp[start:end] = log_p.gather(-1, targets[start:end, None])[:, 0]
            entropy[start:end] = -(log_p.exp() * log_p).sum(-1)
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
        return (grad_h, grad_w.to(weight.dtype) if want_w else None, grad_b.to(bias.dtype) if want_b else None,
                None, None, None)


def chunked_logprobs(h: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor, temperature: float,
                     chunk: int):
    """(log-prob of each target [M], entropy [M], no gradient) under softmax(h W^T / T),
    for h [M, d] the hidden states of M positions and W the output layer's weight [V, d]:
    the numbers of the plain path's log_softmax over [M, V] logits, without holding them."""
    if h.shape[0] == 0:
        empty = h.new_zeros(0, dtype=torch.float32)
        return empty + h.sum() * 0, empty  # keeps the graph when no position is scored here
    return _ChunkedLogprobs.apply(h, weight, bias, targets, temperature, max(1, chunk))


def action_logprobs(model, seqs: list[list[int]], prompt_lens: list[int], pad_id: int, targets: torch.Tensor,
                    mask: torch.Tensor, temperature: float, chunk: int, first_cols: torch.Tensor | None = None):
    """The trainer's log-probs of actions, as flow_grpo.token_logprobs' plain path computes
    them, without its [n, La, V] logits. Row i is seqs[i] = prompt + action, prompt_lens[i]
    long; targets, mask [n, La] hold the action tokens right-aligned. Returns (logp [n, La]:
    log softmax(logits / temperature)[target] at every masked position, entropy [n, La] of
    that softmax, no gradient, z0 [n, V]: the float32 logits at column first_cols[i] of each
    row, or None). Columns first_cols are left at 0 in logp and entropy: the caller scores
    them under their own distribution.

    The hidden states at action positions come from `prefill` (text the rows share runs
    once: the module's instructions for all rows, the whole prompt for the G actions
    sampled from it), and chunked_logprobs runs the output layer over `chunk` positions at
    a time, recomputing each chunk's logits in the backward pass."""
    n, La = mask.shape
    dev = mask.device
    h, _ = prefill(model, seqs, pad_id, None, La + 1, [p - 1 for p in prompt_lens], hidden=True)
    h = h[:, :-1]  # [n, La, d] the hidden state that predicts each action token
    scored = mask.bool()  # [n, La] positions scored at `temperature`
    rows = torch.arange(n, device=dev)  # [n]
    if first_cols is not None:
        scored[rows, first_cols] = False
    at = scored.nonzero(as_tuple=True)
    head = model.get_output_embeddings()
    lp, ent = chunked_logprobs(h[at], head.weight, head.bias, targets[at], temperature, chunk)  # [M] each
    logp = torch.zeros((n, La), device=dev).index_put(at, lp)  # [n, La]
    entropy = torch.zeros((n, La), device=dev).index_put(at, ent)
    z0 = head(h[rows, first_cols]).float() if first_cols is not None else None  # [n, V]
    return logp, entropy, z0


# ----------------------------------------------------------------------------------------
# Drawing a token


def draw(weights: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One index per row of weights [b, V] (>= 0, not necessarily summing to 1), drawn
    with probability weights / row sum: inverse-CDF sampling with ONE uniform per row.

    With c the running sum along the row and u uniform on [0, c_V), index i is the one
    with c_{i-1} <= u < c_i, an interval of length w_i: P(i) = w_i / c_V. A zero weight
    is an empty interval, so it is never drawn. torch.multinomial draws the same
    distribution by drawing an exponential for EVERY entry (argmax w_i / E_i): batch x
    vocabulary random numbers a step, where this draws batch many.

    The running sum and the uniform are float64: in float32, once c reaches ~1 every
    weight below its rounding step (~6e-8) adds nothing, so with a 152k vocabulary tens
    of thousands of tail tokens would get intervals of width zero and could never be
    drawn; float64 resolves weights down to ~1e-16 of the total."""
    c = weights.cumsum(-1, dtype=torch.float64)  # [b, V] non-decreasing: adding w >= 0 never lowers a float sum
    u = torch.rand(c.shape[0], 1, generator=gen, device=c.device, dtype=c.dtype) * c[:, -1:]  # [b, 1]
    tok = torch.searchsorted(c, u, right=True)[:, 0]  # [b] how many c_i <= u: the first i with c_i > u
    # u rounded up to c_V (odds ~1e-16 a draw): no c_i exceeds it; u then sits at the end of the
    # last interval with weight. On a GPU the fix is applied to every row (it changes no other
    # row: there tok <= last already), so that no step waits for the device to ask "any?".
    if c.device.type != "cpu" or bool((tok == c.shape[-1]).any()):
        last = c.shape[-1] - 1 - (weights.flip(-1) > 0).int().argmax(-1)
        tok = torch.minimum(tok, last)
    return tok
