"""scripts/seed_table.py: the README's results table from run folders laid out as train.py
writes them (learning.json, eval/step_N/results.jsonl, eval/paraphrase/step_N/...). The
summaries are the real eval.summarize of result rows written here."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval import summarize  # noqa: E402
from scripts import seed_table  # noqa: E402

SEARCH_CODE = ["Local_Search", "Python_Coder"]


def row(i: int, task: str, correct: bool, tools: list[str]) -> dict:
    return {"id": f"q{i}", "task": task, "correct": correct, "f1": float(correct), "turns": len(tools),
            "tools": tools, "tool_errors": 0, "errors": []}


def write_run(root: Path, name: str, after_two_step: list[bool], lost_lookup: bool, wall_s: float) -> Path:
    """A run of 2 lookups and 4 two_step items: before, every lookup right and no two_step;
    after, the two_step items in after_two_step right (planned search then code), and the
    first lookup lost when lost_lookup."""
    run = root / name
    before = [row(0, "lookup", True, ["Local_Search"]), row(1, "lookup", True, ["Local_Search"])]
    before += [row(2 + k, "two_step", False, ["Python_Coder"]) for k in range(4)]
    after = [row(0, "lookup", not lost_lookup, ["Local_Search"]), row(1, "lookup", True, ["Local_Search"])]
    after += [row(2 + k, "two_step", ok, SEARCH_CODE if ok else ["Local_Search"]) for k, ok in enumerate(after_two_step)]
    learning = {"before": summarize(before), "after": summarize(after), "run": {"wall_s": wall_s}}
    para_after = [dict(r, correct=False) if r["task"] == "two_step" else r for r in after]  # new wordings: none
    learning["paraphrase"] = {"before": summarize(before), "after": summarize(para_after)}
    for where, step, rows in (("", 0, before), ("", 8, after), ("paraphrase", 0, before), ("paraphrase", 8, para_after)):
        d = run / "eval" / where / f"step_{step}"
        d.mkdir(parents=True)
        (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "learning.json").write_text(json.dumps(learning))
    return run


def test_table_from_two_runs(tmp_path, capsys):
    a = write_run(tmp_path, "seed0", [True, True, True, False], lost_lookup=False, wall_s=605.0)
    b = write_run(tmp_path, "seed1", [True, False, False, False], lost_lookup=True, wall_s=59.9)
    assert seed_table.main([str(a), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| | before | seed0 | seed1 |"
    para_at = next(i for i, ln in enumerate(lines) if ln.startswith("| paraphrase, all"))
    cells = {ln.split(" | ")[0].lstrip("| "): ln for ln in lines[2:para_at]}  # the held-out rows
    held = lines[2]
    # all: before 2/6; after 5/6 and 2/6 (seed1 lost a lookup and won one two_step)
    assert held == "| held-out, all | 0.333 | **0.833 (+0.500)** | **0.333 (+0.000)** |"
    assert cells["two_step"] == "| two_step | 0.000 | 0.750 | 0.250 |"
    assert cells["two_step planned search, then code"] == "| two_step planned search, then code | 0/4 | 3/4 | 1/4 |"
    assert "| mean turns, lookup / two_step | 1.00 / 1.00 | 1.00 / 1.75 | 1.00 / 1.25 |" in lines
    flips = [ln for ln in lines if ln.startswith("| items wrong -> right")]
    assert flips == ["| items wrong -> right / right -> wrong | | 3 / 0 | 1 / 1 |",  # held-out
                     "| items wrong -> right / right -> wrong | | 0 / 0 | 0 / 1 |"]  # paraphrase
    assert "| paraphrase, all | 0.333 | **0.333 (+0.000)** | **0.167 (-0.167)** |" in lines
    assert lines[-1] == "| wall time | | 10 min 5 s | 0 min 59 s |"


def test_a_run_without_learning_json_is_refused(tmp_path, capsys):
    a = write_run(tmp_path, "seed0", [True] * 4, lost_lookup=False, wall_s=1.0)
    (tmp_path / "unfinished").mkdir()
    assert seed_table.main([str(a), str(tmp_path / "unfinished")]) == 2
    assert "no learning.json in" in capsys.readouterr().err
