"""eval.py's folders and its paper suite, on tiny random models: a folder holds one
planner's rows under one setup (made_by.json) and never resumes another's; `--suite paper`
evaluates every shipped Table 1 benchmark and writes the table with the paper's figures."""

import json
import re
from pathlib import Path

import pytest

import eval as evaluation
from scripts.tiny_model import build

ROOT = Path(__file__).resolve().parents[1]
FAST = ["model.device=cpu", f"tools.corpus={ROOT / 'data' / 'corpus.jsonl'}", "agent.planner.max_new_tokens=6",
        "agent.executor.max_new_tokens=8", "agent.generator.max_new_tokens=6", "eval.max_turns=1"]


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory, tiny_model_dir) -> str:
    """A second random planner: the tiny model's shape and tokenizer, other weights."""
    return build(str(tmp_path_factory.mktemp("other")), seed=1)


def run_eval(model_dir, out_dir, *args, planner=None) -> int:
    return evaluation.main(["--benchmark", str(ROOT / "data" / "heldout.jsonl"), "--config", str(ROOT / "config.yaml"),
                            "--limit", "3", *args, *(["--model", planner] if planner else []),
                            f"model.name={model_dir}", f"out_dir={out_dir}", *FAST])


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def test_two_planners_into_one_run_folder_each_get_their_own_rows(tiny_model_dir, other_tiny, tmp_path, capsys):
    """The default folder is the planner's own; a shared --out refuses the second planner,
    naming the weights, and leaves the first one's rows as they were."""
    assert run_eval(tiny_model_dir, tmp_path / "a") == 0
    assert run_eval(tiny_model_dir, tmp_path / "a", planner=other_tiny) == 0
    assert run_eval(tiny_model_dir, tmp_path / "alone", planner=other_tiny) == 0
    frozen, trained = sorted((tmp_path / "a" / "eval").iterdir())
    alone = next((tmp_path / "alone" / "eval").iterdir())
    assert frozen.name == "heldout" and trained.name.startswith("heldout_") and alone.name == trained.name
    assert rows(trained) == rows(alone)  # exactly what it gets alone
    assert [r["answer"] for r in rows(frozen)] != [r["answer"] for r in rows(trained)]  # not the first one's rows

    shared = tmp_path / "shared"
    assert run_eval(tiny_model_dir, tmp_path, "--out", str(shared)) == 0
    before = (shared / "results.jsonl").read_text()
    capsys.readouterr()
    assert run_eval(tiny_model_dir, tmp_path, "--out", str(shared), planner=other_tiny) == 2
    err = capsys.readouterr().err
    assert "another setup" in err and "planner_weights" in err and "another --out" in err
    assert (shared / "results.jsonl").read_text() == before
    # A setting that changes the rows is refused too; the same setup resumes.
    assert run_eval(tiny_model_dir, tmp_path, "--out", str(shared), "eval.seed=7") == 2
    assert "seed" in capsys.readouterr().err
    assert run_eval(tiny_model_dir, tmp_path, "--out", str(shared), "--limit", "4") == 0
    assert (shared / "results.jsonl").read_text().startswith(before) and len(rows(shared)) == 4


def test_other_questions_under_the_same_ids_are_refused(tiny_model_dir, tmp_path, capsys):
    """A benchmark file edited between two runs: the folder's rows no longer answer its items."""
    data = tmp_path / "tasks.jsonl"
    def write(q):
        data.write_text("".join(json.dumps({"id": f"t{k}", "question": f"{q} {k}?", "answer": "4", "kind": "number"})
                                + "\n" for k in range(2)))
    args = ["--benchmark", str(data), "--config", str(ROOT / "config.yaml"), "--out", str(tmp_path / "e"),
            f"model.name={tiny_model_dir}", *FAST]
    write("What is 2 + 2, item")
    assert evaluation.main(args) == 0
    write("What is 3 + 1, item")
    capsys.readouterr()
    assert evaluation.main(args) == 2
    assert "other questions or golds under the ids t0, t1" in capsys.readouterr().err


def test_suite_paper_writes_the_table_with_the_papers_figures(tiny_model_dir, tmp_path):
    """--suite paper --limit 1 --model: the eight shipped benchmarks for both planners (here
    the same weights, so the same rows), GAIA and GPQA named absent, the paper's two rows
    beside ours in table.json and table.md, and in the run's report; a second call with
    --limit 2 resumes."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")  # a training run's folder: its report shows the table
    out = run / "eval" / "paper"  # the default --out
    args = ["--suite", "paper", "--config", str(ROOT / "config.yaml"), "--limit", "1", "--model", tiny_model_dir,
            f"out_dir={run}", f"model.name={tiny_model_dir}", *FAST]
    assert evaluation.main(args) == 0
    table = json.loads((out / "table.json").read_text())
    shipped = sorted(p.stem for p in (ROOT / "data" / "benchmarks").glob("*.json"))
    assert sorted(table["benchmarks"]) == shipped and len(shipped) == 8
    assert table["absent"] == ["gaia", "gpqa"]
    for name, row in table["benchmarks"].items():
        assert row["n"] == 1 and set(row["planners"]) == {"frozen", "trained"}
        assert (row["paper"]["untrained"], row["paper"]["trained"]) == evaluation.PAPER_TABLE_1[name]
        f, t = row["planners"]["frozen"], row["planners"]["trained"]
        assert f["accuracy"] == t["accuracy"] and f["tool_calls_per_item"] == t["tool_calls_per_item"]
        assert rows(out / "frozen" / name)[0]["answer"] == rows(out / "trained" / name)[0]["answer"]
    md = (out / "table.md").read_text()
    lines = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| benchmark")]
    assert [line.split(" | ")[0][2:] for line in lines] == list(evaluation.PAPER_TABLE_1)  # the paper's order
    assert re.search(r"\| musique \| 1 \| .* \| 19\.2 \| 25\.3 \| \+6\.1 \|$", md, re.M)
    assert "| gaia | absent |" in md and "Qwen2.5-7B-Instruct" in md and "No web search in agent.tools" in md
    page = (run / "report.html").read_text()
    assert "Table 1 beside ours" in page and "<td>musique</td><td>1</td>" in page and "<td>25.3</td>" in page
    assert "No web search in agent.tools" in page
    assert evaluation.main(args[:5] + ["2"] + args[6:]) == 0
    assert all(r["n"] == 2 for r in json.loads((out / "table.json").read_text())["benchmarks"].values())


def test_paper_figures_in_the_docs_are_the_suites():
    """docs/PAPER.md's Table 1 rows are the figures the suite prints beside ours."""
    text = (ROOT / "docs" / "PAPER.md").read_text()
    for label, column in (("AgentFlow + Flow-GRPO", 1), ("AgentFlow, untrained", 0)):
        line = next(line for line in text.splitlines() if line.startswith(f"| {label} |"))
        figures = [float(x) for x in line.split("|")[2:-1]]
        assert figures == [v[column] for v in evaluation.PAPER_TABLE_1.values()], label
