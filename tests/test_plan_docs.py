"""Every figure docs/SCALING.md and the 7B config's header state about the memory plan and
the whole run is the one `python train.py configs/qwen2.5-7b-1gpu.yaml --plan` prints, with
the budget the sentence names: a figure that drifts from the plan, or a new figure no entry
below reads, fails."""

import re
import shutil
from pathlib import Path

import pytest

from support import datasets, device_memory
from support.config import load_config
from tools import network_tools

ROOT = Path(__file__).resolve().parents[1]
SCALING, SEVEN_B = "docs/SCALING.md", "configs/qwen2.5-7b-1gpu.yaml"
LORA24, LORA48 = "configs/qwen2.5-7b-lora-24gb.yaml", "configs/qwen2.5-7b-lora-48gb.yaml"
WORDS = {"one": 1, "two": 2, "eight": 8}

# (file, the doc's words as a regex whose group is the figure, the plan's overrides, the
# --plan words as a regex whose group is the same figure). A sentence reworded without its
# entry here fails too: its regex no longer matches.
FIGURES = [
    (SCALING, r"this config's ([\d,]+)-token prompts", "", r"KV cache of \d+ rows x \((\d+) \+"),
    (SCALING, r"and\s+([\d,]+)-token actions", "", r"x \(\d+ \+ (\d+)\) tokens"),
    (SCALING, r"the plan fits (80) GB", "", r"GB of ([\d.]+) GB: fits"),
    (SCALING, r"\(the rollout in (\d+) sub-batches\)", "", r"rollouts in (\d+) sub-batch"),
    (SCALING, r"and (141) GB \(one sub-batch\)", "model.memory_gb=141", r"GB of ([\d.]+) GB: fits"),
    (SCALING, r"141 GB \((one) sub-batch\)", "model.memory_gb=141", r"rollouts in (\d+) sub-batch"),
    (SCALING, r"AdamW's moments \(([\d.]+) GB for the paper config", "", r"a checkpoint ([\d.]+) GB"),
    (SCALING, r"\(([\d.]+) GB; `python -m scripts.export_model", "", r"the final export ([\d.]+) GB"),
    (SCALING, r"while the newer is written:\s+([\d.]+) GB", "", r"out_dir needs ([\d.]+) GB free"),
    (SCALING, r"reads ([\d.]+) GB of weights", "", r"weights, one copy .*?([\d.]+) GB"),
    (SCALING, r"about ([\d.]+) GB of disk, the plan's `disk in all`", "", r"disk in all: ([\d.]+) GB"),
    (SCALING, r"train_layers=4`: about ([\d.]+)\)", "train.train_layers=4", r"disk in all: ([\d.]+) GB"),
    (SCALING, r"with the (eight) benchmark files", "", r"(\d+) of \d+ benchmarks"),
    (SCALING, r"a step at most ([\d.]+) min at an H200's speed", "", r"tokens: ([\d.]+) min on an H200"),
    (SCALING, r"the whole run about ([\d.]+) h\s+on an H100", "", r"on an H200, ([\d.]+) h on an H100"),
    (SCALING, r"about ([\d.]+) h on an H200;", "model.memory_gb=141", r"about ([\d.]+) h on an H200"),
    (SCALING, r"about ([\d.]+) GB\s+of disk in all", "", r"disk in all: ([\d.]+) GB"),
    (SCALING, r"at most ([\d,]+) web-search calls", "", r"web-search calls at most ([\d,]+)"),
    (SCALING, r"\(([\d,]+) in training", "", r"([\d,]+) in training"),
    (SCALING, r"([\d,]+) in the\s+evaluations", "", r"([\d,]+) in the evaluations"),
    (SCALING, r"([\d,]+) in the suite\)", "", r"([\d,]+) in the suite"),
    (SEVEN_B, r"exist once \(~(\d+) GB\)", "", r"weights, one copy .*?([\d.]+) GB"),
    # The LoRA section: an entry's overrides may start with the config file to plan.
    (SCALING, r"in bf16 \(([\d.]+) GB\s+for Qwen2.5-7B\)", "", r"weights, one copy .*?([\d.]+) GB"),
    (SCALING, r"only \(([\d.]+) GB for the 24 GB config\)", LORA24, r"a checkpoint ([\d.]+) GB"),
    *[(SCALING, rf"\| ([\d.]+) GB of {gb}\.0 \|", overrides, r"([\d.]+) GB of [\d.]+ GB: fits")
      for gb, overrides in ((80, ""), (48, LORA48), (40, f"{LORA48} model.memory_gb=40"), (24, LORA24))],
    *[(SCALING, rf"GB of {gb}\.0 \| ([\d.]+) min", overrides, r"tokens: ([\d.]+) min on an H200")
      for gb, overrides in ((80, ""), (48, LORA48), (40, f"{LORA48} model.memory_gb=40"), (24, LORA24))],
    *[(SCALING, rf"GB of {gb}\.0 \| [\d.]+ min \((?:rollouts in )?(\d+) sub-batches", overrides,
       r"rollouts in (\d+) sub-batch")
      for gb, overrides in ((80, ""), (48, LORA48), (40, f"{LORA48} model.memory_gb=40"), (24, LORA24))],
    (SCALING, r"28 blocks hold ([\d.]+) GB for two", LORA24, r"update: activations, .*?([\d.]+) GB"),
    (SCALING, r"for (two) [\d,]+-token rows", LORA24, r"update: activations, (\d+) x"),
    (SCALING, r"for two ([\d,]+)-token rows", LORA24, r"x (\d+) tokens x"),
    (SCALING, r"8 blocks alone hold ([\d.]+) GB", f"{LORA24} train.grad_checkpoint=false train.train_layers=8 "
                                                 f"train.micro_batch=1", r"update: activations, .*?([\d.]+) GB"),
    (SCALING, r"hold [\d.]+ GB for (one)\.", f"{LORA24} train.grad_checkpoint=false train.train_layers=8 "
                                           f"train.micro_batch=1", r"update: activations, (\d+) x"),
    (LORA24, r"\(~([\d.]+) GB\)", LORA24, r"weights, one copy .*?([\d.]+) GB"),
    (LORA24, r"take (\d+) sub-batches", LORA24, r"rollouts in (\d+) sub-batch"),
    (LORA24, r"not (\d+) \(the plan", "", r"rollouts in (\d+) sub-batch"),
    (LORA24, r"28 blocks hold ([\d.]+) GB", LORA24, r"update: activations, .*?([\d.]+) GB"),
    (LORA24, r"for two ([\d,]+)-token rows", LORA24, r"x (\d+) tokens x"),
    (LORA24, r"would be ([\d.]+) GB", f"{LORA24} train.grad_checkpoint=false train.train_layers=8 train.micro_batch=1",
     r"update: activations, .*?([\d.]+) GB"),
    (LORA48, r"\(~([\d.]+) GB\)", LORA48, r"weights, one copy .*?([\d.]+) GB"),
    (SEVEN_B, r"train_layers 8: ~(\d+) GB", "", r"fp32 masters \+ AdamW moments \+ fp32 gradients\s+([\d.]+) GB"),
]
# A figure with a unit the plan prints in: every one in the texts below must be read by an
# entry of FIGURES, or be one of these, which are not the plan's.
FIGURE = re.compile(r"\d[\d,.]*(?=-token| GB| h\b| min\b| sub-batch| web-search)")
# the budget to give, or a card's size: not figures of the plan
NOT_THE_PLAN = [(SEVEN_B, "for an 80 GB card"), *[(name, f"{gb} GB") for name in (SCALING, LORA24, LORA48)
                                                   for gb in ("24", "40", "48", "80", "24.0", "48.0")]]


def stated(name: str) -> str:
    """The text that states the plan: SCALING.md's section on the paper's setup, the
    7B config's header comments."""
    text = (ROOT / name).read_text()
    if name == SCALING:
        return text.split("## More than one device")[0]
    return "\n".join(line for line in text.splitlines() if line.startswith("#"))


def number(s: str) -> float:
    return WORDS[s] if s in WORDS else float(s.replace(",", ""))


def agree(doc: str, printed: str) -> bool:
    """Equal at the coarser of the two precisions: "44.7" states the plan's "44.75" (44.747
    rounded twice), "3" does not state "2", "10.8" does not state "10.7"."""
    half = lambda s: 0.5 * 10 ** -(len(s.split(".")[1]) if "." in s else 0) if s not in WORDS else 0.5
    return abs(number(doc) - number(printed)) < half(doc) + half(printed)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """--plan's text for each override set, with data/benchmarks/ as the repository ships it
    (GAIA and GPQA, which scripts.prepare_data adds, left out: the docs count without them)."""
    shipped = tmp_path_factory.mktemp("benchmarks")
    for p in datasets.BENCHMARKS.glob("*.json"):
        if p.name not in ("gaia.json", "gpqa.json"):
            shutil.copy(p, shipped)
    mp = pytest.MonkeyPatch()
    mp.setattr(datasets, "BENCHMARKS", shipped)
    cache = {}

    def text(overrides: str) -> str:
        if overrides not in cache:
            words = overrides.split()
            yaml = words.pop(0) if words and words[0].endswith(".yaml") else SEVEN_B
            cfg = load_config(str(ROOT / yaml), (["model.memory_gb=80"] if yaml == SEVEN_B else []) + words)
            cache[overrides] = device_memory.plan_for(cfg, web_tools=network_tools(cfg)).text()
        return cache[overrides]

    yield text
    mp.undo()


def test_every_figure_the_docs_state_is_the_plans(plans):
    wrong = []
    for name, doc_words, overrides, plan_words in FIGURES:
        found = re.search(doc_words, stated(name))
        assert found, f"{name} no longer says {doc_words!r}: update the sentence's entry in FIGURES"
        printed = re.search(plan_words, plans(overrides))
        assert printed, f"--plan ({overrides or 'as shipped'}) no longer prints {plan_words!r}"
        if not agree(found.group(1), printed.group(1)):
            wrong.append(f"{name}: {found.group(0)!r} but --plan model.memory_gb=80 {overrides} prints "
                         f"{printed.group(0)!r}")
    assert not wrong, "\n".join(wrong)


def test_no_figure_of_the_plan_goes_unchecked():
    unread = []
    for name in (SCALING, SEVEN_B, LORA24, LORA48):
        text = stated(name)
        read = [m.span(1) for doc_words in [f[1] for f in FIGURES if f[0] == name]
                for m in re.finditer(doc_words, text)]
        read += [(m.start(), m.end()) for n, words in NOT_THE_PLAN if n == name
                 for m in re.finditer(re.escape(words), text)]
        unread += [f"{name}: {text[max(0, m.start() - 30):m.end() + 10]!r}" for m in FIGURE.finditer(text)
                   if not any(a <= m.start() < b for a, b in read)]
    assert not unread, "figures no entry of FIGURES reads:\n" + "\n".join(unread)


def test_the_figures_are_compared_and_a_drift_fails():
    assert agree("44.7", "44.75") and agree("60", "59.98") and agree("one", "1") and agree("2,048", "2048")
    assert not agree("3", "2") and not agree("10.8", "10.7") and not agree("22.5", "22.37")


def test_the_rehearsal_the_7b_header_names_rehearses_it():
    named = re.search(r"\((tests/test_\w+\.py)\)", stated(SEVEN_B)).group(1)
    assert "configs/qwen2.5-7b-1gpu.yaml" in (ROOT / named).read_text()
