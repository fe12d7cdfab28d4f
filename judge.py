"""The reward: is the final answer right?

This is the verifiable outcome reward R(o, q, y*) in {0, 1} of Flow-GRPO (paper,
section 2): one number per trajectory, broadcast to every planner turn. The paper
asks a GPT-4o judge whether the Solution Generator's answer o is semantically,
numerically or option-wise equivalent to the gold answer y*. We do it by rules
first, per answer kind:

    text    normalised exact match (SQuAD style) against any gold alias; a date
            matches the same date written another way ("5 January 1964" ==
            "January 5, 1964"); token F1 is reported too, as partial credit for
            tables, never as the reward
    number  exact rational equality (Fraction); an answer written as a decimal
            also matches a non-integer gold it rounds, at the precision it was
            written with (math_answer.rounds_to: "0.333" for 1/3), an integer gold
            only its own value ("2270750.0", never "2270751.0"); a gold or answer
            that is not a plain number goes to the math rule, except plain
            arithmetic left undone ("80319 * 9011"): it restates a question
    math    LaTeX math answers (DeepMath, AIME, AMC): expressions with \\sqrt,
            \\pi, \\frac, powers, functions and variables, intervals, tuples, sets,
            matrices, degrees, percentages, scientific notation (math_answer.py
            says how, and which cases it cannot score)
    choice  the option letter or the option text, whichever the model wrote
    game24  a safe parser checks that the expression uses each given number
            exactly once and makes exactly 24 (any valid expression counts, not
            only the reference one)

What the rules cannot score - paraphrase ("JFK" is not "John F. Kennedy"),
answers in words for math ("all real numbers"), algebra that renames variables,
mixed numbers other than "2 1/2", dates as "04/15/18" - the LLM judge can take:
an OpenAI-compatible endpoint or the frozen copy of the policy, off by default
(config judge.*), asked only when the rules said wrong (never for game24, where
the rule is exact). `Judge` is that configured pair; each verdict says which of
the two decided ("rule" or "llm").

Anything that goes wrong - no answer found, an unparseable expression, an HTTP
error, a timeout, a reply that is neither yes nor no - counts as wrong, never as a
crash and never as right: a failed LLM verdict leaves the rule's verdict (wrong,
reward 0) and is counted as a judge failure in the metrics. The official code
drops crashed problems from the accuracy denominator, which flatters the score.

The reward a trajectory trains on is `Reward`: a weighted sum of named terms
(reward.terms in the config), by default the paper's alone, {"correct": 1.0}. Other
terms (a format term, a turn count) or terms of one's own (@reward_term, in a module
listed in reward.modules) shape it; each term is logged per step. Nothing downstream
assumes 0/1: the group advantage normalises whatever R is.
"""

import importlib
import logging
import re
from concurrent.futures import ThreadPoolExecutor

from support.config import ConfigError
from support.registry import Registry
from support.web import chat_reply
from support.answers import (KINDS, choice_index, choice_letter, date_key, extract_answer, game24_candidates,
                             game24_number_sets, check_game24, gold_aliases, normalize_text, parse_number,
                             same_math, strip_option_labels, token_f1, undone_arithmetic, words)

log = logging.getLogger(__name__)


def score(prediction: str, gold, kind: str, options: list[str] | None = None) -> dict:
    """R(o, q, y*) by rules. Returns {"correct": bool, "f1": float, "extracted": str}.

    prediction is the generator's raw text. gold is a string or a list of aliases
    (for game24: the four numbers, a string of them, or reference expressions).
    f1 is token F1 for text (1.0 whenever correct), else 1.0 or 0.0.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown answer kind {kind!r}; expected one of {KINDS}")
    raw = "" if prediction is None else str(prediction)
    ext = extract_answer(raw)

    def result(ok, f1, extracted=ext):
        return {"correct": bool(ok), "f1": float(1.0 if ok else f1), "extracted": extracted}

    if kind == "game24":
        for cand in game24_candidates(ext):
            for nums in game24_number_sets(gold):
                if check_game24(cand, nums):
                    return result(True, 1.0, cand)
        return result(False, 0.0)

    golds = gold_aliases(gold)
    if not golds or not ext:
        return result(False, 0.0)

    if kind == "choice":
        opts = strip_option_labels(options) if options else None
        p = choice_index(ext, opts)
        if p is None:
            # "The answer is C because ..." extracts as "C because ...": look at the whole text
            p = choice_letter(raw, len(opts) if opts else None)
        for g in golds:
            gi = choice_index(g, opts) if opts else choice_letter(g, None)
            if p is not None and gi is not None and p == gi:
                return result(True, 1.0)
        # no options to map onto: compare the texts themselves
        ok = any(normalize_text(ext) == normalize_text(g) for g in golds) if not opts else False
        return result(ok, 0.0)

    if kind == "number" and undone_arithmetic(ext):
        return result(False, 0.0)
    if kind in ("number", "math"):
        if any(same_math(ext, g) for g in golds):
            return result(True, 1.0)
        # words ("Yes", "\text{diverges}"): compare them as text
        ok = bool(words(ext)) and any(words(ext) == words(g) for g in golds)
        return result(ok, 0.0)

    # text: token F1 is reported beside the verdict, as partial credit, never as the reward
    return result(same_text(ext, raw, golds), max(token_f1(ext, g) for g in golds))


def same_text(ext: str, raw: str, golds: list[str]) -> bool:
    """The text rule: whether the extracted answer, or the whole response (a bare one-line
    answer that happens to contain "Answer:" somewhere is still itself), matches a gold alias."""
    cands = [normalize_text(ext), normalize_text(raw)]
    pred_num = parse_number(ext, allow_units=False)
    ok = False
    for g in golds:
        ng = normalize_text(g)
        if ng and ng in cands:
            ok = True
        elif ng in ("yes", "no") and cands[0].split()[:1] == [ng]:
            ok = True  # "Yes, both are American." answers a yes/no question
        elif pred_num is not None and pred_num == parse_number(g, allow_units=False):
            ok = True  # "22.0" vs "22": a number inside a text dataset
        elif date_key(g) is not None and date_key(g) == date_key(ext):
            ok = True  # "5 January 1964" vs "January 5, 1964"
    return ok


def score_item(answer: str, gold: list[str], kind: str, options: list[str] | None = None,
               numbers: list[int] | None = None) -> dict:
    """R(o, q, y*) for one benchmark item (support.datasets.Item's fields): the reward of a
    trajectory and the verdict of an evaluation. A Game-of-24 item is scored against
    its puzzle numbers, so any valid expression counts, not only the reference one."""
    return score(answer, numbers if kind == "game24" and numbers else gold, kind, options)


# --- the reward R: a weighted sum of named terms ----------------------------------------

REWARD_TERMS = {}  # name -> fn(trajectory, item, verdict) -> float, in the order they registered


def reward_term(name: str):
    """Register fn(trajectory, item, verdict) -> float as a term reward.terms may weigh: the
    trajectory (agentflow.Trajectory: its memory, turns, answer), its benchmark item, and
    the judge's verdict on its answer (score_item's dict)."""
    def add(fn):
        REWARD_TERMS[name] = fn
        return fn
    return add


@reward_term("correct")
def correct(traj, item, verdict) -> float:
    """R(o, q, y*) of the paper: 1 if the judge found the final answer right, else 0."""
    return float(verdict["correct"])


@reward_term("format")
def named_a_tool(traj, item, verdict) -> float:
    """The share of the trajectory's turns whose planner action named a tool it has."""
    records = traj.memory.records
    return sum(1 for r in records if r.tool) / len(records) if records else 0.0


@reward_term("turns")
def turns(traj, item, verdict) -> float:
    """The planner turns the trajectory took: with a negative weight, a price per turn."""
    return float(len(traj.turns))


# A score per planner turn, for credit per turn (train.advantage_mode: per_turn): each turn
# row's advantage is its score normalised over the group's turn rows (flow_grpo.kept_rows).
# name -> fn(trajectory, item, verdict) -> [one float per planner turn]
TURN_SCORES = Registry("train.turn_score", "turn score", "judge.turn_score")


def turn_score(name: str):
    """Register fn(trajectory, item, verdict) -> list of floats, one per planner turn (with
    the trajectory's reward R_i already set), as a score train.turn_score may name."""
    return TURN_SCORES.add(name)


@turn_score("outcome")
def outcome(traj, item, verdict) -> list[float]:
    """R_i on every turn: normalised over turn rows, the official code's credit (turn_rows)."""
    return [traj.reward] * len(traj.turns)


@turn_score("tool_errors")
def outcome_less_tool_errors(traj, item, verdict) -> list[float]:
    """R_i on every turn, less 0.5 on a turn whose tool call failed: the outcome, and a price
    on the one turn that wasted a step."""
    return [traj.reward - (0.5 if r.error and not r.infra else 0.0) for r in traj.memory.records[:len(traj.turns)]]


class Reward:
    """R_i = sum_k w_k * term_k(trajectory i): reward.terms as {name: w_k}. Terms of
    modules listed in reward.modules register themselves when imported."""

    def __init__(self, weights: dict[str, float], modules: list[str] = ()):
        for name in modules:
            try:
                importlib.import_module(name)
            except ImportError as e:
                raise ConfigError(f"reward.modules: cannot import {name!r} ({e})") from None
        unknown = sorted(set(weights) - set(REWARD_TERMS))
        if unknown:
            raise ConfigError(f"reward.terms: unknown term(s) {', '.join(unknown)}; known: {', '.join(REWARD_TERMS)} "
                              f"(a term of your own: @judge.reward_term in a module listed in reward.modules)")
        bad = [k for k, w in weights.items() if isinstance(w, bool) or not isinstance(w, (int, float))]
        if bad:
            raise ConfigError(f"reward.terms: the weight of {', '.join(bad)} must be a number")
        self.weights = {k: float(w) for k, w in weights.items() if w}

    @classmethod
    def from_config(cls, rcfg: dict) -> "Reward":
        return cls(rcfg["terms"], rcfg["modules"])

    def __call__(self, traj, item, verdict) -> tuple[float, dict[str, float]]:
        """(R, each term's value) for one judged trajectory."""
        values = {k: float(REWARD_TERMS[k](traj, item, verdict)) for k in self.weights}
        return sum(self.weights[k] * v for k, v in values.items()), values


# --- optional LLM judge ------------------------------------------------------------

JUDGE_PROMPT = """You are grading an answer to a question.

Question: {question}
Gold answer: {gold}
Response: {prediction}

Is the response equivalent to the gold answer (same entity, same value, or same option;
ignore formatting and wording)? Reply with one word: yes or no."""

JUDGE_SYSTEM = "You grade answers. You reply with one word: yes or no."


class LLMJudge:
    """Asks an LLM whether a response is equivalent to the gold answer.

    Backends: an OpenAI-compatible chat endpoint (base_url like
    "http://host:8000/v1", model, and the NAME of an environment variable holding
    the API key, so keys never sit in configs; an empty name sends no key, for a
    local server), or a local callable generate(prompts: list[str]) -> list[str],
    e.g. the project's own engine (engine_generate).
    Every failure is "no verdict": verdicts() returns None for it with the reason (also in
    self.last_reason and the log), and whether the infrastructure failed (the request, the
    endpoint, the engine) rather than the judge's reply. A judge that cannot answer must not
    turn into a reward of 1, nor a crash; one whose infrastructure failed must not turn into
    a reward at all.
    """

    def __init__(self, base_url: str | None = None, model: str | None = None,
                 api_key_env: str = "OPENAI_API_KEY", generate=None, timeout: float = 30.0,
                 max_chars: int = 2000, max_workers: int = 4):
        if generate is None and not (base_url and model):
            raise ValueError("LLMJudge needs either generate=callable or base_url and model")
        self.base_url = base_url.rstrip("/") if base_url else None
        self.model = model
        self.api_key_env = api_key_env
        self.generate = generate
        self.timeout = timeout
        self.max_chars = max_chars  # long responses are cut: the judge needs the answer, not the essay
        self.max_workers = max(1, int(max_workers))  # requests in flight at once (endpoint only)
        self.last_reason = ""

    def prompt(self, question: str, prediction: str, gold) -> str:
        gold_text = " / ".join(gold_aliases(gold)) or str(gold)
        return JUDGE_PROMPT.format(question=str(question)[: self.max_chars], gold=gold_text,
                                   prediction=extract_answer(prediction)[: self.max_chars])

    @staticmethod
    def _parse(reply) -> tuple[bool | None, str]:
        if not isinstance(reply, str):
            return None, f"reply is not text: {reply!r:.100}"
        words = re.findall(r"[a-z]+", reply.lower())
        says = {w for w in words if w in ("yes", "no")}
        if len(says) == 1:  # "Yes." or "The answer is: no"; both words at once is no verdict
            verdict = says.pop()
            return verdict == "yes", f"judge said {verdict}"
        return None, f"unparseable reply {reply[:100]!r}"

    def _chat(self, prompt: str) -> tuple[bool | None, str, bool]:
        reply, why = chat_reply(self.base_url, self.model, self.api_key_env, prompt, self.timeout)
        return (None, why, True) if reply is None else (*self._parse(reply), False)

    def verdicts(self, items: list[tuple]) -> list[tuple[bool | None, str, bool]]:
        """(verdict, reason, infra) for many (question, prediction, gold); verdict None = the
        judge gave none, infra True = because its infrastructure failed. One generate() call
        for the local engine (it batches), one request each for an endpoint, max_workers of
        them in flight."""
        prompts = [self.prompt(q, p, g) for q, p, g in items]
        if not prompts:
            return []
        if self.generate is None:
            with ThreadPoolExecutor(max_workers=min(self.max_workers, len(prompts))) as pool:
                out = list(pool.map(self._chat, prompts))
        else:
            try:
                replies = self.generate(prompts)
            except Exception as e:  # the engine's failure is a wrong answer, not a dead training run
                replies, why = None, f"generate raised {type(e).__name__}: {e}"
            else:
                why = "generate returned the wrong number of replies"
            if not isinstance(replies, (list, tuple)) or len(replies) != len(prompts):
                out = [(None, why, True)] * len(prompts)
            else:
                out = [(*self._parse(r), False) for r in replies]
        for verdict, reason, _ in out:
            self.last_reason = reason
            if verdict is None:
                log.warning("LLM judge gave no verdict (counted as wrong): %s", reason)
        return out


class Judge:
    """R(o, q, y*) as the config's judge section says: the rules, and with judge.llm an
    LLM for what the rules call wrong (never game24, where the rule is exact).

    Every verdict is score_item's dict plus "judge": who decided, "rule" (the rules
    said right, or were the only judge, or the LLM gave no verdict) or "llm" (the LLM
    said yes or no), "judge_error": why the LLM gave no verdict ("" otherwise), and
    "judge_infra": whether that was its infrastructure's failure. A reply that is no
    verdict leaves the rule's verdict, wrong: reward 0, never 1; a failed request leaves
    the answer out of training (train.judge_rollouts), like a tool's infrastructure failure.
    """

    def __init__(self, llm: LLMJudge | None = None):
        self.llm = llm

    @classmethod
    def from_config(cls, jcfg: dict, engine=None) -> "Judge":
        """From config judge.*: off -> rules only; base_url -> that endpoint; an empty
        base_url -> `engine` (an engine.LLM, the frozen copy of the policy)."""
        if not jcfg.get("llm"):
            return cls(None)
        timeout, workers = float(jcfg.get("timeout_s", 30.0)), int(jcfg.get("max_workers", 4))
        if jcfg.get("base_url"):
            return cls(LLMJudge(base_url=jcfg["base_url"], model=jcfg["model"], api_key_env=jcfg["api_key_env"],
                                timeout=timeout, max_workers=workers))
        if engine is None:
            raise ValueError("judge.llm with an empty judge.base_url judges with the frozen policy, "
                             "but no engine was given")
        return cls(LLMJudge(generate=engine_generate(engine)))

    def score_batch(self, answers: list[str], items: list) -> list[dict]:
        """Verdicts for answers[k] on items[k] (anything with question, gold, kind, options,
        numbers: a support.datasets.Item). The LLM sees all that the rules rejected at once."""
        out = []
        for answer, it in zip(answers, items):
            v = dict(score_item(answer, it.gold, it.kind, it.options, it.numbers))
            v.update(judge="rule", judge_error="", judge_infra=False)
            out.append(v)
        if self.llm is None:
            return out
        ask = [k for k, v in enumerate(out) if not v["correct"] and items[k].kind != "game24"]
        got = self.llm.verdicts([(items[k].question, answers[k], items[k].gold) for k in ask])
        for k, (verdict, reason, infra) in zip(ask, got):
            if verdict is None:
                out[k].update(judge_error=reason, judge_infra=infra)
            else:
                out[k]["judge"] = "llm"
                if verdict:
                    out[k].update(correct=True, f1=1.0)
        return out


def engine_generate(llm, batch_size: int = 32):
    """generate(prompts) -> "yes" or "no" for each, from the project's own engine (an
    engine.LLM): the verdict is one forced token, as the verifier's is, the likelier first
    token of "yes" or "no" in any casing (LLM.choose). A 7B model nearly always complies
    anyway; a small one would otherwise ramble into "no verdict"."""
    words = ("no", "No", "NO", "yes", "Yes", "YES")
    return lambda prompts: [w.lower() for w in llm.choose(JUDGE_SYSTEM, prompts, words, batch_size)]
