"""Checkpoints: what transformers loads and what a resume needs, written atomically.

out_dir/checkpoints/step_N/ holds the model and its tokenizer in Hugging Face format
(`AutoModelForCausalLM.from_pretrained` loads it) and trainer_state.pt: AdamW's state,
the schedule, the fp32 master weights and the RNG state, no more; only the newest
checkpoint is kept. A checkpoint is written to a temporary folder and renamed, so a crash
mid-write never leaves one that looks complete; the older one goes only after that.

A resumed run reaches the weights an uninterrupted one does: the data order and every
sampling seed are functions of (seed, step) (support/seeds.py), and the RNG state is
restored with the weights.
"""

import json
import os
import shutil
from pathlib import Path

import torch

from support.ranks import SINGLE
from support.seeds import rng_state, set_rng_state


def save_checkpoint(out: Path, step: int, model, tok, optimizer) -> Path:
    """Write checkpoints/step_{step} (optimizer: support.optim.PlannerOptimizer) and drop the older ones."""
    ckdir = out / "checkpoints"
    ckdir.mkdir(parents=True, exist_ok=True)
    final = ckdir / f"step_{step}"
    tmp = ckdir / f".tmp_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    torch.save({"step": step, **optimizer.state_dict(), "rng": rng_state()}, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old_step, path in checkpoints(out):
        if old_step != step:
            shutil.rmtree(path)
    return final


def resume(out: Path, model, optimizer, world=SINGLE) -> int:
    """Load the latest complete checkpoint; return its step (0 if there is none).

    Under torchrun every rank loads the checkpoint rank 0 found (it wrote it), from
    out_dir, which every rank must therefore see (one machine, or a shared filesystem);
    a rank that cannot stops the run, on every rank, rather than train from other weights."""
    found = sorted(checkpoints(out)) if world.main else []
    step = world.broadcast(found[-1][0] if found else 0)
    if not step:
        return 0
    path = out / "checkpoints" / f"step_{step}"
    blind = [r for r, ok in enumerate(world.all_gather((path / "trainer_state.pt").exists())) if not ok]
    if blind:
        raise RuntimeError(f"rank(s) {blind} cannot read {path}, the checkpoint rank 0 resumes from: under "
                           f"torchrun out_dir must be a folder every rank sees (a shared filesystem)")
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=next(model.parameters()).dtype)
    model.load_state_dict(loaded.state_dict())
    del loaded
    # Onto the CPU first: saved from rank 0's GPU, the tensors would otherwise all land on
    # GPU 0 on every rank; load_state_dict moves them to each weight's device.
    state = torch.load(path / "trainer_state.pt", weights_only=False, map_location="cpu")
    try:
        optimizer.load_state_dict(state)
    except RuntimeError as e:
        raise RuntimeError(f"{path}: {e}") from None
    set_rng_state(state["rng"])  # rank 0's; every rank seeded the same and draws from its own generators
    # Metrics rows written after this checkpoint belong to steps that will run again.
    metrics = out / "metrics.jsonl"
    if world.main and metrics.exists():
        rows = [r for r in metrics.read_text().splitlines() if r.strip() and json.loads(r)["step"] <= step]
        metrics.write_text("".join(r + "\n" for r in rows))
    return step


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in out_dir."""
    ckdir = out / "checkpoints"
    if not ckdir.exists():
        return []
    return [(int(p.name.split("_")[1]), p) for p in ckdir.glob("step_*")
            if (p / "trainer_state.pt").exists()]
