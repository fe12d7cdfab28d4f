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
    number  exact rational equality (Fraction), with a 1e-6 relative tolerance
            only when a decimal point is involved; a gold or answer that is not
            a plain number goes to the math rule, except plain arithmetic left
            undone ("80319 * 9011"): it restates a question, it is no number
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
"""

import ast
import json
import logging
import os
import re
import string
import unicodedata
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import requests

import math_answer

log = logging.getLogger(__name__)

KINDS = ("text", "number", "math", "choice", "game24")


# --- finding the answer in the generator's raw text ---------------------------

def _last_boxed(text: str) -> str | None:
    r"""Content of the last complete \boxed{...} (or \fbox{...}), braces balanced.

    A regex cannot match nested braces (\boxed{\frac{1}{2}}), so we scan.
    "Last" means the box that closes last, so a box nested inside another one
    loses to the outer box. A \boxed whose braces never close (a cut-off
    generation) is ignored.
    """
    best, best_end = None, -1
    for m in re.finditer(r"\\(?:boxed|fbox)", text):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        if j > best_end:
                            best, best_end = text[i + 1:j], j
                        break
        elif i > m.end():
            # "\boxed 5": no braces, the box holds the next token
            tok = re.match(r"[^\s$]+", text[i:])
            if tok and i + tok.end() > best_end:
                best, best_end = tok.group(0), i + tok.end()
    return best


_ANSWER_LINE = re.compile(r"(?:final\s+answer|answer)\s*(?:is\s*:?|:|=)\s*(.+)$", re.IGNORECASE)


def extract_answer(text: str) -> str:
    """The answer part of a raw response, by the first rule that applies.

    1. the last <answer>...</answer> tag (an unclosed last tag runs to the end of
       the text: a stop string often eats the closing tag); a \\boxed{} inside
       the tag is unwrapped too
    2. the last \\boxed{...}
    3. the last line that says "Answer: X", "The answer is X", "final answer is X"
    4. the whole text, stripped
    """
    if text is None:
        return ""
    text = str(text)
    opens = list(re.finditer(r"<answer>", text, re.IGNORECASE))
    if opens:
        start = opens[-1].end()
        close = re.search(r"</answer>", text[start:], re.IGNORECASE)
        inner = text[start:start + close.start()] if close else text[start:]
        boxed = _last_boxed(inner)
        return (boxed if boxed is not None else inner).strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for line in reversed(text.splitlines()):
        # markdown bold ("**Answer:** 42") would hide the pattern
        m = _ANSWER_LINE.search(line.replace("*", ""))
        if m:
            ans = m.group(1).strip()
            return ans[:-1].strip() if ans.endswith(".") else ans
    return text.strip()


# --- text ----------------------------------------------------------------------

_PUNCT = set(string.punctuation)


def normalize_text(s: str) -> str:
    """SQuAD-style normalisation: lowercase, no punctuation, no articles, single spaces.

    One addition to SQuAD: accents are dropped ("Gülçiçek" == "Gulcicek"), since
    models and search snippets write names both ways. Punctuation is deleted, not
    replaced by a space, exactly as in SQuAD ("Let'S" -> "lets").
    """
    s = unicodedata.normalize("NFKD", str(s).lower())
    s = "".join(ch for ch in s if not unicodedata.combining(ch))
    # ASCII punctuation (as SQuAD) plus Unicode punctuation (dashes, curly quotes)
    s = "".join(ch for ch in s if ch not in _PUNCT and not unicodedata.category(ch).startswith("P"))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(pred: str, gold: str) -> float:
    """SQuAD token F1 between normalised strings (bag of words, counts clipped)."""
    p, g = normalize_text(pred).split(), normalize_text(gold).split()
    if not p or not g:
        return float(p == g)  # both empty: a match; one empty: nothing in common
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


# --- numbers ---------------------------------------------------------------------

# One plain number: optional sign, digits with optional thousands commas, optional
# decimals and exponent ("1,234.5", "-.5", "1e-3"). Commas must group by three,
# so "1,2" is not a number (it is more likely a list).
_NUM = r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_NUM_RE = re.compile(rf"^{_NUM}$")
_FRAC_RE = re.compile(rf"^([+-]?)\(?({_NUM})\)?\s*/\s*\(?({_NUM})\)?$")
_MIXED_RE = re.compile(r"^([+-]?)(\d+)\s+(\d+)\s*/\s*(\d+)$")
# A number followed by a few unit words ("42 apples", "3.5 km per hour").
_UNITS_RE = re.compile(r"^(.+?)\s+([A-Za-z][A-Za-z.\-]*(?:\s+[A-Za-z][A-Za-z.\-]*){0,2})$")
# Words after a number that change its value, so it is not "a number with units".
_NOT_UNITS = {"pi", "i", "e", "sqrt", "root", "x", "y", "z", "n", "times", "squared", "cubed",
              "thousand", "million", "billion", "hundred", "percent"}


def _clean_number_text(s: str) -> str:
    """Strip the LaTeX and decoration around a number, leaving plain ASCII."""
    t = s.strip()
    boxed = _last_boxed(t)
    if boxed is not None:
        t = boxed
    t = t.replace("\\$", "").replace("$", "").replace("\\%", "%")
    for a in ("\\(", "\\)", "\\[", "\\]", "\\left", "\\right", "\\displaystyle"):
        t = t.replace(a, "")
    for a in ("\\!", "\\,", "\\;", "\\:", "~"):  # LaTeX thin spaces, used as thousands separators
        t = t.replace(a, "")
    t = t.replace("\\ ", " ").replace("{,}", ",").replace("\u2212", "-")
    t = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°", "", t)  # degrees: 90^\circ -> 90
    t = re.sub(r"\\(?:text|mathrm|textbf|mbox|mathbf|operatorname)\s*\{([^{}]*)\}", r" \1 ", t)
    # \frac{a}{b}, \dfrac, \tfrac, and the brace-less \frac12
    t = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"(\1)/(\2)", t)
    t = re.sub(r"\\[dt]?frac\s*(\d)\s*(\d)", r"\1/\2", t)
    t = t.replace("{", "").replace("}", "")
    return " ".join(t.split())


def parse_number(s: str, allow_units: bool = True) -> Fraction | None:
    """The exact value of a string that is essentially one number, else None.

    Understands "1,234,567", "-0.5", "3/4", "2 1/2", "50%" (-> 50, see _number_match
    for how percent is compared), "\\frac{3}{4}", "$\\dfrac{3}{4}$", "x = 5" (the
    right-hand side), "42 apples" (a few trailing unit words, when allow_units).
    Never evaluates anything: only regexes and Fraction().
    """
    if s is None or isinstance(s, bool):
        return None
    if isinstance(s, (int, Fraction)):
        return Fraction(s)
    if isinstance(s, float):
        return Fraction(repr(s)) if s == s and abs(s) != float("inf") else None
    t = _clean_number_text(str(s))
    if "=" in t:
        t = t.rsplit("=", 1)[1].strip()
    if t.endswith("."):
        t = t[:-1].strip()
    if t.endswith("%"):
        t = t[:-1].strip()
    t = t.lstrip("€£¥").strip()
    # a sign outside parentheses: "-(3)/(4)" from "-\frac{3}{4}"
    sign = 1
    if t.startswith("-(") or t.startswith("+("):
        sign, t = (-1 if t[0] == "-" else 1), t[1:]
    value = _plain_number(t)
    if value is None and allow_units:
        m = _UNITS_RE.match(t)
        if m and not any(w.lower().strip(".-") in _NOT_UNITS for w in m.group(2).split()):
            value = _plain_number(m.group(1).strip())
    return None if value is None else sign * value


def _plain_number(t: str) -> Fraction | None:
    if re.fullmatch(r"\(.*\)", t) and t.count("(") == 1:
        t = t[1:-1].strip()
    if _NUM_RE.match(t):
        return Fraction(t.replace(",", ""))
    m = _MIXED_RE.match(t)
    if m:
        if int(m.group(4)) == 0:
            return None
        v = int(m.group(2)) + Fraction(int(m.group(3)), int(m.group(4)))
        return -v if m.group(1) == "-" else v
    m = _FRAC_RE.match(t)
    if m:
        num, den = Fraction(m.group(2).replace(",", "")), Fraction(m.group(3).replace(",", ""))
        if den == 0:
            return None
        v = num / den
        return -v if m.group(1) == "-" else v
    return None


def _number_match(pred_text: str, gold_text: str) -> bool:
    p, g = parse_number(pred_text), parse_number(gold_text)
    if p is None or g is None:
        return False
    preds, golds = {p}, {g}
    # "50%" against a gold of 0.5 or of 50: accept both readings of the percent sign
    if "%" in pred_text:
        preds.add(p / 100)
    if "%" in str(gold_text):
        golds.add(g / 100)
    if preds & golds:
        return True
    # Decimals are often rounded ("0.3333333" for 1/3); integers and fractions never are.
    if "." in pred_text or "." in str(gold_text):
        return any(abs(a - b) <= Fraction(1, 10**6) * max(abs(a), abs(b)) for a in preds for b in golds)
    return False


def _math_match(pred_text: str, gold_text: str) -> bool:
    """Two plain numbers by the number rule (exact, thousands commas, units, percent);
    anything else by math_answer (expressions, intervals, sets, ...)."""
    pb, gb = _last_boxed(pred_text), _last_boxed(str(gold_text))
    pred_text = pb if pb is not None else pred_text
    gold_text = gb if gb is not None else str(gold_text)
    if parse_number(pred_text) is not None and parse_number(gold_text) is not None:
        return _number_match(pred_text, gold_text)
    return math_answer.equivalent(pred_text, gold_text)


# Numbers joined by + - * / ^ (in any spelling) and nothing else: "80319 * 9011",
# "(3 + 4) x 2". A model that copies the question's sum has not answered it, though the
# math rule would evaluate the copy to the gold. One number in scientific notation
# ("3 \times 10^{8}") is a number, not a sum to do.
_ARITH_OP = r"(?:[-+*/^x×÷]|\\times|\\cdot|\\div)"
_UNDONE = re.compile(rf"[(\s]*-?\d[\d,.]*[)\s]*(?:{_ARITH_OP}[(\s]*-?\d[\d,.]*[)\s]*)+")
_SCIENTIFIC = re.compile(rf"\s*-?\d[\d.]*\s*(?:[*x×]|\\times|\\cdot)\s*10\s*\^\s*\{{?\s*-?\d+\s*\}}?\s*")


def _undone_arithmetic(s: str) -> bool:
    """True for an answer that is a sum of plain numbers still to be done (see _UNDONE).
    A lone fraction "3/4" and a lone number are answers: parse_number reads them."""
    s = s.strip().rstrip(".")
    return (parse_number(s) is None and _UNDONE.fullmatch(s) is not None
            and _SCIENTIFIC.fullmatch(s) is None)


def _wordy(s: str) -> bool:
    """Only words: no digits, no operators once LaTeX wrappers are gone."""
    t = math_answer.clean(s)[0]
    return bool(re.fullmatch(r"[A-Za-z][A-Za-z .,'-]*", t))


# --- dates -------------------------------------------------------------------------

_MONTHS = {m: i + 1 for i, m in enumerate(("january", "february", "march", "april", "may", "june", "july",
                                             "august", "september", "october", "november", "december"))}
_MONTHS.update({m[:3]: i for m, i in list(_MONTHS.items())})
_MONTHS["sept"] = 9
_MONTH = r"(" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + r")\.?"
_DAY = r"(\d{1,2})(?:st|nd|rd|th)?"
_DATE_FORMS = (
    (re.compile(rf"{_DAY} {_MONTH},? (\d{{1,4}})"), ("d", "m", "y")),    # 5 January 1964
    (re.compile(rf"{_MONTH} {_DAY},? (\d{{1,4}})"), ("m", "d", "y")),    # January 5, 1964
    (re.compile(rf"{_MONTH},? (\d{{3,4}})"), ("m", "y")),                # June 1941
    (re.compile(r"(\d{4})-(\d{1,2})-(\d{1,2})"), ("y", "m", "d")),     # 1964-01-05
)


def date_key(s: str) -> tuple | None:
    """(year, month, day or None) when the whole string is one date, else None. Numeric
    forms other than ISO ("04/05/18") are left alone: day and month order is ambiguous."""
    t = " ".join(str(s).lower().replace(",", " , ").replace(" ,", ",").split()).strip(" .")
    t = re.sub(r"^(?:on|the) ", "", t)
    for pattern, order in _DATE_FORMS:
        m = pattern.fullmatch(t)
        if m:
            got = dict(zip(order, m.groups()))
            month = _MONTHS[got["m"]] if not got["m"].isdigit() else int(got["m"])
            day = int(got["d"]) if "d" in got else None
            if not 1 <= month <= 12 or day is not None and not 1 <= day <= 31:
                return None
            return (int(got["y"]), month, day)
    return None


# --- game of 24 --------------------------------------------------------------------

def _g24_normalize(expr: str) -> str:
    """Map the ways models write arithmetic onto + - * / ( ) and digits."""
    t = str(expr)
    t = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"((\1)/(\2))", t)
    for a, b in (("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"), ("\\left", ""), ("\\right", ""),
                 ("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", ""), ("$", "")):
        t = t.replace(a, b)
    for a, b in (("×", "*"), ("∗", "*"), ("·", "*"), ("x", "*"), ("X", "*"), ("÷", "/"),
                 ("−", "-"), ("–", "-"), ("[", "("), ("]", ")"), ("{", "("), ("}", ")")):
        t = t.replace(a, b)
    return t.strip()


class _G24Parser:
    """Recursive descent over  expr := term (+|- term)* ; term := factor (*|/ factor)* ;
    factor := INT | ( expr ).  Binary operations only: the game has no unary minus.
    Values are Fractions, so 8/(3-8/3) is exactly 24, not 23.999999999999996."""

    def __init__(self, tokens):
        self.tokens, self.i, self.used = tokens, 0, []

    def peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self):
        tok = self.peek()
        self.i += 1
        return tok

    def expr(self):
        v = self.term()
        while self.peek() in ("+", "-"):
            op, w = self.take(), self.term()
            v = v + w if op == "+" else v - w
        return v

    def term(self):
        v = self.factor()
        while self.peek() in ("*", "/"):
            op, w = self.take(), self.factor()
            if op == "/" and w == 0:
                raise ZeroDivisionError
            v = v * w if op == "*" else v / w
        return v

    def factor(self):
        tok = self.take()
        if tok == "(":
            v = self.expr()
            if self.take() != ")":
                raise ValueError("missing )")
            return v
        if tok is not None and tok.isdigit():
            self.used.append(int(tok))
            return Fraction(int(tok))
        raise ValueError(f"unexpected token {tok!r}")


def check_game24(expr: str, numbers: list[int]) -> bool:
    """True iff expr uses each of the numbers exactly once (as a multiset) with
    + - * / and parentheses, and equals exactly 24. "expr = 24" and "24 = expr"
    are accepted. Anything else - other tokens, a number reused or left out,
    division by zero, a wrong value, absurdly long input - is False, never an error."""
    try:
        target = Counter(int(n) for n in numbers)
        t = _g24_normalize(expr).rstrip(" .")
        parts = [p.strip() for p in t.split("=")]
        if len(parts) > 1:
            # the claimed value must be 24; a chain "a = b = 24" is judged on its first part
            if parts[-1] == "24":
                t = parts[0]
            elif parts[0] == "24" and len(parts) == 2:
                t = parts[1]
            else:
                return False
        if len(t) > 200:  # a real answer is ~20 characters; this bounds the recursion too
            return False
        tokens = re.findall(r"\d+|[-+*/()]|\S", t)
        if not tokens or any(not (tok.isdigit() or tok in "+-*/()") for tok in tokens):
            return False
        parser = _G24Parser(tokens)
        value = parser.expr()
        if parser.peek() is not None:
            return False  # trailing tokens: "3*8 4"
        return Counter(parser.used) == target and value == 24
    except (ValueError, TypeError, ZeroDivisionError, RecursionError):
        return False


def game24_number_sets(gold) -> list[list[int]]:
    """The puzzle's numbers, from whatever the gold is: [4, 4, 6, 8], "4 4 6 8",
    "[4, 4, 6, 8]", ["4", "4", "6", "8"], or reference expressions like
    ["(1+1+1)×8"] (the numbers are the expression's integer literals)."""
    if isinstance(gold, (list, tuple)) and gold and all(
            isinstance(x, int) or (isinstance(x, str) and x.strip().isdigit()) for x in gold):
        return [[int(x) for x in gold]]
    aliases = gold if isinstance(gold, (list, tuple)) else [gold]
    sets = []
    for a in aliases:
        t = _g24_normalize(str(a))
        parts = [p.strip() for p in t.split("=")]
        if len(parts) > 1 and parts[-1] == "24":  # "(1+1+1)*8 = 24": the 24 is not a puzzle number
            t = parts[0]
        nums = [int(x) for x in re.findall(r"\d+", t)]
        if nums and nums not in sets:
            sets.append(nums)
    return sets


def _g24_candidates(text: str) -> list[str]:
    """The extracted answer itself, then arithmetic-looking runs inside it, last first
    ("So the expression is (1+1+1)×8, which is 24." -> "(1+1+1)×8")."""
    t = _g24_normalize(text)
    runs = re.findall(r"[\d\s+\-*/()=.]+", t)
    runs = [r.strip(" .=*/+-") for r in runs]  # parentheses stay; a dangling operator goes
    runs = [r for r in runs if len(re.findall(r"\d+", r)) >= 2 and re.search(r"[-+*/]", r)]
    return [text] + runs[::-1]


# --- multiple choice ---------------------------------------------------------------

_LETTERS = string.ascii_uppercase


def strip_option_labels(options: list[str]) -> list[str]:
    """["A. x", "B. y"] -> ["x", "y"], but only when every option carries the label
    of its own position, so that an option text like "A fever" is left alone."""
    out = []
    for i, opt in enumerate(options):
        m = re.match(r"^\s*\(?([A-Za-z])\s*[.):]\s*(.*)$", str(opt), re.DOTALL)
        if not m or m.group(1).upper() != _LETTERS[i % 26]:
            return [str(o).strip() for o in options]
        out.append(m.group(2).strip())
    return out


def _choice_letter(s: str, n: int | None) -> int | None:
    """The option index a string names by letter ("B", "(b)", "B.", "option B",
    "The answer is B", "C. Colorectal cancer"), or None. An uppercase letter may be
    followed by text; a lowercase one only stands alone, since "a" is an article."""
    t = s.replace("*", "").replace("$", "").strip()
    t = re.sub(r"\\text(?:bf)?\s*\{([^{}]*)\}", r"\1", t)
    key = r"^(?i:the\s+)?(?i:correct\s+)?(?i:option|choice|answer)\s*(?i:is\s*)?:?\s*"
    pats = [
        r"^\(?([A-Za-z])\)?[.:)]?$",                  # B  (B)  b.  b)
        key + r"\(?([A-Za-z])\)?(?:[.:),]|$)",          # option b   answer: (B).
        key + r"\(?([A-Z])\)?(?:\s|$)",                # The answer is B because ...
        r"^\(([A-Z])\)\s*\S",                          # (C) Colorectal cancer
        r"^([A-Z])[.:)]\s+\S",                          # C. Colorectal cancer
    ]
    for pat in pats:
        m = re.match(pat, t)
        if m:
            idx = _LETTERS.index(m.group(1).upper())
            if n is None or idx < n:
                return idx
    # "... so the correct answer is (C)." anywhere, last mention wins
    hits = re.findall(r"(?i:answer|option|choice)\s+(?i:is\s+)?(?i:option\s+)?\(?([A-Z])\)?(?=[\s.,:;)!]|$)", t)
    for letter in reversed(hits):
        idx = _LETTERS.index(letter)
        if n is None or idx < n:
            return idx
    return None


def _choice_index(s: str, options: list[str] | None) -> int | None:
    """Which option a string means: by letter first, then by the option's text
    (exact after normalisation, else the one option whose text it contains)."""
    if options is None:
        return _choice_letter(s, None)
    idx = _choice_letter(s, len(options))
    if idx is not None:
        return idx
    ns = normalize_text(s)
    norm = [normalize_text(o) for o in options]
    if ns in norm:
        return norm.index(ns)
    inside = [i for i, o in enumerate(norm) if o and re.search(rf"\b{re.escape(o)}\b", ns)]
    if len(inside) == 1:
        return inside[0]
    return None


# --- the reward ---------------------------------------------------------------------

def gold_aliases(gold) -> list[str]:
    """Any gold (a string, a number, a list of aliases, a stringified list
    "['a', 'b']") as a list of non-empty strings."""
    if isinstance(gold, str):
        t = gold.strip()
        if t.startswith("[") and t.endswith("]"):
            try:
                val = ast.literal_eval(t)  # literals only: safe on untrusted text
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                val = None
            if isinstance(val, (list, tuple)):
                return [str(v).strip() for v in val if str(v).strip()]
        return [t] if t else []
    if isinstance(gold, (list, tuple)):
        return [str(g).strip() for g in gold if g is not None and str(g).strip()]
    if gold is None:
        return []
    return [str(gold)]


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
        for cand in _g24_candidates(ext):
            for nums in game24_number_sets(gold):
                if check_game24(cand, nums):
                    return result(True, 1.0, cand)
        return result(False, 0.0)

    golds = gold_aliases(gold)
    if not golds or not ext:
        return result(False, 0.0)

    if kind == "choice":
        opts = strip_option_labels(options) if options else None
        p = _choice_index(ext, opts)
        if p is None:
            # "The answer is C because ..." extracts as "C because ...": look at the whole text
            p = _choice_letter(raw, len(opts) if opts else None)
        for g in golds:
            gi = _choice_index(g, opts) if opts else _choice_letter(g, None)
            if p is not None and gi is not None and p == gi:
                return result(True, 1.0)
        # no options to map onto: compare the texts themselves
        ok = any(normalize_text(ext) == normalize_text(g) for g in golds) if not opts else False
        return result(ok, 0.0)

    if kind == "number" and _undone_arithmetic(ext):
        return result(False, 0.0)
    if kind in ("number", "math"):
        if any(_math_match(ext, g) for g in golds):
            return result(True, 1.0)
        # words ("Yes", "\text{diverges}"): compare them as text
        ok = any(_wordy(ext) and _wordy(g) and normalize_text(ext) == normalize_text(g) for g in golds)
        return result(ok, 0.0)

    # text: the extracted answer, and also the whole response (a bare one-line
    # answer that happens to contain "Answer:" somewhere is still itself)
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
    f1 = max(token_f1(ext, g) for g in golds)
    return result(ok, f1)


def score_item(answer: str, gold: list[str], kind: str, options: list[str] | None = None,
               numbers: list[int] | None = None) -> dict:
    """R(o, q, y*) for one benchmark item (benchmarks.Item's fields): the reward of a
    trajectory and the verdict of an evaluation. A Game-of-24 item is scored against
    its puzzle numbers, so any valid expression counts, not only the reference one."""
    return score(answer, numbers if kind == "game24" and numbers else gold, kind, options)


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
    Every failure is "no verdict": judge() and judge_batch() return False for it and
    record why in self.last_reason (and the log); verdicts() returns None with the
    reason. A judge that cannot answer must not turn into a reward of 1, nor a crash.
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

    def _chat(self, prompt: str) -> tuple[bool | None, str]:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "temperature": 0, "max_tokens": 5}
        try:
            r = requests.post(f"{self.base_url}/chat/completions", headers=headers,
                              data=json.dumps(body), timeout=self.timeout)
        except requests.RequestException as e:
            return None, f"request failed: {type(e).__name__}: {e}"
        if r.status_code != 200:
            return None, f"HTTP {r.status_code}: {r.text[:200]!r}"
        try:
            reply = r.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as e:
            return None, f"malformed response ({type(e).__name__}): {r.text[:200]!r}"
        return self._parse(reply)

    def verdicts(self, items: list[tuple]) -> list[tuple[bool | None, str]]:
        """(verdict, reason) for many (question, prediction, gold); verdict None = the
        judge gave none. One generate() call for the local engine (it batches), one
        request each for an endpoint, max_workers of them in flight."""
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
                out = [(None, why)] * len(prompts)
            else:
                out = [self._parse(r) for r in replies]
        for verdict, reason in out:
            self.last_reason = reason
            if verdict is None:
                log.warning("LLM judge gave no verdict (counted as wrong): %s", reason)
        return out

    def judge(self, question: str, prediction: str, gold) -> bool:
        return self.judge_batch([(question, prediction, gold)])[0]

    def judge_batch(self, items: list[tuple]) -> list[bool]:
        """True / False per (question, prediction, gold); no verdict is False."""
        return [bool(v) for v, _ in self.verdicts(items)]

    def score(self, question: str, prediction: str, gold, kind: str,
              options: list[str] | None = None) -> dict:
        """Rules first, then this LLM (see Judge); adds "judge" and "judge_error"."""
        return Judge(self).score_batch([prediction], [_Row(question, gold, kind, options)])[0]


class _Row:
    """The fields of a benchmarks.Item that the judge reads (no import of benchmarks:
    benchmarks imports judge)."""

    def __init__(self, question, gold, kind, options=None, numbers=None):
        self.question, self.gold, self.kind, self.options, self.numbers = question, gold, kind, options, numbers


class Judge:
    """R(o, q, y*) as the config's judge section says: the rules, and with judge.llm an
    LLM for what the rules call wrong (never game24, where the rule is exact).

    Every verdict is score_item's dict plus "judge": who decided, "rule" (the rules
    said right, or were the only judge, or the LLM gave no verdict) or "llm" (the LLM
    said yes or no), and "judge_error": why the LLM gave no verdict ("" otherwise). A
    failed LLM call therefore leaves the rule's verdict, wrong: reward 0, never 1.
    """

    def __init__(self, llm: LLMJudge | None = None):
        self.llm = llm

    @classmethod
    def from_config(cls, jcfg: dict, engine=None) -> "Judge":
        """From config judge.*: off -> rules only; base_url -> that endpoint; an empty
        base_url -> `engine` (an agentflow.LLM, the frozen copy of the policy)."""
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
        numbers: a benchmarks.Item). The LLM sees all that the rules rejected at once."""
        out = []
        for answer, it in zip(answers, items):
            v = dict(score_item(answer, it.gold, it.kind, it.options, it.numbers))
            v.update(judge="rule", judge_error="")
            out.append(v)
        if self.llm is None:
            return out
        ask = [k for k, v in enumerate(out) if not v["correct"] and items[k].kind != "game24"]
        got = self.llm.verdicts([(items[k].question, answers[k], items[k].gold) for k in ask])
        for k, (verdict, reason) in zip(ask, got):
            if verdict is None:
                out[k]["judge_error"] = reason
            else:
                out[k]["judge"] = "llm"
                if verdict:
                    out[k].update(correct=True, f1=1.0)
        return out


def judge_counts(verdicts: list[dict]) -> dict:
    """How many verdicts each judge decided, and how many LLM calls gave no verdict
    (for metrics.jsonl and summary.json)."""
    return {"rule": sum(v.get("judge", "rule") == "rule" for v in verdicts),
            "llm": sum(v.get("judge") == "llm" for v in verdicts),
            "llm_failed": sum(bool(v.get("judge_error")) for v in verdicts)}


def engine_generate(llm, batch_size: int = 32):
    """generate(prompts) -> replies with the project's own engine (an agentflow.LLM),
    greedy. The verdict is one forced token, as the verifier's is: the likelier of the
    first tokens of "yes" and "no" (any casing), read back as the word. A 7B model
    nearly always complies anyway; a small one would otherwise ramble into "no verdict"."""
    from agentflow import SamplingParams  # here, not at the top: agentflow is above judge

    says = {}
    for word in ("no", "No", "NO", "yes", "Yes", "YES"):
        ids = llm.tok.encode(word, add_special_tokens=False)
        if ids:
            says[ids[0]] = word.lower()
    params = SamplingParams(temperature=0.0, max_new_tokens=1, first_tokens=tuple(sorted(says)))

    def generate(prompts: list[str]) -> list[str]:
        replies = []
        for s in range(0, len(prompts), batch_size):  # bounded memory for long prompts at 7B
            ids = [llm.chat_ids(JUDGE_SYSTEM, p) for p in prompts[s:s + batch_size]]
            replies += [says.get(out.ids[0], "") if out.ids else "" for out in llm.sample(ids, params, seed=0)]
        return replies
    return generate
