"""The CUDA-graph block of the engine (engine.graph_step, GraphStep): on a GPU it is replayed
as a CUDA graph; on a CPU the very same block runs eagerly (LLM.graphs turned on), and here
it must give what decode_step gives, in the sampler's own loop: rows of different lengths
behind a shared prefix, rows that finish early (the batch shrinks inside fixed buffers),
sub-batches, sampled tokens, in float32 and bfloat16.

Every test counts GraphStep.runs: a graph block that silently fell back to decode_step
would still give the right tokens, and must fail here."""

import gc

import pytest
import torch
from transformers import DynamicCache

from engine import LLM, GraphStep, SamplingParams, decode_step, graph_step
from test_sampler import QUESTIONS, SYSTEM, tiny_qwen2


def qwen2_llm(tiny_llm, monkeypatch, dtype=torch.float32, **kw) -> LLM:
    """An LLM over a tiny random Qwen2 (q/k/v biases) with the real tokenizer, decoding
    through the graph block (as on CUDA)."""
    model = tiny_qwen2(tiny_llm.model.config.vocab_size)
    with torch.no_grad():  # at the default init every row repeats one token; these vary
        model.model.embed_tokens.weight.normal_(0, 0.3)
        model.lm_head.weight.normal_(0, 0.3)  # decisive greedy choices, as conftest's tiny Llama
    llm = LLM(model.to(dtype), tiny_llm.tok, **kw)
    llm.graphs = True
    return llm


def prompts_of(llm: LLM) -> list[list[int]]:
    """A shared prefix (system prompt), rests of different lengths, rows that share their
    question beyond it (pads in the middle of the layout), a duplicate."""
    plain = [llm.chat_ids(SYSTEM, q, "Tool:") for q in QUESTIONS]
    memory = [llm.chat_ids(SYSTEM, f"{q}\nMemory: {m}") for q in QUESTIONS[1:3]
              for m in ("none yet", "Turn 1 found the year 1204.")]
    prompts = plain + memory + plain[:1]
    assert len({len(p) for p in prompts}) > 3
    return prompts


def sample_both(llm: LLM, prompts, params, seed=0, row_stops=None):
    """(the samples of decode_step, of the graph block, its steps run, GraphSteps made)."""
    llm.graphs = False
    ref = llm.sample(prompts, params, seed=seed, row_stops=row_stops)
    llm.graphs = True
    runs, setups = GraphStep.runs, GraphStep.setups
    ours = llm.sample(prompts, params, seed=seed, row_stops=row_stops)
    return ref, ours, GraphStep.runs - runs, GraphStep.setups - setups


def assert_same(ref, ours, tol=1e-5):
    for a, b in zip(ref, ours, strict=True):
        assert a.ids == b.ids and a.finish == b.finish and a.text == b.text
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < tol


def early_finishes(llm: LLM, prompts, n: int):
    """Row stops and an extra EOS id, taken from greedy text, that end five of the nine
    rows at different steps after the first decode step (rows 0, 3, 4, 6 on a stop
    string, the text of their tokens k-1 and k; row 2 on its 5th token, now an EOS id);
    the other rows run to the length limit."""
    llm.graphs = False
    free = llm.sample(prompts, SamplingParams(0.0, max_new_tokens=n))
    row_stops = [()] * len(prompts)
    for r, k in ((0, 3), (3, 5), (4, 8), (6, 11)):
        row_stops[r] = (llm.tok.decode(free[r].ids[k - 1:k + 1]),)
    eos_extra = free[2].ids[4]
    return row_stops, eos_extra


def finish_steps(samples) -> list[int]:
    """How many tokens each row drew before it ended early (the rows that did)."""
    return sorted(len(s.ids) for s in samples if s.finish != "length")


def test_greedy_equals_step_float32(tiny_llm, monkeypatch):
    llm = qwen2_llm(tiny_llm, monkeypatch)
    prompts = prompts_of(llm)
    params = SamplingParams(0.0, max_new_tokens=16)
    ref, ours, runs, setups = sample_both(llm, prompts, params)
    assert_same(ref, ours)
    assert runs == params.max_new_tokens - 1 and setups == 1  # every decode step was static, one capture
    assert {s.finish for s in ours} == {"length"}


@pytest.mark.parametrize("check_every", [1, 8])
def test_rows_finishing_early_float32(tiny_llm, monkeypatch, check_every):
    """Rows end at different steps (stop strings, EOS, the length limit): the live rows move
    down inside the buffers, the garbage rows behind them are ignored, and once half the
    rows or fewer are left the step is set up (captured) again at the smaller size."""
    llm = qwen2_llm(tiny_llm, monkeypatch, check_every=check_every)
    prompts = prompts_of(llm)
    row_stops, eos_extra = early_finishes(llm, prompts, 20)
    llm.eos_ids = sorted(llm.eos_ids + [eos_extra])
    params = SamplingParams(0.0, max_new_tokens=20)
    ref, ours, runs, setups = sample_both(llm, prompts, params, row_stops=row_stops)
    assert_same(ref, ours)
    assert {s.finish for s in ours} == {"eos", "stop", "length"}
    ended = finish_steps(ours)
    assert len(ended) >= len(prompts) // 2 + 1 and ended[0] > 1  # all after the first decode step: B = 9
    assert runs == params.max_new_tokens - 1 and setups == 2  # 9 rows, then 4 (9 >= 2 x 4), no more


def test_sampled_tokens_equal_step(tiny_llm, monkeypatch):
    """Only the logits' path changes, not the draw: at temperature 1 with the same seed the
    same tokens, also with rows that end early, up to the first draw on a boundary, which no
    two ways of summing can rule out. engine.draw picks token i when the row's uniform u falls
    in [c_{i-1}, c_i) of the running sum of probabilities: a u within ~1e-7 of a boundary c_i
    (the two ways' float32 logits differ by that much) lands in token i for one way and in
    its neighbour i + 1 for the other. After such a draw the two batches may differ in which
    rows a stop string ends, and each step draws one uniform per live row, so every later
    row can get another uniform: the comparison holds up to that first step. So: all rows
    equal before it, and at it only neighbours in the vocabulary, in one or two rows."""
    llm = qwen2_llm(tiny_llm, monkeypatch)
    prompts = prompts_of(llm) * 2
    params = SamplingParams(1.0, max_new_tokens=12, stop=("an",))  # most rows end, at different steps
    ref, ours, runs, setups = sample_both(llm, prompts, params, seed=7)
    assert runs == params.max_new_tokens - 1 and setups >= 2 and {s.finish for s in ours} == {"stop", "length"}
    assert len({tuple(s.ids) for s in ours}) > len(prompts) // 2  # a real draw: copies differ
    first = {k: next((j for j, (x, y) in enumerate(zip(a.ids, b.ids)) if x != y), None)
             for k, (a, b) in enumerate(zip(ref, ours))}
    j0 = min((j for j in first.values() if j is not None), default=params.max_new_tokens)
    for a, b in zip(ref, ours):  # every row, up to the first boundary draw of any row
        assert a.ids[:j0] == b.ids[:j0]
        assert max((abs(x - y) for x, y in zip(a.logprobs[:j0], b.logprobs[:j0])), default=0.0) < 1e-5
    at_j0 = [k for k, j in first.items() if j == j0]
    assert len(at_j0) <= 2, at_j0
    for k in at_j0:
        assert abs(ref[k].ids[j0] - ours[k].ids[j0]) == 1, (k, j0, ref[k].ids[j0], ours[k].ids[j0])


def test_sub_batches(tiny_llm, monkeypatch):
    """Several sub-batches (each with its own cache, so its own GraphStep): the results
    of decode_step under the same split, and nothing kept once the call is over."""
    from support.device_memory import DECODE_BYTES_PER_LOGIT, kv_bytes_per_token

    llm = qwen2_llm(tiny_llm, monkeypatch)
    prompts = prompts_of(llm)
    params = SamplingParams(0.0, max_new_tokens=8)
    per_row = (max(map(len, prompts)) + 8) * kv_bytes_per_token(llm.model.config, 4) + \
        llm.model.config.vocab_size * DECODE_BYTES_PER_LOGIT
    llm.sub_batch_bytes = 3 * per_row  # about three rows a sub-batch
    before = llm.sub_batches_run
    ref, ours, runs, setups = sample_both(llm, prompts, params)
    subs = (llm.sub_batches_run - before) // 2
    assert subs >= 3 and setups >= subs and runs == subs * (params.max_new_tokens - 1)
    assert_same(ref, ours)
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is GraphStep]  # each went with its cache


def test_bfloat16_step_by_step(tiny_llm, monkeypatch):
    """bfloat16, with rows ending early (check_every 8, as on a GPU). Here the two ways
    cannot be compared token for token over a whole generation: attention over all
    `capacity` columns (the masked ones add exact zeros) sums in other blocks than
    attention over S columns, which moves some of its bfloat16 outputs by one unit in the
    last place, and bfloat16 logits of a 49k vocabulary hold exact and near ties at the
    top, so one flipped token sends a row elsewhere. So both ways run on the SAME inputs
    at every step (the sampler follows "step"'s logits): the static logits must be within
    two bfloat16 roundings (2 x 2^-7 relative) of the step's, and pick the same greedy
    token, or at worst one whose step logit is within twice that distance of the step's
    greedy token's (a tie in bfloat16), and the same token in nearly every row."""
    llm = qwen2_llm(tiny_llm, monkeypatch, torch.bfloat16, check_every=8)
    prompts = prompts_of(llm)
    row_stops, eos_extra = early_finishes(llm, prompts, 20)
    llm.eos_ids = sorted(llm.eos_ids + [eos_extra])
    params = SamplingParams(0.0, max_new_tokens=20)
    llm.graphs = False
    ref = llm.sample(prompts, params, row_stops=row_stops)
    compared = []
    model = llm.model

    def both(tok, pos, mask, cache):
        twin = DynamicCache()  # the cache as it is before this step, for decode_step
        for i, layer in enumerate(cache.layers):
            twin.update(layer.keys.clone(), layer.values.clone(), i)  # [b, kv, S-1, D]
        step = decode_step(model, tok, pos, mask, twin).float()  # [b, V]
        static = graph_step(model, tok, pos, mask, cache).float()  # [b, V]
        tol = 2 * 2 ** -7 * step.abs().max()
        assert (static - step).abs().max() <= tol, ((static - step).abs().max(), tol)
        pick = static.argmax(-1)  # [b] the static way's greedy tokens
        at_most_a_tie = step.gather(-1, pick[:, None])[:, 0] >= step.max(-1).values - 2 * tol  # [b]
        assert at_most_a_tie.all()
        compared.append((tok.shape[0], int((pick == step.argmax(-1)).sum())))
        return step

    llm.decode = both
    runs = GraphStep.runs
    followed = llm.sample(prompts, params, row_stops=row_stops)
    # `both` returned step's logits, so the rows take step's tokens and end where planned;
    # the log-probs differ a little, since the cache `both` copies for step was written by
    # the static step (keys and values that differ from step's in the last bfloat16 place).
    assert_same(ref, followed, tol=1e-2)
    assert GraphStep.runs - runs == len(compared) == params.max_new_tokens - 1
    assert len({b for b, _ in compared}) >= 3  # the batch shrank twice or more
    assert sum(c for _, c in compared) >= 0.95 * sum(b for b, _ in compared)  # nearly all: the same token
    assert {s.finish for s in followed} == {"eos", "stop", "length"}


def test_bfloat16_sampler_runs_static(tiny_llm, monkeypatch):
    """bfloat16 through the sampler's own loop with the graph block (the buffers,
    the bias and index_copy_ in the model's dtype): every decode step static, finite
    log-probs. (Token for token it is compared above, step by step: see there why.)"""
    llm = qwen2_llm(tiny_llm, monkeypatch, torch.bfloat16)
    prompts = prompts_of(llm)
    _, ours, runs, setups = sample_both(llm, prompts, SamplingParams(0.0, max_new_tokens=10))
    assert runs == 9 and setups == 1 and all(len(s.ids) == 10 for s in ours)
    assert all(torch.isfinite(torch.tensor(s.logprobs)).all() for s in ours)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_growth_and_dropped_rows_at_the_step_level(tiny_llm, dtype):
    """graph_step against decode_step, each on its own cache: a cache planned with
    too little room (it grows: new buffers, so a new GraphStep), rows dropped in place
    (garbage rows, then a smaller one), over 40 steps with the same tokens fed to both."""
    from engine import prefill
    from support.kv_cache import preallocated_cache

    model = tiny_qwen2(tiny_llm.model.config.vocab_size).to(dtype)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13] + [20 + i] * (2 * i + 1) for i in range(4)]  # lengths differ
    caches = {"step": preallocated_cache(), "static": preallocated_cache()}  # room for 2 x the prefill
    setups, tol = GraphStep.setups, 1e-5 if dtype == torch.float32 else 2 * 2 ** -7
    with torch.no_grad():
        for cache in caches.values():
            logits, mask = prefill(model, prompts, tiny_llm.pad_id, cache, shareable=[8] * len(prompts))
        planned = caches["static"].layers[0].k_buffer.shape[2]
        tok, pos = logits.argmax(-1), mask.sum(-1, keepdim=True)
        for step in range(40):  # 40 > the capacity: both caches grow
            if step in (10, 20):  # drop rows 1 and 3 (4 -> 2 rows: set up again), then row 0
                keep = torch.tensor([0, 2] if step == 10 else [1])
                for cache in caches.values():
                    cache.batch_select_indices(keep)
                tok, mask, pos = tok[keep], mask[keep], pos[keep]
            mask = torch.cat([mask, torch.ones_like(pos)], -1)
            ref = decode_step(model, tok, pos, mask, caches["step"]).float()  # [b, V]
            ours = graph_step(model, tok, pos, mask, caches["static"]).float()
            assert (ours - ref).abs().max() <= tol * ref.abs().max().clamp(min=1), (step, (ours - ref).abs().max())
            assert caches["static"].layers[0].keys.shape == caches["step"].layers[0].keys.shape
            tok, pos = ref.argmax(-1), pos + 1
    assert caches["static"].layers[0].k_buffer.shape[2] > planned  # it did outgrow its first buffers
    assert GraphStep.setups - setups >= 4  # first step, 2 rows, 1 row, grown buffers


def test_the_device_type_decides(tiny_llm):
    """The graph block is CUDA's: an LLM on a CPU decodes with decode_step, and checks the
    stop rules after every token (one on CUDA would take the graph and look every 8)."""
    llm = LLM(tiny_llm.model, tiny_llm.tok)
    assert llm.device.type == "cpu" and not llm.graphs and llm.check_every == 1
    runs = GraphStep.runs
    llm.sample(prompts_of(llm)[:2], SamplingParams(0.0, max_new_tokens=3))
    assert GraphStep.runs == runs


def test_a_failed_capture_stops_the_run_with_the_plans_knobs(tiny_llm, monkeypatch):
    """A capture that fails (here torch.cuda.graph raising as a driver would, the rest of
    torch.cuda stood in for on a CPU) is a CaptureError; plan.guard turns it into the plan's
    message with the knobs, and an evaluation stops on it rather than score every batch as
    crashed."""
    import contextlib

    import eval as evaluation
    from support.config import load_config
    from support.device_memory import CaptureError, PlanError, plan_for

    llm = qwen2_llm(tiny_llm, monkeypatch)
    made = []
    real_init = GraphStep.__init__
    monkeypatch.setattr(GraphStep, "__init__", lambda self, *a: made.append(self) or real_init(self, *a))
    llm.sample(prompts_of(llm)[:3], SamplingParams(0.0, max_new_tokens=2))
    step = made[0]

    class Stand:  # a stream or a graph that does nothing
        def wait_stream(self, other):
            pass

    def driver_says_no(graph):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    for name, value in (("device", lambda d: contextlib.nullcontext()), ("current_stream", Stand), ("Stream", Stand),
                        ("stream", lambda s: contextlib.nullcontext()), ("CUDAGraph", Stand),
                        ("graph", driver_says_no)):
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(GraphStep, "_step", torch.no_grad()(GraphStep._step))  # as the sampler runs it
    with pytest.raises(CaptureError, match="decode step of 3 rows .* operation not permitted"):
        step._capture()
    assert step.graph is None  # the next step captures afresh, nothing half-made is replayed

    plan = plan_for(load_config("config.yaml", [f"model.name={tiny_llm.model.name_or_path}"]))
    with pytest.raises(PlanError) as stopped, plan.guard("in training step 1"):
        step._capture()
    msg = str(stopped.value)
    assert "operation not permitted" in msg and "in training step 1" in msg and "lower model.memory_gb" in msg

    class Agent:
        def rollout(self, *a, **k):
            step._capture()
    with pytest.raises(CaptureError):
        evaluation._run_batch(Agent(), [], 1, 0, judge=None)
