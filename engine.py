"""The engine: chat formatting and the hand-written, batched, KV-cached sampler. Every LLM
call of AgentFlow goes through LLM.sample here (the four modules, evaluation, the
judge's yes/no), and the trainer's log-probs (flow_grpo.token_logprobs) run through
`last_hidden`, which lays rows out as the sampler's prefill does. There is no other engine.

Paper: the modules are served by vLLM there; this file is what replaces it. What it must
guarantee for Flow-GRPO: the planner samples from the CURRENT trainable weights, and every
sampled token comes with its log-prob under exactly the distribution it was drawn from
(SamplingParams), which flow_grpo.token_logprobs recomputes.

One call of LLM.sample, in the numbered steps of LLM._sample_sub_batch:

  1. Prefill (`prefill_prompts`, `prefill`). Identical prompts run once (the G rollouts of
     a query at turn 1). The text every prompt starts with (a module's instructions and
     tool cards) runs once at batch 1 and its keys and values are copied to every row; a
     group of rows that shares more (the G rollouts of a query share their question)
     runs that part once for the group; each row's own rest then runs behind it, in
     batches of rows of similar length, so that padding costs little. A token's keys and
     values depend only on the tokens before it, so every row computes exactly what it
     would alone. Everything lands in a KV cache allocated once, at its final size, and
     written in place (support/kv_cache.py).
  2. Draw (`pick`, `draw`): one token per live row from softmax(logits / T), by
     inverse-CDF sampling with one uniform per row; greedy at T = 0.
  3. Stop rules: EOS, a stop string, the token limit. A stop string can only end at a
     token whose own text holds its last character, so a row's text is decoded only then.
  4. Drop finished rows from the batch and the cache: a finished row costs nothing.
  5. Decode (`decode_step`): one new position for every live row, the model's own
     forward written out for Llama and Qwen2 decoders without the general forward's
     per-step overhead. On CUDA that same step runs on fixed buffers and is replayed as
     a CUDA graph (the marked block, `GraphStep`): a 7B step is ~2,000 small kernels,
     which take longer to launch than to run. Back to 2.

What each speed idea earns is measured side by side by `python -m scripts.speed_bench`,
which swaps it for the generic way (figures by machine in docs/LOG.md). The written-out
decode step and the cache written in place are also what the CUDA graph stands on.

Simplified: no continuous batching (a call's rows start together), no speculative
decoding, no paged attention; a model other than Llama or Qwen2 decodes through its own
forward (step 5), which is slower and computes the same.
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from transformers import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer

from support.batching import capped, layout, left_padded, length_groups, unique_prompts
from support.config import ConfigError
from support.device_memory import CaptureError, sampler_sub_batches
from support.kv_cache import PreallocatedLayer, cache_layer, preallocated_cache, replay_cache


@dataclass
class Sample:
    ids: list[int]  # the sampled token ids, with the EOS / stop-string token that ended the row
    logprobs: list[float]  # log-prob of each id, see LLM.sample for which distribution
    text: str  # decoded ids, cut before the stop string, EOS removed
    finish: str  # "eos", "stop" or "length"


@dataclass(frozen=True)
class SamplingParams:
    """How one module samples. For the planner this is also exactly what the loss scores
    (flow_grpo.token_logprobs takes the same object), so the two cannot disagree."""
    temperature: float  # 0 = greedy
    max_new_tokens: int
    stop: tuple[str, ...] = ()  # generation ends once the decoded text contains one of these
    first_tokens: tuple[int, ...] = ()  # if set, the first token is drawn from these ids only
    first_temperature: float = 0.0  # temperature of the first token alone; 0 = `temperature`

    def temperature_at(self, j: int) -> float:
        """The temperature of the action's j-th token (0-based)."""
        return self.first_temperature if j == 0 and self.first_temperature > 0 else self.temperature


class LLM:
    """A causal LM plus its tokenizer: chat formatting and the batched sampler.

    Memory (set by train.py from the memory plan; None = no limit, the CPU default):
    `sub_batch_bytes` caps one sub-batch of rows (their KV cache at its final size and the
    decode step's logits): more rows than fit run as successive sub-batches.
    `prefill_tokens` caps what one prefill forward holds. `check_every`: how many tokens
    are drawn between two looks at the stop rules, which need the tokens on the host:
    every token on a CPU (where that costs nothing), every 8 on a GPU (each look waits
    for the device). `graphs`: decode through the CUDA-graph block (on by the device
    type: CUDA; tests turn it on on a CPU, where the same block runs eagerly).
    """

    def __init__(self, model, tokenizer, check_every: int | None = None):
        self.model, self.tok = model, tokenizer
        eos, pad = {tokenizer.eos_token_id}, tokenizer.pad_token_id
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        eos |= set(gen_eos) if isinstance(gen_eos, list) else {gen_eos}
        self.eos_ids = sorted(i for i in eos if i is not None)
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        self.sub_batch_bytes: int | None = None
        self.prefill_tokens: int | None = None
        self.check_every = check_every or (8 if self.device.type == "cuda" else 1)
        self.graphs = self.device.type == "cuda"
        self.sub_batches_run = 0  # sub-batches sampled so far (metrics, tests)
        self._piece: dict[int, str] = {}  # token id -> its text alone (step 3)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def chat_ids(self, system: str, user: str, assistant_prefix: str = "") -> list[int]:
        """Token ids of a system + user exchange, opened for the assistant's reply.

        `assistant_prefix` is text the reply is forced to start with ("Tool:"): a format
        a small model can hardly miss. It is part of the prompt, never of the action."""
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return self.tok(text + assistant_prefix, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], params: SamplingParams, seed: int = 0,
               row_stops: list[tuple[str, ...]] | None = None) -> list[Sample]:
        """Sample a continuation for every prompt.

        `row_stops`, if given, replaces params.stop with one tuple of stop strings per row
        (one batched executor call serves tools whose commands end differently).

        Log-probs: token j is drawn from softmax(logits / T_j) over the full vocabulary,
        T_j = params.temperature_at(j), and its logprob is log softmax(logits / T_j)[id]:
        exactly the quantity flow_grpo.token_logprobs recomputes. For greedy decoding
        (T = 0) it is log softmax(logits)[id]. With `first_tokens`, the first position is
        a softmax over those ids alone (the other logits set to -inf), and its logprob is
        under that restricted softmax. Same prompts, params and seed give the same tokens.
        """
        if not prompts:
            return []
        stops = row_stops or [params.stop] * len(prompts)
        gen, out = torch.Generator(device=self.device).manual_seed(seed), []
        for rows in sampler_sub_batches(prompts, params.max_new_tokens, self.sub_batch_bytes,
                                        self.model):  # as many rows as the memory plan allows
            out += self._sample_sub_batch([prompts[i] for i in rows], params, gen,
                                          [stops[i] for i in rows])
            self.sub_batches_run += 1
        return out

    def _sample_sub_batch(self, prompts: list[list[int]], params: SamplingParams,
                          gen: torch.Generator, stops: list[tuple[str, ...]]) -> list[Sample]:
        n, dev, M = len(prompts), self.device, params.max_new_tokens
        # 1. Prefill: every prompt's keys and values into a cache with room for M more
        #    positions a row, and the logits that predict each row's first new token.
        logits, mask, cache = prefill_prompts(self.model, prompts, self.pad_id, extra=M,
                                              max_tokens=self.prefill_tokens)
        logits = logits.float()  # [n, V]
        next_pos = mask.sum(-1, keepdim=True)  # [n, 1] position of the next token

        # `live` maps the rows of the shrinking batch to the original prompts. Drawn tokens
        # and their log-probs wait on the device ([n, M] each) until the next look at the
        # stop rules, which reads them back (on a GPU a row that ended since the last look
        # has run a few steps too many: those tokens are discarded).
        live = torch.arange(n, device=dev)  # [b]
        drawn = torch.zeros((n, M), dtype=torch.long, device=dev)  # [n, M]
        drawn_lp = torch.zeros((n, M), device=dev)  # [n, M]
        new_ids, new_lp = [[] for _ in range(n)], [[] for _ in range(n)]  # drawn so far, per row
        finish = ["length"] * n
        eos, looked = set(self.eos_ids), 0
        for step in range(M):
            # 2. Draw one token per live row.
            if step == 0 and params.first_tokens:
                logits = restrict(logits, params.first_tokens)
            tok, lp = pick(logits, params.temperature_at(step), gen)  # [b], [b]
            drawn[live, step], drawn_lp[live, step] = tok, lp
            # 3. Stop rules, every check_every tokens.
            if step + 1 - looked == self.check_every or step == M - 1:
                keep = self._end_finished_rows(live, drawn[live, looked:step + 1].tolist(),
                                               drawn_lp[live, looked:step + 1].tolist(),
                                               new_ids, new_lp, finish, stops, eos)
                looked = step + 1
                if not keep or step == M - 1:
                    break
                # 4. Drop finished rows from everything we carry.
                if len(keep) < len(live):
                    idx = torch.tensor(keep, device=dev)
                    cache.batch_select_indices(idx)
                    live, tok, mask, next_pos = live[idx], tok[idx], mask[idx], next_pos[idx]
            # 5. Decode: the drawn tokens' keys and values into the cache, the next logits out.
            mask = torch.cat([mask, torch.ones_like(next_pos)], dim=-1)  # [b, len+1]
            logits = self.decode(tok, next_pos, mask, cache).float()  # [b, V]
            next_pos = next_pos + 1

        return [Sample(ids=new_ids[i], logprobs=new_lp[i], text=self._text(new_ids[i], stops[i]),
                       finish=finish[i]) for i in range(n)]

    def decode(self, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache):
        """Step 5: logits [b, V] for tok [b] at pos [b, 1], mask [b, S] (its last column is tok)."""
        cfg = self.model.config
        if cfg.model_type in DECODE_STEP_MODELS and not getattr(cfg, "use_sliding_window", False):
            if not self.graphs:  # the CPU default: the decoder written out
                return decode_step(self.model, tok, pos, mask, cache)
            return graph_step(self.model, tok, pos, mask, cache)  # CUDA: the same step, as a graph
        return self.model(tok[:, None], attention_mask=mask, position_ids=pos, cache=cache,
                          use_cache=True).logits[:, -1, :]  # any other decoder: its own forward

    def _end_finished_rows(self, live: torch.Tensor, ids: list[list[int]], lps: list[list[float]],
                           new_ids, new_lp, finish, stops, eos: set[int]) -> list[int]:
        """Append each live row's tokens since the last look, up to the one that finishes it
        (EOS, or the token that completes a stop string); return the live rows that go on."""
        keep = []
        for j, row in enumerate(live.tolist()):
            for t, l in zip(ids[j], lps[j]):
                new_ids[row].append(t)
                new_lp[row].append(l)
                if t in eos:
                    finish[row] = "eos"
                    break
                if stops[row] and self._hit_stop(new_ids[row], stops[row]):
                    finish[row] = "stop"
                    break
            else:
                keep.append(j)
        return keep

    def _hit_stop(self, ids: list[int], stops: tuple[str, ...]) -> bool:
        """Whether the row's text now holds a stop string. Its last token completes one only
        if that token's own text holds the stop's last character (or is part of a character
        split over tokens, or the stop ends in a space, which a tokenizer may drop from a
        lone token), so the row's tail is decoded only then; a stop string is at most a few
        tokens long, so the last 8 suffice."""
        piece = self._piece.get(ids[-1])
        if piece is None:
            piece = self._piece[ids[-1]] = self.tok.decode(ids[-1:], skip_special_tokens=True)
        if "\ufffd" not in piece and not any(s[-1] in piece or s[-1] == " " for s in stops):
            return False
        tail = self.tok.decode(ids[-8:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    def _text(self, ids: list[int], stops: tuple[str, ...]) -> str:
        text = self.tok.decode(ids, skip_special_tokens=True)
        for s in stops:
            if s in text:
                text = text[: text.index(s)]
        return text

    def choose(self, system: str, prompts: list[str], words: tuple[str, ...],
               batch_size: int = 32) -> list[str]:
        """For each prompt, the likelier of `words` as the first token of the reply (greedy,
        forced among the words' first tokens, as the verifier's verdict is): the judge's
        yes/no. A word whose first token another word took is never chosen."""
        first = {}
        for w in words:
            ids = self.tok.encode(w, add_special_tokens=False)
            if ids:
                first.setdefault(ids[0], w)
        params = SamplingParams(0.0, max_new_tokens=1, first_tokens=tuple(sorted(first)))  # greedy
        out = []
        for s in range(0, len(prompts), batch_size):  # bounded memory for long prompts at 7B
            ids = [self.chat_ids(system, p) for p in prompts[s:s + batch_size]]
            out += [first.get(x.ids[0], "") if x.ids else "" for x in self.sample(ids, params)]
        return out


# ----------------------------------------------------------------------------------------
# Step 2: drawing a token


def restrict(logits: torch.Tensor, allowed: tuple[int, ...]) -> torch.Tensor:
    """logits [..., V] with every id outside `allowed` set to -inf."""
    keep = torch.full_like(logits, float("-inf"))
    idx = torch.tensor(allowed, device=logits.device).expand(*logits.shape[:-1], -1)
    return keep.scatter(-1, idx, logits.gather(-1, idx))


def pick(logits: torch.Tensor, temperature: float, gen: torch.Generator):
    """Choose one token per row from logits [b, V]; return (ids [b], logprobs [b]).
    temperature 0 is greedy; otherwise the token is drawn from softmax(logits / T)."""
    if temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)  # [b, V]
        tok = logits.argmax(dim=-1)  # [b]
    else:
        logp = torch.log_softmax(logits / temperature, dim=-1)  # [b, V] what the trainer recomputes
        tok = draw(logp.exp(), gen)  # [b]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def draw(weights: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One index per row of weights [b, V] (>= 0, not necessarily summing to 1), drawn
    with probability weights / row sum: inverse-CDF sampling with ONE uniform per row.

    With c the running sum along the row and u uniform on [0, c_V), index i is the one
    with c_{i-1} <= u < c_i, an interval of length w_i: P(i) = w_i / c_V. A zero weight
    is an empty interval, so it is never drawn. torch.multinomial draws the same
    distribution by drawing an exponential for EVERY entry: batch x vocabulary random
    numbers a step, where this draws batch many.

    The running sum and the uniform are float64: in float32, once c reaches ~1 every
    weight below its rounding step (~6e-8) adds nothing, so with a 152k vocabulary tens
    of thousands of tail tokens would get intervals of width zero and could never be
    drawn; float64 resolves weights down to ~1e-16 of the total."""
    c = weights.cumsum(-1, dtype=torch.float64)  # [b, V] non-decreasing (w >= 0 never lowers a sum)
    u = torch.rand(len(c), 1, generator=gen, device=c.device, dtype=c.dtype) * c[:, -1:]  # [b, 1]
    tok = torch.searchsorted(c, u, right=True)[:, 0]  # [b] the first i with c_i > u: #{c_i <= u}
    # u rounded up to c_V (odds ~1e-16 a draw): no c_i exceeds it; u then sits at the end of the
    # last interval with weight. On a GPU the fix is applied to every row (it changes no other
    # row: there tok <= last already), so that no step waits for the device to ask "any?".
    if c.device.type != "cpu" or bool((tok == c.shape[-1]).any()):
        last = c.shape[-1] - 1 - (weights.flip(-1) > 0).int().argmax(-1)
        tok = torch.minimum(tok, last)
    return tok


# ----------------------------------------------------------------------------------------
# Step 1: prefill, shared text once, the rest in batches of similar length


def prefill_prompts(model, prompts: list[list[int]], pad_id: int, extra: int = 0,
                    max_tokens: int | None = None):
    """The sampler's prefill: (logits [n, V] of each prompt's last token, mask [n, S], the
    cache, allocated once with room for `extra` more positions per row). Identical
    prompts (the G rollouts of a query at turn one) run once; their rows are copied
    afterwards and then draw their own tokens. max_tokens caps what one forward holds."""
    unique, src = unique_prompts(prompts)
    shareable = [len(p) - 1 for p in unique]  # a prompt's last token runs with its row: its logits
    cache = preallocated_cache(layout(unique, shareable).width + extra, len(prompts))
    logits, mask = prefill(model, unique, pad_id, cache, shareable, max_tokens)  # [u, V], [u, S]
    if len(unique) < len(prompts):
        for layer in cache.layers:
            layer.spread(src)  # [u, H, S, D] -> [n, H, S, D] in every layer
        rows = torch.tensor(src, device=logits.device)  # [n]
        logits, mask = logits[rows], mask[rows]  # [n, V], [n, S]
    return logits, mask, cache


def _plan(seqs: list[list[int]], shareable: list[int], pad_id: int, dev):
    """How rows run: (their Layout, pre_mask [n, K]: which of the K positions a row finds
    before its own rest are real tokens, the batches of rows whose rests run together).

    `shareable[r]` is how many leading tokens of row r may be computed with other rows:
    the rest need their own outputs (the sampler: the last token; the trainer: the last
    prompt token and the action). support.batching.layout finds
      * the prefix ALL rows start with, P tokens: it runs once at batch 1;
      * shared groups, rows that share more than that (the G rollouts of a query share the
        question; the trainer's G actions share their whole prompt): each group's shared
        part runs once, all groups' parts as one left-padded batch behind the prefix;
      * each row's own rest, run behind its prefix and shared part, in batches of rows of
        similar length (length_groups: a pad runs through every layer like a token).
    Each row is laid out [prefix (P) | pads, shared part | pads, own rest (L)], with its
    tokens in the last columns of each block. Pads are masked out and skipped by the
    position ids, so each row computes exactly what it would alone."""
    row_layout = layout(seqs, shareable)
    P, width = row_layout.prefix_len, row_layout.shared_width
    pre_mask = torch.ones((len(seqs), P + width), dtype=torch.long, device=dev)  # [n, K]
    masks = left_padded(row_layout.shared_parts + [[]], width, pad_id, dev)[1]  # [groups+1, width]
    pre_mask[:, P:] = masks[row_layout.group_of]  # its group's part (in none: all pads)
    return row_layout, pre_mask, length_groups([len(s) for s in row_layout.rest])


def _behind(rest: list[list[int]], pre_mask: torch.Tensor, pad_id: int):
    """Rows `rest` left-padded to run behind the K positions cached for them (pre_mask
    [c, K]): ids [c, L] and their mask [c, L], L the longest rest; the mask over all the
    keys [c, K+L]; each token's position in its own sequence [c, L], pads skipped."""
    ids, mask = left_padded(rest, max(len(s) for s in rest), pad_id, pre_mask.device)
    full = torch.cat([pre_mask, mask], dim=-1)  # [c, K+L]
    return ids, mask, full, (full.cumsum(-1) - 1).clamp(min=0)[:, pre_mask.shape[1]:]


def prefill(model, seqs: list[list[int]], pad_id: int, cache, shareable: list[int],
            max_tokens: int | None = None):
    """The sampler's prefill (its one caller: prefill_prompts): every row's keys and values
    into `cache` (empty on entry), laid out by _plan; returns (logits [n, V] that predict
    each row's next token, mask [n, S]). max_tokens (a memory plan) caps one forward at
    rows x positions by splitting batches into fewer rows and long rows into pieces: which
    forwards run changes, not what a row computes (its logits are in the last piece)."""
    dev = next(model.parameters()).device
    row_layout, pre_mask, batches = _plan(seqs, shareable, pad_id, dev)
    P, K, rest = row_layout.prefix_len, pre_mask.shape[1], row_layout.rest
    batches = [run for rows in batches  # with max_tokens, fewer rows a forward
               for run in capped(rows, K + max(len(rest[r]) for r in rows), max_tokens)]
    # The prefix, once at batch 1. With a single batch and no groups, the batch runs in
    # the caller's cache itself, the prefix copied to its rows.
    one_batch = len(batches) == 1 and not row_layout.shared_groups
    work = cache if one_batch else DynamicCache()
    if P and max_tokens and P > max_tokens:
        _run_rest(model, [seqs[0][:P]], pre_mask.new_ones(1, 0), pad_id, work, max_tokens)
    elif P:
        model(torch.tensor([seqs[0][:P]], device=dev), cache=work, use_cache=True, logits_to_keep=1)
    if not one_batch:
        return _prefill_into(model, row_layout, pre_mask, batches, work, cache, pad_id, max_tokens)
    if P:
        work.batch_repeat_interleave(len(seqs))  # [1, H, P, D] -> [n, H, P, D] in every layer
    logits, rest_mask = _run_rest(model, rest, pre_mask, pad_id, work, max_tokens)  # [n, V], [n, L]
    return logits, torch.cat([pre_mask, rest_mask], dim=-1)


@torch.no_grad()
def _prefill_into(model, row_layout, pre_mask, batches, work, cache, pad_id: int, max_tokens):
    """prefill's layout written straight into the sampler's cache, allocated once at its
    final size: first every row's [prefix | shared part], then each batch's rests right
    after the batch has run, so that besides the final cache only one batch of shared
    parts or of rests has its keys and values at a time (what the memory plan counts)."""
    rest, P, K = row_layout.rest, row_layout.prefix_len, pre_mask.shape[1]  # K: before a rest
    n, L, dev = len(rest), max(len(s) for s in rest), pre_mask.device
    S, groups, parts = K + L, row_layout.shared_groups, row_layout.shared_parts
    zeros = lambda t, rows, width: t.new_zeros(rows, t.shape[1], width, t.shape[3])  # masked pads
    prefix = lambda t: F.pad(t[:1, :, :P], (0, 0, 0, K - P)).expand(n, -1, -1, -1)  # [n, H, K, D]
    for i, src in enumerate(work.layers if P else []):  # every row: the prefix, zeros for a part
        cache_layer(cache, i).put(slice(None), 0, prefix(src.keys), prefix(src.values), n, S)
    for chunk in capped(list(range(len(groups))), K, max_tokens):  # the groups' shared parts
        shared_cache = DynamicCache()
        for i, src in enumerate(work.layers):  # the prefix, copied to every group of the chunk
            shared_cache.update(src.keys[:1, :, :P].expand(len(chunk), -1, -1, -1),
                                src.values[:1, :, :P].expand(len(chunk), -1, -1, -1), i)
        _run_rest(model, [parts[g] for g in chunk], pre_mask.new_ones(len(chunk), P), pad_id,
                  shared_cache, max_tokens)  # [c, H, P+width_c, D] a layer
        for i, src in enumerate(shared_cache.layers):
            layer = cache_layer(cache, i)
            k, v = src.keys[:, :, P:], src.values[:, :, P:]  # [c, H, width_c, D] the shared parts
            if layer.k_live is None:  # no prefix: zeros first, as masked pads before short parts
                layer.put(slice(None), 0, zeros(k, n, K), zeros(v, n, K), n, S)
            for j, g in enumerate(chunk):  # right-aligned in [P, K), like one batch padded to K - P
                rows = torch.tensor(groups[g][0], device=dev)
                layer.put(rows, K - k.shape[2], k[j:j + 1].expand(len(rows), -1, -1, -1),
                          v[j:j + 1].expand(len(rows), -1, -1, -1), n, S)
        del shared_cache
    logits = []
    for rows in batches:
        idx = torch.tensor(rows, device=dev)  # [c]
        batch_cache = DynamicCache()
        for i, layer in enumerate(cache.layers if K else []):  # what the rows find: [c, H, K, D]
            batch_cache.update(layer.k_live[idx, :, :K], layer.v_live[idx, :, :K], i)
        logits.append(_run_rest(model, [rest[r] for r in rows], pre_mask[rows], pad_id, batch_cache,
                                max_tokens)[0])  # [c, V]
        Lc = max(len(rest[r]) for r in rows)  # the batch's longest rest
        for i, src in enumerate(batch_cache.layers):  # [cached | zeros as extra pads | pads, rest]
            layer = cache_layer(cache, i)
            k, v = src.keys[:, :, K:], src.values[:, :, K:]  # [c, H, L_c, D]
            if Lc < L:
                layer.put(idx, K, zeros(k, len(rows), L - Lc), zeros(v, len(rows), L - Lc), n, S)
            layer.put(idx, S - Lc, k, v, n, S)
        del batch_cache
    back = torch.argsort(torch.tensor(sum(batches, []), device=dev))  # batch order -> row order
    return torch.cat(logits)[back], torch.cat([pre_mask, left_padded(rest, L, pad_id, dev)[1]], -1)


def _run_rest(model, rest: list[list[int]], pre_mask: torch.Tensor, pad_id: int, cache,
              max_tokens: int | None = None):
    """The sampler's forward of `rest` behind the K positions in `cache` (_behind): logits
    [c, V] that predict each row's next token, the mask [c, L] of the rest. With max_tokens,
    in pieces of max_tokens // c columns (each attends to the cache and the pieces before)."""
    ids, mask, full, pos = _behind(rest, pre_mask, pad_id)  # [c, L], [c, L], [c, K+L], [c, L]
    K, L = pre_mask.shape[1], ids.shape[1]
    piece = max(1, max_tokens // len(rest)) if max_tokens else L  # columns per forward
    for start in range(0, L, piece):
        end = min(L, start + piece)
        logits = model(input_ids=ids[:, start:end], attention_mask=full[:, :K + end], cache=cache,
                       position_ids=pos[:, start:end], use_cache=True, logits_to_keep=1).logits
    return logits[:, -1], mask  # [c, V]: the last piece's last column is every row's last token


# ----------------------------------------------------------------------------------------
# The trainer's forward: the prefill's layout, with gradient, and no cache kept


def last_hidden(model, seqs: list[list[int]], pad_id: int, keep: int, shareable: list[int]):
    """The decoder's last hidden states [n, keep, d], at each row's last `keep` positions,
    with gradient (its one caller: flow_grpo.token_logprobs, which runs the output layer
    on them piece by piece, for log-probs and entropy). Rows are laid out as the sampler's
    prefill lays them out (_plan); the text they share is computed once."""
    n, dev = len(seqs), next(model.parameters()).device
    row_layout, pre_mask, batches = _plan(seqs, shareable, pad_id, dev)
    rest, parts, P = row_layout.rest, row_layout.shared_parts, row_layout.prefix_len
    # Each forward gets a cache of its own, holding what its rows find before them
    # (support/kv_cache.replay_cache: a checkpointed block may run its forward twice).
    work = replay_cache()
    if P:  # the prefix, once at batch 1 (base_model: the decoder without its output layer)
        model.base_model(torch.tensor([seqs[0][:P]], device=dev), cache=work, use_cache=True)
    if len(batches) == 1 and not parts:  # one batch, behind the prefix copied to its rows
        held = [(layer.keys.repeat_interleave(n, dim=0), layer.values.repeat_interleave(n, dim=0))
                for layer in work.layers] if P else []  # [1, H, P, D] -> [n, H, P, D] a layer
        return _hidden_rest(model, rest, pre_mask, pad_id, replay_cache(held), keep)  # [n, keep, d]
    # Keys and values a row finds before its rest, a layer: [groups+1, H, P+width, D] each,
    # a shared group's, then the prefix and pads for rows in none (no groups: the prefix).
    cached_kv = [(layer.keys, layer.values) for layer in work.layers] if P else []
    if parts:
        shared_cache = replay_cache([(k.expand(len(parts), -1, -1, -1), v.expand(len(parts), -1, -1, -1))
                                     for k, v in cached_kv])  # the prefix, copied to every shared group
        _hidden_rest(model, parts, pre_mask.new_ones(len(parts), P), pad_id, shared_cache, 1)
        entries = lambda t: torch.cat([t, F.pad(t[:1, :, :P], (0, 0, 0, row_layout.shared_width))])
        cached_kv = [(entries(layer.keys), entries(layer.values)) for layer in shared_cache.layers]
    # Rows of one shared group read the same entry. k[idx] with repeated indices would do,
    # but on a CPU with more than one thread its backward sums those rows' gradients with
    # atomic float adds, in whatever order the threads get there, so the same step would
    # give other weights in the 7th digit from run to run. stack's backward hands each
    # row its own slice, and autograd adds the slices of one entry in a fixed order.
    cached_kv = [(k.unbind(0), v.unbind(0)) for k, v in cached_kv]  # a layer: [H, P+width, D] each
    hidden = []
    for rows in batches:
        batch_cache = replay_cache([(torch.stack([k[row_layout.group_of[r]] for r in rows]),
                                     torch.stack([v[row_layout.group_of[r]] for r in rows]))
                                    for k, v in cached_kv])  # what the batch's rows find: [c, H, P+width, D]
        hidden.append(_hidden_rest(model, [rest[r] for r in rows], pre_mask[rows], pad_id,
                                   batch_cache, keep))  # [c, keep, d]
    back = torch.argsort(torch.tensor(sum(batches, []), device=dev))  # batch order -> row order
    return torch.cat(hidden)[back]


def checkpoint_blocks(model, train_layers: int) -> None:
    """Activation checkpointing (train.grad_checkpoint) of the trained blocks (the top
    `train_layers`, 0: all): in the trainer's forward each keeps only its input, and its
    activations are computed again when the backward pass reaches it, one block at a time
    (torch.utils.checkpoint; the same arithmetic twice, so the same gradient to the bit).
    transformers' decoder layers checkpoint themselves when told to, in training mode (Llama's
    and Qwen2's only use of the mode is attention dropout, which their configs set to 0, so
    nothing else changes); last_hidden's caches allow the second forward (replay_cache). The
    sampler runs without gradient, where a checkpointed block runs as it is."""
    blocks = model.get_decoder().layers
    if getattr(model.config, "attention_dropout", 0.0) or not isinstance(blocks[0], GradientCheckpointingLayer):
        raise ConfigError(f"train.grad_checkpoint needs decoder layers that checkpoint themselves and attention "
                          f"dropout 0 (the blocks run in training mode); this {model.config.model_type} model's "
                          f"do not: set train.grad_checkpoint=false")
    for block in blocks[-train_layers:] if train_layers > 0 else blocks:
        block.gradient_checkpointing, block._can_checkpoint_with_cache = True, True
        block._gradient_checkpointing_func = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
        block.train()


def _hidden_rest(model, rest: list[list[int]], pre_mask, pad_id: int, cache, keep: int):
    """The trainer's forward of `rest` behind the K positions in `cache` (_behind), in one
    piece: the last hidden states [c, keep, d], zeros in front of a rest shorter than keep."""
    ids, _, full, pos = _behind(rest, pre_mask, pad_id)  # [c, L], [c, K+L], [c, L]
    h = model.base_model(input_ids=ids, attention_mask=full, position_ids=pos, cache=cache,
                         use_cache=True).last_hidden_state[:, -keep:]  # [c, min(keep, L), d]
    return F.pad(h, (0, 0, keep - h.shape[1], 0))  # [c, keep, d]


# ----------------------------------------------------------------------------------------
# Step 5: the decode step, and on CUDA the same step replayed as a graph

# Decoders whose layers are exactly what decode_step writes out: pre-norm blocks of RMSNorm,
# attention with rotary embeddings and grouped KV heads, and a gated MLP. (Qwen2 adds
# biases to q/k/v; the module's own bias is used. Sliding-window attention is not
# written out: Qwen2.5 configs leave it off.) Anything else decodes through its forward.
DECODE_STEP_MODELS = ("llama", "qwen2")


def decode_step(model, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache):
    """One new token per row through a Llama or Qwen2 decoder: logits [b, V].

    tok [b] the previous token of each row, pos [b, 1] its position, mask [b, S] the
    key mask (1 = a real token; the last column is tok itself), cache the rows' keys and
    values so far. This is the model's own forward for a single position, with its own
    weights and modules (norms, rotary table, activation), minus what a general forward
    pays at every step: building a 4-D mask, dispatching attention, wrapping outputs.
    Attention groups the query heads by their KV head ([b, kv, g, D] against [b, kv, S,
    D]), so grouped keys and values are read as they are in the cache, never repeated per
    query head. Same math as the HF forward, not the same summation order: log-probs
    agree to ~1e-5 in fp32 (tests/test_sampler.py), greedy tokens are the same.
    """
    dtype = model.model.embed_tokens.weight.dtype  # the residual stream's
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)  # [b, S]
    bias = bias.masked_fill(mask == 0, torch.finfo(dtype).min)[:, None, None, :]  # [b, 1, 1, S]
    return _decode_layers(model, tok, pos, bias, lambda i, k, v: cache.update(k, v, i))


def _decode_layers(model, tok: torch.Tensor, pos: torch.Tensor, bias: torch.Tensor, write_kv):
    """The arithmetic of one decode step, shared by decode_step and the graph (GraphStep),
    so that both run the same modules in the same order: logits [b, V]. bias [b, 1, 1, S]
    is 0 where a row may attend and the dtype's minimum elsewhere; write_kv(i, k, v) stores
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
        q = attn.q_proj(h).view(b, -1, 1, D)  # [b, H, 1, D]
        k = attn.k_proj(h).view(b, kv_heads, 1, D)  # [b, kv, 1, D]
        v = attn.v_proj(h).view(b, kv_heads, 1, D)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        keys, values = write_kv(i, k, v)  # [b, kv, S, D]: the new position written in place
        q = q.view(b, kv_heads, -1, D)  # [b, kv, g, D]: the g query heads that share each KV head
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=attn.scaling)
        x = x + attn.o_proj(out.reshape(b, -1))  # [b, h]
        h = layer.post_attention_layernorm(x)
        mlp = layer.mlp
        x = x + mlp.down_proj(mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h))
    return model.lm_head(decoder.norm(x))  # [b, V]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [b, heads, 1, D] at each row's position (cos, sin [b, 1, D]):
    the pairs (x_j, x_{j+D/2}) are rotated by the position's angle for that frequency."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


# ---- The CUDA-graph block ---------------------------------------------------------------
# decode_step's arithmetic (_decode_layers) on fixed shapes and fixed addresses, so that a
# step is one graph replay. On a CPU (tests) the same block runs eagerly.


class GraphStep:
    """A graph replays the kernels it recorded, with the same shapes and pointers; whatever
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
        compute garbage that nobody reads, until b <= B / 2, when graph_step makes a new
        GraphStep of b rows (a new capture).
    tok, pos, bias and col are copied into their static buffers before each step; the
    logits come out of a static buffer. A GraphStep serves one cache: its graph holds that
    cache's buffer addresses (graph_step keeps one per cache, on the cache itself, so the
    graph and its memory pool go with the cache: the memory plan counts one pool per
    sub-batch, support/device_memory.py).
    """

    runs = 0  # steps run, all instances together (tests: proof the block ran)
    setups = 0  # GraphSteps made (on a GPU: graphs captured)
    WARMUP = 3  # eager runs on a side stream before a capture, as torch.cuda.graph's docs ask

    def __init__(self, model, layers: list[PreallocatedLayer], rows: int):
        first = layers[0]
        if any(layer.k_live.data_ptr() != layer.k_buffer.data_ptr() for layer in layers):
            raise RuntimeError("the live rows must be the first rows of the cache's buffers")
        dev, C, written = first.k_buffer.device, first.k_buffer.shape[2], first.length
        dtype = model.model.embed_tokens.weight.dtype  # the residual stream's, as in decode_step
        self.model, self.rows, self.min = model, rows, torch.finfo(dtype).min
        self.buffers = [(layer.k_buffer, layer.v_buffer) for layer in layers]  # to notice grow()
        self.tok = torch.zeros(rows, dtype=torch.long, device=dev)  # [B] each row's previous token
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=dev)  # [B, 1] its position
        self.bias = torch.full((rows, 1, 1, C), self.min, dtype=dtype, device=dev)  # [B, 1, 1, C]
        self.col = torch.zeros(1, dtype=torch.long, device=dev)  # [1] the new position's column
        self.k = [k[:rows] for k, _ in self.buffers]  # [B, kv, C, D] views: fixed addresses
        self.v = [v[:rows] for _, v in self.buffers]
        for k, v in zip(self.k, self.v):  # not written yet: finite (see above)
            k[:, :, written:].zero_()
            v[:, :, written:].zero_()
        self.graph, self.logits = None, None  # logits [B, V]: the output of the last step
        GraphStep.setups += 1

    def _step(self) -> torch.Tensor:
        """_decode_layers on the static buffers: logits [B, V]."""
        def write_kv(i, k, v):  # k, v [B, kv, 1, D] into column col; out all C: [B, kv, C, D]
            return self.k[i].index_copy_(2, self.col, k), self.v[i].index_copy_(2, self.col, v)
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
        GraphStep.runs += 1
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
            try:
                with torch.cuda.graph(self.graph):
                    self.logits = self._step()  # [B, V] in the graph's pool; replays rewrite it
            except RuntimeError as err:  # out of memory too: the plan counts the pool (plan.guard)
                self.graph = None
                raise CaptureError(f"capturing the decode step of {self.rows} rows as a CUDA graph "
                                   f"failed ({type(err).__name__}: {err})") from err


def graph_step(model, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache):
    """decode_step through the cache's GraphStep (a CUDA graph on a GPU, the same block run
    eagerly on a CPU): logits [b, V]. `cache` is the sampler's (prefill_prompts's)."""
    layers = cache.layers
    b, S = mask.shape  # S - 1 positions cached; the new one goes to column S - 1
    if layers[0].length != S - 1:
        raise ValueError(f"the cache holds {layers[0].length} positions, the mask {S - 1}")
    if S > layers[0].k_buffer.shape[2]:  # more than planned: grow (new buffers, so a new capture)
        for layer in layers:
            layer.grow(2 * S)
    step = getattr(cache, "graph_step", None)
    if (step is None or not b <= step.rows < 2 * b  # first step, or half the rows or fewer left
            or any(layer.k_buffer is not k for layer, (k, _) in zip(layers, step.buffers))):  # grew
        step = cache.graph_step = GraphStep(model, layers, b)
    logits = step(tok, pos, mask)  # [b, V]
    for layer in layers:  # one position more, as cache.update leaves it
        layer.set_length(S)
    return logits
