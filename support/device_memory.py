"""The memory plan: what a run holds on its device, from the model's config.json alone.

    python train.py CONFIG [key=value ...] --plan      print the plan, load nothing

Not in the paper (its runs use 8 GPUs); what one GPU needs for its setup: Qwen2.5-7B,
32 queries x 8 rollouts, long prompts and actions. train.py prints this plan at start
and refuses, before any weight is loaded, a plan that cannot fit `model.memory_gb`,
naming the knob to turn. The plan also sets what keeps the run inside it:

  * the sampler runs its rows in sub-batches, each sub-batch's KV cache and decode logits within
    `Plan.sub_batch_bytes` (engine.LLM.sample), its prefill forwards within
    `model.prefill_tokens` tokens;
  * an update's micro-batch holds at most `Plan.update_tokens` tokens (rows x longest
    sequence, flow_grpo.micro_batches).

What is resident all run long, and what comes and goes:

    resident = weights (one copy: the reference shares the frozen ones) + the reference's
               copies of the trained weights + fp32 masters, AdamW moments and fp32
               gradients of the trained weights + a reserve (CUDA context, allocator slack)
    peak     = resident + max(sampler sub-batch, update), never both: gradients are freed
               right after each optimizer step, the cache after each sampler call

The activation figures are upper bounds written from the modules' forward (which tensors
autograd saves per token and layer); `python -m scripts.gpu_check` measures them against a
real device.
Simplified: activation checkpointing by whole trained block only (train.grad_checkpoint), no CPU offload; under torchrun each rank's
device holds a whole plan (replicas, not shards), for its share of the rollouts.
"""

import json
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from support.batching import layout, unique_prompts
from support.datasets import PAPER_TABLE_1, paper_benchmarks

def use_expandable_segments() -> None:
    """Fewer, larger blocks of GPU memory, which the allocator can reuse for tensors of
    other sizes: what the plan's slack assumes. torch reads the setting when CUDA starts,
    so the entry points call this first, before anything (the plan itself) touches CUDA;
    a user's own PYTORCH_CUDA_ALLOC_CONF wins. No effect on a CPU."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


GB = 1e9  # model.memory_gb counts in GB of 10^9 bytes, as GPU memory is sold
# Bytes per vocabulary entry and row of one decode step: the logits in the model's dtype
# and in float32, the log-softmax and its exp, the float64 running sum of the draw.
DECODE_BYTES_PER_LOGIT = 2 + 4 + 4 + 4 + 8


def graph_bytes_per_row(vocab: int, heads: int, intermediate: int, itemsize: int, capacity: int) -> int:
    """On CUDA the decode step is replayed as a CUDA graph (engine.GraphStep), whose private
    memory pool keeps one step's tensors alive for each of its rows: its logits [V] and the
    bias over the cache's `capacity` positions in the model's dtype, the MLP's three
    intermediates, and attention scores over the capacity in float32 per query head (the
    bound where attention materialises them). One pool per sub-batch at a time: a new
    graph replaces the sub-batch's old one."""
    return (vocab + capacity + 3 * intermediate) * itemsize + heads * capacity * 4


@dataclass
class Shape:
    """What the plan needs to know of a model: read from its config, counted on the meta device."""
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int  # unique parameters (tied embeddings counted once)
    trained: int  # parameters that train: select_trainable's, or with LoRA the adapters'
    trained_layers: int  # decoder blocks among them (with LoRA: the blocks with adapters)
    largest_trained: int  # the largest trained tensor (its bf16 gradient exists briefly)
    lora_rank: int = 0  # train.lora_rank: the trained parameters are fp32 adapters (lora.py)
    lora_targets: tuple = ()  # the adapted projections' names (each block's)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Keys and values of one token in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


def model_shape(config, train_layers: int, name: str = "", lora_rank: int = 0, lora_targets=()) -> Shape:
    """Shape of a causal LM from its transformers config; the parameters are counted by
    building the model on the meta device (no memory, no weights), so any architecture
    transformers knows is counted exactly. With lora_rank r the trained parameters are the
    adapters (lora.py): r (in + out) for each projection of `lora_targets` in the top
    train_layers blocks (0: all)."""
    from transformers import AutoModelForCausalLM

    from support.optim import select_trainable

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    trained = [p.numel() for p in select_trainable(model, train_layers)]
    layers, heads, hidden = config.num_hidden_layers, config.num_attention_heads, config.hidden_size
    if lora_rank:  # A [r, in] and B [out, r] for each adapted projection
        blocks = model.get_decoder().layers[-train_layers:] if train_layers > 0 else model.get_decoder().layers
        trained = [lora_rank * n for block in blocks for leaf, m in block.named_modules()
                   if leaf.rpartition(".")[2] in lora_targets and isinstance(m, torch.nn.Linear)
                   for n in (m.in_features, m.out_features)]
    return Shape(
        name=name or getattr(config, "_name_or_path", "") or config.model_type, hidden=hidden,
        intermediate=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden,
        layers=layers, heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or hidden // heads, vocab=config.vocab_size,
        params=sum(p.numel() for p in model.parameters()), trained=sum(trained),
        trained_layers=min(train_layers, layers) if train_layers > 0 else layers,
        largest_trained=max(trained, default=0), lora_rank=lora_rank, lora_targets=tuple(lora_targets))


@dataclass
class Plan:
    shape: Shape
    dtype: str
    device: str
    budget: float | None  # bytes the run may use; None = no limit
    items: list[tuple[str, float, str]] = field(default_factory=list)  # (what, bytes, the knob / a note)
    resident: float = 0.0
    sampler: float = 0.0  # one sub-batch, at the provisioned lengths
    update: float = 0.0
    sub_batch_bytes: int | None = None  # engine.LLM.sub_batch_bytes: a sub-batch's cache + decode logits + graph pool
    prefill_tokens: int | None = None  # engine.LLM.prefill_tokens
    update_tokens: int = 0  # flow_grpo.micro_batches' max_tokens (0 = no cap)
    rows_per_sub_batch: int = 0
    rollout_rows: int = 0  # a step's rollouts on this device, in rollout_sub_batches sampler calls
    rollout_sub_batches: int = 0
    micro_batch: int = 0  # the update's rows per forward this plan was made for (train.micro_batch)
    problems: list[str] = field(default_factory=list)  # why it cannot fit, each naming a knob
    # On disk (support/checkpoints.py): one checkpoint (the trained weights in fp32, as
    # themselves or as masters, and AdamW's moments), the final export (the whole model), and
    # the most a run holds at once: two checkpoints while the newer is written, or the last
    # one beside the export.
    checkpoint_bytes: float = 0.0
    export_bytes: float = 0.0
    evaluation: list[str] = field(default_factory=list)  # what the held-out evaluations cost (evaluation_cost)
    whole_run: list[str] = field(default_factory=list)  # the run in all: hours, disk, web-search calls (whole_run)
    weight_bytes: float = 0.0  # every model's weights (the frozen modules' own model too): the model's disk

    @property
    def disk_bytes(self) -> float:
        return max(2 * self.checkpoint_bytes, self.checkpoint_bytes + self.export_bytes)

    @property
    def peak(self) -> float:
        return self.resident + max(self.sampler, self.update)

    @property
    def fits(self) -> bool:
        return not self.problems

    def text(self) -> str:
        limit = "no limit" if self.budget is None else f"budget {self.budget / GB:.1f} GB (model.memory_gb)"
        out = [f"memory plan: {self.shape.name} in {self.dtype} on {self.device}, {limit}"]
        rows = self.items + [("peak while sampling: resident + one sub-batch", self.resident + self.sampler, ""),
                             ("peak while updating: resident + the update", self.resident + self.update, "")]
        for what, nbytes, note in rows:
            out.append(f"  {what:70s} {nbytes / GB:7.2f} GB" + (f"   {note}" if note else ""))
        if self.budget is None:
            out.append("  no limit to check against (a CPU without model.memory_gb)")
        else:
            out.append(f"  {self.peak / GB:.2f} GB of {self.budget / GB:.1f} GB: "
                       + ("fits" if self.fits else "DOES NOT FIT"))
        out += [f"  to fit: {p}" for p in self.problems]
        out.append(f"disk: a checkpoint {self.checkpoint_bytes / GB:.2f} GB (the trained weights in fp32, AdamW's "
                   f"moments), the final export {self.export_bytes / GB:.2f} GB (the whole model); out_dir needs "
                   f"{self.disk_bytes / GB:.2f} GB free")
        return "\n".join(out + self.evaluation + self.whole_run)

    @contextmanager
    def guard(self, where: str):
        """Running out of memory inside is the plan's error on this machine, not the
        items' or the model's: stop with PlanError, the plan and the knobs that shrink it."""
        knobs = ("lower model.memory_gb (the sampler then runs smaller sub-batches), model.prefill_tokens or "
                 "train.micro_batch")
        try:
            yield
        except torch.OutOfMemoryError as err:
            raise PlanError(f"out of memory {where} ({err}); the plan was:\n{self.text()}\n{knobs}") from err
        except CaptureError as err:
            raise PlanError(f"{err} {where}; each sub-batch's graph pool is planned in \"or: decode logits ...\" "
                            f"below:\n{self.text()}\n{knobs}; a capture that fails with memory to spare is the "
                            f"driver's or torch's: run gpu_check's speed part to see it alone") from err


# Per token and decoder layer, what autograd keeps for the backward pass of a trained
# Llama / Qwen2 block, in bytes, for weights of `s` bytes and sequences of `seq` tokens:
# each RMSNorm keeps its input in float32 (4h), its normalised input and its output (the
# next projections' input; 2 s h); attention keeps q, the keys and values repeated to
# every head (transformers repeats them whenever a padding mask is passed), its output
# and o_proj's input (5 s h), its log-sum-exp (4 per head) and its row of the 4-D mask
# (s per key); the MLP keeps gate, up, act(gate) and their product (4 s I).
# tests/test_memory_plan.py counts what autograd really saves against this.
def saved_per_token_layer(shape: Shape, s: int, seq: int) -> int:
    h, I = shape.hidden, shape.intermediate
    return 2 * (4 + 2 * s) * h + 5 * s * h + 4 * shape.heads + s * seq + 4 * s * I


# The most one layer's forward holds at once without saving anything (a frozen layer, the
# reference, the sampler's prefill): the residual, its norm in float32, then the MLP's
# gate, up and their product.
def transient_per_token_layer(shape: Shape, s: int) -> int:
    h, I = shape.hidden, shape.intermediate
    return s * (4 * h + 3 * I) + 8 * h


# What one chunk of flow_grpo.ChunkedLogprobs holds at once, per position and vocabulary
# entry, for weights of `s` bytes: the forward, the float32 log-softmax, its exp and their
# product (the entropy's terms); the backward, the float32 logits, the softmax times the
# incoming gradient, that over the temperature (all float32) and its cast to the weights'
# dtype (no copy in float32). tests/test_memory_plan.py counts the live temporaries of both
# against this.
def chunk_bytes_per_logit(s: int) -> int:
    return 12 + (s if s < 4 else 0)


SLACK = 0.03  # of the budget: what the allocator may hold beyond the tensors (train.py enables expandable segments)


def reserve_bytes(budget: float, device: str) -> float:
    """Room the plan keeps free: the allocator's slack and, on CUDA, ~1 GB for the context
    (outside torch's counters) and the cuBLAS workspaces (inside them)."""
    return (1 * GB if device == "cuda" else 0.0) + SLACK * budget


def make_plan(shape: Shape, *, dtype: str, device: str, budget: float | None, max_prompt: int, max_new: int,
              planner_new: int, rollout_rows: int, eval_rows: int, micro_batch: int, prefill_tokens: int,
              logits_chunk: int, frozen: Shape | None = None, reference: bool = True,
              checkpointing: bool = False) -> Plan:
    """The plan for one run (all sizes in tokens; budget in bytes or None). `shape` is the
    planner's model; `frozen`, the executor's, verifier's and generator's where it is
    another model (model.planner): its weights are resident too, and the sampler's rows
    are sized for the larger of the two. `reference`: whether the run keeps pi_ref's copies
    of the trained weights (support/models.reference_needed); without it, no line for them.
    `checkpointing` (train.grad_checkpoint): each trained block keeps its input and the keys
    and values its cache holds, and one block's activations exist at a time, recomputed."""
    s = torch.finfo(getattr(torch, dtype)).bits // 8  # bytes per weight
    low = s < 4
    plan = Plan(shape, dtype, device, budget, micro_batch=micro_batch)
    add = plan.items.append
    weights = shape.params * s
    add((f"weights, one copy ({shape.params / 1e9:.2f}B parameters, {dtype})", weights, ""))
    if frozen is not None:
        weights += frozen.params * s
        add((f"the frozen modules' own model ({frozen.params / 1e9:.2f}B parameters)", frozen.params * s,
             "model.name (model.planner is another)"))
    blocks = (f"train.train_layers: {shape.trained_layers} blocks" if shape.trained_layers < shape.layers
              else "train.train_layers 0: every block")
    if shape.lora_rank:  # fp32 adapters (lora.py): no masters; pi_ref is the base without them
        low = False
        add((f"LoRA adapters, fp32 ({shape.trained / 1e6:.1f}M parameters)", shape.trained * 4,
             f"train.lora_rank {shape.lora_rank}: {', '.join(shape.lora_targets)} of {blocks}"))
        if reference:
            add(("the reference: the same weights with the adapters off, no copy", 0.0, "lora.without_adapters"))
    ref_copies = shape.trained * s if reference and not shape.lora_rank else 0
    if reference and not shape.lora_rank:
        add((f"the reference's copies of the trained weights ({shape.trained / 1e9:.2f}B)", ref_copies,
             f"{blocks} + final norm" if shape.trained_layers < shape.layers else "train.train_layers 0: every weight trains"))
    # fp32 master (low precision only), AdamW's two fp32 moments, the fp32 gradient; a
    # bf16 weight's own gradient lives only until its hook moves it (the largest tensor's).
    # The adapters are fp32 weights themselves: their 4 bytes are the line above.
    opt = shape.trained * (4 * 3 + (4 if low else 0)) + (shape.largest_trained * s if low else 0)
    add(("fp32 masters + AdamW moments + fp32 gradients" if low else "AdamW moments + gradients (fp32)", opt, ""))
    reserve = reserve_bytes(budget, device) if budget is not None else 0.0
    if budget is not None:
        add(("reserve: " + ("CUDA context, allocator slack (1 GB + 3%)" if device == "cuda"
                            else "allocator slack (3%)"), reserve, ""))
    plan.resident = weights + ref_copies + opt + reserve + (shape.trained * 4 if shape.lora_rank else 0)
    plan.weight_bytes = weights
    add(("= resident", plan.resident, ""))

    # The sampler: one sub-batch's cache at its final size, plus what its prefill or its
    # decode step needs on top (never both at once).
    rows_of = [shape] + ([frozen] if frozen is not None else [])  # the sampler runs both
    row_kv = (max_prompt + max_new) * max(m.kv_bytes_per_token(s) for m in rows_of)
    row_decode = max(m.vocab for m in rows_of) * DECODE_BYTES_PER_LOGIT
    if device == "cuda":  # the decode step's graph pool (engine.GraphStep)
        row_decode += max(graph_bytes_per_row(m.vocab, m.heads, m.intermediate, s, max_prompt + max_new)
                          for m in rows_of)
    cap = prefill_tokens if budget is not None else None
    prefill = 0.0
    if cap:
        # one forward of `cap` tokens (its largest layer transient and its 4-D mask over
        # every cached key) and the keys and values it materialises (twice: cat on update)
        prefill = cap * (transient_per_token_layer(shape, s) + (max_prompt + max_new) * s
                         + 2 * shape.kv_bytes_per_token(s))
    if budget is not None:
        free = budget - plan.resident - prefill
        plan.rows_per_sub_batch = max(0, int(free // (row_kv + row_decode)))
        plan.sub_batch_bytes = int(max(free, 0))
        plan.prefill_tokens = cap
    rows = min(plan.rows_per_sub_batch, rollout_rows) if budget is not None else rollout_rows
    rollout_sub_batches = -(-rollout_rows // rows) if rows else 0
    plan.rollout_rows, plan.rollout_sub_batches = rollout_rows, rollout_sub_batches
    eval_sub_batches = -(-eval_rows // rows) if rows else 0
    kv = rows * row_kv
    add((f"sampler, one sub-batch: KV cache of {rows} rows x ({max_prompt} + {max_new}) tokens", kv,
         f"rows per sub-batch; {rollout_rows} rollouts in {rollout_sub_batches} sub-batch(es), "
         f"eval.batch_size {eval_rows} in {eval_sub_batches}"
         if budget is not None else f"{rollout_rows} rollouts in one sub-batch"))
    if cap:
        add((f"  or: a prefill forward of at most {cap} tokens", prefill, "model.prefill_tokens"))
    add((f"  or: decode logits of {rows} rows (fp32 softmax, fp64 running sum)"
         + (", the decode graph's pool" if device == "cuda" else ""), rows * row_decode, ""))
    plan.sampler = kv + max(prefill, rows * row_decode)

    # The update: one micro-batch's forward and backward.
    seq = max_prompt + planner_new
    tokens = micro_batch * seq
    # With LoRA each adapted projection also keeps its r-dim A x (lora.LoRALinear), per token.
    lora_saved = len(shape.lora_targets) * shape.lora_rank * s
    block = saved_per_token_layer(shape, s, seq) + lora_saved  # one trained block's, per token
    if checkpointing:  # each block's input and cached keys and values; one block recomputed at a time
        kept = s * shape.hidden + 2 * shape.kv_heads * shape.head_dim * s
        saved = tokens * (shape.trained_layers * kept + block + (4 + s) * shape.hidden)
    else:
        saved = tokens * (shape.trained_layers * block + (4 + s) * shape.hidden)
    transient = tokens * max(saved_per_token_layer(shape, s, seq), transient_per_token_layer(shape, s))
    mask = micro_batch * seq * seq * s
    add((f"update: activations, {micro_batch} x {seq} tokens x {shape.trained_layers} "
         + ("blocks with adapters" if shape.lora_rank else "trained blocks")
         + (", checkpointed: their inputs + one block's" if checkpointing else ""), saved,
         "train.micro_batch, train.train_layers" + (", train.grad_checkpoint" if checkpointing else "")))
    add(("  + one layer's backward or the reference's forward, the 4-D mask", transient + mask, ""))
    chunk = min(logits_chunk, micro_batch * planner_new)
    logits = chunk * shape.vocab * chunk_bytes_per_logit(s)
    add((f"  + the logits of one chunk: {chunk} positions x {shape.vocab}", logits, "train.logits_chunk"))
    # After the backward pass, with the activations gone: torch's foreach AdamW makes one
    # fp32 temporary the size of the trained weights (sqrt of the second moment).
    step = shape.trained * 4
    add(("  or: the optimizer step's temporaries (fp32, foreach AdamW)", step, ""))
    plan.update = max(saved + transient + mask + logits, step)
    plan.update_tokens = tokens if budget is not None else 0
    plan.checkpoint_bytes = shape.trained * (4 * 2 + 4)  # two fp32 moments; fp32 masters or the fp32 weights
    plan.export_bytes = shape.params * s + shape.trained * 4 * (shape.lora_rank > 0)  # + adapter.safetensors

    if budget is not None:
        knobs_update = (f"lower train.micro_batch (now {micro_batch}) or train.train_layers, or the lengths "
                        f"model.max_prompt_tokens ({max_prompt}) / agent.planner.max_new_tokens ({planner_new})")
        if plan.resident > budget:
            plan.problems.append(f"weights and optimizer state alone take {plan.resident / GB:.1f} GB of "
                                 f"{budget / GB:.1f} GB: train fewer blocks (train.train_layers), or raise "
                                 f"model.memory_gb")
        elif plan.resident + plan.update > budget:
            plan.problems.append(f"the update needs {plan.update / GB:.1f} GB beside {plan.resident / GB:.1f} GB "
                                 f"resident: {knobs_update}, or train.logits_chunk")
        if plan.resident <= budget and plan.rows_per_sub_batch < 1:
            plan.problems.append(f"not one sampler row of {max_prompt} + {max_new} tokens fits beside the resident "
                                 f"memory: lower model.max_prompt_tokens or the modules' max_new_tokens "
                                 f"(agent.*.max_new_tokens), or model.prefill_tokens ({cap})")
    return plan


def device_peaks() -> dict:
    """The most GPU memory torch's tensors held, and the most its allocator reserved (what
    the card actually lost, fragmentation included), in GB since the last call, which
    resets both, and whether the allocator's segments are expandable; {} where no GPU is
    in use. A step's row of metrics.jsonl carries them, beside the plan's peaks that
    train.py prints at start."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    segments = torch.cuda.memory_snapshot()
    out = {"gpu_allocated_peak_gb": torch.cuda.max_memory_allocated() / GB,
           "gpu_reserved_peak_gb": torch.cuda.max_memory_reserved() / GB,
           # whether use_expandable_segments was in force when CUDA started (gpu_check reads it)
           "gpu_expandable_segments": bool(segments) and all(seg.get("is_expandable") for seg in segments)}
    torch.cuda.reset_peak_memory_stats()
    return out


def kv_bytes_per_token(config, itemsize: int) -> int:
    """Bytes of the keys and values of one token in every layer of a decoder config:
    2 x layers x kv heads x head dim x itemsize (Shape.kv_bytes_per_token, without a Shape)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * itemsize


def sampler_sub_batches(prompts: list[list[int]], max_new: int, budget: int | None, model) -> list[range]:
    """The sampler's rows in consecutive runs whose KV cache (laid out as engine.prefill
    lays them out, at its final size), decode logits and, on CUDA, decode graph pool fit
    `budget` bytes (Plan.sub_batch_bytes); at least one row each, all rows at
    once without a budget. Consecutive: the G rollouts of a query stay together and share
    their text."""
    n = len(prompts)
    if budget is None:
        return [range(n)]
    param = next(model.parameters())
    per_token = kv_bytes_per_token(model.config, param.element_size())
    per_row = model.config.vocab_size * DECODE_BYTES_PER_LOGIT
    graph = lambda capacity: 0
    if param.device.type == "cuda":  # the decode step's graph pool (engine.GraphStep)
        c = model.config
        inter = getattr(c, "intermediate_size", None) or 4 * c.hidden_size
        graph = lambda capacity: graph_bytes_per_row(c.vocab_size, c.num_attention_heads, inter,
                                                     param.element_size(), capacity)

    def cost(rows: range) -> int:  # the sub-batch's cache, decode logits and graph pool, in bytes
        unique = unique_prompts([prompts[i] for i in rows])[0]
        width = layout(unique, [len(p) - 1 for p in unique]).width
        return len(rows) * ((width + max_new) * per_token + per_row + graph(width + max_new))

    out, start = [], 0
    while start < n:
        longest = max(len(p) for p in prompts[start:])  # the width is at least this
        k = max(1, min(n - start, budget // ((longest + max_new) * per_token + per_row + graph(longest + max_new))))
        while k > 1 and cost(range(start, start + k)) > budget:
            k = max(1, min(k - 1, k * budget // cost(range(start, start + k))))
        out.append(range(start, start + k))
        start += k
    return out


def device_budget(cfg: dict) -> tuple[str, float | None]:
    """(device, budget in bytes or None): model.memory_gb if set; else on CUDA the
    device's total memory, on a CPU no limit."""
    from support.models import pick_device

    device = cfg["model"]["device"]
    resolved = pick_device(device)
    gb = cfg["model"]["memory_gb"]
    if gb > 0:
        return resolved if device != "cuda" else "cuda", gb * GB
    if resolved == "cuda" and torch.cuda.is_available():
        return "cuda", float(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)  # this rank's
    return resolved, None


# The architectures (config.json) of the hub models the shipped configs name, so that a plan
# needs no network: configs/architectures/<owner>--<name>.json.
ARCHITECTURES = Path(__file__).resolve().parents[1] / "configs" / "architectures"


def architecture(name: str):
    """A model's transformers config, for the plan: from its folder or the hub's cache on this
    machine, else the copy kept in configs/architectures/, and only then from the hub."""
    from transformers import AutoConfig

    from support.models import resolve_model

    path = resolve_model(name)
    if Path(path).is_dir():
        return AutoConfig.from_pretrained(path)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except OSError:
        kept = ARCHITECTURES / (name.replace("/", "--") + ".json")
        if kept.is_file():
            fields = json.loads(kept.read_text())
            return AutoConfig.for_model(fields.pop("model_type"), **fields)
        return AutoConfig.from_pretrained(path)  # the hub: an OSError offline, which --plan reports


def plan_for(cfg: dict, config=None, ranks: int = 1, web_tools: list[str] = ()) -> Plan:
    """The plan of a run's config; `config` (a transformers config) saves reading config.json.
    ranks: processes under torchrun, one device each. Each holds everything above for
    itself (weights, reference, optimizer state: they are replicated, not sharded); only
    its rollout is smaller, its share of the step's groups (ranks.World.shard). web_tools: the
    configured tools that call the web (tools.network_tools), whose calls the whole run counts."""
    from support.models import planner_name, reference_needed

    t, a, e, m = cfg["train"], cfg["agent"], cfg["eval"], cfg["model"]
    if config is None:
        config = architecture(planner_name(m))
    device, budget = device_budget(cfg)
    shape = model_shape(config, t["train_layers"], name=planner_name(m), lora_rank=t["lora_rank"],
                        lora_targets=t["lora_targets"])
    frozen = None
    if planner_name(m) != m["name"]:  # the frozen modules run a model of their own
        frozen = model_shape(architecture(m["name"]), 0, name=m["name"])
    max_new = max(a[k]["max_new_tokens"] for k in ("planner", "executor", "verifier", "generator"))
    plan = lambda micro_batch: make_plan(
        shape, dtype=cfg["model"]["dtype"], device=device, budget=budget, max_prompt=cfg["model"]["max_prompt_tokens"],
        max_new=max_new, planner_new=a["planner"]["max_new_tokens"],
        rollout_rows=-(-t["queries_per_step"] // ranks) * t["group_size"],  # the largest share
        eval_rows=e["batch_size"], micro_batch=micro_batch, prefill_tokens=m["prefill_tokens"],
        logits_chunk=t["logits_chunk"], frozen=frozen, reference=reference_needed(cfg),
        checkpointing=t["grad_checkpoint"])
    if t["micro_batch"] != "auto":
        best = plan(t["micro_batch"])
    elif budget is None:  # nothing to fit
        best = plan(AUTO_MICRO_BATCH)
    else:
        # The most rows per update forward that fit beside the resident memory (the update's
        # peak grows with them; the sampler's does not), up to AUTO_MICRO_BATCH.
        best = plan(1)
        for rows in range(2, AUTO_MICRO_BATCH + 1):
            bigger = plan(rows)
            if not bigger.fits:
                break
            best = bigger
    best.evaluation, eval_steps, eval_items = evaluation_cost(cfg, best, ranks)
    best.whole_run = whole_run(cfg, best, ranks, eval_steps, eval_items, web_tools)
    return best


# A decode step reads every weight once, so its time grows with their bytes: an H200 stepped
# the 7B shape (15.2 GB in bf16, 85 rows, the decode graph) at about 21 ms
# (docs/gpu/gpu_check_h200_2026-12-04.txt: 2,479 tokens/s eagerly, 1.61x that replayed).
CUDA_DECODE_S_PER_WEIGHT_GB = 0.021 / 15.23
# An H100's memory is about 1.4x slower (3.35 against 4.8 TB/s, NVIDIA's figures), so are its
# decode steps; its bf16 compute is the H200's, so an update takes as long on both.
H100_DECODE_SLOWER = 1.4
# An update (policy_update: pi_old's and the reference's forwards, the loss's forward and backward, the
# optimizer step) grows with its tokens and, like the decode, the weights' bytes: an H200 updated the 7B
# shape (train_layers 8, micro_batch 2, rows of 1,619 tokens) at 0.116 and 0.156 s a row
# (docs/gpu/gpu_check_h200_2026-12-04.txt, time_card_update_s_per_row; the slower one here).
CUDA_UPDATE_S_PER_TOKEN_WEIGHT_GB = 0.156 / 1619 / 15.23


def decode_steps(a: dict, turns: int) -> int:
    """A sub-batch's decode steps at most: every row takes every turn and every module its
    max_new_tokens (rows that stop early are counted at full length)."""
    return turns * sum(a[k]["max_new_tokens"] for k in ("planner", "executor", "verifier")) \
        + a["generator"]["max_new_tokens"]


def evaluation_steps(cfg: dict, plan: Plan, items: int, ranks: int = 1) -> int:
    """The decode steps of evaluating `items` items: eval.batch_size a round on each rank."""
    e = cfg["eval"]
    rounds = -(-items // (e["batch_size"] * ranks))
    sub_batches = -(-e["batch_size"] // plan.rows_per_sub_batch) if plan.rows_per_sub_batch else 1
    return rounds * sub_batches * decode_steps(cfg["agent"], e["max_turns"])


def evaluation_cost(cfg: dict, plan: Plan, ranks: int = 1) -> tuple[list[str], int | None, int | None]:
    """The held-out evaluations a run makes, their size and, on CUDA, their time at most (the
    tools' own time not counted); with their decode steps and items in all (None: not known
    here), for whole_run."""
    t, e = cfg["train"], cfg["eval"]
    times = 2 * t["eval_before_after"] + ((t["steps"] - 1) // t["eval_every"] if t["eval_every"] else 0)
    if not times:
        return ["evaluation: none (train.eval_before_after false, train.eval_every 0)"], 0, 0
    path = Path(cfg["data"]["heldout"])
    if not path.is_file() and not e["limit"]:
        return [f"evaluation: every row of data.heldout ({path}: not found here), {times} times"], None, None
    items = sum(1 for line in path.open() if line.strip()) if path.is_file() else e["limit"]
    items = min(items, e["limit"] or items)
    steps = evaluation_steps(cfg, plan, items, ranks)
    out = [f"evaluation: {items} held-out items (eval.limit, data.heldout) in batches of {e['batch_size']} "
           f"(eval.batch_size) at up to {e['max_turns']} turns (eval.max_turns), {times} times "
           f"(train.eval_before_after: before and after; train.eval_every: between)"
           + (", data.paraphrase's items beside them before and after" if cfg["data"]["paraphrase"]
              and t["eval_before_after"] else ""),
           f"  each: at most {steps:,} decode steps (turns x the planner's, executor's and verifier's "
           f"max_new_tokens + the generator's, a sub-batch at a time)"]
    if plan.device == "cuda":
        minutes = steps * CUDA_DECODE_S_PER_WEIGHT_GB * plan.export_bytes / GB / 60
        out[-1] += (f": about {minutes:.0f} min on an H200 ({times * minutes:.0f} in all), "
                    f"{H100_DECODE_SLOWER * minutes:.0f} on an H100, tools' time aside; the first runs before step 1")
    return out, times * steps, times * items


def whole_run(cfg: dict, plan: Plan, ranks: int, eval_steps: int | None, eval_items: int | None,
              web: list[str]) -> list[str]:
    """The whole run, said before it starts: its steps, evaluations, the paper suite after it
    and checkpoints, on CUDA in hours; its disk; the web-search calls it may make. The hours
    are rough: the decode and the update at the rates above (each measured at one shape),
    every row at full length; the tools', the judge's and the prefills' time, the KV reads of
    more or longer rows than measured, loading the model and writing checkpoints not counted."""
    t, a, e, d = cfg["train"], cfg["agent"], cfg["eval"], cfg["data"]
    suite = [len(json.loads(p.read_text())) for p in paper_benchmarks().values()]  # eval.py --suite paper's
    rows, sub_batches = plan.rollout_rows, plan.rollout_sub_batches  # this device's share of a step
    rollout = sub_batches * decode_steps(a, a["max_turns"])
    seq = cfg["model"]["max_prompt_tokens"] + a["planner"]["max_new_tokens"]  # an update row: one planner turn
    what = (f"whole run: {t['steps']} steps, the evaluations above, the paper suite after it (eval.py --suite paper: "
            f"{len(suite)} of {len(PAPER_TABLE_1)} benchmarks in data/benchmarks/, {sum(suite):,} items, the planner "
            f"frozen and trained), {-(-t['steps'] // t['save_every'])} checkpoints and the export")
    out = [what + "; hours estimated on CUDA only"]
    if plan.device == "cuda":
        weight_gb = plan.export_bytes / GB  # what both rates scale with
        update_s = rows * a["max_turns"] * seq * CUDA_UPDATE_S_PER_TOKEN_WEIGHT_GB * weight_gb  # as long on both
        suite_steps = 2 * sum(evaluation_steps(cfg, plan, n, ranks) for n in suite)
        decode_s = lambda slower: CUDA_DECODE_S_PER_WEIGHT_GB * weight_gb * slower
        hours = lambda slower: (t["steps"] * (rollout * decode_s(slower) + update_s)
                                + ((eval_steps or 0) + suite_steps) * decode_s(slower)) / 3600
        out = [what + f": about {hours(1):.1f} h on an H200, {hours(H100_DECODE_SLOWER):.1f} h on an H100"
               + (", the evaluations not counted (data.heldout not here)" if eval_steps is None else ""),
               f"  a step at most {rollout:,} decode steps ({rows} rollouts in {sub_batches} sub-batch(es) at up to "
               f"{a['max_turns']} turns) + an update of {rows * a['max_turns']} rows x {seq:,} tokens: "
               f"{(rollout * decode_s(1) + update_s) / 60:.1f} min on an H200; the evaluations "
               f"{(eval_steps or 0) * decode_s(1) / 3600:.1f} h, the suite {suite_steps * decode_s(1) / 3600:.1f} h; "
               f"tools', the judge's and prefill time, loading the model, writing checkpoints not counted"]
    files = d["train"] + [d["heldout"]] + ([d["paraphrase"]] if d["paraphrase"] else [])
    data = sum(Path(f).stat().st_size for f in files if Path(f).is_file())
    missing = [f for f in files if not Path(f).is_file()]
    out.append(f"  disk in all: {(plan.weight_bytes + data + plan.disk_bytes) / GB:.2f} GB: the model "
               f"{plan.weight_bytes / GB:.2f} GB, data {data / 1e6:.1f} MB"
               + (f" (not here: {', '.join(missing)})" if missing else "")
               + f", checkpoints and the export {plan.disk_bytes / GB:.2f} GB (out_dir, as above)")
    if not web:
        return out + [f"  no web-search calls (offline tools: {', '.join(a['tools'])})"]
    # at most one call a turn of every trajectory: training's, the evaluations', the suite's
    calls = [t["steps"] * t["queries_per_step"] * t["group_size"] * a["max_turns"],
             (eval_items or 0) * e["max_turns"], 2 * sum(suite) * e["max_turns"]]
    return out + [f"  web-search calls at most {sum(calls):,} ({', '.join(web)}: one a turn): {calls[0]:,} in "
                  f"training, {calls[1]:,} in the evaluations"
                  + (" (data.heldout not here)" if eval_items is None else "") + f", {calls[2]:,} in the suite"]


# train.micro_batch: auto stops here: past a few thousand tokens per forward a GPU is busy
# and more rows only add memory.
AUTO_MICRO_BATCH = 16


class PlanError(RuntimeError):
    """The run cannot fit its memory budget; the message names the knob to turn."""


class CaptureError(RuntimeError):
    """Recording the decode step as a CUDA graph failed (engine.GraphStep): the device's
    state, not the items', so a run stops (plan.guard says why) instead of an evaluation
    scoring every batch as crashed."""
