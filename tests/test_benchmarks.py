"""Tests for benchmarks.py: the eight official benchmark files and our JSONL tasks
load into uniform Items whose gold answers the judge accepts.

The real files are shipped in data/benchmarks/; the loader's rules are also tested
on small synthetic files written here.
"""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from support.datasets import Item, load_benchmark  # noqa: E402
from judge import check_game24, score  # noqa: E402

from conftest import BENCHMARKS as BENCH  # noqa: E402

# file -> (row count, kind of every item)
EXPECTED = {
    "2wiki": (200, "text"),
    "aime24": (30, "number"),
    "amc23": (40, "number"),
    "bamboogle": (125, "text"),
    "gameof24": (300, "game24"),
    "hotpotqa": (100, "text"),
    "medqa": (300, "choice"),
    "musique": (200, "text"),
}


@pytest.fixture(scope="module")
def bench():
    return {name: load_benchmark(BENCH / f"{name}.json") for name in EXPECTED}


# --- the real files ----------------------------------------------------------------

def test_all_eight_files_load_with_expected_kinds(bench):
    assert sorted(p.stem for p in BENCH.glob("*.json")) == sorted(EXPECTED)
    for name, (count, kind) in EXPECTED.items():
        items = bench[name]
        assert len(items) == count, name
        assert {it.kind for it in items} == {kind}, name
        assert len({it.id for it in items}) == count, f"{name}: ids not unique"
        for it in items:
            assert isinstance(it, Item)
            assert it.question.strip(), (name, it.id)
            assert it.gold and all(g.strip() for g in it.gold), (name, it.id)
            assert it.meta["source"] == name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_gold_scores_correct_against_itself(bench, name):
    for it in bench[name][:20]:
        pred = f"<answer>{it.gold[0]}</answer>"  # for game24 the gold is the reference expression
        res = score(pred, it.gold, it.kind, it.options)
        assert res["correct"], (name, it.id, it.gold, res)
        if it.kind == "game24":
            assert score(pred, it.numbers, it.kind)["correct"], (name, it.id)


def test_gold_of_another_item_is_mostly_wrong(bench):
    # a judge that accepts everything would pass the test above; this one it would not
    for name, items in bench.items():
        shifted = [score(f"<answer>{items[i - 1].gold[0]}</answer>", it.gold, it.kind, it.options)["correct"]
                   for i, it in enumerate(items[:20])]
        assert sum(shifted) <= 2, name


def test_choice_items_carry_their_options(bench):
    for it in bench["medqa"]:
        assert len(it.options) == 4 and not it.options[0].startswith("A. ")
        assert it.gold[0] in it.options  # medqa's gold is the option text
        for letter, opt in zip("ABCD", it.options):
            assert f"{letter}. {opt}" in it.question
        # the official query already lists the options once; we must not add them again
        assert it.question.count(f"A. {it.options[0]}") == 1
    assert score("<answer>C</answer>", bench["medqa"][0].gold, "choice", bench["medqa"][0].options)["correct"]


def test_game24_items_and_every_reference_expression(bench):
    for it in bench["gameof24"]:
        assert len(it.numbers) == 4 and "24" in it.question
        for expr in it.gold:  # 1 to 5 reference expressions per puzzle
            assert check_game24(expr, it.numbers), (it.id, expr, it.numbers)
    assert bench["gameof24"][0].numbers == [1, 1, 1, 8]


def test_questions_are_clean_and_ids_stable(bench):
    for name in ("aime24", "bamboogle", "hotpotqa"):
        for it in bench[name]:
            assert "<answer>" not in it.question, name  # output-format boilerplate stripped ...
            assert "<answer>" in it.meta["raw_question"]  # ... and kept
    assert bench["bamboogle"][0].question.endswith("Citibank was founded?")
    assert bench["bamboogle"][0].gold == ["james madison"]
    assert bench["aime24"][0].gold == ["33"] and bench["aime24"][0].id == "0"
    # medqa numbers rows 0-99 and 100-199 both with pid/idx 0..99 (different
    # questions), then 200-299 with 100..199: ids fall back to the row index
    assert [it.id for it in bench["medqa"][:3]] == ["0", "1", "2"]
    assert bench["medqa"][150].id == "150" and bench["medqa"][150].meta["pid"] == "50"


def test_limit(bench):
    items = load_benchmark(BENCH / "musique.json", limit=5)
    assert [it.id for it in items] == [it.id for it in bench["musique"][:5]]
    assert load_benchmark(BENCH / "musique.json", limit=0) == []


# --- synthetic files: each loader rule without the real data ----------------------------

def write_json(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text(json.dumps(rows), encoding="utf-8")
    return path


def test_jsonl_task_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    rows = [{"question": "What is 48213 * 9127?", "answer": "440040051", "kind": "number"},
            {"question": "Who founded Zorvath?", "answer": ["Ilsa Marrow", "Marrow"], "kind": "text"},
            {"question": "Capital of Qent?", "answer": "Port Vell"}]  # no kind: inferred
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    items = load_benchmark(path)
    assert [it.kind for it in items] == ["number", "text", "text"]
    assert items[1].gold == ["Ilsa Marrow", "Marrow"]
    assert [it.id for it in items] == ["0", "1", "2"]
    assert score("<answer>440,040,051</answer>", items[0].gold, items[0].kind)["correct"]


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q", "answer": "a"}\n{not json\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl: line 2"):
        load_benchmark(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_benchmark(tmp_path / "nope.json")


def test_row_without_question_names_file_row_and_expected_fields(tmp_path):
    path = write_json(tmp_path, "broken.json", [{"query": "ok?", "answer": "a"}, {"prompt_text": "?", "answer": "b"}])
    with pytest.raises(ValueError) as e:
        load_benchmark(path)
    msg = str(e.value)
    assert "broken.json" in msg and "row 1" in msg and "query, question, problem" in msg and "prompt_text" in msg


def test_row_without_answer_and_bad_kind(tmp_path):
    with pytest.raises(ValueError, match=r"row 0 has no gold answer.*answer, answers"):
        load_benchmark(write_json(tmp_path, "a.json", [{"question": "q"}]))
    with pytest.raises(ValueError, match="kind 'essay'"):
        load_benchmark(write_json(tmp_path, "b.json", [{"question": "q", "answer": "a", "kind": "essay"}]))
    with pytest.raises(ValueError, match="not valid JSON"):
        (tmp_path / "c.json").write_text("[{", encoding="utf-8")
        load_benchmark(tmp_path / "c.json")
    with pytest.raises(ValueError, match="expected a JSON object"):
        load_benchmark(write_json(tmp_path, "d.json", ["just a string"]))


def test_field_variants_and_kind_inference(tmp_path):
    rows = [
        {"id": "x1", "problem": "2+2?", "answer": 4},
        {"id": "x2", "problem": "Half of one?", "answer": "['1/2', '0.5']"},  # stringified list
    ]
    items = load_benchmark(write_json(tmp_path, "math.json", rows))
    assert [it.kind for it in items] == ["number", "number"] and [it.id for it in items] == ["x1", "x2"]
    assert items[1].gold == ["1/2", "0.5"]
    # one non-numeric gold makes the whole file text ("323 BC" is not a number)
    rows.append({"id": "x3", "problem": "When?", "answer": "323 BC"})
    items = load_benchmark(write_json(tmp_path, "qa.json", rows))
    assert {it.kind for it in items} == {"text"}


def test_choices_as_dict_and_letter_gold(tmp_path):
    rows = [{"question": "Which is a fruit?", "choices": {"B": "Carrot", "A": "Apple", "C": "Leek"}, "answer": "A"}]
    it = load_benchmark(write_json(tmp_path, "mc.json", rows))[0]
    assert it.kind == "choice" and it.options == ["Apple", "Carrot", "Leek"]
    assert it.question == "Which is a fruit?\nA. Apple\nB. Carrot\nC. Leek"
    assert score("<answer>apple</answer>", it.gold, it.kind, it.options)["correct"]
    assert not score("<answer>B</answer>", it.gold, it.kind, it.options)["correct"]


def test_game24_variants(tmp_path):
    rows = [{"numbers": "4 4 6 8", "answer": ["(4+8)*(6-4)"]},  # no question text at all
            {"nums": [3, 3, 8, 8], "question": "Solve this puzzle.", "answer": "8/(3-8/3)"}]
    items = load_benchmark(write_json(tmp_path, "puzzles.json", rows))
    assert [it.kind for it in items] == ["game24", "game24"]
    assert items[0].numbers == [4, 4, 6, 8]
    assert items[0].question == "Use the numbers 4, 4, 6, 8 each exactly once with + - * / to make 24."
    assert items[1].question.startswith("Solve this puzzle.\nUse the numbers 3, 3, 8, 8")
    for it in items:
        assert score(f"<answer>{it.gold[0]}</answer>", it.gold, it.kind)["correct"]
    # a game24 file known only by its name and its questions: the numbers are read from the text
    rows = [{"query": "Using the numbers [2, 3, 4, 1], make 24.", "answer": "2*3*4*1"}]
    it = load_benchmark(write_json(tmp_path, "game_of_24_extra.json", rows))[0]
    assert it.kind == "game24" and it.numbers == [2, 3, 4, 1]


def test_the_folders_readme_names_every_file_with_its_item_count():
    """data/benchmarks/README.md's table: one row per shipped file, with its real item count."""
    rows = [line.split(" | ") for line in (BENCH / "README.md").read_text().splitlines() if line.startswith("| ")
            and line.split(" | ")[0][2:].endswith(".json")]
    assert {r[0][2:]: int(r[1]) for r in rows} == {f"{name}.json": count for name, (count, _) in EXPECTED.items()}
