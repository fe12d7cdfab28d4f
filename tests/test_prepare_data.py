"""Tests for prepare_data.py on small files the test builds in the sources' own layouts
and field names (FlashRAG's NQ JSONL, DeepMath's parquet shards, GAIA's metadata
parquet / JSONL, GPQA's CSV), and for its one-line messages when offline or gated."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import prepare_data  # noqa: E402
from support.datasets import load_benchmark, read_jsonl  # noqa: E402
from judge import score_item  # noqa: E402

pq = pytest.importorskip("pyarrow.parquet")
import pyarrow as pa  # noqa: E402

NQ_RECORDS = [
    {"id": "train_0", "question": "who got the first nobel prize in physics",
     "golden_answers": ["Wilhelm Conrad Röntgen"], "metadata": {}},
    {"id": "train_1", "question": "when is the next deadpool movie being released?",
     "golden_answers": ["May 18, 2018", "May 18, 2018"], "metadata": {}},
    {"id": "train_2", "question": "how many episodes are in chicago fire season 4",
     "golden_answers": ["23"], "metadata": {}},
    {"id": "train_3", "question": "a question with no answer", "golden_answers": [], "metadata": {}},
]
DEEPMATH_SHARDS = [
    [{"question": r"Evaluate $\lim_{x\to 0} \frac{\sin x}{x}$.", "final_answer": "1"},
     {"question": "Find the interval where f is increasing.", "final_answer": r"(-\infty, 2]"},
     {"question": "Compute the integral.", "final_answer": r"\dfrac{\pi}{4}"}],
    [{"question": "Solve for x.", "final_answer": r"\{1, 2\}"},
     {"question": "Is the series convergent?", "final_answer": "Yes"}],
]
GAIA_RECORDS = [
    {"task_id": "t-1", "Question": "How many studio albums did the band release?", "Level": "1",
     "Final answer": "3", "file_name": "", "file_path": "", "Annotator Metadata": {"Steps": "1. search"}},
    {"task_id": "t-2", "Question": "What is in the attached spreadsheet?", "Level": "2",
     "Final answer": "89706.00", "file_name": "sheet.xlsx", "file_path": "2023/validation/sheet.xlsx",
     "Annotator Metadata": {"Steps": "open it"}},
    {"task_id": "t-3", "Question": "Which word describes the society?", "Level": "2",
     "Final answer": "egalitarian", "file_name": "", "file_path": "", "Annotator Metadata": {"Steps": "x"}},
]
GPQA_HEADER = ["Pre-Revision Question", "Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
               "Incorrect Answer 3", "Explanation", "Record ID", "High-level domain", "Subdomain"]
GPQA_RECORDS = [
    ["old", "What is the ratio of the masses?\nAssume Eddington-limited accretion.", "0.9", "0.7", "0.1", "0.3",
     "because", "rec1", "Physics", "Astrophysics"],
    ["old", "Which product forms?", "ethyl 4-aminobenzoate", "benzoic acid", "toluene", "aniline",
     "because", "rec2", "Chemistry", "Organic Chemistry"],
]


def write_parquet(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.fixture()
def source_dir(tmp_path):
    """Local copies laid out as --from expects: DIR/<owner>/<name>/<path in the repo>."""
    root = tmp_path / "hub"
    nq = root / "RUC-NLPIR" / "FlashRAG_datasets" / "nq" / "train.jsonl"
    nq.parent.mkdir(parents=True)
    nq.write_text("".join(json.dumps(r) + "\n" for r in NQ_RECORDS), encoding="utf-8")
    for k, shard in enumerate(DEEPMATH_SHARDS):
        rows = [dict(r, difficulty=6.5, topic="Mathematics -> Calculus", r1_solution_1="...",
                     r1_solution_2="...", r1_solution_3="...") for r in shard]
        write_parquet(root / "zwhe99" / "DeepMath-103K" / "data" / f"train-0000{k}-of-00002.parquet", rows)
    write_parquet(root / "gaia-benchmark" / "GAIA" / "2023" / "validation" / "metadata.parquet", GAIA_RECORDS)
    gpqa = root / "Idavidrein" / "gpqa" / "gpqa_diamond.csv"
    gpqa.parent.mkdir(parents=True)
    with open(gpqa, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(GPQA_HEADER)
        w.writerows(GPQA_RECORDS)
    return root


def test_help_and_usage():
    r = subprocess.run([sys.executable, "-m", "scripts.prepare_data", "--help"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0 and "--dry-run" in r.stdout and "gated" in r.stdout


def test_train_mix_in_the_official_order(source_dir, tmp_path):
    out = tmp_path / "mix"
    assert prepare_data.main(["train", "--from", str(source_dir), "--out", str(out), "--heldout", "2"]) == 0
    train, held = read_jsonl(out / "train.jsonl", strict=True), read_jsonl(out / "heldout.jsonl", strict=True)
    # NQ first, then DeepMath, permuted as datasets.shuffle(seed=42) does; the empty NQ row dropped
    ids = [f"nq-{k}" for k in range(4)] + [f"deepmath-{k}" for k in range(5)]
    want = [ids[i] for i in np.random.default_rng(42).permutation(9) if ids[i] != "nq-3"]
    assert [r["id"] for r in held + train] == want and len(held) == 2
    for r in held + train:
        assert set(r) == {"id", "question", "answer", "kind", "task"}
    nq0 = next(r for r in held + train if r["id"] == "nq-0")
    assert nq0 == {"id": "nq-0", "question": "who got the first nobel prize in physics?",
                   "answer": ["Wilhelm Conrad Röntgen"], "kind": "text", "task": "nq"}
    assert next(r for r in held + train if r["id"] == "nq-1")["answer"] == ["May 18, 2018"]  # aliases deduplicated
    dm = next(r for r in held + train if r["id"] == "deepmath-1")
    assert dm["answer"] == r"(-\infty, 2]" and dm["kind"] == "math" and dm["task"] == "deepmath"
    # the loader takes both files as they are, and every gold scores itself
    items = load_benchmark(str(out / "train.jsonl")) + load_benchmark(str(out / "heldout.jsonl"))
    assert sorted(it.kind for it in items) == ["math"] * 5 + ["text"] * 3
    assert {it.meta["task"] for it in items} == {"nq", "deepmath"}
    for it in items:
        assert score_item(f"<answer>{it.gold[0]}</answer>", it.gold, it.kind)["correct"], it.id
    # --limit keeps the first training rows of the same order
    assert prepare_data.main(["train", "--from", str(source_dir), "--out", str(out), "--heldout", "2",
                              "--limit", "3"]) == 0
    assert [r["id"] for r in read_jsonl(out / "train.jsonl")] == want[2:5]


def test_dry_run_writes_nothing(source_dir, tmp_path, capsys):
    out = tmp_path / "dry"
    assert prepare_data.main(["all", "--from", str(source_dir), "--out", str(out), "--dry-run",
                              "--heldout", "2"]) == 0
    text = capsys.readouterr().out
    assert not out.exists()
    assert f"would write {out / 'train.jsonl'}: 6 rows; kinds math 4, text 2" in text
    assert f"would write {out / 'gaia.json'}: 2 rows" in text and "first row:" in text
    assert f"would write {out / 'gpqa.json'}: 2 rows; kinds choice 2" in text


def test_gaia_text_only_tasks(source_dir, tmp_path):
    out = tmp_path / "bench"
    assert prepare_data.main(["gaia", "--from", str(source_dir), "--out", str(out)]) == 0
    rows = json.loads((out / "gaia.json").read_text())
    assert [r["task_id"] for r in rows] == ["t-1", "t-3"]  # the task with an attachment is left out
    assert [r["kind"] for r in rows] == ["number", "text"] and rows[0]["level"] == "1"
    items = load_benchmark(str(out / "gaia.json"))
    assert [it.kind for it in items] == ["number", "text"] and items[0].gold == ["3"]
    assert score_item("<answer>three</answer>", items[0].gold, items[0].kind)["correct"] is False
    assert score_item("<answer>3</answer>", items[0].gold, items[0].kind)["correct"]
    assert prepare_data.main(["gaia", "--from", str(source_dir), "--out", str(out), "--with-files"]) == 0
    assert len(json.loads((out / "gaia.json").read_text())) == 3


def test_gaia_older_jsonl_layout(tmp_path):
    root = tmp_path / "hub"
    meta = root / "gaia-benchmark" / "GAIA" / "2023" / "validation" / "metadata.jsonl"
    meta.parent.mkdir(parents=True)
    meta.write_text("".join(json.dumps(r) + "\n" for r in GAIA_RECORDS), encoding="utf-8")
    assert prepare_data.main(["gaia", "--from", str(root), "--out", str(tmp_path / "b")]) == 0
    assert len(json.loads((tmp_path / "b" / "gaia.json").read_text())) == 2


def test_gpqa_options_shuffled_reproducibly(source_dir, tmp_path):
    out = tmp_path / "bench"
    assert prepare_data.main(["gpqa", "--from", str(source_dir), "--out", str(out)]) == 0
    rows = json.loads((out / "gpqa.json").read_text())
    again = prepare_data.gpqa_rows([dict(zip(GPQA_HEADER, r)) for r in GPQA_RECORDS])
    assert rows == again  # the same file twice: the same shuffle
    for row, rec in zip(rows, GPQA_RECORDS):
        letter = "ABCD"[int(row["answer_idx"])]
        assert row["answer"] == f"{letter}. {rec[2]}" and row["options"][int(row["answer_idx"])] == row["answer"]
        assert sorted(o[3:] for o in row["options"]) == sorted(rec[2:6])
    assert "\n" in rows[0]["query"]  # the CSV's multi-line question survives
    items = load_benchmark(str(out / "gpqa.json"))
    for it, row in zip(items, rows):
        letter = "ABCD"[int(row["answer_idx"])]
        assert it.kind == "choice" and len(it.options) == 4 and f"{letter}. " in it.question
        assert score_item(f"<answer>{letter}</answer>", it.gold, it.kind, it.options)["correct"]
        wrong = "ABCD"[(int(row["answer_idx"]) + 1) % 4]
        assert not score_item(f"<answer>{wrong}</answer>", it.gold, it.kind, it.options)["correct"]


def test_heldout_larger_than_the_mix_is_an_error(source_dir, capsys):
    assert prepare_data.main(["train", "--from", str(source_dir), "--dry-run"]) == 1  # default 200 > 8 rows
    assert "nothing left to train on" in capsys.readouterr().err


def test_missing_local_files_name_the_path(tmp_path, capsys):
    assert prepare_data.main(["gpqa", "--from", str(tmp_path), "--subset", "main"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "gpqa_main.csv" in err and "huggingface.co/datasets/Idavidrein/gpqa" in err


def test_offline_is_one_line(tmp_path):
    """The real hub client with the network unavailable (HF_HUB_OFFLINE, empty cache)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), HF_TOKEN="", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "scripts.prepare_data", "train", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot reach the Hugging Face hub") and "--from DIR" in last
    assert not (tmp_path / "o").exists()
    # the dry run offline is a plan, not an error
    r = subprocess.run([sys.executable, "-m", "scripts.prepare_data", "all", "--dry-run"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0 and "would download zwhe99/DeepMath-103K" in r.stdout
    assert "gated: accept its terms at https://huggingface.co/datasets/gaia-benchmark/GAIA" in r.stdout


def test_gated_set_says_what_to_do(monkeypatch, capsys):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    class Gated(GatedRepoError):
        def __init__(self):
            Exception.__init__(self, "403 Client Error: Access to dataset is restricted")

    class Unauthorized(RepositoryNotFoundError):
        def __init__(self):
            Exception.__init__(self, "401 Client Error")

    for error in (Gated, Unauthorized):
        def refuse(*args, **kwargs):
            raise error()
        monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
        assert prepare_data.main(["gaia"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0, err
        assert "gaia-benchmark/GAIA is gated" in err and "accept its terms" in err and "HF_TOKEN" in err


def test_missing_pyarrow_says_what_to_install(source_dir, monkeypatch, capsys):
    import builtins
    real = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    assert prepare_data.main(["train", "--from", str(source_dir), "--dry-run"]) == 1
    assert "needs pyarrow: pip install pyarrow" in capsys.readouterr().err


def test_truncated_parquet_is_one_line(source_dir, capsys):
    shard = next((source_dir / "zwhe99" / "DeepMath-103K" / "data").glob("*.parquet"))
    shard.write_bytes(shard.read_bytes()[:50])
    assert prepare_data.main(["train", "--from", str(source_dir), "--dry-run"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a readable parquet file" in err


def test_hub_path_through_the_client(source_dir, tmp_path, monkeypatch):
    """The Hub fetcher as it runs for users, with the client's download replaced by the
    local copies: what it asks for, and that a dry run asks the cache only."""
    import huggingface_hub
    asked = []

    def fake_snapshot(repo_id, repo_type=None, allow_patterns=None, token=None, local_files_only=False, **kw):
        asked.append((repo_id, repo_type, tuple(allow_patterns), token, local_files_only))
        return str(source_dir / repo_id)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    out = tmp_path / "mix"
    assert prepare_data.main(["train", "--out", str(out), "--heldout", "1", "--token", "hf_x"]) == 0
    assert asked == [("RUC-NLPIR/FlashRAG_datasets", "dataset", ("nq/train.jsonl",), "hf_x", False),
                     ("zwhe99/DeepMath-103K", "dataset", ("data/train-*.parquet",), "hf_x", False)]
    assert len(read_jsonl(out / "train.jsonl")) == 7
    asked.clear()
    assert prepare_data.main(["gpqa", "--out", str(tmp_path / "b"), "--dry-run"]) == 0
    assert asked[0][-1] is True and not (tmp_path / "b").exists()
