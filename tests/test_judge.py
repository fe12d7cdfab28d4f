"""Tests for judge.py: the 0/1 outcome reward R(o, q, y*) and its tricky cases.

Every rule gets a case that should pass and a near miss that should not, because
a judge that is too lenient rewards wrong answers during training as surely as a
strict one starves the policy of signal. The optional LLM judge is tested against
a local HTTP server (no network) and a local callable.
"""

import json
import sys
import threading
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from conftest import BENCHMARKS  # noqa: E402
from support.datasets import Item  # noqa: E402
from support.run_log import judge_counts  # noqa: E402
from judge import (KINDS, Judge, LLMJudge, check_game24, date_key, engine_generate, extract_answer,  # noqa: E402
                   gold_aliases, normalize_text, parse_number, score, score_item, token_f1)

MEDQA_OPTIONS = ["A. Hemolytic uremic syndrome", "B. Oral ulcers", "C. Colorectal cancer", "D. Pancreatic cancer"]


def correct(pred, gold, kind, options=None):
    return score(pred, gold, kind, options)["correct"]


# --- extraction ---------------------------------------------------------------

def test_extract_last_answer_tag_wins():
    assert extract_answer("<answer>1</answer> wait, no: <answer>2</answer>") == "2"
    assert extract_answer("I will use <answer> tags.\n<answer> Paris </answer>") == "Paris"
    # a stop string often eats the closing tag
    assert extract_answer("reasoning... <answer>42") == "42"
    assert extract_answer("<ANSWER>x</ANSWER>") == "x"


def test_extract_boxed_with_nested_braces():
    assert extract_answer(r"so $\boxed{\dfrac{3}{4}}$.") == r"\dfrac{3}{4}"
    assert extract_answer(r"\boxed{1} at first, finally \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    # the box that closes last is the outer one, not the one nested inside it
    assert extract_answer(r"\boxed{\frac{1}{\boxed{2}}}") == r"\frac{1}{\boxed{2}}"
    # a cut-off box is ignored in favour of a complete one
    assert extract_answer(r"\boxed{3} and then \boxed{4") == "3"
    assert extract_answer(r"<answer>\boxed{7}</answer>") == "7"


def test_extract_answer_lines_and_fallback():
    assert extract_answer("Thinking.\nAnswer: Paris\n") == "Paris"
    assert extract_answer("blah\nThe final answer is 12.") == "12"
    assert extract_answer("**Answer:** 42") == "42"
    assert extract_answer("  just this  ") == "just this"
    assert extract_answer(None) == ""


# --- text ----------------------------------------------------------------------

def test_normalize_text_squad_style():
    assert normalize_text("The Beatles!") == "beatles"
    assert normalize_text("  An   apple, a day ") == "apple day"
    assert normalize_text("Gülçiçek Hatun") == "gulcicek hatun"
    assert normalize_text("323–272 BC") == normalize_text("323-272 BC")


def test_token_f1_against_hand_computation():
    # pred tokens: cat sat on mat (the is dropped); gold: cat on hat (a dropped)
    # common = {cat, on} = 2; precision 2/4, recall 2/3; F1 = 2pr/(p+r) = 4/7
    assert token_f1("the cat sat on mat", "cat on a hat") == pytest.approx(4 / 7)
    assert token_f1("Paris", "paris") == 1.0
    assert token_f1("London", "Paris") == 0.0
    assert token_f1("", "") == 1.0 and token_f1("", "x") == 0.0
    # repeated tokens are clipped to the gold count: 1 common of 3 predicted
    assert token_f1("new new new", "new york") == pytest.approx(2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2))


def test_text_kind():
    assert correct("<answer>The Beatles</answer>", "beatles", "text")
    assert correct("<answer>beatles</answer>", ["The Beatles", "Fab Four"], "text")
    assert correct("<answer>Fab Four.</answer>", ["The Beatles", "Fab Four"], "text")
    assert correct("<answer>Let's Make Money</answer>", "Let'S Make Money", "text")
    assert correct("Answer: James Madison", "['james madison', 'madison']", "text")  # stringified list
    assert correct("<answer>Yes, both are American.</answer>", "yes", "text")
    assert correct("<answer>1,000</answer>", "1000", "text")
    assert not correct("<answer>Beatles tribute band</answer>", "The Beatles", "text")
    assert not correct("<answer>no</answer>", "yes", "text")
    assert not correct("", "yes", "text")
    res = score("<answer>James Madison Jr.</answer>", ["james madison"], "text")
    assert not res["correct"] and res["f1"] == pytest.approx(0.8)  # p = 2/3, r = 1
    assert res["extracted"] == "James Madison Jr."


# --- numbers -----------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [
    ("1000", 1000), ("1,000", 1000), ("1,234,567", 1234567), ("-3", -3), ("+7", 7),
    ("0.5", Fraction(1, 2)), ("1/2", Fraction(1, 2)), ("-3/4", Fraction(-3, 4)), (".25", Fraction(1, 4)),
    (r"\frac{1}{2}", Fraction(1, 2)), (r"\dfrac{3}{4}", Fraction(3, 4)), (r"\tfrac{3}{4}", Fraction(3, 4)),
    (r"-\frac{1}{2}", Fraction(-1, 2)), (r"\frac12", Fraction(1, 2)), (r"$\boxed{\dfrac{3}{4}}$", Fraction(3, 4)),
    (r"$42$", 42), (r"42\text{ apples}", 42), ("42 apples", 42), ("x = 5", 5), ("33.", 33),
    ("50%", 50), (r"50\%", 50), (r"90^\circ", 90), ("1{,}000", 1000), (r"1\,000", 1000), ("2 1/2", Fraction(5, 2)),
    ("1e-3", Fraction(1, 1000)), ("\u22125", -5), (7, 7), (0.5, Fraction(1, 2)),
])
def test_parse_number_accepts(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1,2", "3pi", "3 pi", r"\sqrt{2}", "1/0", "12 and 13", "2x+1",
                                  "__import__('os').system('echo hi')", None, True])
def test_parse_number_rejects(text):
    assert parse_number(text) is None


def test_parse_number_strict_mode_rejects_units():
    assert parse_number("323 BC", allow_units=False) is None
    assert parse_number("323", allow_units=False) == 323


def test_number_kind():
    assert correct("<answer>1,000</answer>", "1000", "number")
    for half in ["0.5", "1/2", r"\frac{1}{2}", r"$\boxed{\dfrac{1}{2}}$", ".5", "0.50"]:
        assert correct(f"<answer>{half}</answer>", "1/2", "number"), half
        assert correct(f"<answer>{half}</answer>", r"\frac{1}{2}", "number"), half
    assert correct(r"The value is $\boxed{\dfrac{3}{4}}$", "0.75", "number")
    assert correct("<answer>33</answer>", 33, "number")
    assert correct("<answer>m+n = 33</answer>", "33", "number")
    assert correct("<answer>0.3333333</answer>", "1/3", "number")  # a rounded decimal (more: test_rounded_...)
    assert not correct("<answer>34</answer>", "33", "number")
    assert not correct("<answer>33.001</answer>", "33", "number")
    assert not correct("<answer>I think 33 or 34</answer>", "33", "number")
    assert correct("<answer>50%</answer>", "0.5", "number") and correct("<answer>50%</answer>", "50", "number")
    assert correct(r"<answer>2\sqrt{3}</answer>", r"2\sqrt{3}", "number")  # a non-number gold: text fallback
    assert score("<answer>1/2</answer>", "0.5", "number")["f1"] == 1.0
    assert score("<answer>2</answer>", "0.5", "number")["f1"] == 0.0


@pytest.mark.parametrize("kind", ["number", "math"])
def test_integer_gold_is_only_its_own_value(kind):
    """A relative tolerance once paid 2270751.0 for 2270750 and 258460000.0 for 258459975:
    on large arithmetic answers it rewarded wrong digits."""
    for pred in ["2270750.0", "2,270,750", "2270750.00", r"2.27075 \times 10^{6}", "2270750 km"]:
        assert correct(f"<answer>{pred}</answer>", "2270750", kind), pred
    for pred, gold in [("2270751.0", "2270750"), ("258460000.0", "258459975"), ("2270750.4", "2270750"),
                       ("2.27e6", "2270750"), ("33.0001", "33"), ("5.0000001", "5")]:
        assert not correct(f"<answer>{pred}</answer>", gold, kind), (pred, gold)


@pytest.mark.parametrize("kind", ["number", "math"])
def test_rounded_decimal_against_a_non_integer_gold(kind):
    """A decimal matches a non-integer gold it rounds, at the places it was written with
    and with at least 3 significant digits."""
    for pred, gold in [("0.333", "1/3"), ("0.3333", "1/3"), ("0.33333333", "1/3"), ("-0.667", "-2/3"),
                       ("2.33", "7/3"), ("0.125", "1/8"), ("0.00400", "1/250"), ("33.3%", "1/3"),
                       ("1.41", r"\sqrt{2}"), ("1.4142", r"\sqrt{2}"), ("3.14", r"\pi")]:
        assert correct(f"<answer>{pred}</answer>", gold, kind), (pred, gold)
    for pred, gold in [("0.33", "1/3"),      # 2 significant digits: a 1.5% window
                       ("0.334", "1/3"), ("0.3334", "1/3"), ("2.3", "7/3"), ("0.13", "1/8"),
                       ("0", "0.004"), ("0.00", "1/250"), ("0.0", "1/250"), ("33%", "1/3"),
                       ("1.42", r"\sqrt{2}"), ("1.4143", r"\sqrt{2}"), ("3.15", r"\pi"),
                       ("2.51", "2.5"),      # 2.5 to two places is 2.50
                       ("1/3", "0.333")]:    # an exact fraction is no rounding of a gold decimal
        assert not correct(f"<answer>{pred}</answer>", gold, kind), (pred, gold)


@pytest.mark.parametrize("kind", ["number", "math"])
def test_text_gold_compares_case_insensitively(kind):
    for pred in ["yes", "YES", "Yes", r"\text{yes}", r"\boxed{\text{YES}}"]:
        assert correct(pred, r"\text{Yes}", kind), pred
    for pred in ["no", r"\text{No}", "yes and no", "1"]:
        assert not correct(pred, r"\text{Yes}", kind), pred


def test_math_kind_on_deepmath_style_answers():
    # the same answer in the model's words and the gold's
    for pred, gold in [(r"\boxed{\dfrac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"), (r"$(-\infty, 1]$", r"(-\infty,1]"),
                       (r"The answer is \boxed{\{1,2\}}", r"\{2, 1\}"), ("Answer: 1,000", "1000"),
                       (r"<answer>e^{-2}</answer>", r"\frac{1}{e^2}"), (r"\boxed{\text{Yes}}", "Yes"),
                       (r"\boxed{x = 3}", "3"), (r"\boxed{90^\circ}", r"\frac{\pi}{2}")]:
        assert correct(pred, gold, "math"), (pred, gold)
    for pred, gold in [(r"\boxed{\frac{\sqrt3}{3}}", r"\frac{\sqrt3}{2}"), (r"\boxed{(-\infty, 1)}", r"(-\infty,1]"),
                       (r"\boxed{\text{No}}", "Yes"), ("I think 3 or 4", "3"), ("", "3")]:
        assert not correct(pred, gold, "math"), (pred, gold)


def test_number_kind_rejects_arithmetic_left_undone():
    """A generator that copies the question's sum ("Calculate 97210 * 4592." answered
    "97210 * 4592") has not answered it, though the math rule evaluates the copy to the
    gold: on the offline default that earned Base_Generator reward 1 on arithmetic."""
    for undone, gold in [("97210 * 4592", "446388320"), ("954283 + 525273 + 463808", "1943364"),
                         ("(3 + 4) * 2", "14"), (r"4 \times 5", "20"), ("80319 * 9011.", "723754509"),
                         ("<answer>6 + 3</answer>", "9"), ("Answer: 7 - 2", "5")]:
        assert not correct(undone, gold, "number"), undone
        assert correct(undone, gold, "math"), undone  # competition math keeps its closed forms
    for done, gold in [("446388320", "446388320"), ("3/4", "0.75"), (r"3 \times 10^{8}", "300000000"),
                       ("-5", "-5"), (r"\sqrt{1089}", "33"), ("m+n = 33", "33")]:
        assert correct(done, gold, "number"), done


def test_number_kind_hands_non_plain_numbers_to_the_math_rule():
    assert correct(r"<answer>\sqrt{1089}</answer>", "33", "number")
    assert correct(r"<answer>\sqrt{12}</answer>", r"2\sqrt{3}", "number")
    assert not correct("<answer>33.001</answer>", "33", "number")  # two plain numbers: the number rule decides


def test_dates_in_text_answers():
    assert date_key("5 January 1964") == date_key("January 5, 1964") == date_key("1964-01-05") == (1964, 1, 5)
    assert date_key("June 1941") == (1941, 6, None) and date_key("Sept. 3rd, 1939") == (1939, 9, 3)
    assert date_key("04/15/18") is None and date_key("323 BC") is None and date_key("May 2018 and 2019") is None
    assert correct("<answer>January 5, 1964</answer>", "5 January 1964", "text")
    assert correct("<answer>on 30 June 2011</answer>", "['30 June 2011']", "text")
    assert not correct("<answer>January 6, 1964</answer>", "5 January 1964", "text")
    assert not correct("<answer>January 1964</answer>", "5 January 1964", "text")


@pytest.mark.parametrize("path", sorted(BENCHMARKS.glob("*.json")), ids=lambda p: p.stem)
def test_every_shipped_gold_scores_itself(path):
    """Each benchmark's gold, written back as the model's answer, earns reward 1
    (through the same loader and score_item the training uses)."""
    from support.datasets import load_benchmark
    for it in load_benchmark(str(path)):
        if it.kind == "game24":
            continue  # the reference expression is checked in the game24 tests
        answer = f"<answer>{it.gold[0]}</answer>"
        assert score_item(answer, it.gold, it.kind, it.options, it.numbers)["correct"], (it.id, it.gold)


# --- multiple choice -------------------------------------------------------------------

@pytest.mark.parametrize("pred", ["<answer>C</answer>", "<answer>(C)</answer>", "<answer>C.</answer>",
                                  "<answer>c</answer>", "<answer>option C</answer>", "The answer is C",
                                  "The answer is C because of the pseudopolyps.", "Answer: (C)",
                                  "<answer>C. Colorectal cancer</answer>", "<answer>Colorectal cancer</answer>",
                                  "<answer>colorectal CANCER.</answer>", r"$\boxed{C}$",
                                  "<answer>The patient is at risk of colorectal cancer</answer>"])
def test_choice_accepts_letter_or_text(pred):
    assert correct(pred, "Colorectal cancer", "choice", MEDQA_OPTIONS)  # gold as option text
    assert correct(pred, "C", "choice", MEDQA_OPTIONS)                  # gold as letter
    assert correct(pred, "(C)", "choice", [o[3:] for o in MEDQA_OPTIONS])  # options without labels


@pytest.mark.parametrize("pred", ["<answer>B</answer>", "<answer>Oral ulcers</answer>", "The answer is B",
                                  "<answer>E</answer>", "<answer>cancer</answer>", "<answer></answer>",
                                  "<answer>A patient like this</answer>"])
def test_choice_rejects_wrong_or_ambiguous(pred):
    assert not correct(pred, "Colorectal cancer", "choice", MEDQA_OPTIONS)


def test_choice_without_options():
    assert correct("<answer>(B)</answer>", "B", "choice")
    assert correct("The answer is B.", "b", "choice")
    assert not correct("<answer>A</answer>", "B", "choice")


# --- game of 24 ------------------------------------------------------------------------

def test_game24_checker():
    assert check_game24("(1+1+1)*8", [1, 1, 1, 8])
    assert check_game24("(1+1+1)×8", [8, 1, 1, 1])            # order of numbers does not matter
    assert check_game24("(1 + 1 + 1) x 8 = 24", [1, 1, 1, 8])  # 'x' and a trailing "= 24"
    assert check_game24("24 = 8 ÷ (3 − 8 ÷ 3)", [3, 3, 8, 8])
    assert check_game24(r"$\left(1+1+1\right) \times 8$", [1, 1, 1, 8])
    assert check_game24("[(4+4)*6]/2", [4, 4, 6, 2])
    # 8/(3-8/3): the intermediate 1/3 is a fraction; exact arithmetic still gives 24
    assert check_game24("8/(3-8/3)", [3, 3, 8, 8])
    assert not check_game24("8*3", [8, 3, 3, 8])                # numbers missing
    assert not check_game24("(8+8+8)*1", [8, 8, 1, 2])          # 8 used three times, 2 missing
    assert not check_game24("8*(3+3-3)", [3, 3, 8, 8])          # 3 used thrice, an 8 missing
    assert not check_game24("(1+1+1)*8 + 1", [1, 1, 1, 8])      # extra number
    assert not check_game24("(1+1)*8+1", [1, 1, 1, 8])          # makes 17
    assert not check_game24("(1+1+1)*8 = 25", [1, 1, 1, 8])     # claims something else
    assert not check_game24("8/(3-3)*8", [3, 3, 8, 8])          # division by zero
    assert not check_game24("-(1-4)*8*1", [1, 4, 8, 1])         # unary minus is not an operation of the game
    assert not check_game24("2**4+8", [2, 4, 8])                # no power
    assert not check_game24("(1+1+1)8", [1, 1, 1, 8])           # no implicit product


@pytest.mark.parametrize("bad", ["__import__('os').system('echo pwned')", "exec('1')", "lambda: 24",
                                 "(" * 5000 + "24" + ")" * 5000, "1" * 10000, "", "24", "None",
                                 "8 * 3 \x00", "3e1-6", "24.0"])
def test_game24_hostile_input_is_false_not_an_error(bad):
    assert check_game24(bad, [1, 1, 1, 8]) is False
    assert score(f"<answer>{bad}</answer>", [1, 1, 1, 8], "game24")["correct"] is False


def test_game24_score_finds_the_expression_inside_text():
    # the checker takes only a bare expression; score looks for one inside the answer
    # text (the expression itself is what is checked, the rest is never run)
    assert not check_game24("(1+1+1)*8; import os", [1, 1, 1, 8])
    res = score("<answer>(1+1+1)*8; import os</answer>", [1, 1, 1, 8], "game24")
    assert res["correct"] and res["extracted"] == "(1+1+1)*8"


def test_game24_score_accepts_every_gold_form():
    pred = "<answer>(1+1+1)×8</answer>"
    for gold in ([1, 1, 1, 8], "1 1 1 8", "[1, 1, 1, 8]", ["1", "1", "1", "8"], ["(8*(1+1+1))"],
                 "(8*(1+1+1)) = 24"):
        assert correct(pred, gold, "game24"), gold
    # any valid expression counts, not only the reference one
    assert correct("<answer>8*(1+1+1)</answer>", ["(1+1+1)×8"], "game24")
    assert correct("So the expression is 8/(3-8/3), which is 24.", "3 3 8 8", "game24")
    assert not correct("<answer>8*3</answer>", "3 3 8 8", "game24")
    res = score("<answer>8/(3-8/3) = 24</answer>", [3, 3, 8, 8], "game24")
    assert res == {"correct": True, "f1": 1.0, "extracted": "8/(3-8/3) = 24"}


# --- plumbing ------------------------------------------------------------------------

def test_score_shape_and_unknown_kind():
    for kind in KINDS:
        res = score("<answer>x</answer>", "y", kind)
        assert set(res) == {"correct", "f1", "extracted"} and res["correct"] is False
    with pytest.raises(ValueError, match="unknown answer kind"):
        score("a", "a", "essay")


def test_gold_aliases():
    assert gold_aliases("['a', 'b']") == ["a", "b"]
    assert gold_aliases(["x", 3]) == ["x", "3"]
    assert gold_aliases(33) == ["33"]
    assert gold_aliases("[citation needed]") == ["[citation needed]"]
    assert gold_aliases("[__import__('os')]") == ["[__import__('os')]"]  # literal_eval refuses calls
    assert gold_aliases(None) == [] and gold_aliases("  ") == []


# --- LLM judge -------------------------------------------------------------------------

class _Handler(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint whose behaviour is chosen by the model name."""
    seen = []

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.seen.append((self.path, dict(self.headers), body))
        mode = body["model"]
        if mode == "http500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"internal error")
            return
        if mode == "slow":
            threading.Event().wait(2.0)
        if mode == "notjson":
            payload = b"<html>oops</html>"
        elif mode == "nochoices":
            payload = json.dumps({"error": "x"}).encode()
        else:
            reply = {"yes": "Yes.", "no": "no", "garbage": "I cannot say.", "both": "yes or no?",
                     "slow": "yes"}[mode]
            payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}]}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the "slow" client gave up waiting, as intended


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def said(j: LLMJudge, items: list[tuple]) -> list[bool]:
    """The LLM's verdict on each (question, prediction, gold) as a reward reads it: no verdict
    is False."""
    return [bool(v) for v, _, _ in j.verdicts(items)]


def says(j: LLMJudge, question, prediction, gold) -> bool:
    return said(j, [(question, prediction, gold)])[0]


def rules_then(j: LLMJudge, question, prediction, gold, kind) -> dict:
    """The verdict of a Judge with `j` as its LLM on one answer: the rules first, then `j`."""
    return Judge(j).score_batch([prediction], [Item(id="0", question=question, gold=gold, kind=kind)])[0]


def test_llm_judge_http_yes_and_no(server, monkeypatch):
    monkeypatch.setenv("TEST_JUDGE_KEY", "sk-test")
    _Handler.seen.clear()
    yes = LLMJudge(base_url=server, model="yes", api_key_env="TEST_JUDGE_KEY")
    assert says(yes, "Who founded Citibank's country?", "<answer>JFK</answer>", ["John F. Kennedy"]) is True
    path, headers, body = _Handler.seen[-1]
    assert path == "/v1/chat/completions"
    assert headers["Authorization"] == "Bearer sk-test"
    prompt = body["messages"][0]["content"]
    assert "JFK" in prompt and "John F. Kennedy" in prompt and "<answer>" not in prompt
    assert says(LLMJudge(base_url=server, model="no"), "q", "a", "b") is False


@pytest.mark.parametrize("mode", ["http500", "garbage", "both", "notjson", "nochoices"])
def test_llm_judge_http_failures_are_false(server, mode):
    j = LLMJudge(base_url=server, model=mode)
    assert says(j, "q", "a", "b") is False
    assert j.last_reason


def test_llm_judge_timeout_and_refused_connection(server):
    j = LLMJudge(base_url=server, model="slow", timeout=0.2)
    assert says(j, "q", "a", "b") is False and "request failed" in j.last_reason
    j = LLMJudge(base_url="http://127.0.0.1:1/v1", model="m", timeout=1)
    assert says(j, "q", "a", "b") is False and "request failed" in j.last_reason


def test_llm_judge_local_callable():
    calls = []

    def generate(prompts):
        calls.append(prompts)
        return ["Yes" if "Paris" in p.split("Response:")[1] else "No." for p in prompts]

    j = LLMJudge(generate=generate)
    got = said(j, [("Capital of France?", "<answer>Paris</answer>", "paris"),
                   ("Capital of France?", "<answer>Lyon</answer>", "paris")])
    assert got == [True, False] and len(calls) == 1  # one batched call
    assert says(LLMJudge(generate=lambda ps: ["perhaps"] * len(ps)), "q", "a", "b") is False
    assert says(LLMJudge(generate=lambda ps: []), "q", "a", "b") is False

    def broken(prompts):
        raise RuntimeError("CUDA out of memory")
    j = LLMJudge(generate=broken)
    assert says(j, "q", "a", "b") is False and "CUDA out of memory" in j.last_reason
    with pytest.raises(ValueError):
        LLMJudge()


def test_llm_judge_score_consults_llm_only_when_rules_fail():
    asked = []

    def generate(prompts):
        asked.extend(prompts)
        return ["yes"] * len(prompts)

    j = LLMJudge(generate=generate)
    assert rules_then(j, "q", "<answer>Paris</answer>", "paris", "text")["judge"] == "rule"
    assert not asked
    res = rules_then(j, "q", "<answer>JFK</answer>", "John F. Kennedy", "text")
    assert res["correct"] and res["judge"] == "llm" and len(asked) == 1
    # game24 is checked exactly; an agreeable LLM cannot rescue a wrong expression
    assert not rules_then(j, "q", "<answer>8*3</answer>", [3, 3, 8, 8], "game24")["correct"]


# --- the configured judge: rules, then the LLM for what they reject ------------------------

class _Item:
    def __init__(self, question, gold, kind, options=None, numbers=None):
        self.question, self.gold, self.kind, self.options, self.numbers = question, gold, kind, options, numbers


ITEMS = [_Item("Who was the 35th US president?", ["John F. Kennedy"], "text"),   # rules: wrong (JFK)
         _Item("Capital of France?", ["Paris"], "text"),                        # rules: right
         _Item("Make 24", ["(1+1+1)*8"], "game24", numbers=[1, 1, 1, 8])]       # rules only
ANSWERS = ["<answer>JFK</answer>", "<answer>Paris</answer>", "<answer>8*3</answer>"]


def test_judge_rules_only_by_default():
    j = Judge.from_config({"llm": False, "base_url": "", "model": "", "api_key_env": "OPENAI_API_KEY"})
    assert j.llm is None
    v = j.score_batch(ANSWERS, ITEMS)
    assert [x["correct"] for x in v] == [False, True, False]
    assert {x["judge"] for x in v} == {"rule"} and judge_counts(v) == {"rule": 3, "llm": 0, "llm_failed": 0}


def test_judge_endpoint_decides_what_the_rules_reject(server):
    _Handler.seen.clear()
    j = Judge.from_config({"llm": True, "base_url": server, "model": "yes", "api_key_env": "",
                           "timeout_s": 5.0, "max_workers": 2})
    v = j.score_batch(ANSWERS, ITEMS)
    assert [x["correct"] for x in v] == [True, True, False]
    assert [x["judge"] for x in v] == ["llm", "rule", "rule"]
    assert len(_Handler.seen) == 1  # only the JFK answer went to the LLM; game24 never does
    assert "Authorization" not in _Handler.seen[0][1]  # api_key_env "" sends no key
    assert judge_counts(v) == {"rule": 2, "llm": 1, "llm_failed": 0}
    no = Judge.from_config({"llm": True, "base_url": server, "model": "no", "api_key_env": ""})
    v = no.score_batch(ANSWERS[:1], ITEMS[:1])
    assert v[0]["correct"] is False and v[0]["judge"] == "llm" and v[0]["judge_error"] == ""


@pytest.mark.parametrize("mode, infra", [("http500", True), ("garbage", False), ("notjson", True), ("slow", True)])
def test_judge_failure_is_never_a_right_answer_and_counted(server, mode, infra):
    """No verdict leaves the rule's (wrong); a failed request, an error status, a malformed
    response or a timeout are the infrastructure's failures (train.py leaves such answers
    out of the update), a reply that says neither yes nor no is the judge's."""
    j = Judge.from_config({"llm": True, "base_url": server, "model": mode, "api_key_env": "",
                           "timeout_s": 0.3, "max_workers": 4})
    v = j.score_batch(ANSWERS[:1] * 3, ITEMS[:1] * 3)
    assert all(x["correct"] is False and x["judge"] == "rule" and x["judge_error"] for x in v)
    assert all(x["judge_infra"] is infra for x in v)
    assert judge_counts(v) == {"rule": 3, "llm": 0, "llm_failed": 3}


def test_judge_with_the_frozen_policy_needs_an_engine():
    cfg = {"llm": True, "base_url": "", "model": "", "api_key_env": ""}
    with pytest.raises(ValueError, match="frozen policy"):
        Judge.from_config(cfg)


def test_engine_generate_forces_a_verdict_on_the_local_engine(tiny_llm):
    """A random 2-layer model cannot grade, but the first token is forced to begin yes
    or no, so every reply parses, and the Judge built on it runs end to end."""
    gen = engine_generate(tiny_llm, batch_size=2)
    replies = gen(["Question: q\nGold answer: a\nResponse: b"] * 3)
    assert len(replies) == 3
    assert all(r in ("yes", "no") for r in replies), replies
    j = Judge.from_config({"llm": True, "base_url": "", "model": "", "api_key_env": ""}, engine=tiny_llm)
    v = j.score_batch(ANSWERS, ITEMS)
    assert v[1]["judge"] == "rule" and v[0]["judge"] in ("llm", "rule")


def test_eval_scores_through_the_configured_judge(server, tmp_path, monkeypatch):
    """eval.evaluate with an LLM judge on a loopback endpoint: each result row and the
    summary say who decided (a stand-in agent, so no model is needed, nor its fingerprint)."""
    import eval as evaluation
    from support.datasets import Item
    monkeypatch.setattr(evaluation, "made_by", lambda agent, judge, **settings: {"agent": "a stand-in"})

    class Traj:
        def __init__(self, answer):
            self.answer, self.memory = answer, type("M", (), {"records": []})()

        def to_dict(self):
            return {"answer": self.answer}

    class Agent:
        def rollout(self, questions, seed=0, max_turns=None):
            return [Traj(a) for a in ANSWERS[:len(questions)]]

    items = [Item(id=str(k), question=it.question, gold=it.gold, kind=it.kind, numbers=it.numbers)
             for k, it in enumerate(ITEMS)]
    judge = Judge.from_config({"llm": True, "base_url": server, "model": "yes", "api_key_env": ""})
    summary = evaluation.evaluate(Agent(), items, tmp_path, batch_size=3, judge=judge)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["judge"] for r in rows] == ["llm", "rule", "rule"]
    assert [r["correct"] for r in rows] == [True, True, False]
    assert summary["judge"] == {"rule": 2, "llm": 1, "llm_failed": 0} and summary["accuracy"] == 2 / 3
