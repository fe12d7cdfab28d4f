"""The sampler's KV cache: one buffer per layer, allocated once at its final size and
written in place (engine.py's steps 1 and 5). Beneath the method: how keys and values are
stored changes no number the sampler computes, only how often memory is copied.

transformers' DynamicLayer appends each new token with torch.cat, which copies the
whole cache of every layer at every decode step; at a few dozen rows of a small model
that is as much memory traffic as reading the weights (the in-place cache was worth
1.14x on the default run, docs/LOG.md).
"""

import functools

import torch
from transformers.cache_utils import Cache, DynamicLayer

class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in a buffer allocated with room to grow (the sampler's cache).

    Instead of DynamicLayer's torch.cat (see above), the buffer [rows, H, capacity, D]
    (k_buffer, v_buffer) is written in place, and attention reads a view of its first
    `length` positions and live rows (k_live, v_live). The sampler knows the
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

    def grow(self, capacity: int) -> None:
        """New buffers of `capacity` positions, the cached ones copied: more positions than
        planned (the CUDA-graph decode step, which writes into the buffers itself)."""
        self._move(capacity)

    def set_length(self, length: int) -> None:
        """The first `length` positions now hold keys and values (the CUDA-graph decode step
        wrote them into the buffers itself): the views, and batch_select_indices, see them."""
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


class ReplayLayer(DynamicLayer):
    """One layer of the trainer's cache (engine.last_hidden): the keys and values `held` when
    it is made (a prefix, a shared part, or nothing), and after the forward those followed by
    the forward's own. Unlike DynamicLayer's, an update never appends to what an earlier
    update wrote: it returns held + new. So the same update can run twice, which it must
    when a block is checkpointed (train.grad_checkpoint: the block's forward runs again in
    the backward pass) and gives the same keys and values both times; without
    checkpointing it computes exactly what DynamicLayer does (the same torch.cat)."""

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        super().__init__()
        self.held = None
        if keys is not None:
            self.lazy_initialization(keys, values)
            self.keys, self.values, self.held = keys, values, (keys, values)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.held is None:  # a forward into an empty layer: its own keys and values
            self.keys, self.values = key_states, value_states
        else:  # [b, H, held + new, D]
            self.keys = torch.cat([self.held[0], key_states], dim=-2)
            self.values = torch.cat([self.held[1], value_states], dim=-2)
        return self.keys, self.values


def replay_cache(held: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> Cache:
    """The trainer's cache: one ReplayLayer a layer holding (keys, values) of `held` (none: an
    empty cache, filled by the first forward)."""
    if not held:
        return Cache(layer_class_to_replicate=ReplayLayer)
    return Cache(layers=[ReplayLayer(k, v) for k, v in held])


def preallocated_cache(capacity: int = 0, rows: int = 0) -> Cache:
    """A cache for the sampler whose layers live in buffers of `capacity` positions and
    `rows` rows (0: grow in place as needed), see PreallocatedLayer."""
    return Cache(layer_class_to_replicate=functools.partial(PreallocatedLayer, capacity, rows))


def cache_layer(cache: Cache, i: int) -> PreallocatedLayer:
    """Layer i of `cache`, created first if the cache has no layer i yet."""
    while len(cache.layers) <= i:  # what Cache.update does for a new layer index
        cache.layers.append(cache.layer_class_to_replicate())
    return cache.layers[i]
