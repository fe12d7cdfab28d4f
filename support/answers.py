"""Reading answers: the parsers the judge's rules stand on.

judge.py decides R(o, q, y*) per answer kind; this file knows how answers are written:
where the answer sits in a generator's raw text (an <answer> tag, a \\boxed{}, an
"Answer:" line), SQuAD's text normalisation and token F1, exact numbers (thousands
commas, fractions, percent, units), dates written several ways, Game-of-24
expressions (parsed, never evaluated), option letters of multiple choice, and gold
answers given as strings, numbers or lists of aliases. Nothing here executes the text
it reads: regexes, Fraction and a small recursive-descent parser.
"""

import ast
import re
import string
import unicodedata
from collections import Counter
from fractions import Fraction

from support import math_answer

# The answer kinds the rules know (judge.score): each benchmark item names one.
KINDS = ("text", "number", "math", "choice", "game24")


# --- finding the answer in the generator's raw text ---------------------------

def last_boxed(text: str) -> str | None:
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
        boxed = last_boxed(inner)
        return (boxed if boxed is not None else inner).strip()
    boxed = last_boxed(text)
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
    boxed = last_boxed(t)
    if boxed is not None:
        t = boxed
    t = t.replace("\\$", "").replace("$", "").replace("\\%", "%")
    # delimiters, and LaTeX thin spaces (used as thousands separators)
    for a in ("\\(", "\\)", "\\[", "\\]", "\\left", "\\right", "\\displaystyle", "\\!", "\\,", "\\;", "\\:", "~"):
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

    Understands "1,234,567", "-0.5", "3/4", "2 1/2", "50%" (-> 50, see same_number
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


def same_number(pred_text: str, gold_text: str) -> bool:
    """Equal values, or a prediction written as a decimal that is the gold rounded at the
    precision it was written with (math_answer.rounds_to: "0.333" for 1/3, never "2270751.0"
    for 2270750)."""
    p, g = parse_number(pred_text), parse_number(gold_text)
    if p is None or g is None:
        return False
    unit = math_answer.written_unit(pred_text)
    preds, golds = [(p, unit)], {g}
    # "50%" against a gold of 0.5 or of 50: accept both readings of the percent sign
    if "%" in pred_text:
        preds.append((p / 100, unit and unit / 100))
    if "%" in str(gold_text):
        golds.add(g / 100)
    return any(a == b or math_answer.rounds_to(b, a, u) for a, u in preds for b in golds)


def same_math(pred_text: str, gold_text: str) -> bool:
    """Two plain numbers by the number rule (exact, thousands commas, units, percent);
    anything else by math_answer (expressions, intervals, sets, ...)."""
    pb, gb = last_boxed(pred_text), last_boxed(str(gold_text))
    pred_text = pb if pb is not None else pred_text
    gold_text = gb if gb is not None else str(gold_text)
    if parse_number(pred_text) is not None and parse_number(gold_text) is not None:
        return same_number(pred_text, gold_text)
    return math_answer.equivalent(pred_text, gold_text)


# Numbers joined by + - * / ^ (in any spelling) and nothing else: "80319 * 9011",
# "(3 + 4) x 2". A model that copies the question's sum has not answered it, though the
# math rule would evaluate the copy to the gold. One number in scientific notation
# ("3 \times 10^{8}") is a number, not a sum to do.
_ARITH_OP = r"(?:[-+*/^x×÷]|\\times|\\cdot|\\div)"
_UNDONE = re.compile(rf"[(\s]*-?\d[\d,.]*[)\s]*(?:{_ARITH_OP}[(\s]*-?\d[\d,.]*[)\s]*)+")
_SCIENTIFIC = re.compile(rf"\s*-?\d[\d.]*\s*(?:[*x×]|\\times|\\cdot)\s*10\s*\^\s*\{{?\s*-?\d+\s*\}}?\s*")


def undone_arithmetic(s: str) -> bool:
    """True for an answer that is a sum of plain numbers still to be done (see _UNDONE).
    A lone fraction "3/4" and a lone number are answers: parse_number reads them."""
    s = s.strip().rstrip(".")
    return (parse_number(s) is None and _UNDONE.fullmatch(s) is not None
            and _SCIENTIFIC.fullmatch(s) is None)


def words(s: str) -> str:
    """An answer that is only words once LaTeX wrappers are gone, normalised like any text
    ("\\text{Yes}" -> "yes"); "" when it has digits or operators."""
    t = math_answer.clean(s)[0]
    return normalize_text(t) if re.fullmatch(r"[A-Za-z][A-Za-z .,'-]*", t) else ""


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
                 ("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", ""), ("$", ""),
                 ("×", "*"), ("∗", "*"), ("·", "*"), ("x", "*"), ("X", "*"), ("÷", "/"),
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


def game24_candidates(text: str) -> list[str]:
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


def choice_letter(s: str, n: int | None) -> int | None:
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
    letters = [m.group(1) for m in (re.match(pat, t) for pat in pats) if m]
    # then "... so the correct answer is (C)." anywhere, last mention first
    anywhere = r"(?i:answer|option|choice)\s+(?i:is\s+)?(?i:option\s+)?\(?([A-Z])\)?(?=[\s.,:;)!]|$)"
    letters += reversed(re.findall(anywhere, t))
    for letter in letters:
        idx = _LETTERS.index(letter.upper())
        if n is None or idx < n:
            return idx
    return None


def choice_index(s: str, options: list[str] | None) -> int | None:
    """Which option a string means: by letter first, then by the option's text
    (exact after normalisation, else the one option whose text it contains)."""
    if options is None:
        return choice_letter(s, None)
    idx = choice_letter(s, len(options))
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


# --- gold answers ---------------------------------------------------------------------

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
