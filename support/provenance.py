"""Provenance: where and with what each process of a run ran (out_dir/run.json).

What a reader needs to see why the same seed gives another number on another machine:
the code's commit, torch and transformers versions, the CPU and the SIMD level torch
dispatches to, threads, wall time. train.py calls record_run once, right
after it writes config.json; the report shows it in every run's header. An evaluation
folder records which planner weights wrote it (weights_fingerprint).
"""

import atexit
import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
import transformers

from support.report.runs import read_json


ROOT = Path(__file__).resolve().parents[1]  # the repository: its git commit is the code's version


def cpu_name() -> str:
    """The model name of this machine's first CPU (what decides which kernels torch
    dispatches to, and so the last bits of a run's floats), or what the platform says where /proc/cpuinfo has none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def provenance(cfg: dict) -> dict:
    """This process: seed, code version, library versions, CPU, threads, start time."""
    def git(*args):
        try:
            done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):
        commit += " dirty"  # tracked files differ from that commit: the numbers may not reproduce from it
    device = cfg.get("model", {}).get("device", "auto")
    gpu = torch.cuda.get_device_name(0) if device != "cpu" and torch.cuda.is_available() else None
    return {"seed": cfg.get("seed"), "git_commit": commit, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "cpu": cpu_name(),
            # The SIMD level torch dispatches its CPU kernels to (AVX2, AVX512, ...): two
            # machines with the same CPU name can still sum floats in another order.
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_count": os.cpu_count(),
            # train.py sets model.threads after this call, so the config says what the run uses.
            "threads": cfg.get("model", {}).get("threads") or torch.get_num_threads(), "gpu": gpu,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "started_unix": round(time.time(), 3)}


def record_run(out_dir, cfg: dict) -> dict:
    """Append this process's provenance to out_dir/run.json and stamp its wall time there
    when the process exits.

    A list, one entry per process: a resumed run may have been continued on another
    machine or another torch version, and its total wall time (evaluations included) is
    the sum of its processes' times. The exit stamp runs on a normal end, an exception or
    Ctrl-C (atexit); a process killed outright leaves its entry without wall_s, and the
    report says so."""
    entry = provenance(cfg)

    def stamp():
        try:  # re-read: another run() in this process may have appended since
            note_run(out_dir, entry, wall_s=round(time.time() - entry["started_unix"], 1))
        except OSError:  # the folder is gone (a test's temporary run): nothing to stamp
            pass

    _save_run(Path(out_dir) / "run.json", lambda ps: ps + [entry])
    atexit.register(stamp)
    return entry


def note_run(out_dir, entry: dict, **fields) -> None:
    """Add `fields` to this process's run.json entry (`entry`, from record_run): what is
    known only later, such as the wall time at exit."""
    _save_run(Path(out_dir) / "run.json",
              lambda ps: [{**p, **fields} if p.get("started_unix") == entry["started_unix"] else p for p in ps])


def _save_run(path: Path, update) -> None:
    old = read_json(path)
    processes = old.get("processes") if isinstance(old, dict) else None
    processes = update([p for p in processes or [] if isinstance(p, dict)])
    tmp = path.with_name(f".run.json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"processes": processes}, indent=2) + "\n")
    os.replace(tmp, path)


def weights_fingerprint(model) -> str:
    """A short hash that tells two sets of weights apart (an evaluation folder records its
    planner's): every parameter's name, shape, dtype and a strided sample of its bytes.
    Training moves every trained weight, so the sample sees it; reading 1/4099 of the
    weights keeps it cheap at 7B. The same weights give the same hash on any device."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        sample = p.detach().reshape(-1)[::4099].float().cpu()  # float32 holds bf16 / fp16 values exactly
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]
