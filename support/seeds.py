"""Every seed a run uses, derived from its one `seed`, in one place; and the RNG state a
checkpoint keeps.

A run is a function of its seed: the data order, each step's rollouts, each rank's
share, each module call of each turn, the update's mini-batch order and each held-out
batch draw from their own streams, and those streams must never coincide. derive_seed
names each use and its formula:

    step         seed * 1_000_003 + step         a training step (its mini-batch order too)
    rank         step seed + rank * 2^32         a rank's rollouts under torchrun (rank 0: the step's)
    turn         seed * 1000 + 10 * turn + k     module k of a turn (0 planner, 1 executor, 2 verifier)
    generator    seed * 1000 + 999               the final answers of a rollout
    epoch        seed * 7919 + epoch             the order of the training data in an epoch
    kind_epoch   "seed/kind/epoch", as an int    one task kind's order (train.task_shares)
    eval_batch   eval seed + first item's place  a held-out batch (a resumed evaluation samples the same)
    paraphrase   eval seed + 2^31                the paraphrase set's evaluation seed (its batches: eval_batch)
    lora         seed * 1_000_003 - 1            the LoRA adapters' initial A (step -1's seed: no step's)

Why they do not collide: step seeds differ by one per step and a rank adds 2^32, more than
any run's steps; the paraphrase set's batches sit 2^31 above the held-out ones, more than
any file's items; a rollout's turn seeds stay below its next seed's (seed * 1000 + 999);
the data-order streams are Python's `random`, the others torch generators. The formulas
are the ones the published tables were made with, so the tables still reproduce.
"""

import hashlib
import random

import numpy as np
import torch


def derive_seed(use: str, seed: int, *keys) -> int:
    """The seed of one use of randomness (the table above) from `seed` and that use's keys."""
    if use == "step":
        (step,) = keys
        return seed * 1_000_003 + step
    if use == "rank":
        (rank,) = keys
        return seed + rank * 2 ** 32
    if use == "turn":
        turn, module = keys
        return seed * 1000 + 10 * turn + module
    if use == "generator":
        return seed * 1000 + 999
    if use == "epoch":
        (epoch,) = keys
        return seed * 7919 + epoch
    if use == "kind_epoch":  # the integer random.Random makes of the string "seed/kind/epoch"
        kind, epoch = keys
        text = f"{seed}/{kind}/{epoch}".encode()
        return int.from_bytes(text + hashlib.sha512(text).digest(), "big")
    if use == "eval_batch":
        (first_item,) = keys
        return seed + first_item
    if use == "paraphrase":
        return seed + 2 ** 31
    if use == "lora":
        return seed * 1_000_003 - 1
    raise ValueError(f"no derived seed for {use!r}")


def seed_everything(seed: int) -> None:
    """The global generators (Python, NumPy, torch): what model code draws from by itself."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
