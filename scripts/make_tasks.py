"""The built-in offline task suite: where the right tool decides success.

The paper trains its planner on a shuffled mix of search questions (Natural
Questions, via Search-R1) and competition math (DeepMath-103K), so that the
planner has to learn WHICH tool a question needs: a web search for facts, the
Python coder for computation. This file is the offline, CPU-sized analogue of
that mix, small enough for SmolLM2-135M to learn from in minutes:

  arithmetic  "Compute 48213 * 9127."  A 135M model cannot multiply five-digit
              numbers in its head, but it can copy the expression into
              `print(48213 * 9127)`. The Python_Coder tool decides success.
  lookup      "In what year was Velmora founded?"  Velmora is an invented
              entity: the model cannot know it, and the only place the fact
              exists is our shipped corpus (data/corpus.jsonl). Local_Search
              decides success; the answer is then a number to copy.
  two_step    "What is the population of Velmora multiplied by 7?"  About a
              fifth of the mix needs both tools, in order: search, then code.

So the rule a planner should learn is: "unknown named entity -> Local_Search,
big arithmetic -> Python_Coder", and Base_Generator alone fails almost always.
Every answer is an integer, so the judge can score exactly ("kind": "number").

How it is generated (all from one random.Random(seed); no set iteration order,
no hash(), so the files are identical on every machine and Python version):
  1. Invented names from consonant-vowel syllables, each a single word that
     occurs nowhere else in the corpus, so BM25 on the question ranks the
     entity's passage first (a rare token has a high IDF).
  2. Six entity types (town, river, mountain, ship, company, writer), each with
     two numeric facts, a one- or two-sentence passage that names the entity in
     its title AND its text, and two question wordings per fact.
  3. Entities are split three ways: asked about in train, asked about in
     heldout (never seen in train, so the planner must learn the rule rather
     than memorise entities), and distractors that are never asked about but
     sit in the corpus so retrieval is not trivially right.
  4. Arithmetic questions are fresh random expressions; no question repeats
     across splits.
  5. data/paraphrase.jsonl asks about held-out entities again, in wordings no other
     file uses, with numbers from a random stream of its own (`paraphrased`): never
     trained on, and regenerating it changes no other file.

Numbers are written without thousands separators ("12408", not "12,408"): the
executor copies a looked-up number into code, and in Python `12,408 * 7` is a
tuple, not 86856.

Run `python -m scripts.make_tasks [--out data] [--seed 0]` to regenerate the data files.
"""

import argparse
import json
import os
import random
import re

# ---------------------------------------------------------------------------
# Entity types. For each: passage openers (variety only; no fact in them), the
# sentence with the two facts, the value range of each fact, question wordings
# per fact, and the quantity fact a two_step question multiplies (years are
# facts too, but "the founding year times 7" is not a sensible question).
# "{n}" is the entity's name, "{r}" a region name shared by many passages.
# ---------------------------------------------------------------------------
ENTITY_TYPES = {
    "town": {
        "opener": ["{n} is a river town in the {r} valley.",
                   "{n} is a market town on the {r} plain.",
                   "{n} is a small hill town in the {r} highlands."],
        "facts": "{n} was founded in {founded} and has a population of {population}.",
        "ranges": {"founded": (1600, 1950), "population": (800, 250000)},
        "ask": {"founded": ["In what year was the town of {n} founded?",
                            "When was {n} founded?"],
                "population": ["What is the population of {n}?",
                               "How many people live in {n}?"]},
        "quantity": ("population", "the population of {n}"),
    },
    "river": {
        "opener": ["The {n} is a river in the {r} lowlands.",
                   "The {n} is a slow river that drains the {r} basin.",
                   "The {n} is a mountain river in the {r} region."],
        "facts": "The {n} is {length} km long and is crossed by {bridges} bridges.",
        "ranges": {"length": (30, 2400), "bridges": (3, 95)},
        "ask": {"length": ["How long is the {n} river in km?",
                           "What is the length of the {n} river in km?"],
                "bridges": ["How many bridges cross the {n} river?",
                            "How many bridges are there over the {n}?"]},
        "quantity": ("length", "the length of the {n} river in km"),
    },
    "mountain": {
        "opener": ["{n} is a mountain in the {r} range.",
                   "{n} is a snowy peak above the {r} valley.",
                   "{n} is the highest summit of the {r} hills."],
        "facts": "{n} is {height} metres high and was first climbed in {climbed}.",
        "ranges": {"height": (1200, 6800), "climbed": (1780, 1975)},
        "ask": {"height": ["How high is {n} in metres?",
                           "What is the height of {n} in metres?"],
                "climbed": ["In what year was {n} first climbed?",
                            "When was the mountain {n} first climbed?"]},
        "quantity": ("height", "the height of {n} in metres"),
    },
    "ship": {
        "opener": ["The {n} is a cargo ship registered in {r}.",
                   "The {n} is a passenger ferry from the port of {r}.",
                   "The {n} is a fishing ship based in {r}."],
        "facts": "The {n} was launched in {launched} and carries a crew of {crew}.",
        "ranges": {"launched": (1850, 1995), "crew": (12, 480)},
        "ask": {"launched": ["In what year was the ship {n} launched?",
                             "When was the {n} launched?"],
                "crew": ["How many crew members does the {n} carry?",
                         "What is the crew size of the ship {n}?"]},
        "quantity": ("crew", "the crew size of the ship {n}"),
    },
    "company": {
        "opener": ["{n} is a company that makes glass in {r}.",
                   "{n} is a paper mill company based in {r}.",
                   "{n} is a bicycle maker with its works in {r}."],
        "facts": "{n} was founded in {founded} and has {employees} employees.",
        "ranges": {"founded": (1850, 2012), "employees": (40, 60000)},
        "ask": {"founded": ["In what year was the company {n} founded?",
                            "When was the firm {n} founded?"],
                "employees": ["How many employees does {n} have?",
                              "How many people work at {n}?"]},
        "quantity": ("employees", "the number of employees at {n}"),
    },
    "writer": {  # a person: first name + surname, both invented
        "opener": ["{n} is a writer from the {r} coast.",
                   "{n} is a novelist born in {r}.",
                   "{n} is a travel writer who lived in {r}."],
        "facts": "{n} was born in {born} and wrote {books} books.",
        "ranges": {"born": (1800, 1990), "books": (2, 95)},
        "ask": {"born": ["In what year was {n} born?",
                         "When was the writer {n} born?"],
                "books": ["How many books did {n} write?",
                          "How many books has the writer {n} written?"]},
        "quantity": ("books", "the number of books written by {n}"),
    },
}
TYPE_ORDER = list(ENTITY_TYPES)  # fixed order: dicts keep insertion order

# Arithmetic: the expression is written in Python syntax inside the question, so
# a small executor model only has to copy it into print(...). Two shapes, both
# beyond a 135M model's mental arithmetic: a 4-5 digit times a 3-4 digit number, or
# three 5-6 digit numbers added up. Wordings never mention an entity, so the kind is
# visible.
ARITH_TEMPLATES = ["Compute {e}.", "What is {e}?", "Calculate {e}.", "Evaluate {e}."]

# two_step: a looked-up quantity times a small factor. The factor is written as
# a digit, and the entity's name is in the question, so the planner can see
# that it needs both tools.
TWO_STEP_TEMPLATES = ["What is {q} multiplied by {k}?",
                      "What is {k} times {q}?",
                      "If you multiply {q} by {k}, what do you get?"]

# Other wordings, never in train.jsonl: data/heldout_wordings.jsonl asks the held-out
# questions again in them (every two_step question in all six, each arithmetic and each
# quantity lookup in one), so a trained planner can be checked on the rule it learned
# rather than the templates it saw. They stay out of _template_words on purpose: adding
# words there would change the generated names, and with them every shipped file.
OTHER_ARITH_WORDINGS = ["Work out {e}.", "What does {e} come to?", "Give the value of {e}."]
OTHER_LOOKUP_WORDINGS = ["Tell me {q}.", "I would like to know {q}."]
OTHER_TWO_STEP_WORDINGS = ["Take {q} and multiply it by {k}.",
                           "Multiply {q} by {k}.",
                           "How much is {k} times {q}?",
                           "What do you get when {q} is multiplied by {k}?",
                           "Find {q}, then multiply it by {k}.",
                           "{Q} times {k} equals what?"]

# The paraphrase set, data/paraphrase.jsonl: questions about held-out entities, worded in
# none of the wordings above, never trained on. It asks whether what the planner and the
# verifier learned holds on wordings no one chose to match the templates: two_step in sentence
# shapes the templates never take (a request, a fronted "Multiplied by k,", "please" at the
# end) and words they never use ("scale", "product", "-fold").
# Its numbers come from a stream of their own (paraphrased), so adding or changing a wording
# here changes no other file.
PARA_ARITH_WORDINGS = ["Find the value of {e}.", "How much is {e}?", "Please calculate {e} for me.",
                       "I need the result of {e}."]
PARA_LOOKUP_WORDINGS = ["Please look up {q}.", "Do you know {q}?", "{Q}, please.", "I am looking for {q}."]
PARA_TWO_STEP_WORDINGS = ["Look up {q} and scale it by {k}.",
                          "I need {k} times {q}.",
                          "{Q} multiplied by {k}, please.",
                          "What number is {k} times {q}?",
                          "Scale {q} by a factor of {k}.",
                          "How much is {q} when scaled up {k}-fold?",
                          "Multiplied by {k}, how much is {q}?",
                          "Find the product of {k} and {q}."]
PARA_COUNTS = {"arithmetic": 16, "lookup": 16, "two_step": 16}

# Split sizes: heldout asks 96 questions (40 arithmetic, 40 lookup, 16 two_step);
# train keeps about the same mix at four times the size.
TRAIN_COUNTS = {"arithmetic": 160, "lookup": 160, "two_step": 80}
HELDOUT_COUNTS = {"arithmetic": 40, "lookup": 40, "two_step": 16}
TRAIN_ENTITIES_PER_TYPE = 20   # 120 entities asked about in train
ENTITIES_PER_TYPE = 72         # 432 passages: train + heldout + distractors
N_REGIONS = 12

# Syllable pieces for invented names. No "y" or "w" and no doubled letters, so
# names read as one clean word and tokenise as one word in any BM25 tokenizer.
ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
          "br", "dr", "gr", "kr", "tr", "st", "th", "sk"]
VOWELS = ["a", "e", "i", "o", "u"]
CODAS = ["", "", "", "n", "r", "l", "s", "k", "th"]


def _template_words():
    """Every word used by a template, lowercased: a name must not be one of them."""
    texts = ARITH_TEMPLATES + TWO_STEP_TEMPLATES
    for spec in ENTITY_TYPES.values():
        texts += spec["opener"] + [spec["facts"], spec["quantity"][1]]
        for wordings in spec["ask"].values():
            texts += wordings
    words = []
    for text in texts:
        words += "".join(c if c.isalpha() else " " for c in text).lower().split()
    return frozenset(words)


def _name_maker(rng):
    """Return a function that yields a fresh invented name on every call."""
    taken = set(_template_words())  # membership tests only, never iterated

    def new_name():
        while True:
            n_syllables = rng.choice([2, 2, 3])
            name = "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)
                           for _ in range(n_syllables))
            if 5 <= len(name) <= 10 and name not in taken:
                taken.add(name)
                return name.capitalize()
    return new_name


def _make_entity(rng, etype, new_name, regions):
    """One invented entity: its name, fact values, and its corpus passage."""
    spec = ENTITY_TYPES[etype]
    name = new_name() + " " + new_name() if etype == "writer" else new_name()
    facts = {key: rng.randint(lo, hi) for key, (lo, hi) in spec["ranges"].items()}
    opener = rng.choice(spec["opener"]).format(n=name, r=rng.choice(regions))
    text = opener + " " + spec["facts"].format(n=name, **facts)
    return {"type": etype, "name": name, "facts": facts,
            "passage": {"title": name, "text": text}}


def _lookup_question(rng, ent, fact=None):
    spec = ENTITY_TYPES[ent["type"]]
    fact = fact or rng.choice(sorted(spec["ask"]))
    question = rng.choice(spec["ask"][fact]).format(n=ent["name"])
    return {"question": question, "answer": str(ent["facts"][fact]), "task": "lookup"}


def _two_step_question(rng, ent):
    fact, phrase = ENTITY_TYPES[ent["type"]]["quantity"]
    k = rng.randint(3, 9)
    question = rng.choice(TWO_STEP_TEMPLATES).format(q=phrase.format(n=ent["name"]), k=k)
    return {"question": question, "answer": str(ent["facts"][fact] * k), "task": "two_step"}


def _arithmetic_question(rng):
    if rng.random() < 0.5:
        a, b = rng.randint(1000, 99999), rng.randint(100, 9999)
        expr, value = f"{a} * {b}", a * b
    else:
        xs = [rng.randint(10000, 999999) for _ in range(3)]
        expr, value = " + ".join(map(str, xs)), sum(xs)
    question = rng.choice(ARITH_TEMPLATES).format(e=expr)
    return {"question": question, "answer": str(value), "task": "arithmetic"}


def _parse(templates, question):
    """The slots ({q}, {Q}, {k}, {e}, {n}) of the template `question` was made from, or None."""
    for template in templates:
        pattern = re.escape(template)
        for slot, value in (("q", ".+"), ("Q", ".+"), ("k", r"\d+"), ("e", ".+"), ("n", ".+")):
            pattern = pattern.replace(re.escape("{" + slot + "}"), f"(?P<{slot}>{value})")
        m = re.fullmatch(pattern, question)
        if m:
            return m.groupdict()
    return None


def reworded(heldout: list[dict]) -> list[dict]:
    """The held-out questions again in the OTHER_* wordings, same answers, ids
    "<id>-w<j>". Lookups of a fact other than the type's quantity have no other wording
    here (they would need one per fact) and are left out."""
    rows, used = [], {"arithmetic": 0, "lookup": 0}  # rows of each kind reworded so far
    quantity_asks = [(ask, spec["quantity"][1]) for spec in ENTITY_TYPES.values()
                     for ask in spec["ask"][spec["quantity"][0]]]
    for row in heldout:
        if row["task"] == "two_step":
            slots = _parse(TWO_STEP_TEMPLATES, row["question"])
            q = slots["q"]
            wordings = [w.format(q=q, k=slots["k"], Q=q[0].upper() + q[1:]) for w in OTHER_TWO_STEP_WORDINGS]
        elif row["task"] == "arithmetic":
            e = _parse(ARITH_TEMPLATES, row["question"])["e"]
            wordings = [OTHER_ARITH_WORDINGS[used["arithmetic"] % len(OTHER_ARITH_WORDINGS)].format(e=e)]
            used["arithmetic"] += 1
        else:
            found = [(phrase, _parse([ask], row["question"])) for ask, phrase in quantity_asks]
            found = [phrase.format(n=slots["n"]) for phrase, slots in found if slots]
            if not found:
                continue
            wordings = [OTHER_LOOKUP_WORDINGS[used["lookup"] % len(OTHER_LOOKUP_WORDINGS)].format(q=found[0])]
            used["lookup"] += 1
        rows += [{**row, "id": f"{row['id']}-w{j}", "question": w} for j, w in enumerate(wordings)]
    return rows


def paraphrased(heldout_ents: list[dict], seen: set, seed: int = 0) -> list[dict]:
    """The paraphrase set: PARA_COUNTS questions per kind in the PARA_* wordings, each wording
    used in turn, ids "para-NNNN". Lookups and two_step ask the quantity fact of distinct
    held-out entities; every number (operands, factors) and the choice of entities come from
    random.Random("paraphrase/<seed>"), not the generator's stream, which it leaves untouched.
    `seen` (the questions of train and heldout) is only read: no question repeats one there."""
    rng = random.Random(f"paraphrase/{seed}")  # a str seed is hashed by sha512: the same everywhere
    ents = rng.sample(heldout_ents, PARA_COUNTS["lookup"] + PARA_COUNTS["two_step"])
    rows = []
    for i, ent in enumerate(ents):
        fact, phrase = ENTITY_TYPES[ent["type"]]["quantity"]
        q = phrase.format(n=ent["name"])
        slots = {"q": q, "Q": q[0].upper() + q[1:]}
        if i < PARA_COUNTS["lookup"]:
            wording = PARA_LOOKUP_WORDINGS[i % len(PARA_LOOKUP_WORDINGS)]
            rows.append({"question": wording.format(**slots), "answer": str(ent["facts"][fact]), "task": "lookup"})
        else:
            k = rng.randint(3, 9)  # the training range, fresh draws
            wording = PARA_TWO_STEP_WORDINGS[(i - PARA_COUNTS["lookup"]) % len(PARA_TWO_STEP_WORDINGS)]
            rows.append({"question": wording.format(k=k, **slots), "answer": str(ent["facts"][fact] * k),
                         "task": "two_step"})
    seen_exprs = {_parse(ARITH_TEMPLATES, q)["e"] for q in seen if _parse(ARITH_TEMPLATES, q)}
    n = 0
    while n < PARA_COUNTS["arithmetic"]:
        row = _arithmetic_question(rng)  # the training shapes, fresh operands, wording replaced below
        e = _parse(ARITH_TEMPLATES, row["question"])["e"]
        if e in seen_exprs:
            continue
        seen_exprs.add(e)
        rows.append({**row, "question": PARA_ARITH_WORDINGS[n % len(PARA_ARITH_WORDINGS)].format(e=e)})
        n += 1
    rng.shuffle(rows)  # kinds interleave, so eval.limit keeps all three
    return [{"id": f"para-{i + 1:04d}", "kind": "number", **row} for i, row in enumerate(rows)]


def generate(seed: int = 0) -> dict:
    """Build {"corpus", "train", "heldout", "heldout_wordings", "paraphrase"} deterministically
    from `seed`."""
    rng = random.Random(seed)
    new_name = _name_maker(rng)
    regions = [new_name() for _ in range(N_REGIONS)]

    # Entities per type, split into train / heldout / distractor pools.
    by_type = {t: [_make_entity(rng, t, new_name, regions) for _ in range(ENTITIES_PER_TYPE)]
               for t in TYPE_ORDER}
    train_ents = [e for t in TYPE_ORDER for e in by_type[t][:TRAIN_ENTITIES_PER_TYPE]]
    # Heldout entities round-robin over types, so every type is tested; each
    # heldout entity gets exactly one question.
    heldout_ents = [by_type[TYPE_ORDER[i % len(TYPE_ORDER)]][TRAIN_ENTITIES_PER_TYPE + i // len(TYPE_ORDER)]
                    for i in range(HELDOUT_COUNTS["lookup"] + HELDOUT_COUNTS["two_step"])]
    # Whatever is left over is a distractor: in the corpus, never asked about.

    seen = set()  # every question asked so far, over both splits (membership only)

    def add(rows, row):
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)

    # Train: lookup questions over (entity, fact) pairs, so both facts of an
    # entity may be asked; two_step over the quantity fact of sampled entities.
    train = []
    pairs = [(e, f) for e in train_ents for f in sorted(ENTITY_TYPES[e["type"]]["ask"])]
    for ent, fact in rng.sample(pairs, TRAIN_COUNTS["lookup"]):
        add(train, _lookup_question(rng, ent, fact))
    for ent in rng.sample(train_ents, TRAIN_COUNTS["two_step"]):
        add(train, _two_step_question(rng, ent))
    while len(train) < sum(TRAIN_COUNTS.values()):
        add(train, _arithmetic_question(rng))

    heldout = []
    for ent in heldout_ents[:HELDOUT_COUNTS["lookup"]]:
        add(heldout, _lookup_question(rng, ent))
    for ent in heldout_ents[HELDOUT_COUNTS["lookup"]:]:
        add(heldout, _two_step_question(rng, ent))
    while len(heldout) < sum(HELDOUT_COUNTS.values()):
        add(heldout, _arithmetic_question(rng))

    # Shuffle so kinds interleave, then number the rows.
    splits = {}
    for split, rows in (("train", train), ("heldout", heldout)):
        rng.shuffle(rows)
        splits[split] = [{"id": f"{split}-{i + 1:04d}", "kind": "number", **row}
                         for i, row in enumerate(rows)]

    # Corpus: every entity's passage, shuffled so position says nothing about
    # the entity's type or split.
    passages = [e["passage"] for t in TYPE_ORDER for e in by_type[t]]
    rng.shuffle(passages)
    corpus = [{"id": f"doc-{i + 1:04d}", **p} for i, p in enumerate(passages)]
    return {"corpus": corpus, **splits, "heldout_wordings": reworded(splits["heldout"]),
            "paraphrase": paraphrased(heldout_ents, seen, seed)}


def dump_jsonl(rows, path):
    """One JSON object per line, sorted keys, utf-8, '\\n' line ends."""
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n")


def write(out_dir="data", seed=0):
    """Write corpus.jsonl, train.jsonl, heldout.jsonl, heldout_wordings.jsonl and
    paraphrase.jsonl into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    for name, rows in generate(seed).items():
        dump_jsonl(rows, os.path.join(out_dir, f"{name}.jsonl"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m scripts.make_tasks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="data", help="directory for the .jsonl files")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    args = parser.parse_args()
    write(args.out, args.seed)
    print(f"wrote {args.out}/corpus.jsonl, train.jsonl, heldout.jsonl, heldout_wordings.jsonl, "
          f"paraphrase.jsonl (seed {args.seed})")
