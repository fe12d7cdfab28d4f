"""The engine's speed work: what makes sampling and the update fast on a CPU, behind
the plain path of agentflow.py, which is the reference (tests/test_sampler.py and
tests/test_flow_grpo.py prove the two give the same tokens, log-probs and gradients).

Nothing here changes WHAT is computed; each part changes how much work it takes:

  * RoomyLayer: the sampler's KV cache grows in place instead of being re-concatenated
    at every step, and finished rows move down inside the same buffer.
  * prefill: beyond the prefix all rows share, rows that share more (a family: the G
    rollouts of a query share its question; the trainer's G actions share their whole
    prompt) run that part once; the rest runs in groups of similar length, so padding
    costs little (length_groups). prefill_prompts also runs identical prompts once.
  * decode_step: one decode position written out for Llama and Qwen2 decoders, without
    the general forward's per-step overhead; its linears as W @ x^T or x @ W^T,
    whichever this machine runs faster (choose_decode measures it once).
  * draw: inverse-CDF sampling, one uniform per row instead of torch.multinomial's
    random number per vocabulary entry.

Measured effects, machine by machine, are in bench.py's output and docs/LOG.md.
"""

import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

# ----------------------------------------------------------------------------------------
# The cache


class RoomyLayer(DynamicLayer):
    """One layer's keys and values in a buffer with room to grow (the sampler's cache).

    Hugging Face's DynamicLayer appends each new token with torch.cat, which copies the
    WHOLE cache of every layer at every decode step: for a small model at a large batch
    that is as much memory traffic as reading the weights. Here the buffer [b, H, capacity, D] is written in place and attention
    reads a view of its first `length` positions; the capacity doubles when full, so
    growing costs O(1) per token amortised. Dropping finished rows (batch_select_indices)
    moves the rows behind them down inside the same buffer. Masks and positions are
    untouched: to the model this is a DynamicLayer whose tensors happen to live inside a
    bigger buffer.
    """

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length, self.k_buf, self.v_buf = 0, None, None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, s = self.length, key_states.shape[-2]
        if self.k_buf is None:  # first call (the prefill): room for as many new positions again
            b, H, _, D = key_states.shape
            self.k_buf = key_states.new_empty((b, H, 2 * s, D))
            self.v_buf = value_states.new_empty((b, H, 2 * s, value_states.shape[-1]))
        elif n + s > self.k_buf.shape[-2]:
            self._move(2 * (n + s))
        self.k_buf[:, :, n:n + s] = key_states  # [b, H, s, D] into the free slots
        self.v_buf[:, :, n:n + s] = value_states
        self.length = n + s
        self._views()
        return self.keys, self.values  # [b, H, n+s, D] views, no copy

    def _views(self) -> None:
        self.keys, self.values = self.k_buf[:, :, :self.length], self.v_buf[:, :, :self.length]

    def _move(self, capacity: int, rows: torch.Tensor | None = None) -> None:
        """Copy the cached positions (of `rows` only, if given) into new buffers."""
        k, v = self.k_buf[:, :, :self.length], self.v_buf[:, :, :self.length]
        if rows is not None:
            k, v = k[rows], v[rows]
        self.k_buf = k.new_empty((k.shape[0], k.shape[1], capacity, k.shape[3]))
        self.v_buf = v.new_empty((v.shape[0], v.shape[1], capacity, v.shape[3]))
        self.k_buf[:, :, :self.length], self.v_buf[:, :, :self.length] = k, v
        self._views()

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_repeat_interleave(self, repeats: int) -> None:  # the shared prefix -> every row
        if self.get_seq_length() > 0:
            rows = torch.arange(self.k_buf.shape[0], device=self.k_buf.device).repeat_interleave(repeats)
            self._move(self.k_buf.shape[-2], rows)

    def batch_select_indices(self, indices: torch.Tensor) -> None:  # drop finished rows, copy duplicates
        if self.get_seq_length() == 0:
            return
        keep = indices.tolist()
        if any(a >= b for a, b in zip(keep, keep[1:])):  # not a subset in order: new buffers
            self._move(self.k_buf.shape[-2], indices)
            return
        # Dropping finished rows: keep[j] >= j, so row keep[j] moves down to slot j in place.
        # Rows before the first dropped one stay where they are; only the rest is copied,
        # and no new buffer is allocated (first touching a fresh buffer of hundreds of MB
        # costs page faults on every page, more than the copy itself).
        first = next((j for j, r in enumerate(keep) if r != j), len(keep))
        n = self.length
        if first < len(keep):
            src = indices[first:]  # [m - first] rows that move down
            self.k_buf[first:len(keep), :, :n] = self.k_buf[src, :, :n]
            self.v_buf[first:len(keep), :, :n] = self.v_buf[src, :, :n]
        self.k_buf, self.v_buf = self.k_buf[:len(keep)], self.v_buf[:len(keep)]
        self._views()


def roomy_cache() -> Cache:
    """A cache for the sampler whose layers grow in place (RoomyLayer)."""
    return Cache(layer_class_to_replicate=RoomyLayer)


# ----------------------------------------------------------------------------------------
# Prefill: shared text once, the rest in groups of similar length


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


def prefill_prompts(model, prompts: list[list[int]], pad_id: int):
    """The sampler's prefill: (logits [n, V] of each prompt's last token, mask [n, S], the
    cache). Identical prompts (the G rollouts of a query at turn one) run once; their
    rows are copied afterwards and then draw their own tokens."""
    dev = next(model.parameters()).device
    cache = roomy_cache()
    first_of: dict[tuple[int, ...], int] = {}
    src = [first_of.setdefault(tuple(p), len(first_of)) for p in prompts]  # row -> its unique prompt
    unique = [list(p) for p in first_of]
    logits, mask = prefill(model, unique, pad_id, cache, logits_to_keep=1, shareable=[len(p) - 1 for p in unique])
    logits = logits[:, -1, :]  # [u, V]
    if len(unique) < len(prompts):
        rows = torch.tensor(src, device=dev)  # [n]
        cache.batch_select_indices(rows)  # [u, H, S, D] -> [n, H, S, D] in every layer
        logits, mask = logits[rows], mask[rows]  # [n, V], [n, S]
    return logits, mask, cache


def prefill(model, seqs: list[list[int]], pad_id: int, cache, logits_to_keep: int,
            shareable: list[int]):
    """Run token sequences as one batch; return (logits [n, logits_to_keep, V], mask [n, S]).

    Rows share text, and shared text is computed once (keys and values of a token depend
    only on the tokens before it). `shareable[r]` is how many leading tokens of row r may
    be computed with other rows: the rest need their own logits (the sampler: the last
    token; the trainer: the last prompt token and the action). Two levels:
      * the prefix ALL rows start with (a module's instructions and tool cards) runs once
        at batch 1: P positions;
      * a family, rows that share more than that (the G rollouts of a query share the
        question; the trainer's G actions share their whole prompt), runs its shared part
        once: the families run together as one left-padded batch behind the prefix;
    then every row's own rest runs behind its prefix and family part. Each row is laid out
      [prefix (P) | pads, family part (Lq) | pads, own rest (L)],   S = P + Lq + L,
    with its tokens in the last columns of each block. Pads are masked out and skipped by
    the position ids, so each row computes exactly what it would alone. The sampler and
    the trainer (flow_grpo.token_logprobs) both lay rows out through this one function;
    it is differentiable, so the trainer's shared text is computed once too. The plain
    version (agentflow.prefill) runs the common prefix once and the rest as one batch.

    Padding is work too: a pad runs through every layer like a token. When the rests'
    lengths differ a lot (a 30-token question beside an 80-token one, an empty memory
    beside a full one), the rows are split into groups of similar length
    (`length_groups`) and each group runs as its own left-padded batch; the groups' keys
    and values are then laid out as if they had run together. `cache` (empty on entry;
    None if only the logits are wanted) ends up holding every row's keys and values.
    """
    n, dev = len(seqs), next(model.parameters()).device
    P = min(common_prefix_len(seqs), min(shareable)) if n > 1 else 0
    if P < MIN_SHARED:  # too short to be worth a separate forward
        P = 0
    families = shared_families(seqs, shareable, P)  # [(rows, q)]: rows share seqs[rows[0]][P:P+q]
    parts = [seqs[rows[0]][P:P + q] for rows, q in families]  # each family's shared part
    fam_of, rest = [len(families)] * n, [s[P:] for s in seqs]  # no family: the last "family", empty
    for f, (rows, q) in enumerate(families):
        for r in rows:
            fam_of[r], rest[r] = f, seqs[r][P + q:]
    Lq = max(map(len, parts), default=0)
    # Each row's mask over the positions it finds cached: [prefix | its family part].
    pre_mask = torch.ones((n, P + Lq), dtype=torch.long, device=dev)  # [n, P+Lq], 1 = real token
    fam_masks = left_padded(parts + [[]], Lq, pad_id, dev)[1]  # [F+1, Lq]; the last: no family, all pads
    pre_mask[:, P:] = fam_masks[fam_of]  # [n, Lq] each row's family
    groups = length_groups([len(s) for s in rest])

    work = cache if len(groups) == 1 and not families and cache is not None else DynamicCache()
    if P:
        prefix = torch.tensor([seqs[0][:P]], device=dev)  # [1, P]
        model(input_ids=prefix, cache=work, use_cache=True, logits_to_keep=1)  # work: [1, H, P, D] a layer
    if len(groups) == 1 and not families:  # one batch: run it in the caller's cache
        if P:
            work.batch_repeat_interleave(n)  # [1, H, P, D] -> [n, H, P, D] in every layer
        logits, suffix_mask = _run_rest(model, rest, pre_mask, pad_id, work, logits_to_keep)
        return logits, torch.cat([pre_mask, suffix_mask], dim=-1)
    # Keys and values each row finds before its rest: one entry per family, and a last one
    # (prefix, then Lq pads) for rows in no family. Per layer: ([F+1, H, P+Lq, D], same);
    # without families that is the prefix alone, [1, H, P, D], and every row's entry is 0.
    pre_kv = [(layer.keys, layer.values) for layer in work.layers] if P else []  # [1, H, P, D] each
    if families:
        fam = DynamicCache()
        for i, (k, v) in enumerate(pre_kv):  # the prefix, copied to every family
            fam.update(k.expand(len(parts), -1, -1, -1), v.expand(len(parts), -1, -1, -1), i)
        _run_rest(model, parts, pre_mask.new_ones(len(parts), P), pad_id, fam, 1)  # [F, H, P+Lq, D] a layer
        none = lambda t: F.pad(t[:1, :, :P], (0, 0, 0, Lq))  # [1, H, P+Lq, D]: the prefix, then zeros
        pre_kv = [(torch.cat([l.keys, none(l.keys)]), torch.cat([l.values, none(l.values)])) for l in fam.layers]
    L = max(len(s) for s in rest)
    logits, kvs, masks = [], [], []
    for rows in groups:
        idx = torch.tensor([fam_of[r] for r in rows], device=dev)  # [c] each row's entry in pre_kv
        sub = DynamicCache()
        for i, (k, v) in enumerate(pre_kv):  # what the group's rows find cached: [c, H, P+Lq, D]
            sub.update(k[idx], v[idx], i)
        part, m = _run_rest(model, [rest[r] for r in rows], pre_mask[rows], pad_id, sub,
                            logits_to_keep)  # [c, k<=keep, V], [c, L_c]
        logits.append(F.pad(part, (0, 0, logits_to_keep - part.shape[1], 0)))  # [c, keep, V]
        masks.append(F.pad(m, (L - m.shape[1], 0)))  # [c, L]
        kvs.append(sub)
    back = torch.argsort(torch.tensor([r for rows in groups for r in rows], device=dev))  # group order -> row order
    mask = torch.cat([pre_mask, torch.cat(masks)[back]], dim=-1)  # [n, P+Lq+L]
    if cache is not None:
        K, S = P + Lq, mask.shape[1]

        def widen(t):  # [c, H, K+L_c, D] -> [c, H, S, D]: [cached | zeros as extra pads | group's pads, rest]
            return torch.cat([t[:, :, :K], t.new_zeros(t.shape[0], t.shape[1], S - t.shape[2], t.shape[3]),
                              t[:, :, K:]], dim=2)
        for i in range(len(kvs[0].layers)):  # one cache layer per decoder layer
            keys = torch.cat([widen(sub.layers[i].keys) for sub in kvs])[back]  # [n, H, S, D]
            values = torch.cat([widen(sub.layers[i].values) for sub in kvs])[back]
            cache.update(keys, values, i)
    return torch.cat(logits)[back], mask


def _run_rest(model, rest: list[list[int]], pre_mask: torch.Tensor, pad_id: int, cache, logits_to_keep: int):
    """Left-padded forward of `rest` behind the K positions already in `cache` (pre_mask
    [c, K]: which of them are real tokens): logits [c, min(logits_to_keep, L), V] and the
    mask [c, L] of the rest, for L the longest."""
    ids, mask = left_padded(rest, max(len(s) for s in rest), pad_id, next(model.parameters()).device)  # [c, L] each
    full = torch.cat([pre_mask, mask], dim=-1)  # [c, K+L]
    pos = (full.cumsum(-1) - 1).clamp(min=0)[:, pre_mask.shape[1]:]  # [c, L] each token's position in its sequence
    out = model(input_ids=ids, attention_mask=full, position_ids=pos, cache=cache, use_cache=True,
                logits_to_keep=min(logits_to_keep, ids.shape[1]))
    return out.logits, mask


# Shared text shorter than this runs with each row: a separate forward costs more.
MIN_SHARED = 8


def shared_families(seqs: list[list[int]], shareable: list[int], P: int) -> list[tuple[list[int], int]]:
    """Rows that share at least MIN_SHARED tokens beyond the common prefix P, as
    (rows, q): the rows' next q tokens are the same (and within each row's `shareable`).

    Sorted, rows sharing a beginning are neighbours, and a run's shared length only
    shrinks as it grows; a run grows while it keeps MIN_SHARED tokens in common."""
    order = sorted(range(len(seqs)), key=lambda r: seqs[r][P:])
    families, i = [], 0
    while i < len(order):
        first, q, j = seqs[order[i]], shareable[order[i]] - P, i + 1
        while j < len(order):
            other, k = seqs[order[j]], P
            while k < min(len(first), len(other)) and first[k] == other[k]:
                k += 1
            shared = min(q, k - P, shareable[order[j]] - P)
            if shared < MIN_SHARED:
                break
            q, j = shared, j + 1
        if j - i > 1:
            families.append((sorted(order[i:j]), q))
        i = j
    return families


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
    sl = [lengths[r] for r in order]
    best, cut = [0] + [float("inf")] * len(sl), [0] * (len(sl) + 1)
    for j in range(1, len(sl) + 1):
        for i in range(j):
            cost = best[i] + (j - i) * sl[j - 1] + group_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(sl)
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


def choose_decode(model):
    """The fastest way this machine decodes one token for `model`: decode_step (linears
    as W @ x^T), decode_step_xw (linears as x @ W^T, nn.Linear's layout), or None (the
    caller's plain decode, the model's own forward). A layout that wins on one CPU loses
    on another, so it is measured: once per machine, torch version, thread count, device,
    dtype and model shape, then remembered in the cache folder (engine.json), so every
    later run on this machine takes the same path and stays repeatable. The
    AGENTFLOW_DECODE environment variable (plain | wx | xw) overrides the measurement."""
    covered = model.config.model_type in DECODE_STEP_MODELS and not getattr(model.config, "use_sliding_window", False)
    if not covered:
        return None
    ways = {"plain": None, "wx": decode_step, "xw": decode_step_xw}
    forced = os.environ.get("AGENTFLOW_DECODE", "")
    if forced:
        if forced not in ways:
            raise ValueError(f"AGENTFLOW_DECODE must be one of {', '.join(ways)}, not {forced!r}")
        return ways[forced]
    key = _machine_key(model)
    if key not in _CHOICES:
        _CHOICES.update(_read_choices())
    if key not in _CHOICES:
        _CHOICES[key] = _measure_decode(model, ways)
        _write_choices()
        print(f"decode step measured on this machine: {_CHOICES[key]} ({key}); "
              f"remembered in {_choices_path()}", flush=True)
    return ways[_CHOICES[key]]


_CHOICES: dict[str, str] = {}  # machine key -> the decode way it measured fastest


def _choices_path() -> Path:
    return Path(os.environ.get("AGENTFLOW_HOME", Path.home() / ".cache" / "agentflow")) / "engine.json"


def cpu_name() -> str:
    """The model name of this machine's first CPU (what decides, e.g., which matmul layout
    its BLAS runs faster), or what the platform says where /proc/cpuinfo has none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _machine_key(model) -> str:
    p = next(model.parameters())
    cpu = cpu_name()
    if p.device.type == "cuda":
        cpu = torch.cuda.get_device_name(p.device)
    c = model.config
    return (f"{cpu} | torch {torch.__version__} | threads {torch.get_num_threads()} | {p.device.type} {p.dtype} | "
            f"{c.model_type} h{c.hidden_size} L{c.num_hidden_layers} V{c.vocab_size}")


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
def _measure_decode(model, ways: dict, rows: int = 32, context: int = 8, rounds: int = 5) -> str:
    """Time one decode step of `rows` rows behind a short cache with each way, the ways
    interleaved round by round and each way's fastest round kept (a busy machine slows
    single calls, never speeds them up); the fastest way wins, and a way within 3% of
    the plain one loses to it."""
    dev = next(model.parameters()).device
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (rows, context + 1), generator=gen).to(dev)  # [b, c+1]
    cache = DynamicCache()
    model(input_ids=ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
    tok, pos = ids[:, context], torch.full((rows, 1), context, device=dev)  # [b], [b, 1]
    mask = torch.ones((rows, context + 1), dtype=torch.long, device=dev)  # [b, c+1]
    plain = lambda m, t, p, k, c: m(input_ids=t[:, None], attention_mask=k, position_ids=p, cache=c, use_cache=True)
    best = {name: float("inf") for name in ways}
    for r in range(rounds + 1):  # round 0 warms every way up
        for name, fn in ways.items():
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            (fn or plain)(model, tok, pos, mask, cache)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            if r:
                best[name] = min(best[name], time.perf_counter() - t0)
            cache.crop(-1)  # drop the new position: back to the prefix for the next timing
    fastest = min(best, key=best.get)
    return fastest if best[fastest] < 0.97 * best["plain"] else "plain"


def decode_step(model, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache,
                linear=None) -> torch.Tensor:
    """One new token per row through a Llama or Qwen2 decoder: logits [b, V].

    tok [b] the previous token of each row, pos [b, 1] its position, mask [b, S] the
    key mask (1 = a real token; the last column is tok itself), cache the rows' keys and
    values so far. This is the model's own forward for a single position, with its own
    weights and modules (norms, rotary table, activation), minus what a general forward
    pays at every step: building a 4-D mask, dispatching attention, wrapping outputs.
    Two things can make it faster than the same arithmetic in the HF forward:
      * by default (`linear` None) every linear layer is computed as W @ x^T, not
        x @ W^T: the same product, but some CPUs' BLAS runs the [out, in] x [in, b]
        shape much faster for a few dozen rows, and others much slower (bench.py,
        `linear_only_*`); decode_step_xw keeps nn.Linear's layout; choose_decode picks;
      * attention groups the query heads by their KV head ([b, kv, g, D] against
        [b, kv, S, D]), so grouped keys and values are read as they are in the cache,
        never repeated per query head.
    Same math as the HF forward, but not the same summation order: log-probs agree to
    ~1e-5 in fp32 (tests/test_sampler.py), greedy tokens are the same.
    """
    mm = linear or _linear_wx  # one linear layer: [b, in] -> [b, out]
    dec = model.model
    b = tok.shape[0]
    x = dec.embed_tokens(tok)  # [b, h]
    cos, sin = dec.rotary_emb(x, pos)  # [b, 1, D] each
    bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device)  # [b, S]
    bias = bias.masked_fill(mask == 0, torch.finfo(x.dtype).min)[:, None, None, :]  # [b, 1, 1, S]
    for i, layer in enumerate(dec.layers):
        att = layer.self_attn
        D, kv = att.head_dim, att.config.num_key_value_heads
        h = layer.input_layernorm(x)  # [b, h]
        q = mm(h, att.q_proj).view(b, -1, 1, D)  # [b, H, 1, D]
        k = mm(h, att.k_proj).view(b, kv, 1, D)  # [b, kv, 1, D]
        v = mm(h, att.v_proj).view(b, kv, 1, D)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        keys, values = cache.update(k, v, i)  # [b, kv, S, D]: the new position written in place
        q = q.view(b, kv, -1, D)  # [b, kv, g, D]: the g query heads that share each KV head
        o = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=bias,
                                                             scale=att.scaling)  # [b, kv, g, D]
        x = x + mm(o.reshape(b, -1), att.o_proj)  # [b, h]
        h = layer.post_attention_layernorm(x)
        mlp = layer.mlp
        x = x + mm(mlp.act_fn(mm(h, mlp.gate_proj)) * mm(h, mlp.up_proj), mlp.down_proj)
    return mm(dec.norm(x), model.lm_head)  # [b, V]


# Output rows of W per product in _linear_wx. A vocabulary projection in one product writes
# a [V, b] result far bigger than the CPU's cache before transposing it; in blocks, each
# block's [1024, b] output stays in cache while it is transposed into place. The same
# numbers bit for bit: a block is the same dot products.
ROW_BLOCK = 1024


def decode_step_xw(model, tok, pos, mask, cache) -> torch.Tensor:
    """decode_step with every linear as nn.Linear computes it, x @ W^T."""
    return decode_step(model, tok, pos, mask, cache, linear=lambda x, lin: lin(x))


def _linear_wx(x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
    """lin(x) for x [b, in] -> [b, out], computed as (W [out, in] @ x^T [in, b])^T,
    by blocks of ROW_BLOCK output features when there are many (the lm_head)."""
    W = lin.weight  # [out, in]
    if W.shape[0] <= 4 * ROW_BLOCK:
        y = torch.mm(W, x.t()).t()  # [b, out], a transposed view
        return (y + lin.bias if lin.bias is not None else y).contiguous()
    y = x.new_empty(x.shape[0], W.shape[0])  # [b, out]
    for i in range(0, W.shape[0], ROW_BLOCK):
        y[:, i:i + ROW_BLOCK] = torch.mm(W[i:i + ROW_BLOCK], x.t()).t()  # [b, block] <- [block, b]^T
    return y + lin.bias if lin.bias is not None else y


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [b, heads, 1, D] at each row's position (cos, sin [b, 1, D]):
    the pairs (x_j, x_{j+D/2}) are rotated by the position's angle for that frequency."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]



# ----------------------------------------------------------------------------------------
# Drawing a token


def draw(weights: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One index per row of weights [b, V] (>= 0, not necessarily summing to 1), drawn
    with probability weights / row sum: inverse-CDF sampling with ONE uniform per row.

    With c the running sum along the row and u uniform on [0, c_V), index i is the one
    with c_{i-1} <= u < c_i, an interval of length w_i: P(i) = w_i / c_V. A zero weight
    is an empty interval, so it is never drawn. torch.multinomial draws the same
    distribution by drawing an exponential for EVERY entry (argmax w_i / E_i): batch x
    vocabulary random numbers a step, where this draws batch many."""
    c = weights.cumsum(-1)  # [b, V] non-decreasing: adding w >= 0 never lowers a float sum
    u = torch.rand(c.shape[0], 1, generator=gen, device=c.device, dtype=c.dtype) * c[:, -1:]  # [b, 1]
    tok = torch.searchsorted(c, u, right=True)[:, 0]  # [b] how many c_i <= u: the first i with c_i > u
    if bool((tok == c.shape[-1]).any()):  # u rounded up to c_V (odds ~1e-7 a draw): no c_i exceeds
        last = c.shape[-1] - 1 - (weights.flip(-1) > 0).int().argmax(-1)  # it; u sits at the end of
        tok = torch.minimum(tok, last)  # the last interval with weight
    return tok

