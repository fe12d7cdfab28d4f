"""memory_plan.py on the paper's setup: Qwen2.5-7B-Instruct (its config.json below; no
weights, no network), 32 queries x 8 rollouts, 2,048-token prompts and actions, on an
80 GB and a 141 GB card; refusals name the knob; the CPU default has no limit."""

import json
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import train
from tools import network_tools
from support.config import ConfigError, load_config
from support import datasets, device_memory
from support.device_memory import GB, plan_for

ROOT = Path(__file__).resolve().parents[1]
SEVEN_B = ROOT / "configs" / "qwen2.5-7b-1gpu.yaml"

# Qwen/Qwen2.5-7B-Instruct's config.json (as published with the model; its card: 28
# layers, 28 query heads and 4 key/value heads, untied embeddings, 7.61B parameters of
# which 6.53B are not embeddings).
QWEN_7B = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
           "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
           "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
           "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
           "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
           "use_sliding_window": False, "vocab_size": 152064}
PAPER_LENGTHS = ("model.max_prompt_tokens=2048", "agent.planner.max_new_tokens=2048",
                 "agent.executor.max_new_tokens=2048", "agent.generator.max_new_tokens=2048")


def empty_weights(folder: Path) -> None:
    """Qwen2.5-7B's four shard names in an index, each an empty file: the preflight looks for
    every weight file a model names (a half download is refused); nothing here loads them."""
    shards = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {s: s for s in shards}}))
    for s in shards:
        (folder / s).touch()


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory, default_model_path) -> str:
    """Qwen2.5-7B-Instruct's config.json, no weights (empty stand-ins), beside a chat
    tokenizer (the default model's: the checks before a run read it; the plan never does)."""
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp("qwen7b")
    AutoTokenizer.from_pretrained(default_model_path).save_pretrained(d)
    (d / "config.json").write_text(json.dumps(QWEN_7B))
    empty_weights(d)
    return str(d)


def plan(model_dir, *overrides):
    return plan_for(load_config(str(SEVEN_B), [f"model.name={model_dir}", *overrides]))


def test_the_7b_shape_is_counted_exactly(qwen7b):
    p = plan(qwen7b, "model.memory_gb=80")
    h, I, V, kv = 3584, 18944, 152064, 4 * 128
    block = (h * h + h) + 2 * (h * kv + kv) + h * h + 3 * h * I + 2 * h  # q (+bias), k, v (+bias), o, MLP, 2 norms
    assert p.shape.params == 28 * block + 2 * V * h + h  # blocks, untied embedding and lm_head, final norm
    assert p.shape.trained == 8 * block + h  # train_layers 8 + the final norm
    assert round((p.shape.params - 2 * V * h) / 1e9, 2) == 6.53  # the card's non-embedding count
    assert p.shape.kv_bytes_per_token(2) == 2 * 28 * 4 * 128 * 2  # 57,344 bytes of keys and values a token


@pytest.mark.parametrize("gb", [80, 141])
def test_the_paper_setup_fits(qwen7b, gb, capsys):
    """256 rollouts of 2,048 + 2,048 tokens: the sampler runs them in sub-batches sized to what
    the resident memory (weights once, masters, AdamW, fp32 grads) leaves; the update at
    the config's micro_batch fits beside it. The printed plan says so."""
    p = plan(qwen7b, f"model.memory_gb={gb}", *PAPER_LENGTHS)
    assert p.fits, p.text()
    assert p.peak <= gb * GB and p.resident + p.update <= gb * GB
    assert p.rows_per_sub_batch >= (100 if gb == 80 else 256)  # 141 GB: all 256 rollouts in one sub-batch
    assert p.sub_batch_bytes and p.prefill_tokens == 8192 and p.update_tokens == p.micro_batch * 4096
    assert p.micro_batch >= 2  # micro_batch: auto, the plan's choice
    # On disk: a checkpoint is the trained weights in fp32 (masters) and two moments, the export
    # the whole bf16 model; two checkpoints at once is the most a run holds.
    assert p.checkpoint_bytes == 12 * p.shape.trained and p.export_bytes == 2 * p.shape.params
    assert p.disk_bytes == 2 * p.checkpoint_bytes and "out_dir needs" in p.text()
    # The frozen reference shares the 20 frozen blocks: one copy of the weights (~15 GB in
    # bf16), not two, and only the trained ~1.9B parameters are copied.
    assert 15.0 * GB < p.items[0][1] < 15.5 * GB and p.items[1][1] < 4 * GB
    print(p.text())
    out = capsys.readouterr().out
    assert "fits" in out and "rows per sub-batch" in out


@pytest.mark.parametrize("gb", [80, 141])
def test_micro_batch_auto_is_the_most_that_fits(qwen7b, gb):
    p = plan(qwen7b, f"model.memory_gb={gb}", *PAPER_LENGTHS)
    assert p.fits and 1 <= p.micro_batch <= device_memory.AUTO_MICRO_BATCH
    one_more = plan(qwen7b, f"model.memory_gb={gb}", f"train.micro_batch={p.micro_batch + 1}", *PAPER_LENGTHS)
    assert not one_more.fits or p.micro_batch == device_memory.AUTO_MICRO_BATCH
    assert f"update: activations, {p.micro_batch} x 4096 tokens" in p.text()  # --plan shows the choice


def test_micro_batch_auto_without_a_budget_and_bad_values(tiny_model_dir):
    cfg = load_config(str(ROOT / "config.yaml"), [f"model.name={tiny_model_dir}", "train.micro_batch=auto"])
    assert plan_for(cfg).micro_batch == device_memory.AUTO_MICRO_BATCH
    for bad in ("0", "big", "2.5"):
        with pytest.raises(ConfigError, match="train.micro_batch.*auto"):
            load_config(str(ROOT / "config.yaml"), [f"train.micro_batch={bad}"])


def test_refusals_name_the_knob(qwen7b):
    p = plan(qwen7b, "model.memory_gb=80", "train.micro_batch=4", *PAPER_LENGTHS)
    assert not p.fits and "train.micro_batch" in p.problems[0] and "DOES NOT FIT" in p.text()
    p = plan(qwen7b, "model.memory_gb=40")  # the weights and optimizer state alone are ~52 GB
    assert not p.fits and "train.train_layers" in p.problems[0]
    p = plan(qwen7b, "model.memory_gb=80", "train.micro_batch=1", "model.max_prompt_tokens=200000")
    assert any("model.max_prompt_tokens" in q for q in p.problems)


def test_the_plan_prints_without_a_gpu_or_weights(qwen7b, capsys, monkeypatch):
    monkeypatch.setattr(train, "load_model", lambda *a, **k: pytest.fail("--plan must not load the model"))
    assert train.main([str(SEVEN_B), f"model.name={qwen7b}", "model.memory_gb=80", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "budget 80.0 GB" in out and "fp32 masters" in out and "fits" in out
    assert train.main([str(SEVEN_B), f"model.name={qwen7b}", "model.memory_gb=30", "--plan"]) == 3


def test_a_run_that_cannot_fit_stops_before_loading_anything(qwen7b, tmp_path, capsys, monkeypatch):
    for name in ("load_model", "build_tools"):
        monkeypatch.setattr(train, name, lambda *a, **k: pytest.fail("the plan must refuse first"))
    monkeypatch.setenv("GOOGLE_API_KEY", "k")
    monkeypatch.setenv("GOOGLE_CSE_ID", "cx")
    monkeypatch.setenv("SERPER_API_KEY", "k")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "q?", "answer": "a"}) + "\n")
    rc = train.main([str(SEVEN_B), f"model.name={qwen7b}", "model.memory_gb=40", f"out_dir={tmp_path / 'run'}",
                     f"data.train={data}", f"data.heldout={data}", "tools.contact=tests@example.org"])
    assert rc == 3
    err = capsys.readouterr().err
    assert "memory plan error" in err and "train.train_layers" in err


def test_the_cpu_default_has_no_limit(tiny_model_dir):
    cfg = load_config(str(ROOT / "config.yaml"), [f"model.name={tiny_model_dir}", "model.device=cpu"])
    p = plan_for(cfg)
    assert p.budget is None and p.fits and p.sub_batch_bytes is None and p.prefill_tokens is None
    assert p.update_tokens == 0  # micro-batches by rows only, as before
    assert "no limit" in p.text()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_update_activations_bound_what_autograd_saves(dtype):
    """The plan's largest update term, counted for real: every tensor autograd saves for
    the backward pass of a forward through a Qwen2 whose top 2 of 4 blocks train (distinct
    storages, parameters excluded) is within the plan's per-token figure, and the figure
    is not loose by more than a fifth (measured: 8% over in bf16, 6% in fp32; the first
    trained block keeps less, its input needing no gradient)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from support import optim
    from support.device_memory import model_shape, saved_per_token_layer

    cfg = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    optim.select_trainable(model, 2)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    n, L = 2, 96
    ids = torch.randint(0, 256, (n, L))
    mask = torch.ones(n, L, dtype=torch.long)
    mask[0, :10] = 0  # a left-padded row, as the trainer's batches have
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            saved[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.base_model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    measured = sum(saved.values()) / (n * L)
    s = torch.finfo(getattr(torch, dtype)).bits // 8
    shape = model_shape(cfg, 2)
    planned = 2 * saved_per_token_layer(shape, s, L) + (4 + s) * shape.hidden  # as make_plan counts them
    assert measured <= planned <= 1.2 * measured, (measured, planned)


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensors the ops under it create while they are referenced;
    `peak` is the most a function's temporaries held at once. Views and in-place results
    share an input's storage and are not new."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self.free, nbytes)
        return out

    def free(self, nbytes):
        self.live -= nbytes


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_logits_chunk_bounds_its_temporaries(dtype):
    """The plan's logits term, counted for real: the live temporaries of ChunkedLogprobs'
    forward (log-probs and entropies) and backward are within chunk x V x
    chunk_bytes_per_logit, and that figure is not loose by more than a tenth."""
    from flow_grpo import ChunkedLogprobs
    from support.device_memory import chunk_bytes_per_logit

    M, d, V, chunk = 48, 32, 4096, 16
    dt = getattr(torch, dtype)
    torch.manual_seed(0)
    h = torch.randn(M, d, dtype=dt, requires_grad=True)
    weight, targets = (torch.randn(V, d) * 0.1).to(dt), torch.randint(0, V, (M,))
    with LiveBytes() as mem:
        logp, entropy = ChunkedLogprobs.apply(h, weight, None, targets, 0.7, chunk)
        logp.sum().backward()
    planned = chunk * V * chunk_bytes_per_logit(torch.finfo(dt).bits // 8)
    beside = 4 * M * d * 4 + 8 * M * 4  # h's gradient and its copies, the [M] outputs: not per logit
    assert 0.9 * planned <= mem.peak <= planned + beside, (mem.peak, planned)


def test_the_7b_config_is_planned_offline(monkeypatch, capsys):
    """`python train.py configs/qwen2.5-7b-1gpu.yaml model.memory_gb=80 --plan` on a machine
    that never saw the hub: the architecture kept in configs/architectures/ is read, the
    network is never asked."""
    from transformers import AutoConfig

    real = AutoConfig.from_pretrained

    def local_only(name, *a, **k):
        assert k.get("local_files_only") or Path(name).is_dir(), "the plan asked the hub"
        return real(name, *a, **k)

    monkeypatch.setattr(AutoConfig, "from_pretrained", local_only)
    assert train.main([str(SEVEN_B), "model.memory_gb=80", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "Qwen/Qwen2.5-7B-Instruct in bfloat16 on cuda, budget 80.0 GB" in out and "fits" in out
    assert "7.62B parameters" in out  # the kept architecture is Qwen2.5-7B's


def test_the_plan_states_what_the_evaluations_cost():
    """The 7B config's evaluations in the plan: 200 items in 4 batches of 64 at up to 10 turns,
    before, after and every 10 of 60 steps; each row at most 10 x (256 + 512 + 1) + 512 decode
    steps a sub-batch, and a time on CUDA; an evaluation switched off says so."""
    cfg = load_config(str(SEVEN_B), ["model.memory_gb=80"])
    p = plan_for(cfg)
    sub_batches = -(-64 // p.rows_per_sub_batch)
    first, each = p.evaluation
    assert "200 held-out items" in first and "batches of 64" in first and "up to 10 turns" in first
    assert "7 times" in first  # before, after, and after steps 10, 20, 30, 40, 50 (60 is "after")
    assert f"at most {4 * sub_batches * (10 * (256 + 512 + 1) + 512):,} decode steps" in each
    assert "min on an H200" in each and each in p.text()
    limited = plan_for(load_config(str(SEVEN_B), ["model.memory_gb=80", "eval.limit=64", "eval.max_turns=3"]))
    assert f"at most {sub_batches * (3 * (256 + 512 + 1) + 512):,} decode steps" in limited.evaluation[1]
    off = plan_for(load_config(str(SEVEN_B), ["model.memory_gb=80", "train.eval_before_after=false",
                                              "train.eval_every=0"]))
    assert off.evaluation == ["evaluation: none (train.eval_before_after false, train.eval_every 0)"]


def test_the_plan_states_the_whole_run(tmp_path, monkeypatch, tiny_model_dir):
    """The 7B config's whole run: 60 steps of 256 rollouts at up to 3 turns, the 7 evaluations
    and the paper suite (two benchmark files here, of 3 and 70 items: 1 and 2 batches of 64)
    twice, 6 checkpoints; on CUDA its hours at the decode and update rates; the model, data and
    checkpoints on disk; a web-search call every turn at most. The offline default: no hours,
    no web-search calls."""
    for name, n in (("aime24", 3), ("amc23", 70), ("not_in_table_1", 5)):
        (tmp_path / f"{name}.json").write_text(json.dumps([{}] * n))
    monkeypatch.setattr(datasets, "BENCHMARKS", tmp_path)
    (tmp_path / "train.jsonl").write_text("x" * 10**6)
    data = [f"data.train=[{tmp_path / 'train.jsonl'}]", f"data.heldout={tmp_path / 'absent.jsonl'}"]
    cfg = load_config(str(SEVEN_B), ["model.memory_gb=80", *data])
    p = plan_for(cfg, web_tools=network_tools(cfg))
    first, step, disk, web = p.whole_run
    assert "60 steps" in first and "2 of 10 benchmarks" in first and "73 items" in first and "6 checkpoints" in first
    row = 10 * (256 + 512 + 1) + 512  # an evaluation row's decode steps at most, 10 turns
    rollout = -(-256 // p.rows_per_sub_batch) * (3 * (256 + 512 + 1) + 512)
    weight_gb = p.export_bytes / GB
    decode_s = device_memory.CUDA_DECODE_S_PER_WEIGHT_GB * weight_gb
    update_s = 256 * 3 * (2048 + 256) * device_memory.CUDA_UPDATE_S_PER_TOKEN_WEIGHT_GB * weight_gb
    decodes = 7 * 4 * row + 2 * (1 + 2) * row  # the evaluations, 4 batches of 200 items; the suite, twice
    for card, slower in (("H200", 1), ("H100", 1.4)):
        hours = (60 * (rollout * decode_s * slower + update_s) + decodes * decode_s * slower) / 3600
        assert f"{hours:.1f} h on an {card}" in first
    assert f"a step at most {rollout:,} decode steps" in step and "768 rows x 2,304 tokens" in step
    assert disk.startswith(f"  disk in all: {(p.weight_bytes + 1e6 + p.disk_bytes) / GB:.2f} GB") and "1.0 MB" in disk
    assert f"not here: {tmp_path / 'absent.jsonl'}" in disk
    calls = 60 * 32 * 8 * 3 + 7 * 200 * 10 + 2 * 73 * 10  # training, the evaluations, the suite: 10 turns each
    assert f"at most {calls:,} (Wikipedia_Search, Google_Search, Web_Search" in web
    cpu = plan_for(load_config(str(ROOT / "config.yaml"), [f"model.name={tiny_model_dir}", "model.device=cpu"]))
    assert cpu.whole_run[0].endswith("hours estimated on CUDA only") and len(cpu.whole_run) == 3
    assert cpu.whole_run[-1] == "  no web-search calls (offline tools: Base_Generator, Python_Coder, Local_Search)"
    assert cpu.text().endswith(cpu.whole_run[-1])  # --plan ends with the whole run


def test_no_reference_where_nothing_reads_it(qwen7b, tiny_model_dir):
    """With beta 0 and the frozen modules on a model of their own, nothing reads pi_ref:
    the plan has no line for its copies and its peak is lower by exactly them. Beta 0 with
    model.planner empty keeps them (they are the modules' weights), as does beta > 0."""
    ref_line = "the reference's copies"
    two = (f"model.planner={qwen7b}", f"model.name={tiny_model_dir}", "model.device=cpu",
           "train.micro_batch=2")  # no budget, a fixed micro-batch: nothing spends the room saved
    kept, gone = plan(qwen7b, *two), plan(qwen7b, *two, "train.beta=0")
    assert any(ref_line in what for what, _, _ in kept.items)
    assert not any(ref_line in what for what, _, _ in gone.items) and ref_line not in gone.text()
    copies = kept.shape.trained * 2  # bf16
    assert gone.resident == kept.resident - copies and gone.peak == kept.peak - copies
    shared = plan(qwen7b, "model.device=cpu", "train.beta=0")  # the modules run the reference
    assert any(ref_line in what for what, _, _ in shared.items)
