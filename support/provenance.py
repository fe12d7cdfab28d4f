"""Provenance: where and with what each process of a run ran (out_dir/run.json).

What a reader needs to see why the same seed gives another number on another machine:
the code's commit, torch and transformers versions, the CPU and the SIMD level torch
dispatches to, threads, wall time. A training run calls record_run once, right after it
writes config.json (support/run_log.start_run); the report shows it in every run's header.

An evaluation folder (eval.evaluate) records what wrote its rows in made_by.json: the
planner's and the modules' weights (weights_fingerprint), the agent's, tools' and judge's
settings (made_by); claim refuses a folder another setup wrote.
"""

import atexit
import hashlib
import json
import os
import platform
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

import torch
import transformers

from support.config import dotted
from support.datasets import read_jsonl
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


# ----------------------------------------------------------------------------------------
# An evaluation folder's made_by.json: the rows of one planner under one setup.

def made_by(agent, judge, **settings) -> dict:
    """What decides the rows of an evaluation of `agent` (an agentflow.AgentSystem) judged by
    `judge` (a judge.Judge) besides its items: the planner's and the frozen modules' weights,
    the agent's settings (the planner's as it samples here; texts over 80 characters, the
    prompts, by their hash), the tools and their settings, the judge, and `settings`
    (evaluate's turn budget, seed, batch size: a batch's seed and rows)."""
    setup = json.loads(json.dumps({
        "agent": {**asdict(agent.cfg), "planner": asdict(agent.planner_params)},
        "tools": {t.name: {k: t.cfg[k] for k in t.settings} for t in agent.tools.values()}}))

    def short(v):
        text = json.dumps(v)
        return v if len(text) <= 80 else "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]

    return {"planner_weights": weights_fingerprint(agent.planner.model),
            "modules_weights": weights_fingerprint(agent.frozen.model),
            "judge": judge_label(judge),
            **settings, **{k: short(v) for k, v in dotted(setup).items()}}


def judge_label(judge) -> str:
    """Who decides a verdict: the rules alone, or the rules and then which LLM."""
    if judge.llm is None:
        return "rules"
    return f"rules, then LLM {judge.llm.model or '(the frozen modules)'}"


def claim(out: Path, record: dict, items: list) -> str | None:
    """Make `out` this evaluation's folder, or say why it is not: a folder holds the rows of
    one planner under one setup (made_by.json, `record`), so a resume never passes another
    planner's rows off as this one's. None when `out` is new or was made by the same setup,
    with the same question and gold for every item id it holds (`items`: its
    support.datasets.Item list); else the refusal, naming what differs."""
    path, results = out / "made_by.json", out / "results.jsonl"
    fix = f"give this evaluation another --out, or delete {out} to start it over"
    if path.exists():
        old = json.loads(path.read_text())
        diff = [f"{k}: {old.get(k)!r} there, {record.get(k)!r} here"
                for k in sorted(old.keys() | record.keys()) if old.get(k) != record.get(k)]
        if diff:
            return f"{out} holds an evaluation made by another setup ({'; '.join(diff)}): {fix}"
    elif results.exists():
        return (f"{out} holds results.jsonl but no made_by.json (an older or foreign evaluation): "
                f"{fix}")
    by_id = {it.id: it for it in items}
    changed = [r["id"] for r in read_jsonl(results) if r["id"] in by_id
               and (r["question"], r["gold"]) != (by_id[r["id"]].question, by_id[r["id"]].gold)]
    if changed:
        return f"{out} holds other questions or golds under the ids {', '.join(changed[:5])}: {fix}"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return None
