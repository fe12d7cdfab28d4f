"""The planner's optimizer: AdamW, with fp32 master weights when the weights are bf16.

Paper, section 3: lr 1e-6 on Qwen2.5-7B, whose weights are stored in bfloat16. bf16 keeps
8 significant bits, so a weight w moves only by steps of about |w| / 256: for w ~ 0.02
that is ~8e-5, and for a norm weight ~1 it is ~4e-3. An AdamW update is about lr = 1e-6
a step, far below half such a step, so stepping the bf16 tensors directly rounds almost
every update away (and bf16 moments lose what is left). The textbook remedy, used here:

  * a float32 "master" copy of every trainable bf16 / fp16 weight; AdamW (and the LR
    schedule) step the masters, with fp32 moments, so small updates accumulate;
  * gradients accumulate in float32 on the masters across micro-batches: a hook on each
    bf16 weight adds its fresh gradient (in fp32) to the master's and drops the bf16 one,
    so bf16 gradients are never summed;
  * after every optimizer step the masters are rounded into the bf16 weights, which the
    sampler and the trainer both use: the policy that samples is the policy that is
    trained, in one dtype.

Frozen weights stay bf16, with no master, no gradient, no optimizer state. A float32
model needs none of this: it gets the plain AdamW over its own weights.
"""

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def select_trainable(model, train_layers: int) -> list:
    """All weights, or only the top `train_layers` transformer blocks and the final norm
    (a cheaper update, and on a GPU a smaller optimizer state; the embeddings, tied to
    the output layer in small models, stay frozen)."""
    if train_layers <= 0:
        return [p for p in model.parameters() if p.requires_grad]
    model.requires_grad_(False)
    decoder = model.get_decoder()
    for module in list(decoder.layers[-train_layers:]) + [decoder.norm]:
        module.requires_grad_(True)
    return [p for p in model.parameters() if p.requires_grad]


class MasterWeights:
    """fp32 masters of low-precision trainable weights, their gradients, and the copy back."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = list(params)  # the model's bf16 / fp16 weights
        for p in self.params:  # two sets of hooks would race for the same gradient
            owner = getattr(p, "_fp32_masters", None)
            if owner is not None and any(q is p for q in owner.params):
                raise RuntimeError("a weight already has an fp32 master: call remove() on the old MasterWeights first")
            p._fp32_masters = self
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.params]  # fp32
        self._hooks = [p.register_post_accumulate_grad_hook(self._into(m)) for p, m in zip(self.params, self.masters)]

    def remove(self) -> None:
        """Detach from the weights (their gradients then stay in .grad again)."""
        for h in self._hooks:
            h.remove()
        for p in self.params:
            if getattr(p, "_fp32_masters", None) is self:
                del p._fp32_masters
        self._hooks, self.params = [], []

    @staticmethod
    def _into(master: torch.nn.Parameter):
        def add(p: torch.Tensor) -> None:
            # Runs once the backward pass has put this weight's gradient in p.grad: move it
            # to the master in fp32 (summed over micro-batches there), free the bf16 one.
            if p.grad is None:
                return
            g = p.grad.float()
            if master.grad is None:
                master.grad = g
            else:
                master.grad.add_(g)
            p.grad = None
        return add

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Round every master into its model weight (round to nearest even)."""
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach().cpu().clone() for m in self.masters]

    @torch.no_grad()
    def load_state_dict(self, tensors: list[torch.Tensor]) -> None:
        if len(tensors) != len(self.masters):
            raise ValueError(f"{len(tensors)} saved master weights for {len(self.masters)} trainable weights")
        for m, t in zip(self.masters, tensors):
            m.copy_(t)
        self.copy_to_model()


class PlannerOptimizer:
    """AdamW over the trained weights, through their fp32 masters when the weights are
    bf16 / fp16, with a linear warmup to the learning rate, then constant."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
                 warmup_steps: int = 0):
        low = [p for p in params if p.dtype in LOW_PRECISION]
        self.masters = MasterWeights(low) if low else None  # float32 weights: the plain AdamW, no masters
        master_of = {id(p): m for p, m in zip(self.masters.params, self.masters.masters)} if low else {}
        self.adamw = torch.optim.AdamW([master_of.get(id(p), p) for p in params], lr=lr, weight_decay=weight_decay)
        warm = max(1, warmup_steps)  # counted in optimizer steps
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.adamw, lambda k: min(1.0, (k + 1) / warm))

    @property
    def lr(self) -> float:
        """The learning rate the next step takes."""
        return self.adamw.param_groups[0]["lr"]

    @property
    def stepped(self) -> list[torch.nn.Parameter]:
        """What AdamW steps: the trained weights, or their fp32 masters (whose .grad holds
        the gradient; the bf16 weights' .grad is None by then)."""
        return [p for group in self.adamw.param_groups for p in group["params"]]

    def copy_back(self) -> None:
        """The stepped masters rounded into the model's bf16 weights (nothing for fp32)."""
        if self.masters is not None:
            self.masters.copy_to_model()

    def state_dict(self) -> dict:
        """What a resume needs: AdamW's moments, the schedule, the fp32 masters."""
        return {"optimizer": self.adamw.state_dict(), "scheduler": self.schedule.state_dict(),
                "masters": self.masters.state_dict() if self.masters is not None else None}

    def load_state_dict(self, state: dict) -> list[str]:
        """Resume AdamW's moments, the schedule's position and the masters. The learning rate
        and weight decay stay the run's own (train.lr, train.weight_decay): AdamW's state holds
        the ones it was saved with, which would otherwise win without a word. Returns a line
        for each of the two that differs from the checkpoint's."""
        lr, decay = self.schedule.base_lrs[0], self.adamw.param_groups[0]["weight_decay"]
        self.adamw.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["scheduler"])
        changed = [f"train.{key} {was:g} in the checkpoint, {now:g} from now on" for key, was, now in (
            ("lr", self.schedule.base_lrs[0], lr), ("weight_decay", self.adamw.param_groups[0]["weight_decay"], decay))
            if was != now]
        self.schedule.base_lrs = [lr] * len(self.adamw.param_groups)
        factor = self.schedule.lr_lambdas[0](self.schedule.last_epoch)  # the warmup's factor at this step
        for group in self.adamw.param_groups:
            group.update(initial_lr=lr, lr=lr * factor, weight_decay=decay)
        if self.masters is not None:  # the fp32 weights the bf16 checkpoint is a rounding of
            if state.get("masters") is None:
                raise RuntimeError("the checkpoint holds no fp32 master weights; it was not written by a bf16 run")
            self.masters.load_state_dict(state["masters"])
        return changed
