"""Tests for the offline task suite (make_tasks.py and the shipped data/ files).

They check what the default training run relies on: the files are exactly what
the generator makes, every gold answer is right (checked independently of the
generator's own bookkeeping), heldout asks about entities train never saw, and
the Local_Search tool finds the right passage first for every heldout question. The
paraphrase set asks about held-out entities in wordings that no other file uses.
"""

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts import make_tasks  # noqa: E402
from support.datasets import read_jsonl  # noqa: E402

DATA = ROOT / "data"
FILES = ["corpus.jsonl", "train.jsonl", "heldout.jsonl", "heldout_wordings.jsonl", "paraphrase.jsonl"]


@pytest.fixture(scope="module")
def data():
    return {name[: -len(".jsonl")]: read_jsonl(DATA / name, strict=True) for name in FILES}


@pytest.fixture(scope="module")
def passage_of(data):
    """Map from entity name (= passage title) to its corpus row."""
    return {row["title"]: row for row in data["corpus"]}


def entities_in(question, passage_of):
    """Titles that occur in the question as whole words."""
    return [t for t in passage_of if re.search(r"\b" + re.escape(t) + r"\b", question)]


def numbers_in(text):
    return [int(x) for x in re.findall(r"\d+", text)]


def safe_eval(expr):
    """Evaluate an integer expression of + - * only, via the ast (never eval)."""
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b}

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(f"disallowed syntax: {ast.dump(node)}")

    return ev(ast.parse(expr, mode="eval"))


def test_safe_eval_rejects_anything_but_arithmetic():
    assert safe_eval("48213 * 9127 + 1") == 48213 * 9127 + 1
    for bad in ["__import__('os')", "2 ** 100", "x + 1", "1.5 * 2", "(lambda: 1)()"]:
        with pytest.raises(ValueError):
            safe_eval(bad)


# --- files and determinism ---------------------------------------------------

def test_shipped_files_are_reproduced_byte_for_byte(tmp_path):
    make_tasks.write(tmp_path, seed=0)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), name


def test_generate_is_deterministic_and_seed_dependent():
    assert make_tasks.generate(0) == make_tasks.generate(0)
    assert make_tasks.generate(1)["train"] != make_tasks.generate(0)["train"]


def test_row_format_and_counts(data):
    assert 300 <= len(data["corpus"]) <= 600
    for row in data["corpus"]:
        assert set(row) == {"id", "title", "text"}
    for split in ("train", "heldout"):
        ids = [row["id"] for row in data[split]]
        assert ids == [f"{split}-{i + 1:04d}" for i in range(len(ids))]
        for row in data[split]:
            assert set(row) == {"id", "question", "answer", "kind", "task"}
            assert row["kind"] == "number" and row["answer"].isdigit()
    count = lambda split, task: sum(r["task"] == task for r in data[split])
    assert [count("heldout", t) for t in ("arithmetic", "lookup", "two_step")] == [40, 40, 16]
    assert 380 <= len(data["train"]) <= 420
    assert 0.15 <= count("train", "two_step") / len(data["train"]) <= 0.25


# --- splits --------------------------------------------------------------------

def test_splits_share_no_question(data):
    train = [r["question"] for r in data["train"]]
    heldout = [r["question"] for r in data["heldout"]]
    assert len(set(train)) == len(train) and len(set(heldout)) == len(heldout)
    assert not set(train) & set(heldout)


def test_heldout_asks_about_unseen_entities(data, passage_of):
    def entities(split):
        return {e for r in data[split] if r["task"] != "arithmetic"
                for e in entities_in(r["question"], passage_of)}
    assert not entities("train") & entities("heldout")
    # and the corpus holds distractors that no question asks about
    assert len(passage_of) - len(entities("train") | entities("heldout")) >= 100


def test_other_wordings_ask_the_held_out_questions_in_words_training_never_used(data, passage_of):
    """heldout_wordings.jsonl: each row is a held-out question (same id stem, task and
    answer) about the same entity, or with the same numbers, in a wording that none of
    the templates train.jsonl was made from can produce."""
    heldout = {r["id"]: r for r in data["heldout"]}
    train_templates = make_tasks.ARITH_TEMPLATES + make_tasks.TWO_STEP_TEMPLATES + [
        ask for spec in make_tasks.ENTITY_TYPES.values() for asks in spec["ask"].values() for ask in asks]
    per_item = {}
    for r in data["heldout_wordings"]:
        stem, j = r["id"].rsplit("-w", 1)
        base = heldout[stem]
        per_item.setdefault(stem, []).append(int(j))
        assert (r["task"], r["answer"]) == (base["task"], base["answer"])
        assert make_tasks._parse(train_templates, r["question"]) is None, r["question"]
        assert entities_in(r["question"], passage_of) == entities_in(base["question"], passage_of)
        assert sorted(numbers_in(r["question"])) == sorted(numbers_in(base["question"])), r["question"]
    kinds = {t: [i for i, b in heldout.items() if b["task"] == t] for t in ("arithmetic", "lookup", "two_step")}
    assert all(per_item[i] == list(range(len(make_tasks.OTHER_TWO_STEP_WORDINGS))) for i in kinds["two_step"])
    assert all(per_item[i] == [0] for i in kinds["arithmetic"])
    # lookups: only those of the fact two_step multiplies, asked by that fact's phrase
    phrases = [spec["quantity"][1] for spec in make_tasks.ENTITY_TYPES.values()]
    for r in data["heldout_wordings"]:
        if r["task"] == "lookup":
            name = entities_in(r["question"], passage_of)[0]
            assert any(p.format(n=name) in r["question"] for p in phrases), r["question"]
    assert 0 < sum(i in per_item for i in kinds["lookup"]) < len(kinds["lookup"])


# --- the paraphrase set ----------------------------------------------------------

TRAIN_TEMPLATES = make_tasks.ARITH_TEMPLATES + make_tasks.TWO_STEP_TEMPLATES + [
    ask for spec in make_tasks.ENTITY_TYPES.values() for asks in spec["ask"].values() for ask in asks]
OTHER_WORDINGS = (make_tasks.OTHER_ARITH_WORDINGS + make_tasks.OTHER_LOOKUP_WORDINGS
                  + make_tasks.OTHER_TWO_STEP_WORDINGS)
PARA_WORDINGS = {"arithmetic": make_tasks.PARA_ARITH_WORDINGS, "lookup": make_tasks.PARA_LOOKUP_WORDINGS,
                 "two_step": make_tasks.PARA_TWO_STEP_WORDINGS}


def test_paraphrase_rows_and_counts(data):
    rows = data["paraphrase"]
    assert [r["id"] for r in rows] == [f"para-{i + 1:04d}" for i in range(len(rows))]
    for r in rows:
        assert set(r) == {"id", "question", "answer", "kind", "task"}
        assert r["kind"] == "number" and r["answer"].isdigit()
    assert [sum(r["task"] == t for r in rows) for t in PARA_WORDINGS] == [16, 16, 16]
    questions = [r["question"] for r in rows]
    assert len(set(questions)) == len(questions)
    assert not set(questions) & {r["question"] for split in ("train", "heldout", "heldout_wordings")
                                 for r in data[split]}


def test_paraphrase_wordings_are_new_and_several_per_kind(data):
    """No wording of the set is a training template or one of heldout_wordings.jsonl's, and
    no question of it can be made from one of those (a template's slot may swallow a whole
    wording: "What is {e}?" reads any "What is ...?"). Each kind in at least four wordings."""
    for kind, wordings in PARA_WORDINGS.items():
        assert not set(wordings) & set(TRAIN_TEMPLATES + OTHER_WORDINGS), kind
    used = {kind: set() for kind in PARA_WORDINGS}
    for r in data["paraphrase"]:
        assert make_tasks._parse(TRAIN_TEMPLATES + OTHER_WORDINGS, r["question"]) is None, r["question"]
        made_from = [w for w in PARA_WORDINGS[r["task"]] if make_tasks._parse([w], r["question"])]
        assert len(made_from) == 1, r["question"]
        used[r["task"]].add(made_from[0])
    assert all(len(u) >= 4 for u in used.values()), used
    # the two_step shapes the issue names: a factor put first, "scale", "please" at the end
    two_step = [r["question"] for r in data["paraphrase"] if r["task"] == "two_step"]
    assert any(re.match(r"I need \d+ times ", q) for q in two_step)
    assert any(re.search(r"scale it by \d+\.$", q) for q in two_step)
    assert any(re.search(r"multiplied by \d+, please\.$", q) for q in two_step)


def test_paraphrase_asks_about_held_out_entities_only(data, passage_of):
    def entities(split):
        return {e for r in data[split] if r["task"] != "arithmetic" for e in entities_in(r["question"], passage_of)}
    para = entities("paraphrase")
    assert len(para) == 32 and para <= entities("heldout") and not para & entities("train")
    for r in data["paraphrase"]:
        q, names = r["question"], entities_in(r["question"], passage_of)
        if r["task"] == "arithmetic":  # the kind still shows in the question, as in train
            assert names == [] and re.search(r"\d+ [*+] \d+", q), q
        elif r["task"] == "lookup":
            assert len(names) == 1 and not re.search(r"\d", q), q
        else:
            assert len(names) == 1 and len(numbers_in(q)) == 1, q


def test_paraphrase_numbers_are_fresh_and_answers_right(data, passage_of):
    """Every answer recomputed from the question and the corpus; the arithmetic expressions
    are none of train's or heldout's."""
    def expressions(split):
        return {re.search(r"\d[\d\s*+-]*\d", r["question"]).group() for r in data[split]
                if r["task"] == "arithmetic"}
    assert not expressions("paraphrase") & (expressions("train") | expressions("heldout"))
    for r in data["paraphrase"]:
        if r["task"] == "arithmetic":
            [expr] = [e for e in expressions("paraphrase") if e in r["question"]]
            assert safe_eval(expr) == int(r["answer"]) >= 10_000, r
            continue
        [name] = entities_in(r["question"], passage_of)
        facts = numbers_in(passage_of[name]["text"])
        if r["task"] == "lookup":
            assert int(r["answer"]) in facts, r
        else:
            [k] = numbers_in(r["question"])
            assert 3 <= k <= 9 and int(r["answer"]) in [n * k for n in facts], r


# --- the kind is visible from the wording --------------------------------------

def test_kind_is_visible_from_the_question(data, passage_of):
    for split in ("train", "heldout"):
        for r in data[split]:
            q, names = r["question"], entities_in(r["question"], passage_of)
            if r["task"] == "arithmetic":
                assert names == [] and re.search(r"\d+ [*+] \d+", q), q
            elif r["task"] == "lookup":
                assert len(names) == 1 and not re.search(r"\d", q), q
            else:
                assert len(names) == 1 and len(numbers_in(q)) == 1, q


# --- every answer is right -----------------------------------------------------

def test_arithmetic_answers(data):
    for split in ("train", "heldout"):
        for r in data[split]:
            if r["task"] == "arithmetic":
                expr = re.search(r"\d[\d\s*+-]*\d", r["question"]).group()
                assert safe_eval(expr) == int(r["answer"]), r
                # big enough that a 135M model cannot do it in its head
                assert int(r["answer"]) >= 10_000, r


def test_lookup_answers_are_in_the_entity_passage(data, passage_of):
    for split in ("train", "heldout"):
        for r in data[split]:
            if r["task"] == "lookup":
                [name] = entities_in(r["question"], passage_of)
                assert int(r["answer"]) in numbers_in(passage_of[name]["text"]), r


def test_two_step_answers_follow_from_the_looked_up_fact(data, passage_of):
    for split in ("train", "heldout"):
        for r in data[split]:
            if r["task"] == "two_step":
                [name] = entities_in(r["question"], passage_of)
                [k] = numbers_in(r["question"])
                assert "multipl" in r["question"] or "times" in r["question"], r
                facts = numbers_in(passage_of[name]["text"])
                assert int(r["answer"]) in [n * k for n in facts], r


def test_passages_are_short_and_name_their_entity(data):
    for row in data["corpus"]:
        assert len(row["text"].split()) <= 40, row
        assert row["title"] in row["text"], row
    titles = [row["title"] for row in data["corpus"]]
    assert len(set(titles)) == len(titles)
    # each name word is its own token in one passage only, which is what makes
    # BM25 on the question rank the entity's passage first
    words = [w for t in titles for w in t.split()]
    assert len(set(words)) == len(words)


# --- retrieval -----------------------------------------------------------------

def test_local_search_ranks_the_right_passage_first(data, passage_of):
    from tools import build_tools

    search = build_tools(["Local_Search"], {"corpus": str(DATA / "corpus.jsonl")})["Local_Search"]
    misses = []
    for r in data["heldout"] + data["paraphrase"]:
        if r["task"] == "arithmetic":
            continue
        [name] = entities_in(r["question"], passage_of)
        result = search.run(r["question"])
        assert result.error == "", (r["question"], result.error)
        first = next(line for line in result.output.splitlines() if line.strip())
        if f"{name}: {passage_of[name]['text']}" not in first:
            misses.append((r["question"], first))
    assert misses == []
