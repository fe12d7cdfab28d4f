"""The hand-written sampler against a naive reference: recompute the whole sequence for
every new token, no cache, no padding, no batching, no shared prefix."""

import pytest
import torch

import engine
from engine import LLM, SamplingParams, restrict
from support.models import load_model

SYSTEM = "You pick tools. Available: Python_Coder, Local_Search, Base_Generator. Reply with a tool name."
QUESTIONS = ["What is 2+2?", "When was the town of Velmora founded, and by whom?", "Compute 48213 * 9127.",
             "Hi"]


def naive_greedy(model, prompt: list[int], n: int, first_tokens=()) -> tuple[list[int], list[float]]:
    ids, lps = list(prompt), []
    for step in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()  # [V]
        if step == 0 and first_tokens:
            logits = restrict(logits, first_tokens)
        lp = torch.log_softmax(logits, -1)
        tok = int(logits.argmax())
        ids.append(tok)
        lps.append(lp[tok].item())
    return ids[len(prompt):], lps


def prompts_for(llm: LLM) -> list[list[int]]:
    return [llm.chat_ids(SYSTEM, q, "Tool:") for q in QUESTIONS]


def check_against_naive(llm: LLM, prompts, n=12, first_tokens=()):
    params = SamplingParams(temperature=0.0, max_new_tokens=n, first_tokens=first_tokens)
    batched = llm.sample(prompts, params)
    for p, s in zip(prompts, batched):
        ref_ids, ref_lp = naive_greedy(llm.model, p, len(s.ids), first_tokens)
        assert s.ids == ref_ids
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref_lp)) < 1e-4
        assert s.finish in ("eos", "length")
        if s.finish == "length":
            assert len(s.ids) == n
    return batched


def test_cached_batched_greedy_equals_full_recomputation_tiny(tiny_llm):
    prompts = prompts_for(tiny_llm)
    assert len({len(p) for p in prompts}) > 1  # different lengths: padding is exercised
    check_against_naive(tiny_llm, prompts)


def test_cached_greedy_equals_full_recomputation_default_model(default_model_path):
    model, tok = load_model(default_model_path)
    llm = LLM(model, tok)
    out = check_against_naive(llm, prompts_for(llm)[:3], n=10)
    assert all(s.text for s in out)


def test_shared_prefix_is_exact(tiny_llm):
    """The common prefix (system prompt + tool list) is run once and copied; results
    must equal prompts run one at a time (no sharing, no padding)."""
    prompts = prompts_for(tiny_llm) + prompts_for(tiny_llm)[:2]  # duplicates, like G rollouts
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    together = tiny_llm.sample(prompts, params)
    for p, s in zip(prompts, together):
        alone = tiny_llm.sample([p], params)[0]
        assert alone.ids == s.ids
        assert max(abs(a - b) for a, b in zip(alone.logprobs, s.logprobs)) < 1e-4


def test_first_token_restriction(tiny_llm):
    allowed = tuple(tiny_llm.tok.encode(" " + n, add_special_tokens=False)[0]
                    for n in ("Python_Coder", "Local_Search", "Base_Generator"))
    check_against_naive(tiny_llm, prompts_for(tiny_llm), n=4, first_tokens=allowed)
    samples = tiny_llm.sample(prompts_for(tiny_llm) * 8, SamplingParams(20.0, max_new_tokens=2,
                                                                       first_tokens=allowed), seed=5)
    assert all(s.ids[0] in allowed for s in samples)
    assert len({s.ids[0] for s in samples}) > 1  # a real draw, not always the same token


def test_same_seed_same_tokens_and_sampled_logprobs_match(tiny_llm):
    prompts = prompts_for(tiny_llm) * 3
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    a = tiny_llm.sample(prompts, params, seed=7)
    b = tiny_llm.sample(prompts, params, seed=7)
    c = tiny_llm.sample(prompts, params, seed=8)
    assert [s.ids for s in a] == [s.ids for s in b]
    assert [s.ids for s in a] != [s.ids for s in c]
    # The logprob of a sampled token is log softmax(logits / T) at that position.
    for p, s in zip(prompts[:4], a[:4]):
        with torch.no_grad():
            logits = tiny_llm.model(torch.tensor([p + s.ids])).logits[0].float()  # [L, V]
        lp = torch.log_softmax(logits / params.temperature, -1)
        ref = [lp[len(p) - 1 + j, t].item() for j, t in enumerate(s.ids)]
        assert max(abs(x - y) for x, y in zip(ref, s.logprobs)) < 1e-4


def test_greedy_equals_transformers_generate(tiny_llm, default_model_path):
    """transformers' own generate, each prompt alone (its cache, its forward), against the
    sampler's batched rows behind a shared prefix: the same greedy tokens, and log-probs
    that are the log-softmax of generate's raw logits; on the tiny model and the default."""
    for llm in (tiny_llm, LLM(*load_model(default_model_path))):
        prompts = prompts_for(llm) + prompts_for(llm)[:1]  # a duplicate: prefilled once
        params = SamplingParams(0.0, max_new_tokens=10)
        ours = llm.sample(prompts, params)
        for p, s in zip(prompts, ours):
            out = llm.model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, pad_token_id=llm.pad_id,
                                     eos_token_id=llm.eos_ids, output_logits=True, return_dict_in_generate=True)
            ref = out.sequences[0, len(p):].tolist()  # ends at its EOS, as ours does
            assert s.ids == ref, (s.ids, ref)
            ref_lp = [torch.log_softmax(z[0].float(), -1)[t].item() for z, t in zip(out.logits, ref)]
            assert max(abs(a - b) for a, b in zip(s.logprobs, ref_lp)) < 1e-4


def test_bench_concat_cache_samples_what_the_in_place_cache_samples(tiny_llm):
    """scripts.speed_bench's kv_cache_in_place_speedup compares equal work: with each new position
    concatenated onto the cache (speed_bench.ConcatLayer), the sampler draws the same tokens."""
    from unittest.mock import patch

    from scripts import speed_bench
    prompts = prompts_for(tiny_llm) * 2
    hot = SamplingParams(1.0, max_new_tokens=9)
    ours = tiny_llm.sample(prompts, hot, seed=5)
    with patch.object(engine, "preallocated_cache", speed_bench.concat_cache):
        theirs = tiny_llm.sample(prompts, hot, seed=5)
    assert [s.ids for s in ours] == [s.ids for s in theirs]
    assert max(abs(x - y) for a, b in zip(ours, theirs) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_stop_rules(tiny_llm):
    prompts = prompts_for(tiny_llm)
    free = tiny_llm.sample(prompts, SamplingParams(0.0, max_new_tokens=12))
    # A stop string taken from what greedy decoding will write: the row stops right there.
    text = free[0].text
    stop = text[3:6]
    assert stop.strip()
    s = tiny_llm.sample(prompts[:1], SamplingParams(0.0, max_new_tokens=12, stop=(stop,)))[0]
    assert s.finish == "stop" and stop not in s.text and text.startswith(s.text)
    assert s.ids == free[0].ids[:len(s.ids)] and len(s.ids) < 12
    # EOS: force the first token to be EOS; the row ends with it, and its text is empty.
    eos = tiny_llm.eos_ids[0]
    e = tiny_llm.sample(prompts[:2], SamplingParams(0.0, max_new_tokens=12, first_tokens=(eos,)))
    assert all(x.finish == "eos" and x.ids == [eos] and x.text == "" for x in e)
    # Length.
    n = tiny_llm.sample(prompts[:2], SamplingParams(0.0, max_new_tokens=3))
    assert all(len(x.ids) <= 3 for x in n)
    # Per-row stop strings.
    r = tiny_llm.sample(prompts[:2], SamplingParams(0.0, max_new_tokens=12), row_stops=[(stop,), ()])
    assert r[0].finish == "stop" and r[1].ids == free[1].ids


def test_finished_rows_cost_nothing(tiny_llm):
    """Rows that end are dropped from later forwards: count the batch size of each call."""
    prompts = prompts_for(tiny_llm)
    eos = tiny_llm.eos_ids[0]
    sizes = []
    hook = tiny_llm.model.model.embed_tokens.register_forward_hook(lambda m, i, o: sizes.append(o.shape[0]))
    try:
        # Row 0 can only start with EOS (finishes at once); the others must run to the end.
        row_stops = [(), (), (), ()]
        params = SamplingParams(0.0, max_new_tokens=6)
        base = tiny_llm.sample(prompts, params, row_stops=row_stops)
        sizes.clear()
        stop0 = tiny_llm.tok.decode(base[0].ids[:1])
        assert stop0.strip(), "the first greedy token of row 0 must be visible text for this test"
        out = tiny_llm.sample(prompts, params, row_stops=[(stop0,), (), (), ()])
    finally:
        hook.remove()
    assert out[0].finish == "stop" and len(out[0].ids) == 1
    # prefix (1 row) and/or prefill (4 rows), then decode steps that carry only 3 rows
    decode_sizes = sizes[-(params.max_new_tokens - 1):]
    assert decode_sizes and all(s == 3 for s in decode_sizes), sizes
    assert eos is not None


def test_identical_prompts_are_prefilled_once(tiny_llm):
    """The G copies of a prompt run through the prefill as one row, then decode as G rows:
    greedy copies match the unbatched reference, sampled copies draw their own tokens."""
    a, b = prompts_for(tiny_llm)[1:3]
    prompts = [a, b, a, a]
    shapes = []
    hook = tiny_llm.model.model.embed_tokens.register_forward_hook(lambda m, i, o: shapes.append(i[0].shape))
    try:
        sampled = tiny_llm.sample(prompts, SamplingParams(temperature=1.0, max_new_tokens=8), seed=3)
    finally:
        hook.remove()
    # ids [b, L] with L > 1: the shared prefix [1, P], the suffixes; then one token per row
    # ([b] through decode_step, [b, 1] through the model's forward)
    prefill = [s for s in shapes if len(s) == 2 and s[1] > 1]
    assert len(prefill) == 2 and prefill[1][0] == 2 and shapes[-1][0] == 4, shapes  # 2 unique rows in, 4 out
    check_against_naive(tiny_llm, prompts, n=6)
    assert len({tuple(sampled[i].ids) for i in (0, 2, 3)}) > 1  # the copies drew different tokens


def test_empty_batch(tiny_llm):
    assert tiny_llm.sample([], SamplingParams(1.0, 4)) == []


def test_preallocated_cache_equals_dynamic_cache(tiny_llm):
    """The sampler's in-place cache gives the same logits as Hugging Face's DynamicCache
    through a shared prefix (repeat), dropped rows (moved down inside the same buffer),
    and growth past its capacity."""
    from transformers import DynamicCache

    from engine import prefill
    from support.kv_cache import preallocated_cache

    model = tiny_llm.model
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13] + [20 + i] * (i + 1) for i in range(4)]  # shared prefix of 9
    outs = []
    for cache in (DynamicCache(), preallocated_cache()):
        with torch.no_grad():
            logits, mask = prefill(model, prompts, tiny_llm.pad_id, cache, shareable=[8] * len(prompts))
            steps = [logits]
            tok, pos = logits.argmax(-1), mask.sum(-1, keepdim=True)
            for step in range(40):  # 40 > the first capacity (2 x the prefill length): it grows
                if step in (10, 20):  # drop rows 1 and 3, then the first of the two left
                    keep = torch.tensor([0, 2] if step == 10 else [1])
                    before = [layer.keys.untyped_storage().data_ptr() for layer in cache.layers]
                    cache.batch_select_indices(keep)
                    if step == 10 and not isinstance(cache, DynamicCache):  # rows moved down in place
                        assert before == [layer.keys.untyped_storage().data_ptr() for layer in cache.layers]
                    tok, mask, pos = tok[keep], mask[keep], pos[keep]
                mask = torch.cat([mask, torch.ones_like(pos)], -1)
                out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, cache=cache, use_cache=True)
                steps.append(out.logits[:, -1])
                tok, pos = out.logits[:, -1].argmax(-1), pos + 1
        outs.append(steps)
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()


def tiny_qwen2(vocab_size: int):
    """A 2-layer random Qwen2: like Llama, plus biases on q, k and v."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # random init leaves the biases at 0: make them count
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_step_equals_the_hf_forward(tiny_llm, arch):
    """decode_step (the decoder written out for one position) gives the logits of the
    model's own forward, step after step, on left-padded rows behind a shared prefix."""
    from engine import decode_step, prefill
    from support.kv_cache import preallocated_cache

    model = tiny_llm.model if arch == "llama" else tiny_qwen2(tiny_llm.model.config.vocab_size)
    assert model.config.model_type == arch
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13] + [20 + i] * (2 * i + 1) for i in range(4)]  # lengths differ
    caches = {"ours": preallocated_cache(), "hf": preallocated_cache()}
    with torch.no_grad():
        for name, cache in caches.items():
            logits, mask = prefill(model, prompts, tiny_llm.pad_id, cache, shareable=[8] * len(prompts))
        tok, pos = logits.argmax(-1), mask.sum(-1, keepdim=True)
        for _ in range(6):
            mask = torch.cat([mask, torch.ones_like(pos)], -1)
            ours = decode_step(model, tok, pos, mask, caches["ours"])  # [b, V]
            hf = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, cache=caches["hf"],
                       use_cache=True).logits[:, -1]  # [b, V]
            assert torch.allclose(ours, hf, atol=1e-5), (ours - hf).abs().max()
            tok, pos = hf.argmax(-1), pos + 1


def test_decode_step_samples_what_the_forward_samples(tiny_llm, monkeypatch):
    """decode_step (the decoder written out) and the model's own forward (what a decoder it
    does not cover decodes through) in the same loop: the same sampled tokens and log-probs."""
    prompts = prompts_for(tiny_llm)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    steps, real = [], engine.decode_step
    monkeypatch.setattr(engine, "decode_step", lambda *a: steps.append(1) or real(*a))
    ours = tiny_llm.sample(prompts, params, seed=7)
    ran = len(steps)
    monkeypatch.setattr(engine, "DECODE_STEP_MODELS", ())
    theirs = tiny_llm.sample(prompts, params, seed=7)
    assert ran and len(steps) == ran  # decode_step ran the first call, the forward the second
    for a, b in zip(ours, theirs):
        assert a.ids == b.ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_stop_rules_decode_only_where_a_stop_can_end(tiny_llm, monkeypatch):
    """A stop string ends only at a token whose text holds its last character: the tail
    of a row is decoded only after such tokens (here never: no token of these rows holds
    a character of this stop), and finishes are those of decoding after every token."""
    prompts = prompts_for(tiny_llm)
    free = tiny_llm.sample(prompts, SamplingParams(0.0, max_new_tokens=12))
    text = "".join(s.text for s in free)
    absent = next(c for c in "~^|@#%" if c not in text)
    stop = free[1].text[2:4]
    calls = []
    real = tiny_llm.tok.decode
    monkeypatch.setattr(tiny_llm.tok, "decode", lambda ids, **k: calls.append(len(ids)) or real(ids, **k))
    tiny_llm.sample(prompts, SamplingParams(0.0, max_new_tokens=12, stop=("x" + absent,)))
    assert not [n for n in calls if n > 1 and n < 12]  # pieces of one token, the final texts: no tail
    out = tiny_llm.sample(prompts, SamplingParams(0.0, max_new_tokens=12), row_stops=[(), (stop,), (), ()])
    assert out[1].finish == "stop" and out[1].text == free[1].text[:free[1].text.index(stop)]
    assert [s.ids for i, s in enumerate(out) if i != 1] == [s.ids for i, s in enumerate(free) if i != 1]


def test_draw_matches_the_weights_and_never_draws_a_zero_weight():
    """Inverse-CDF sampling: frequencies over 40k draws match w / sum(w) within 5 sigma,
    zero weights (top-k / top-p / first-token cuts) are never drawn, and a uniform that
    rounds up to the total still lands on a token with weight."""
    from engine import draw

    w = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 0.0])  # unnormalised, zeros inside and at both ends
    p = w / w.sum()
    n = 40_000
    toks = draw(w.expand(n, -1), torch.Generator().manual_seed(0))  # [n] one draw per row
    freq = torch.bincount(toks, minlength=len(w)).double() / n
    sigma = (p * (1 - p) / n).sqrt().double()
    assert ((freq - p.double()).abs() <= 5 * sigma + 1e-12).all(), (freq, p)
    assert freq[w == 0].sum() == 0


def test_draw_edge_uniform_at_the_total(monkeypatch):
    from engine import draw

    w = torch.tensor([[0.0, 2.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 4.0]])
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.ones(a[0], a[1]))  # u = the row's total
    assert draw(w, torch.Generator()).tolist() == [2, 4]  # the last index with weight


def test_length_groups_is_the_cheapest_split():
    """The dynamic program against every split of the sorted rows into consecutive runs."""
    import itertools
    import random

    from support.batching import length_groups

    def cost(groups, lengths, c):
        return sum(len(g) * max(lengths[r] for r in g) + c for g in groups)

    rnd = random.Random(0)
    for trial in range(30):
        lengths = [rnd.randint(1, 60) for _ in range(rnd.randint(1, 9))]
        c = rnd.choice([0, 5, 16, 100])
        groups = length_groups(lengths, c)
        assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
        order = sorted(range(len(lengths)), key=lambda r: lengths[r])
        best = min(cost([order[a:b] for a, b in zip((0,) + cuts, cuts + (len(order),))], lengths, c)
                   for k in range(len(order))
                   for cuts in itertools.combinations(range(1, len(order)), k))
        assert cost(groups, lengths, c) == best
    assert length_groups([10, 10, 11]) == [[0, 1, 2]]  # 1 pad is cheaper than a second forward
    assert len(length_groups([3, 4, 80, 81])) == 2  # 150 pads are not


BASE = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # the prefix every row of the layout tests shares


@pytest.mark.parametrize("shared", [False, True])
def test_grouped_prefill_equals_one_batch(tiny_llm, monkeypatch, shared):
    """Rows of very different lengths run as separate batches behind the shared prefix
    (and, with `shared`, rows that share more run that part once per shared group); the
    logits, the laid-out cache (decoded from for 5 more steps) and the gradient are those
    of the one left-padded batch where each row computes all of its own tokens."""
    from engine import decode_step, last_hidden, prefill
    from support import batching
    from support.batching import length_groups, shared_text_groups
    from support.kv_cache import preallocated_cache

    model = tiny_llm.model
    if shared:  # rows 0, 1 share 12 more tokens, rows 2, 3 share 10; row 4 shares nothing more
        heads = [list(range(30, 42))] * 2 + [list(range(50, 60))] * 2 + [[]]
        shareable = [len(BASE) + len(h) + n - 1 for h, n in zip(heads, [1, 60, 3, 58, 2])]  # all but the last
    else:
        heads, shareable = [[]] * 5, [8] * 5
    prompts = [BASE + h + [20 + i] * n for i, (h, n) in enumerate(zip(heads, [1, 60, 3, 58, 2]))]
    groups = shared_text_groups(prompts, shareable, min(len(BASE), min(shareable)))
    assert groups == ([([0, 1], 12), ([2, 3], 10)] if shared else [])
    own = [len(p) - len(BASE) - len(h) for p, h in zip(prompts, heads)]  # tokens each row runs itself
    if not shared:
        own = [n + 1 for n in own]  # the prefix is capped at 8: the 9th token runs with each row
    assert len(length_groups(own)) == 2
    real = torch.tensor([[float(j >= 6 - n) for j in range(6)] for n in own])  # [5, 6] 1 = a computed logit
    assert real.sum() < real.numel()  # short rows have fewer than 6 own positions
    tokens = []  # tokens through the model, per run
    hook = model.model.embed_tokens.register_forward_hook(lambda m, i, o: tokens.append(i[0].numel()))
    runs = {}
    try:
        for name in ("shared", "one batch"):
            if name == "one batch":
                monkeypatch.setattr(engine, "length_groups", lambda lengths: [list(range(len(lengths)))])
                monkeypatch.setattr(batching, "shared_text_groups", lambda seqs, shareable, P: [])
            tokens.clear()
            with torch.no_grad():
                cache = preallocated_cache()
                logits, mask = prefill(model, prompts, tiny_llm.pad_id, cache, shareable)
                steps, tok, pos = [logits], logits.argmax(-1), mask.sum(-1, keepdim=True)
                for _ in range(5):
                    mask = torch.cat([mask, torch.ones_like(pos)], -1)
                    steps.append(decode_step(model, tok, pos, mask, cache))  # [b, V]
                    tok, pos = steps[-1].argmax(-1), pos + 1
            prefill_tokens = sum(tokens[:len(tokens) - 5])  # the 5 decode steps ran 5 x 5 tokens
            model.zero_grad()
            wide = model.lm_head(last_hidden(model, prompts, tiny_llm.pad_id, 6, shareable))  # [5, 6, V]
            wide = wide * real[:, :, None]  # positions a row did not compute itself hold no prediction
            wide.logsumexp(-1).sum().backward()
            runs[name] = (steps, wide.detach(), [p.grad.clone() for p in model.parameters()], prefill_tokens)
    finally:
        hook.remove()
    model.zero_grad()
    (a_steps, a_wide, a_grad, a_tok), (b_steps, b_wide, b_grad, b_tok) = runs["shared"], runs["one batch"]
    assert a_tok < b_tok, (a_tok, b_tok)  # pads skipped; with shared groups, shared text run once
    for a, b in zip(a_steps, b_steps):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert torch.allclose(a_wide, b_wide, atol=1e-5)
    # The gradient sums the same terms in another order (a shared group's keys collect
    # the gradients of all its rows): float32 noise relative to each tensor's scale (the
    # embedding's reaches ~15). In float64 each row's gradient agrees to ~1e-18.
    for a, b in zip(a_grad, b_grad):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max().clamp(min=1), (a - b).abs().max()


def test_sampler_with_shared_text_groups_equals_naive(tiny_llm):
    """Verifier-like prompts: the G rows of a query share the question, then their
    memories differ. The sampler runs each question once; greedy tokens and log-probs
    are those of recomputing every row alone."""
    from support.batching import common_prefix_len, shared_text_groups

    q = [tiny_llm.chat_ids(SYSTEM, f"{question}\nMemory: {m}") for question in QUESTIONS[1:3]
         for m in ("none yet", "Turn 1 found the year 1204.")]
    groups = shared_text_groups(q, [len(p) - 1 for p in q], common_prefix_len(q))
    assert [rows for rows, _ in groups] == [[0, 1], [2, 3]]  # beyond the prefix all four share
    check_against_naive(tiny_llm, q, n=8)


def test_shared_text_groups():
    """Rows group by what they share beyond the common prefix P, within `shareable`."""
    from support.batching import MIN_SHARED, shared_text_groups

    q = list(range(100, 100 + MIN_SHARED + 4))  # a question: MIN_SHARED + 4 tokens
    seqs = [[1] * 10 + q + [7], [1] * 10 + [2] * 30, [1] * 10 + q + [8, 9], [1] * 10 + q + [7, 5]]
    long = [len(s) - 1 for s in seqs]
    assert shared_text_groups(seqs, long, 10) == [([0, 2, 3], len(q))]
    # Rows 0 and 3 share one more token; a group's shared part is what ALL its rows share.
    assert shared_text_groups([seqs[0] + [4], seqs[3]], [len(seqs[0]), len(seqs[3]) - 1], 10) == [([0, 1], len(q) + 1)]
    # `shareable` caps the part: row 0 may share only MIN_SHARED - 1 tokens beyond P: no group.
    assert shared_text_groups(seqs, [10 + MIN_SHARED - 1] + long[1:], 10) == [([2, 3], len(q))]
    assert shared_text_groups(seqs, long, 10 + len(q)) == []  # beyond the question nothing is shared


def test_a_model_decode_step_does_not_cover(tiny_llm):
    """GPT-2 (no decode_step, no `model.model`): grouped prefill and the general HF
    forward in the same loop still equal full recomputation."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from support.batching import length_groups

    torch.manual_seed(0)
    tok = tiny_llm.tok
    cfg = GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=512,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    llm = LLM(GPT2LMHeadModel(cfg).eval(), tok)
    assert llm.model.config.model_type not in engine.DECODE_STEP_MODELS  # decodes through its own forward
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13] + [20 + i] * n for i, n in enumerate([1, 60, 3, 58, 2])]
    assert len(length_groups([len(p) - 8 for p in prompts])) == 2
    check_against_naive(llm, prompts, n=5)


def test_draw_reaches_the_tail_of_a_152k_vocabulary(monkeypatch):
    """Qwen2.5's 152,064 tokens, one of them holding almost all the weight: stored in
    float32 the running sum near 1 moves in steps of 1.2e-7, so nearly all the 152,063
    tail tokens behind it (1e-9 each) had intervals of width zero (and on a GPU, which
    also adds in float32, all of them). With the float64 sum each keeps its own interval:
    a uniform that lands inside token k's interval draws token k."""
    from engine import draw

    V = 152_064
    w = torch.full((1, V), 1e-9)
    w[0, 10] = 1.0  # [1, V] the likely token, then a long tail
    c32 = w.cumsum(-1)[0]
    assert float((c32[11:] == c32[10:-1]).float().mean()) > 0.95  # float32: zero-width intervals
    total = 1.0 + (V - 1) * 1e-9
    for k in (11, 5_000, 100_000, V - 1):  # the middle of tail token k's interval, as a fraction of the total
        frac = (1.0 + (k - 1 - 0.5) * 1e-9 + 1e-9) / total if k > 10 else 0.0
        monkeypatch.setattr(torch, "rand", lambda *a, frac=frac, **kw: torch.full((a[0], a[1]), frac,
                                                                              dtype=kw.get("dtype")))
        assert draw(w, torch.Generator()).item() == k


def test_sub_batches_keep_greedy_results_and_the_budget(tiny_llm, monkeypatch):
    """Rows that do not fit one sub-batch's budget run as successive sub-batches: the same greedy
    tokens as one sub-batch (and as full recomputation), each sub-batch's cache within the budget."""
    from support.device_memory import DECODE_BYTES_PER_LOGIT, kv_bytes_per_token

    prompts = prompts_for(tiny_llm) * 2
    params = SamplingParams(0.0, max_new_tokens=6)
    one = tiny_llm.sample(prompts, params)
    per_token = kv_bytes_per_token(tiny_llm.model.config, 4)
    per_row = tiny_llm.model.config.vocab_size * DECODE_BYTES_PER_LOGIT
    budget = 3 * ((max(map(len, prompts)) + 6) * per_token + per_row)  # about three rows
    caches = []
    real = engine.prefill_prompts

    def spy(*a, **k):
        out = real(*a, **k)
        caches.append((len(a[1]), out[2]))
        return out

    monkeypatch.setattr(engine, "prefill_prompts", spy)
    llm = LLM(tiny_llm.model, tiny_llm.tok)
    llm.sub_batch_bytes = budget
    split = llm.sample(prompts, params)
    assert llm.sub_batches_run >= 3 and sum(n for n, _ in caches) == len(prompts)
    for n, cache in caches:
        held = sum(layer.k_buffer.numel() * 4 + layer.v_buffer.numel() * 4 for layer in cache.layers)
        assert held + n * per_row <= budget, (held, budget)
    for a, b in zip(one, split):
        assert a.ids == b.ids and a.finish == b.finish
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
    check_against_naive(llm, prompts[:5], n=6)


def test_the_cache_is_allocated_once_at_its_final_size(tiny_llm, monkeypatch):
    """Prefix repeat, identical prompts spread to their copies, batches and shared groups laid
    out, rows dropped: all inside the buffers allocated at the first update, never moved."""
    from support.kv_cache import PreallocatedLayer

    moves = []
    monkeypatch.setattr(PreallocatedLayer, "_move", lambda self, *a: moves.append(a))
    q = [tiny_llm.chat_ids(SYSTEM, f"{question}\nMemory: {m}") for question in QUESTIONS[1:3]
         for m in ("none yet", "Turn 1 found the year 1204.")]
    long = tiny_llm.chat_ids(SYSTEM, "word " * 60, "Tool:")
    for prompts in (prompts_for(tiny_llm) * 2, q + [long], [q[0], q[0], q[1]]):
        out = tiny_llm.sample(prompts, SamplingParams(0.0, max_new_tokens=8))
        assert len(out) == len(prompts)
    assert moves == []


def test_a_prefill_token_cap(tiny_llm):
    """With prefill_tokens set, no prefill forward runs more than that many new tokens
    (long texts run in pieces, batches with fewer rows), and greedy results stay those
    of full recomputation."""
    q = [tiny_llm.chat_ids(SYSTEM, f"{question}\nMemory: {m}") for question in QUESTIONS[1:3]
         for m in ("none yet", "Turn 1 found the year 1204.")]
    prompts = prompts_for(tiny_llm) + q + [tiny_llm.chat_ids(SYSTEM, "word " * 60, "Tool:")]
    sizes = []
    hook = tiny_llm.model.model.embed_tokens.register_forward_hook(lambda m, i, o: sizes.append(i[0].numel()))
    llm = LLM(tiny_llm.model, tiny_llm.tok)
    llm.prefill_tokens = 48
    try:
        out = llm.sample(prompts, SamplingParams(0.0, max_new_tokens=5))
    finally:
        hook.remove()
    assert max(sizes) <= 48 and max(map(len, prompts)) > 48
    for p, s in zip(prompts, out):
        ref_ids, ref_lp = naive_greedy(llm.model, p, len(s.ids))
        assert s.ids == ref_ids and max(abs(a - b) for a, b in zip(s.logprobs, ref_lp)) < 1e-4


def test_looking_every_8_tokens_equals_every_token(tiny_llm):
    """The GPU's way (stop rules checked every 8 tokens, tokens kept on the device in the
    meantime) against the CPU's (every token): the same greedy tokens, log-probs and
    finishes, with rows that end on EOS, on a stop string and at the length limit."""
    prompts = prompts_for(tiny_llm)
    free = tiny_llm.sample(prompts, SamplingParams(0.0, max_new_tokens=20))
    stop = free[0].text[3:6]
    row_stops = [(stop,), (), (free[2].text[10:12],), ()]
    eos = tiny_llm.eos_ids[0]
    cases = [(SamplingParams(0.0, max_new_tokens=20), row_stops),
             (SamplingParams(0.0, max_new_tokens=13, first_tokens=(eos,)), None),
             (SamplingParams(0.0, max_new_tokens=3), None)]
    results = {}
    for k in (1, 8):
        llm = LLM(tiny_llm.model, tiny_llm.tok, check_every=k)
        results[k] = [llm.sample(prompts, p, row_stops=rs) for p, rs in cases]
    finishes = set()
    for a_call, b_call in zip(results[1], results[8]):
        for a, b in zip(a_call, b_call):
            assert a.ids == b.ids and a.finish == b.finish and a.text == b.text
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5
            finishes.add(a.finish)
    assert finishes == {"eos", "stop", "length"}


def test_prefill_pieces_cannot_drop_positions(tiny_llm):
    """A prefill that kept k positions, run in pieces of max_tokens // rows columns, used to
    return the last piece's columns only, silently (a 15-token row, k = 6, max_tokens = 5:
    [1, 5, d]). The sampler's prefill keeps one position, each row's last, which the last
    piece holds however narrow the pieces; the trainer's forward keeps k positions in one
    piece (it takes no max_tokens), zeros in front of a row shorter than k."""
    import inspect

    from engine import last_hidden, prefill
    from support.kv_cache import preallocated_cache

    model, pad = tiny_llm.model, tiny_llm.pad_id
    rows = [list(range(5, 20)), list(range(40, 47))]  # 15 and 7 tokens, nothing shared
    with torch.no_grad():
        alone = [model.base_model(torch.tensor([r])).last_hidden_state[0] for r in rows]  # [len, d]
        for cap in (5, 1, None):  # one row a forward in pieces of 5 and 1 columns; one batch
            logits, mask = prefill(model, rows, pad, preallocated_cache(), [len(r) - 1 for r in rows], cap)
            assert logits.shape == (2, model.config.vocab_size) and mask.shape == (2, 15)
            for r, h in enumerate(alone):
                assert torch.allclose(logits[r], model.lm_head(h[-1]), atol=1e-5), cap
        hidden = last_hidden(model, rows[:1], pad, 6, [14])  # [1, 6, d]
        short = last_hidden(model, [rows[1][:4]], pad, 6, [3])  # [1, 6, d]: 2 zeros, 4 positions
    assert "max_tokens" not in inspect.signature(last_hidden).parameters
    assert hidden.shape == short.shape == (1, 6, alone[0].shape[-1])
    assert torch.allclose(hidden[0], alone[0][-6:], atol=1e-5)
    assert (short[0, :2] == 0).all() and torch.allclose(short[0, 2:], alone[1][:4], atol=1e-5)


@pytest.mark.parametrize("cap", [None, 40])
def test_shared_groups_without_a_common_prefix(tiny_llm, cap):
    """Rows that share text in pairs but nothing all together (no prefix run once), with
    and without a prefill cap: greedy tokens and log-probs of full recomputation."""
    q1, q2 = list(range(30, 42)), list(range(50, 60))
    prompts = [q1 + [7], q1 + [8, 9] * 10, q2 + [3] * 20, q2 + [4], [60, 61, 62]]
    llm = LLM(tiny_llm.model, tiny_llm.tok)
    llm.prefill_tokens = cap
    check_against_naive(llm, prompts, n=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pad_rows_without_a_shared_prefix_stay_finite(tiny_llm, dtype):
    """Rows that share no prefix (nothing runs once for all of them) and differ in length by
    far: the left pads of the short rows are queries whose every key is masked, which some
    attention kernels turn into NaN, and a NaN in a pad's value would reach the real tokens
    through 0 * NaN. The prefill's logits must be finite and each row's must equal the row
    run alone; in the dtype a GPU run uses too."""
    import copy

    model = copy.deepcopy(tiny_llm.model).to(dtype)
    prompts = [[7 + i] * n for i, n in enumerate((3, 40, 1, 25))]  # no common first token, lengths 1..40
    alone = torch.stack([model(torch.tensor([p])).logits[0, -1].float() for p in prompts])  # [4, V]
    with torch.no_grad():
        logits, mask, _ = engine.prefill_prompts(model, prompts, tiny_llm.pad_id)
    logits = logits.float()  # [4, V]
    assert torch.isfinite(logits).all()
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert (logits - alone).abs().max() < tol * alone.abs().max(), (logits - alone).abs().max()
