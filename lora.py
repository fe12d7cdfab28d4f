"""LoRA: the planner trained through low-rank adapters, on one copy of the base weights.

Not in the paper, whose planner trains every weight on 8 GPUs. LoRA (Hu et al., 2021,
"LoRA: Low-Rank Adaptation of Large Language Models") freezes a linear layer's weight W
[out, in] and learns a low-rank change of it:

    y = W x + b + (alpha / r) B A x          A [r, in] random, B [out, r] zero, r << in, out

so the first forward IS the base model's (B = 0: the added term is exactly 0 in any dtype,
and the first update's ratio rho = pi_theta / pi_old is exactly 1). Only A and B train, in
float32 (AdamW steps them directly, no fp32 masters needed); the base stays in the model's
dtype, frozen. On Qwen2.5-7B at r = 16 that is 40.4M trained weights on all 28 blocks (11.5M on
8) against 7.6B, so the optimizer state is hundreds of MB instead of tens of GB
(docs/SCALING.md).

Where it runs: `LoRALinear` is an nn.Linear with two more parameters, put in place of the
projections (train.lora_targets) of the trained blocks (train.train_layers). The sampler's
decode step and prefill (engine.py) and the trainer's forward (flow_grpo.token_logprobs)
all call these same modules, so the adapters act unmerged, with the same arithmetic, in
the policy that samples and in the policy that is trained: never merged into the bf16 base
and back, which would round the base a little at every step.

One copy of the base: pi_ref (and the executor, verifier and generator, which run the
frozen initial weights) is `without_adapters(model)`: the same module tree over the very
same tensors, with each LoRALinear replaced by the plain nn.Linear of its W and b. No
weight is copied; "the reference" is the base with the adapters off.

At the end, `merged_state_dict` folds the adapters in (W + (alpha/r) B A, in float32, then
cast): the exported model/ is a plain Hugging Face model. The adapters alone are saved
beside it (adapter.safetensors, `save_adapters`); checkpoints hold the adapters and
their AdamW state only (support/checkpoints.py: the trained weights are the adapters).

Simplified: no dropout on the adapters' input (the paper's setup has none to match), no
rank-stabilised scaling, no quantised base (QLoRA): the base is bf16.
"""

import copy
import math

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from support.checkpoints import export_model
from support.config import ConfigError
from support.optim import select_trainable

class LoRALinear(nn.Linear):
    """nn.Linear with adapters: `weight` and `bias` are the base layer's own tensors (no
    copy, frozen), lora_A [r, in] and lora_B [out, r] are new, float32, trained."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, gen: torch.Generator):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias  # the base's tensors themselves
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        dev = base.weight.device
        # A ~ U(-1/sqrt(in), 1/sqrt(in)) (nn.Linear's own init, as the LoRA paper's code uses),
        # from the run's seed; B = 0, so B A = 0 until the first update.
        bound = 1.0 / math.sqrt(base.in_features)
        A = (torch.rand(rank, base.in_features, generator=gen) * 2 - 1) * bound  # [r, in]
        self.lora_A = nn.Parameter(A.to(dev))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=dev))  # [out, r]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """y = W x + b + (alpha / r) B A x, for x [..., in]: [..., out].

        The adapters are float32 and cast to x's dtype here (their gradient flows back through
        the cast into float32): in bf16 the low-rank term is computed in bf16, as the base is,
        and autograd saves nothing of size [..., in] beyond the x that W x already keeps."""
        y = F.linear(x, self.weight, self.bias)  # [..., out]  W x + b, the frozen base
        down = F.linear(x, self.lora_A.to(x.dtype)) * self.scale  # [..., r]   (alpha / r) A x
        return y + F.linear(down, self.lora_B.to(x.dtype))  # [..., out]  + B (...)

    def plain(self) -> nn.Linear:
        """The base layer alone: an nn.Linear over the same weight and bias (no copy)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + (alpha / r) B A, summed in float32, then cast to W's dtype: [out, in]."""
        return (self.weight.float() + self.scale * self.lora_B @ self.lora_A).to(self.weight.dtype)


def trained_weights(model, t: dict, seed: int = 0) -> list:
    """What a run trains (t: the config's train section): with train.lora_rank 0, the top
    train.train_layers blocks' own weights (support/optim.select_trainable); else adapters on
    those blocks' train.lora_targets, A drawn from `seed`."""
    if not t["lora_rank"]:
        return select_trainable(model, t["train_layers"])
    return add_adapters(model, t["lora_rank"], t["lora_alpha"], t["lora_targets"], t["train_layers"], seed)


def add_adapters(model, rank: int, alpha: float, targets: list[str], train_layers: int, seed: int) -> list:
    """Put LoRALinear in place of every projection named in `targets` of the top
    `train_layers` blocks (0 = every block); freeze everything else. Returns the trained
    parameters: the adapters, lora_A and lora_B of each, in module order."""
    model.requires_grad_(False)
    blocks = model.get_decoder().layers
    blocks = blocks[-train_layers:] if train_layers > 0 else blocks
    gen = torch.Generator().manual_seed(seed)
    found = set()
    for block in blocks:
        for name, module in list(block.named_modules()):
            parent_name, _, leaf = name.rpartition(".")
            if leaf in targets and type(module) is nn.Linear:
                setattr(block.get_submodule(parent_name), leaf, LoRALinear(module, rank, alpha, gen))
                found.add(leaf)
    missing = [t for t in targets if t not in found]
    if missing:
        linears = sorted({n.rpartition(".")[2] for n, m in blocks[0].named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(f"train.lora_targets names {', '.join(missing)}, which no block of this model has; "
                          f"its blocks' linear layers are: {', '.join(linears)}")
    return [p for p in model.parameters() if p.requires_grad]


def adapters(model) -> dict[str, LoRALinear]:
    """name -> LoRALinear of every adapted layer ({} for a model without adapters)."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def without_adapters(model):
    """The base model with the adapters off: the same module tree over the same tensors (no
    weight copied), each LoRALinear replaced by its plain nn.Linear. A model without
    adapters comes back as it is."""
    found = adapters(model)
    if not found:
        return model
    shared = {id(t): t for t in list(model.parameters()) + list(model.buffers())}  # deepcopy's memo: no tensor copied
    base = copy.deepcopy(model, shared)
    for name, layer in adapters(base).items():
        parent_name, _, leaf = name.rpartition(".")
        setattr(base.get_submodule(parent_name), leaf, layer.plain())
    return base


def merged_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's state dict with every adapter folded into its weight (merged_weight) and
    the adapters' own entries left out: what a plain Hugging Face model of this architecture
    loads. A model without adapters gives its own state dict."""
    merged = {f"{name}.weight": layer.merged_weight() for name, layer in adapters(model).items()}
    return {key: merged.get(key, tensor) for key, tensor in model.state_dict().items()
            if not key.endswith((".lora_A", ".lora_B"))}


def save_adapters(path, model) -> None:
    """The adapters alone, as safetensors: each layer's lora_A and lora_B (float32) under its
    module's name, with the rank, alpha and targets in the file's metadata."""
    found = adapters(model)
    tensors = {f"{name}.{part}": getattr(layer, part).detach().cpu().contiguous()
               for name, layer in found.items() for part in ("lora_A", "lora_B")}
    first = next(iter(found.values()))
    meta = {"rank": str(first.rank), "alpha": str(first.alpha),
            "targets": ",".join(sorted({name.rpartition(".")[2] for name in found})),
            "formula": "y = W x + b + (alpha / rank) * lora_B @ lora_A @ x"}
    save_file(tensors, str(path), metadata=meta)


def export(folder, model, tok):
    """The trained planner at `folder` in Hugging Face format (support/checkpoints.export_model):
    with adapters, their merge (a plain model, no project code needed to load it) and
    adapter.safetensors beside it; without, the model as it is."""
    if not adapters(model):
        return export_model(folder, model, tok)
    return export_model(folder, model, tok, merged_state_dict(model),
                        also=lambda tmp: save_adapters(tmp / "adapter.safetensors", model))
