"""Several processes, one device each: the few torch.distributed calls train.py and eval.py make.

    torchrun --nproc_per_node 2 train.py config.yaml          (docs/SCALING.md)

Not part of the paper's method (its runs use 8 GPUs through verl and Ray); what running
Flow-GRPO on K devices takes with PyTorch's own runtime. Every process ("rank") holds
the whole system: policy, reference, tools, optimizer. What they share:

  * the step's queries, by whole groups (World.shard): the G rollouts of a query stay on
    one rank, so its advantages are computed where its rewards are;
  * one gradient: the trainable gradients (with bf16 weights, their fp32 masters') are
    summed over ranks before clipping (World.sum_grads, called by optim.step), so every
    rank takes the same optimizer step and the weights stay identical without ever
    being sent;
  * small Python objects (counts, metrics, result rows), gathered to rank 0, which alone
    writes files.

A process started without torchrun's variables, or with WORLD_SIZE=1, gets SINGLE: its
collectives return their input and make no torch.distributed call, so a one-process run
does exactly what it would do with no distributed code at all.

Simplified: one all-reduce per optimizer step after the backward passes, no overlap with
them (the rollout, not the update, is most of a step); no sharding of weights or
optimizer state (each rank holds the whole memory plan); no elastic restarts (when a rank
fails, torchrun stops the others; the run resumes from its checkpoint).
"""

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as tdist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0  # the rank's place on its machine: which GPU it uses
    device: str = "cpu"  # where collective tensors live: the rank's GPU under nccl, the CPU under gloo

    @property
    def main(self) -> bool:
        """Rank 0: the one that prints and writes files."""
        return self.rank == 0

    def shard(self, n: int) -> range:
        """This rank's part of n items: contiguous blocks in rank order, sizes differing
        by at most one, so rank 0's part comes first and the parts in rank order are the
        whole in its order (range(n) for one process)."""
        return range(self.rank * n // self.size, (self.rank + 1) * n // self.size)

    # Python objects: pickled, for counts and rows (small next to a step's compute).

    def all_gather(self, obj) -> list:
        """[rank 0's obj, rank 1's, ...] on every rank."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        tdist.all_gather_object(out, obj)
        return out

    def gather(self, obj) -> list | None:
        """[rank 0's obj, rank 1's, ...] on rank 0; None on the others."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size if self.main else None
        tdist.gather_object(obj, out, dst=0)
        return out

    def broadcast(self, obj):
        """Rank 0's obj, on every rank (what the others pass is ignored)."""
        if self.size == 1:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def minibatches(self, n: int, k: int, gen: torch.Generator) -> list[list[int]]:
        """This rank's n rows dealt into k mini-batches as one process would deal all ranks'
        rows: numbered across ranks in rank order (rank 0's first), shuffled with `gen` when
        k > 1 (its state is the same on every rank), every k-th row to a mini-batch. Each
        mini-batch as this rank's own indices (range(n) in order, for one process and k = 1)."""
        offset, total = self.offset(n)
        order = torch.randperm(total, generator=gen).tolist() if k > 1 else list(range(total))
        return [[i - offset for i in order[mb::k] if offset <= i < offset + n] for mb in range(k)]

    def merge(self, sums: dict, maxes: dict) -> tuple[dict, dict]:
        """The whole batch's figures from each rank's: `sums` added up, `maxes` maximised."""
        if self.size == 1:
            return sums, maxes
        parts = self.all_gather((sums, maxes))
        return ({k: sum(p[0][k] for p in parts) for k in sums}, {k: max(p[1][k] for p in parts) for k in maxes})

    def offset(self, n: int) -> tuple[int, int]:
        """(where this rank's n items start in the ranks' concatenation, the total)."""
        counts = self.all_gather(n)
        return sum(counts[:self.rank]), sum(counts)

    def barrier(self) -> None:
        if self.size > 1:
            tdist.barrier()

    @contextmanager
    def local_first(self):
        """The body runs on each machine's local rank 0 first, then on the other ranks: what
        it caches on the machine's disk (the default model's one-time conversion) is
        made once and read by the rest."""
        if self.local_rank:
            self.barrier()
        yield
        if not self.local_rank:
            self.barrier()

    # Gradients

    @torch.no_grad()
    def sum_grads(self, params: list[torch.Tensor]) -> None:
        """Sum every tensor's .grad over ranks, in place: each rank's loss is its share of
        J (row weights over the whole step), so the sum is the gradient of J.

        A rank with no rows this step (fewer groups than ranks, or all its groups left
        out) has no .grad: it takes zeros, so that it steps the weights as the others do.
        A tensor without a gradient on EVERY rank stays without one, as it would in one
        process (AdamW then skips it: no decay, no moment update). One all-reduce per
        tensor, in place: a flat bucket would cost another copy of the fp32 gradients,
        which the memory plan does not hold."""
        if self.size == 1:
            return
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=self.device)  # [P]
        tdist.all_reduce(has, op=tdist.ReduceOp.MAX)
        for p, any_grad in zip(params, has.tolist()):
            if not any_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            tdist.all_reduce(p.grad)  # SUM; every rank receives the same bits


SINGLE = World()


def env_size() -> int:
    """How many ranks torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def env_main() -> bool:
    """Whether this process is rank 0 (or runs alone), before init: what only one process may
    check, such as an out_dir that rank 0 may already be writing to."""
    return os.environ.get("RANK", "0") == "0"


def init(device: str) -> World:
    """This process's World, from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR, MASTER_PORT); SINGLE without them. `device` is model.device: on CUDA each
    rank takes GPU number LOCAL_RANK (as the current device, so "cuda" means it) and the
    ranks talk over nccl; on a CPU over gloo. Starting twice in a process reuses the group."""
    size = env_size()
    if size == 1:
        return SINGLE
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    if cuda:
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"local rank {local} has no GPU of its own ({torch.cuda.device_count()} here): "
                               f"start at most that many processes per machine (torchrun --nproc_per_node)")
        torch.cuda.set_device(local)
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if cuda else "gloo")
    return World(rank, size, local, f"cuda:{local}" if cuda else "cpu")


def shutdown() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()
