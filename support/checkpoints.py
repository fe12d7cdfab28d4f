"""Checkpoints: what a resume needs, written atomically; the trained model, exported.

out_dir/checkpoints/step_N/trainer_state.pt holds what a resume needs and no more: the
weights that train (the frozen ones are the configured model's, loaded at start; bf16
ones as their fp32 masters, which round into them), AdamW's state, the schedule and the
RNG state. Only the newest is kept.
The whole model, in Hugging Face format (`AutoModelForCausalLM.from_pretrained` loads it,
and eval.py --model), is exported once, at the end of training, to out_dir/model/, and on
request (`python -m scripts.export_model RUN_DIR`). A paper-scale checkpoint is then its
trained blocks, masters and moments, not the whole 7B model each time (the memory plan
prints both sizes and the disk a run needs). Everything is written to a temporary folder
and renamed, so a crash mid-write never leaves one that looks complete; the older
checkpoint goes only after the new one is in place.

A resumed run reaches the weights an uninterrupted one does: the data order and every
sampling seed are functions of (seed, step) (support/seeds.py), and the RNG state is
restored with the weights.
"""

import json
import os
import shutil
from pathlib import Path

import torch

from support.config import RESUMABLE, ConfigError, resume_conflicts
from support.ranks import SINGLE
from support.seeds import rng_state, set_rng_state


def save_checkpoint(out: Path, step: int, model, optimizer) -> Path:
    """Write checkpoints/step_{step} (optimizer: support.optim.PlannerOptimizer) and drop the older ones."""
    ckdir = out / "checkpoints"
    ckdir.mkdir(parents=True, exist_ok=True)
    final = ckdir / f"step_{step}"
    tmp = ckdir / f".tmp_step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # The trained weights; bf16 ones are their fp32 masters rounded, and the masters are saved.
    trained = {} if optimizer.masters is not None else {
        n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.save({"step": step, "trained": trained, **optimizer.state_dict(), "rng": rng_state()},
               tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old_step, path in checkpoints(out):
        if old_step != step:
            shutil.rmtree(path)
    return final


def export_model(folder: Path, model, tok, state_dict: dict | None = None, also=None) -> Path:
    """The whole model and its tokenizer in Hugging Face format at `folder`, atomically:
    `state_dict` in place of the model's own if given (lora.export: the adapters merged),
    and also(tmp_folder) writes more files into it before it is renamed into place."""
    folder = Path(folder)
    tmp = folder.with_name(f".tmp_{folder.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tok.save_pretrained(tmp)
    if also is not None:
        also(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def resume(out: Path, model, optimizer, world=SINGLE) -> int:
    """Load the latest complete checkpoint; return its step (0 if there is none).

    Under torchrun every rank loads the checkpoint rank 0 found (it wrote it), from
    out_dir, which every rank must therefore see (one machine, or a shared filesystem);
    a rank that cannot stops the run, on every rank, rather than train from other weights."""
    found = sorted(checkpoints(out)) if world.main else []
    step = world.broadcast(found[-1][0] if found else 0)
    # Metrics rows written after this checkpoint (after none: every row) belong to steps that will run again.
    metrics = out / "metrics.jsonl"
    if world.main and metrics.exists():
        rows = [r for r in metrics.read_text().splitlines() if r.strip() and json.loads(r)["step"] <= step]
        metrics.write_text("".join(r + "\n" for r in rows))
    if not step:
        return 0
    path = out / "checkpoints" / f"step_{step}"
    blind = [r for r, ok in enumerate(world.all_gather((path / "trainer_state.pt").exists())) if not ok]
    if blind:
        raise RuntimeError(f"rank(s) {blind} cannot read {path}, the checkpoint rank 0 resumes from: under "
                           f"torchrun out_dir must be a folder every rank sees (a shared filesystem)")
    # Onto the CPU first: saved from rank 0's GPU, the tensors would otherwise all land on
    # GPU 0 on every rank; load_state_dict moves them to each weight's device.
    state = torch.load(path / "trainer_state.pt", weights_only=False, map_location="cpu")
    load_trained(model, state["trained"], path)
    try:
        changed = optimizer.load_state_dict(state)
    except RuntimeError as e:
        raise RuntimeError(f"{path}: {e}") from None
    if changed and world.main:
        print(f"resuming with this run's settings: {'; '.join(changed)}", flush=True)
    set_rng_state(state["rng"])  # rank 0's; every rank seeded the same and draws from its own generators
    return step


def check_out_dir(cfg: dict) -> None:
    """Refuse, before anything is written, a start that would mix two runs in out_dir: files
    that are no run's, a run started over there (resume=false), or a resume whose config
    differs from the run's config.json in a key that may not change (config.RESUMABLE).
    A ConfigError naming each key, its two values and the fix."""
    out = Path(cfg["out_dir"])
    # eval.py's evaluations may come first (out_dir/eval/...): each folder guards its own rows.
    if not out.is_dir() or all(p.name == "eval" for p in out.iterdir()):
        return
    fix = f"set out_dir to a folder of its own, or delete {out} to start it over"
    saved = out / "config.json"
    if not saved.is_file():  # train.py writes it first: a run's folder always has one
        raise ConfigError(f"out_dir {out} holds files but no config.json: it is no run's folder; {fix} (to go on "
                          f"with a run copied there, copy its config.json too)")
    if not cfg["resume"]:
        raise ConfigError(f"out_dir {out} holds a run and resume=false starts another there, whose metrics, "
                          f"evaluations and checkpoints would mix with it; {fix}")
    conflicts = resume_conflicts(json.loads(saved.read_text()), cfg)
    if conflicts:
        raise ConfigError("\n".join([f"out_dir {out} holds a run of another config; resuming it would go on with "
                                      f"that run under these settings:"] + [f"  {c}" for c in conflicts]
                                     + [f"{fix}; on a resume only these may change: {', '.join(sorted(RESUMABLE))}"]))
    done = max((step for step, _ in checkpoints(out)), default=0)
    if done > cfg["train"]["steps"]:
        raise ConfigError(f"train.steps={cfg['train']['steps']}, but the run in {out} is checkpointed at step {done}; "
                          f"set train.steps={done} or more to resume it, or {fix}")


def load_trained(model, trained: dict, where) -> None:
    """Put a checkpoint's trained weights into `model` (the configured one: the frozen rest)."""
    params = dict(model.named_parameters())
    unknown = sorted(set(trained) - set(params))
    if unknown:
        raise RuntimeError(f"{where} holds weights this model does not have ({', '.join(unknown[:3])}, ...): "
                           f"it was written for another model.name / model.planner")
    with torch.no_grad():
        for name, tensor in trained.items():
            params[name].copy_(tensor)


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in out_dir."""
    ckdir = out / "checkpoints"
    if not ckdir.exists():
        return []
    return [(int(p.name.split("_")[1]), p) for p in ckdir.glob("step_*")
            if (p / "trainer_state.pt").exists()]
