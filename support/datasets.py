"""Benchmark files -> a uniform list of Items (query q, gold answer y*, answer kind).

This is the data side of the paper's evaluation (docs/PAPER.md, data/benchmarks/): the
benchmark files come in the official AgentFlow format, a JSON list whose rows
name the same things differently - an id in pid / idx / id, the question in
query / question / problem, the answer as a list, a string, a number or a
stringified list "['a', 'b']", options as a list or a letter->text dict, and
Game of 24 puzzles as a bare list of four numbers. Nothing here is keyed to one
file: each rule looks at the fields (the one rule that reads a file name is a
fallback for a Game-of-24 file without a numbers field), and the answer kind
that judge.score needs is inferred from them:

    options present                     -> choice
    four puzzle numbers present         -> game24
    every gold alias of the file parses as a plain number -> number
    otherwise                           -> text

Our own task files (.jsonl, one {"question", "answer", "kind"} object per line)
load through the same path; an explicit kind wins over inference.

Simplifications: the number kind is decided per file, not per row (a text
dataset whose answer happens to be "1932" stays text; judge.score still accepts
"1,932" there); images are ignored (none of the eight files has one). The
official output-format sentence ("When ready, output the final answer enclosed
in <answer> and </answer> tags ...") is cut from questions, since the agent's
own prompts say how to format the answer; the original text stays in
meta["raw_question"].
"""

import ast
import gzip
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from support.answers import KINDS, game24_number_sets, gold_aliases, parse_number, strip_option_labels
from support.seeds import derive_seed

# Field names, in order of preference. "query" comes before "question" because
# in the official files "query" is the text that was shown to the model (medqa's
# "question" lists the options twice; gameof24's "question" is the number list).
ID_FIELDS = ("id", "pid", "idx", "qid", "_id", "question_id")
QUESTION_FIELDS = ("query", "question", "problem", "prompt", "input")
ANSWER_FIELDS = ("answer", "answers", "gold", "target", "final_answer", "label")
OPTION_FIELDS = ("options", "choices")
NUMBER_FIELDS = ("numbers", "nums", "puzzle", "question", "input")
KIND_FIELDS = ("kind",)

# The paper's Table 1 (docs/PAPER.md): accuracy in %, AgentFlow with Qwen2.5-7B-Instruct as
# every module, (untrained planner, Flow-GRPO planner), by benchmark file in data/benchmarks/.
PAPER_TABLE_1 = {"bamboogle": (58.4, 69.6), "2wiki": (60.0, 77.2), "hotpotqa": (51.3, 57.0),
                 "musique": (19.2, 25.3), "gaia": (17.2, 33.1), "aime24": (16.7, 40.0), "amc23": (47.4, 61.5),
                 "gameof24": (31.0, 53.0), "gpqa": (37.0, 47.0), "medqa": (76.0, 80.0)}
BENCHMARKS = Path(__file__).resolve().parents[1] / "data" / "benchmarks"


def paper_benchmarks() -> dict[str, Path]:
    """The Table 1 benchmark files present in data/benchmarks/, by name, in the paper's order
    (eight ship; scripts/prepare_data.py writes GAIA's and GPQA's)."""
    return {b: BENCHMARKS / f"{b}.json" for b in PAPER_TABLE_1 if (BENCHMARKS / f"{b}.json").is_file()}


# Output-format instructions appended to questions in the official files.
_BOILERPLATE = re.compile(r"\s*When ready, output the final answer enclosed in <answer> and </answer> tags\..*$",
                          re.DOTALL)
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass
class Item:
    id: str                       # unique within its file
    question: str                 # the text the agent sees (options and game24 rules included)
    gold: list[str]               # gold aliases; for game24 the reference expressions (or the numbers)
    kind: str                     # one of judge.KINDS
    options: list[str] | None = None   # choice: option texts without "A. " labels, in letter order
    numbers: list[int] | None = None   # game24: the four numbers
    meta: dict = field(default_factory=dict)  # every other field of the row, plus source and row


def read_jsonl(path, strict: bool = False) -> list[dict]:
    """The JSON objects of a .jsonl file, one per line (blank lines skipped); the one
    JSONL reader of the project (iter_jsonl reads the same lines one at a time).

    strict, for data files: a missing file or a line that is not a JSON object is an
    error that names the line. Not strict, for the files a run writes, which an
    interrupted run can leave cut mid-line: a missing file reads as empty, a bad line
    is skipped (eval.py then runs that item again)."""
    return list(iter_jsonl(path, strict))


def iter_jsonl(path, strict: bool = False):
    """read_jsonl one row at a time, for files too large to hold (a 21M-passage corpus);
    a .gz file is read through gzip. Lines end at a newline only: a JSON string may hold
    a raw U+2028, which str.splitlines would take for a line end."""
    path = Path(path)
    if not path.exists():
        if strict:
            raise FileNotFoundError(f"file not found: {path}")
        return
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", newline="\n") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if strict:
                    raise ValueError(f"{path}: line {n} is not valid JSON: {e}") from None
                continue
            if isinstance(row, dict):
                yield row
            elif strict:
                raise ValueError(f"{path}: line {n} is a {type(row).__name__}, expected a JSON object")


def _read_rows(path: Path) -> list:
    """The raw rows of a .json (a list, or a dict wrapping one) or .jsonl file."""
    if not path.exists():
        raise FileNotFoundError(f"benchmark file not found: {path}")
    if path.suffix == ".jsonl":
        return read_jsonl(path, strict=True)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]
        if len(lists) == 1:  # {"data": [...]} and the like
            return lists[0]
        if data and all(isinstance(v, dict) for v in data.values()):  # {"id": {row}, ...}
            return [{"id": k, **v} for k, v in data.items()]
    raise ValueError(f"{path}: expected a JSON list of rows (or a dict holding one list of rows), "
                     f"got {type(data).__name__}")


def _first(row: dict, names, ok=lambda v: v is not None):
    """(name, value) of the first field in names whose value passes ok, else (None, None)."""
    for name in names:
        if name in row and ok(row[name]):
            return name, row[name]
    return None, None


def _options(value) -> list[str] | None:
    """Options as a list of texts in letter order, labels stripped."""
    if isinstance(value, dict):
        if isinstance(value.get("text"), list):  # {"label": [...], "text": [...]}
            return [str(t).strip() for t in value["text"]] or None
        # {"A": "...", "B": "..."}: sort by key so that letters map to positions
        return [str(value[k]).strip() for k in sorted(value, key=str)] or None
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            value = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            return None
    if isinstance(value, (list, tuple)) and value:
        return strip_option_labels([str(v) for v in value])
    return None


def _int_list(value) -> list[int] | None:
    """A list of 3-6 integers given as a list or as a string ("4 4 6 8", "[4, 4, 6, 8]")."""
    if isinstance(value, str):
        t = value.strip()
        if not re.fullmatch(r"\[?\s*\d+(?:\s*[, ]\s*\d+)*\s*\]?", t):
            return None  # a question text, not a puzzle
        value = [int(x) for x in re.findall(r"\d+", t)]
    if isinstance(value, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return list(value) if 3 <= len(value) <= 6 else None
    return None


def _numbers_from_text(text: str) -> list[int] | None:
    """Puzzle numbers written inside a Game-of-24 question: "Using the numbers [1, 1, 1, 8] ..."."""
    m = re.search(r"\[\s*(\d+(?:\s*,\s*\d+){3})\s*\]", text)
    return [int(x) for x in re.findall(r"\d+", m.group(1))] if m else None


def _looks_like_game24(path: Path, rows: list) -> bool:
    """A file with no numbers field that still is Game of 24: its name says so and
    its questions ask to make 24."""
    name = path.stem.lower()
    if "24" not in name or not ("game" in name or "point" in name):
        return False
    texts = [_first(r, QUESTION_FIELDS, lambda v: isinstance(v, str))[1] or "" for r in rows[:20]]
    return all("24" in t for t in texts)


def load_benchmark(path: str, limit: int | None = None) -> list[Item]:
    """Every row of a benchmark file as an Item; the first `limit` rows if given."""
    path = Path(path)
    rows = _read_rows(path)
    where = lambda i: f"{path}: row {i}"
    game24_file = _looks_like_game24(path, rows)

    # Pass 1: fields per row. Kinds need the whole file (the number kind is a
    # property of the dataset), so they are decided in pass 2.
    parsed = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{where(i)} is a {type(row).__name__}, expected a JSON object")
        q_name, question = _first(row, QUESTION_FIELDS, lambda v: isinstance(v, str) and v.strip())
        _, opts_raw = _first(row, OPTION_FIELDS)
        options = _options(opts_raw) if opts_raw is not None else None
        n_name, numbers = _first(row, NUMBER_FIELDS, lambda v: _int_list(v) is not None)
        numbers = _int_list(numbers) if numbers is not None else None
        if numbers is None and game24_file and question:
            numbers = _numbers_from_text(question)
        if question is None and numbers is None:
            raise ValueError(f"{where(i)} has no question field: expected one of {', '.join(QUESTION_FIELDS)} "
                             f"as a non-empty string; the row has fields {sorted(row)}")
        a_name, answer = _first(row, ANSWER_FIELDS)
        gold = gold_aliases(answer)
        if not gold and numbers is None:
            raise ValueError(f"{where(i)} has no gold answer: expected one of {', '.join(ANSWER_FIELDS)} "
                             f"(a string, a number or a list); the row has fields {sorted(row)}")
        _, kind = _first(row, KIND_FIELDS)
        if kind is not None and kind not in KINDS:
            raise ValueError(f"{where(i)} has kind {kind!r}; expected one of {KINDS}")
        parsed.append(dict(row=row, q_name=q_name, question=question, options=options, numbers=numbers,
                           n_name=n_name, a_name=a_name, gold=gold, kind=kind))

    # Pass 2: kinds. A file is numeric when every gold alias of every row that is
    # not choice/game24 is a plain number ("33", "-1", "3/4"; not "323 BC").
    free = [p for p in parsed if p["kind"] is None and p["options"] is None and p["numbers"] is None]
    numeric = bool(free) and all(parse_number(g, allow_units=False) is not None for p in free for g in p["gold"])
    for p in parsed:
        if p["kind"] is None:
            p["kind"] = ("choice" if p["options"] is not None else "game24" if p["numbers"] is not None
                         else "number" if numeric else "text")
        if p["kind"] == "choice" and not p["options"]:
            raise ValueError(f"{where(parsed.index(p))}: kind choice needs options "
                             f"(one of {', '.join(OPTION_FIELDS)})")
        if p["kind"] == "game24" and p["numbers"] is None:
            # an explicit game24 row may give its numbers only in the question text
            # or through its reference expression
            sets = game24_number_sets(p["gold"]) if p["gold"] else []
            p["numbers"] = _numbers_from_text(p["question"] or "") or (sets[0] if sets else None)
            if p["numbers"] is None:
                raise ValueError(f"{where(parsed.index(p))}: kind game24 needs its numbers "
                                 f"(one of {', '.join(NUMBER_FIELDS)}, or a reference expression)")

    # Ids: the row's own id when the file's ids are unique, else the row index
    # (medqa repeats pid and idx 0..99 across its 300 rows).
    ids = [_first(p["row"], ID_FIELDS)[1] for p in parsed]
    unique = None not in ids and len({str(x) for x in ids}) == len(ids)

    items = []
    for i, p in enumerate(parsed[:limit] if limit is not None else parsed):
        row, question = p["row"], p["question"]
        used = {p["q_name"], p["a_name"], *OPTION_FIELDS, *KIND_FIELDS}
        if p["kind"] == "game24":
            used.add(p["n_name"])
        meta = {k: v for k, v in row.items() if k not in used}
        meta.update(source=path.stem, row=i)

        if question is not None:
            stripped = _BOILERPLATE.sub("", question).strip()
            if stripped != question.strip():
                meta["raw_question"] = question
            question = stripped
        if p["kind"] == "choice":
            lines = [f"{_LETTERS[k]}. {o}" for k, o in enumerate(p["options"])]
            if not all(line in question for line in lines):  # medqa's query lists them already
                question = question.rstrip() + "\n" + "\n".join(lines)
        if p["kind"] == "game24":
            nums = ", ".join(str(n) for n in p["numbers"])
            rule = f"Use the numbers {nums} each exactly once with + - * / to make 24."
            if not question:
                question = rule
            elif "24" not in question:
                question = question.rstrip() + "\n" + rule

        gold = p["gold"] or [" ".join(str(n) for n in p["numbers"])]
        items.append(Item(id=str(ids[i]) if unique else str(i), question=question, gold=gold, kind=p["kind"],
                          options=p["options"] if p["kind"] == "choice" else None,
                          numbers=p["numbers"] if p["kind"] == "game24" else None, meta=meta))
    return items


# ----------------------------------------------------------------------------------------
# The order of the training queries (train.py, step 1 of a step)


def draw_queries(items: list, step: int, Q: int, seed: int, shares: dict | None = None, shares_from: int = 1) -> list:
    """Queries step*Q .. step*Q+Q-1 of an endless stream of seeded, stratified shuffles.

    Stratified: each epoch shuffles every task kind (item.meta["task"]) on its own and
    interleaves the kinds in proportion, so any Q consecutive queries hold each kind in
    about its share of the data. With plain shuffling and Q = 8, one step can draw six
    arithmetic queries and no lookup; the update then pushes every question towards
    one tool and the next step swings back. Data without a task field is one kind, i.e.
    a plain shuffle. A resumed run draws the same stream: it depends only on (seed,
    position).

    shares (train.task_shares, kind -> weight): each kind takes that share of every step
    instead, whatever its share of the data, and runs through its own seeded shuffles (a
    small kind's sooner). Which kind a position goes to is fixed by the weights alone:
    the kind furthest behind its share so far (ties to the first name), so equal weights
    take turns and 2:1:1 gives 4/2/2 of every 8. Neither beat the data's shares on the
    default's five seeds; two_step-heavy shares from step 5 did (docs/LOG.md).
    shares_from (train.task_shares_from, counting steps from 1): the steps before it draw
    the data's shares, the stream with shares still counts from position 0, so either
    stream depends only on (seed, position)."""
    by_kind = _by_kind(items)
    if not shares or step + 1 < shares_from:
        return [items[_epoch_order(by_kind, seed, epoch)[pos]]
                for epoch, pos in (divmod(k, len(items)) for k in range(step * Q, step * Q + Q))]
    kinds, total = sorted(shares), sum(shares.values())
    drawn = dict.fromkeys(kinds, 0)  # positions each kind has taken so far in the stream
    out = []
    for k in range(step * Q + Q):
        kind = max(kinds, key=lambda c: (k + 1) * shares[c] / total - drawn[c])  # first max wins ties
        epoch, pos = divmod(drawn[kind], len(by_kind[kind]))
        drawn[kind] += 1
        if k >= step * Q:
            order = list(by_kind[kind])
            random.Random(derive_seed("kind_epoch", seed, kind, epoch)).shuffle(order)
            out.append(items[order[pos]])
    return out


def _by_kind(items: list) -> dict[str, list[int]]:
    by_kind: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        by_kind.setdefault(getattr(it, "meta", {}).get("task", ""), []).append(i)
    return by_kind


def _epoch_order(by_kind: dict[str, list[int]], seed: int, epoch: int) -> list[int]:
    rng = random.Random(derive_seed("epoch", seed, epoch))
    keyed = []  # (place in [0, 1) within its kind's shuffled list, item index)
    for kind in sorted(by_kind):
        idx = list(by_kind[kind])
        rng.shuffle(idx)
        keyed += [((j + rng.random()) / len(idx), i) for j, i in enumerate(idx)]
    return [i for _, i in sorted(keyed)]
