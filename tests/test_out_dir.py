"""A run resumes only its own run: out_dir holding another config's run, files of no run, or
a run to start over (resume=false) is refused before anything in it is written; what may
change on a resume (support/config.py, RESUMABLE) resumes and trains the steps it adds."""

import json
import shutil
from pathlib import Path

from support.config import load_config, resume_conflicts
from test_train import tiny_overrides
from train import main

ROOT = Path(__file__).resolve().parents[1]


def steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def a_run(tiny_model_dir, out: Path, *extra: str) -> list[str]:
    """Run one step on the tiny model into `out`; return the run's train.py arguments."""
    args = [str(ROOT / "config.yaml"), *tiny_overrides(tiny_model_dir, out, "train.steps=1",
                                                       "train.eval_before_after=false", *extra)]
    assert main(args) == 0 and steps(out) == [1]
    return args


def test_another_config_is_refused_naming_each_key_and_the_run_stays_as_it_was(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = a_run(tiny_model_dir, out)
    written = {f: (out / f).read_bytes() for f in ("config.json", "metrics.jsonl", "run.json")}
    capsys.readouterr()
    assert main(args + ["train.lr=1e-4", "reward.terms={correct: 1.0, turns: 0.1}"]) == 2
    err = capsys.readouterr().err
    assert "train.lr: 0.001 -> 0.0001" in err and "reward.terms.turns: (not set) -> 0.1" in err
    assert f"set out_dir to a folder of its own, or delete {out}" in err and "train.steps" in err  # the fix
    assert "train.train_layers" not in err  # what did not change is not named
    # resume=false would start another run over this one's rows: refused as well
    assert main(args + ["resume=false"]) == 2 and "resume=false" in capsys.readouterr().err
    assert {f: (out / f).read_bytes() for f in written} == written
    # files that are no run's (no config.json) are no folder to train in
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine\n")
    assert main(args + [f"out_dir={tmp_path / 'notes'}"]) == 2
    assert "no config.json" in capsys.readouterr().err and sorted((tmp_path / "notes").iterdir()) == [
        tmp_path / "notes" / "todo.txt"]
    # eval.py's evaluations (out_dir/eval/...) may come before the run: it trains there
    (tmp_path / "evaluated" / "eval" / "bamboogle").mkdir(parents=True)
    assert main(args + [f"out_dir={tmp_path / 'evaluated'}"]) == 0 and steps(tmp_path / "evaluated") == [1]


def test_what_may_change_on_a_resume_resumes_and_trains_the_steps_it_adds(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = a_run(tiny_model_dir, out)
    more = args + ["train.steps=2", "train.save_every=5", "train.logits_chunk=64", "judge.max_workers=2"]
    assert main(more) == 0 and steps(out) == [1, 2]
    assert "resumed from" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["train"]["steps"] == 2
    # fewer steps than the checkpoint holds would report its weights as an earlier step's
    assert main(args) == 2 and "checkpointed at step 2" in capsys.readouterr().err
    # no checkpoint left: the run starts over, its earlier rows dropped, not doubled
    shutil.rmtree(out / "checkpoints")
    assert main(more) == 0 and steps(out) == [1, 2]


def test_a_key_an_older_run_lacks_counts_as_its_default():
    cfg = load_config(str(ROOT / "config.yaml"))
    saved = json.loads(json.dumps(cfg))
    del saved["train"]["row_weight"]  # a run from before the key existed
    assert resume_conflicts(saved, cfg) == []
    assert resume_conflicts(saved, {**cfg, "train": {**cfg["train"], "row_weight": "turn"}}) == [
        "train.row_weight: 'trajectory' -> 'turn'"]
