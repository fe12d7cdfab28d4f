"""Are two math answers the same? The rule behind the reward on DeepMath-style questions.

Paper, section 2: the reward R(o, q, y*) asks whether the final answer o is
equivalent to the gold answer y*; the paper asks GPT-4o. For competition math
(DeepMath-103K in the training mix, AIME / AMC at test) most gold answers are
LaTeX: "\\dfrac{3\\sqrt{3}}{4}", "(-\\infty, 2]", "\\{1, 2\\}", "e^{-1}",
"90^\\circ", "3 \\times 10^{8}". This file decides equivalence by hand, without a
computer algebra system:

  1. clean the LaTeX: $...$, \\left / \\right, thin spaces, \\text{...}, \\dfrac,
     unicode symbols, trailing unit words, degree and percent signs;
  2. read the structure: a scalar expression, an ordered tuple (or interval: a pair
     with its two brackets), a set (\\{...\\}, or a bare list "1, 2" / "x = 1 or
     x = 2", order-free), a union of intervals, a matrix, an inequality in one
     variable (read as an interval), "x = ..." (the right-hand side), \\pm (two values);
  3. parse each scalar into a small expression tree (a recursive-descent parser:
     + - * / ^, implicit products "2\\sqrt{3}", \\frac, \\sqrt[n], \\binom, n!, |x|,
     \\pi, e, i, \\infty, sin ... arctan, ln, log, exp) and evaluate it: exactly (Fraction)
     while only rational operations occur, in complex floating point otherwise;
  4. compare: exact rationals must be equal, floating values within 1e-9 (their own
     rounding error); a number written as a decimal also matches a value it is the
     rounding of, at the precision it was written with (rounds_to: "0.333" or "1.414"
     for gold "1/3" or "\\sqrt{2}", never "2270751.0" for gold 2270750), and so does an
     irrational answer against a gold decimal ("\\sqrt{2}" for gold "1.41"); answers
     with variables are compared at three fixed points (a nonzero difference of two
     different expressions is almost never zero at all three).

Never evaluates anything of the model's but this tree: no eval(), bounded input
length, bounded exponents and factorials.

What it still cannot score (the LLM judge, judge.llm, takes these): answers that
differ by an algebraic rewriting that changes the variables ("x + C" against
"x + K"), identities that hold only on part of the domain (ln(x^2) against 2 ln x),
function names and sets written in words ("all real numbers", "the identity
map"), structures named rather than computed (\\mathbb{Z}_2 against
\\mathbb{Z}/2\\mathbb{Z}), inequalities in two variables, multi-letter products
without any operator ("xy" is compared as text), \\log read as the natural
logarithm (a base-10 reading loses), and a tuple against the same numbers written
as a bare list.
"""

import cmath
import math
import operator
import re
from fractions import Fraction

MAX_CHARS = 600          # a real final answer is far shorter; bounds the parser's work
MAX_EXPONENT = 4096      # exact integer powers beyond this go to floating point
MAX_FACTORIAL = 1000
REL_EXACT = 1e-9         # floating evaluation of an exact expression: rounding error only
# Significant digits a rounded decimal must show to count as the rounding of a value: with two,
# "2.3" would be 7/3 and "0.13" 1/8 (a 4% window); with one, "0" would be 0.004.
MIN_DIGITS = 3
# Points at which expressions with variables are compared: irrational-ish, of both signs,
# so that x and |x|, or x^2 and x^4, tell apart.
POINTS = (0.5772156649, -1.3247179572, 2.2360679775)


class _Fail(Exception):
    """The text is not a math expression this parser understands."""


# --- cleaning ---------------------------------------------------------------------

_UNICODE = (("\u2212", "-"), ("\u2013", "-"), ("×", "*"), ("·", "*"), ("⋅", "*"), ("÷", "/"),
            ("√", "\\sqrt"), ("π", "\\pi"), ("∞", "\\infty"), ("≤", "\\le "), ("≥", "\\ge "),
            ("∪", "\\cup "), ("∈", "\\in "), ("±", "\\pm "), ("∅", "\\emptyset "), ("°", "^\\circ"))
_SPACES = ("\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\quad", "\\qquad")
_WRAPPERS = r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}"
FUNCTIONS = ("arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "sin", "cos", "tan", "sec", "csc",
             "cot", "ln", "log", "exp", "sqrt")
_GREEK = ("alpha", "beta", "gamma", "delta", "epsilon", "varepsilon", "zeta", "eta", "theta", "vartheta",
          "kappa", "lambda", "mu", "nu", "xi", "rho", "sigma", "tau", "phi", "varphi", "chi", "psi", "omega")
_CONST_WORDS = {"pi": "pi", "infty": "inf", "inf": "inf", "infinity": "inf"}
_COMMANDS = ((r"\\[dtc]frac", r"\\frac"), (r"\\[dt]binom", r"\\binom"), (r"\\(?:times|cdot)", "*"), (r"\\div", "/"),
             (r"\\(?:leq?|leqslant)", " <= "), (r"\\(?:geq?|geqslant)", " >= "), (r"\\lt", " < "), (r"\\gt", " > "))


def clean(text: str) -> tuple[str, dict]:
    """LaTeX and decoration stripped from an answer; flags for what the decoration meant
    (degree: it was an angle in degrees, percent: a trailing percent sign)."""
    t = str(text).strip()
    flags = {"degree": False, "percent": False}
    for a, b in _UNICODE:
        t = t.replace(a, b)
    t = t.replace("$", "").replace("\\%", "%")
    for a in ("\\(", "\\)", "\\[", "\\]", "\\displaystyle", "\\limits"):
        t = t.replace(a, " ")
    t = re.sub(r"\\(?:left|right)\s*\.", " ", t)           # \left. is an invisible delimiter
    t = re.sub(r"\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])", "", t)
    t = t.replace("\\lvert", "|").replace("\\rvert", "|").replace("\\vert", "|")
    t = t.replace("\\\\", "\x00")  # a matrix row break, before "\\ " (a space) is read
    for a in _SPACES:
        t = t.replace(a, " ")
    t = t.replace("\x00", "\\\\")
    t = t.replace("{,}", "")                                  # 1{,}000: LaTeX thousands grouping
    for command, new in _COMMANDS:
        t = re.sub(command + r"(?![A-Za-z])", new, t)  # the whole command: \lt, not \ltimes
    t = re.sub(r"\\mathbb\s*\{?\s*R\s*\}?", r"\\reals ", t)
    t = re.sub(r"^\s*(?:\\approx|\\sim|≈)\s*", "", t)
    # degrees: 90^\circ, 90^{\circ}, 90\circ, "90 degrees"
    t, n = re.subn(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ", "", t)
    t, m = re.subn(r"\s*\\?(?:text\s*\{\s*)?degrees?\s*\}?\s*$", "", t)
    flags["degree"] = bool(n or m)
    # \text{or} / \text{and} separate alternatives; any other \text{...} is a word
    t = re.sub(r"\\text\s*\{\s*(or|and)\s*\}", r" \1 ", t)
    # a trailing \text{ cm} (or several) after a value is a unit
    if re.search(r"[\d}]\s*\\(?:text|mathrm|mbox)\s*\{\s*[A-Za-z]", t):
        t = re.sub(r"(?:\s*\\(?:text|mathrm|mbox)\s*\{\s*[A-Za-z][A-Za-z .\-/^0-9]*\})+\s*$", "", t)
    t = re.sub(_WRAPPERS, r" \1 ", t)
    t = t.strip()
    if t.endswith("."):
        t = t[:-1].strip()
    if t.endswith("%"):
        flags["percent"], t = True, t[:-1].strip()
    # bare trailing unit words after a number: "12 cm", "3.5 square units"
    m = re.match(r"^(.*[\d)}])\s+([A-Za-z]{2,}(?:\s+[A-Za-z]{2,}){0,2})$", t)
    if m and not any(w.lower() in FUNCTIONS or w.lower() in _CONST_WORDS or w.lower() in ("or", "and")
                     for w in m.group(2).split()):
        t = m.group(1).strip()
    return " ".join(t.split()), flags


# --- tokens and the expression tree ----------------------------------------------

_TOKEN = re.compile(r"\s*(?:(?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)|(?P<cmd>\\[A-Za-z]+)"
                    r"|(?P<word>[A-Za-z]+)|(?P<op>[-+*/^()\[\]{}!_|']))")


def _tokens(t: str) -> list[tuple[str, str]]:
    """(type, text) pairs; alphabetic runs are split into function names and letters.
    A run of two or more letters is a product of variables only where the answer has a
    digit or an operator too: a bare word ("on", "Yes") is not math."""
    mathy = bool(re.search(r"[\d+\-*/^=(){}\\]", t))
    out, i = [], 0
    while i < len(t):
        m = _TOKEN.match(t, i)
        if not m or m.end() == i:
            if t[i:].strip() == "":
                break
            raise _Fail(f"unexpected character {t[i]!r}")
        i = m.end()
        kind = m.lastgroup
        text = m.group(kind)
        if kind != "word":
            out.append((kind, text))
            continue
        w = text
        while w:
            low = w.lower()
            hit = next((f for f in FUNCTIONS + tuple(_CONST_WORDS) if low.startswith(f)), None)
            if hit and (hit == low or mathy):
                out.append(("cmd", "\\" + hit))
                w = w[len(hit):]
            elif len(w) == 1 or mathy:
                out.append(("var", w[0]))
                w = w[1:]
            else:
                raise _Fail(f"a word, not math: {w!r}")
    return out


_PAIRS = {"(": ")", "[": "]", "{": "}"}


class _Parser:
    """expr := term (+|- term)* ; term := unary ((*|/|implicit) unary)* ;
    unary := (+|-) unary | power ; power := postfix (^ unary)? ; postfix := primary !* ;
    primary := number | variable | constant | (expr) | {expr} | [expr] | |expr| | \\frac{}{}
             | \\sqrt[n]{} | \\binom{}{} | function argument.
    Nodes are tuples: ("num", Fraction, written_unit), ("var", name), ("const", name),
    ("neg", a), (op, a, b) for add sub mul div pow, ("fact", a), ("fn", name, arg),
    ("log", base, arg), ("root", n, a), ("binom", a, b), ("abs", a)."""

    def __init__(self, tokens):
        self.toks, self.i = tokens, 0

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else (None, None)

    def take(self):
        tok = self.peek()
        self.i += 1
        return tok

    def expect(self, text):
        if self.take()[1] != text:
            raise _Fail(f"expected {text!r}")

    def parse(self):
        node = self.expr()
        if self.i != len(self.toks):
            raise _Fail(f"unexpected {self.peek()[1]!r}")
        return node

    def expr(self):
        node = self.term()
        while self.peek()[1] in ("+", "-"):
            op = self.take()[1]
            node = ("add" if op == "+" else "sub", node, self.term())
        return node

    def _starts_primary(self):
        kind, text = self.peek()
        if kind in ("num", "var"):
            return True
        if kind == "cmd":
            return text not in ("\\cup", "\\in", "\\pm", "\\mp")
        return text in ("(", "{")

    def term(self):
        node = self.unary()
        while True:
            text = self.peek()[1]
            if text in ("*", "/"):
                self.take()
                node = ("mul" if text == "*" else "div", node, self.unary())
            elif self._starts_primary():
                if self.peek()[0] == "num" and self._ends_in_number(node):
                    raise _Fail("two numbers side by side")  # "1 000" or garbage, not a product
                node = ("mul", node, self.power())
            else:
                return node

    @staticmethod
    def _ends_in_number(node):
        while node[0] in ("mul", "add", "sub", "div"):
            node = node[2]
        return node[0] == "num"

    def unary(self):
        text = self.peek()[1]
        if text in ("-", "+"):
            self.take()
            node = self.unary()
            return ("neg", node) if text == "-" else node
        return self.power()

    def power(self):
        node = self.postfix()
        if self.peek()[1] == "^":
            self.take()
            node = ("pow", node, self.exponent())
        return node

    def exponent(self):
        if self.peek()[1] == "{":
            return self.group()
        if self.peek()[1] in ("-", "+"):
            return self.unary()
        return self.postfix()

    def postfix(self):
        node = self.primary()
        while self.peek()[1] in ("!", "'"):
            if self.take()[1] == "'":
                raise _Fail("derivative marks are not values")
            node = ("fact", node)
        return node

    def group(self):
        """{...} or a single primary (LaTeX arguments)."""
        if self.peek()[1] == "{":
            self.take()
            node = self.expr()
            self.expect("}")
            return node
        return self.postfix()

    def _digit_arg(self):
        """\\frac12, \\sqrt2: a brace-less LaTeX argument is one character."""
        kind, text = self.peek()
        if kind == "num" and len(text) > 1 and text.isdigit():
            self.toks[self.i] = ("num", text[1:])
            return ("num", Fraction(int(text[0])), None)
        return self.group()

    def primary(self):
        kind, text = self.take()
        if kind == "num":
            return ("num", Fraction(text), written_unit(text))
        if kind == "var":
            if self.peek()[1] == "_":  # x_1, a_{n}: one variable's name
                self.take()
                sub = self.take()[1]
                if sub == "{":
                    parts = []
                    while self.peek()[1] not in ("}", None):
                        parts.append(self.take()[1])
                    self.expect("}")
                    sub = "".join(parts)
                return ("var", f"{text}_{sub}")
            return ("var", text)
        if text in _PAIRS:
            node = self.expr()
            self.expect(_PAIRS[text])
            return node
        if text == "|":
            node = self.expr()
            self.expect("|")
            return ("abs", node)
        if kind != "cmd":
            raise _Fail(f"unexpected {text!r}")
        name = text[1:]
        if name in _CONST_WORDS:
            return ("const", _CONST_WORDS[name])
        if name in _GREEK:
            return ("var", name)
        if name == "frac":
            num = self._digit_arg()
            return ("div", num, self._digit_arg())
        if name == "binom":
            return ("binom", self.group(), self.group())
        if name == "sqrt":
            n = ("num", Fraction(2), None)
            if self.peek()[1] == "[":
                self.take()
                n = self.expr()
                self.expect("]")
            return ("root", n, self._fn_arg(digit=True))
        if name == "log" and self.peek()[1] == "_":
            self.take()
            base = self._digit_arg()
            return ("log", base, self._fn_arg())
        if name in FUNCTIONS:
            power = None
            if self.peek()[1] == "^":  # \sin^2 x = (\sin x)^2
                self.take()
                power = self.exponent()
            node = ("fn", name, self._fn_arg())
            return ("pow", node, power) if power is not None else node
        raise _Fail(f"unknown command {text!r}")

    def _fn_arg(self, digit=False):
        if self.peek()[1] in ("(", "{", "["):
            return self.primary()
        return self._digit_arg() if digit else self.power()


def parse_expr(text: str):
    """The expression tree of one scalar, or raise _Fail."""
    toks = _tokens(text)
    if not toks:
        raise _Fail("empty")
    try:
        return _Parser(toks).parse()
    except RecursionError:
        raise _Fail("nested too deeply") from None


def variables(node) -> set[str]:
    if node[0] == "var":
        return {node[1]}
    return set().union(*(variables(c) for c in node[1:] if isinstance(c, tuple)))


def _literal_unit(node) -> Fraction | None:
    """The written_unit of a tree that is one number literal ("-0.25" -> 1/100), else None."""
    node = node[1] if node[0] == "neg" else node
    return node[2] if node[0] == "num" else None


# --- evaluation ---------------------------------------------------------------------

def _exact_root(x: Fraction, n: int):
    """x^(1/n) as a Fraction when it is one (sqrt(4/9) = 2/3), else None."""
    if n <= 0 or x < 0 and n % 2 == 0:
        return None
    sign = -1 if x < 0 else 1
    out = []
    for part in (abs(x.numerator), x.denominator):
        r = round(part ** (1.0 / n)) if part < 2 ** 1000 else None
        if r is None:
            return None
        hit = next((c for c in (r - 1, r, r + 1) if c >= 0 and c ** n == part), None)
        if hit is None:
            return None
        out.append(hit)
    return sign * Fraction(out[0], out[1])


def _pow(a, b):
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if b.denominator == 1 and abs(b.numerator) <= MAX_EXPONENT:
            bits = max(a.numerator.bit_length(), a.denominator.bit_length())
            if bits * abs(b.numerator) <= 200_000:
                if a == 0 and b < 0:
                    raise ZeroDivisionError
                return a ** b.numerator
        elif b.denominator <= 64 and abs(b.numerator) <= MAX_EXPONENT:
            root = _exact_root(a, b.denominator)
            if root is not None:
                return _pow(root, Fraction(b.numerator))
    a, b = complex(a), complex(b)
    if a == 0:
        if b.real > 0:
            return Fraction(0)
        raise ZeroDivisionError
    if a.imag == 0 and a.real > 0 and b.imag == 0:
        return complex(a.real ** b.real)
    return a ** b


_FN = {"sin": cmath.sin, "cos": cmath.cos, "tan": cmath.tan, "arcsin": cmath.asin, "arccos": cmath.acos,
       "arctan": cmath.atan, "sinh": cmath.sinh, "cosh": cmath.cosh, "tanh": cmath.tanh,
       "sec": lambda z: 1 / cmath.cos(z), "csc": lambda z: 1 / cmath.sin(z), "cot": lambda z: 1 / cmath.tan(z),
       "ln": cmath.log, "log": cmath.log, "exp": cmath.exp}
_ARITH = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}


def evaluate(node, env: dict | None = None):
    """The value of a tree: a Fraction while every step is rational, else a complex."""
    env = env or {}
    op = node[0]
    if op == "num":
        return node[1]
    if op == "var":
        if node[1] == "e":
            return complex(math.e)
        if node[1] == "i":
            return 1j
        if node[1] not in env:
            raise _Fail(f"free variable {node[1]}")
        return complex(env[node[1]])
    if op == "const":
        return complex(math.pi) if node[1] == "pi" else complex(math.inf)
    if op == "neg":
        return -evaluate(node[1], env)
    if op in _ARITH:
        a, b = evaluate(node[1], env), evaluate(node[2], env)
        if not (isinstance(a, Fraction) and isinstance(b, Fraction)):
            a, b = complex(a), complex(b)
        if op == "div" and b == 0:
            raise ZeroDivisionError
        return _ARITH[op](a, b)
    if op == "pow":
        if node[1] == ("var", "e"):  # e^x: exact exp, and e^0 = 1 exactly
            x = evaluate(node[2], env)
            return Fraction(1) if x == 0 else cmath.exp(complex(x))
        return _pow(evaluate(node[1], env), evaluate(node[2], env))
    if op == "root":
        n = evaluate(node[1], env)
        if not isinstance(n, Fraction) or n == 0:
            n = complex(n)
            if n == 0:
                raise ZeroDivisionError
        return _pow(evaluate(node[2], env), 1 / n)
    if op == "fact":
        x = evaluate(node[1], env)
        if not (isinstance(x, Fraction) and x.denominator == 1 and 0 <= x <= MAX_FACTORIAL):
            raise _Fail("factorial of a non-integer or a huge number")
        return Fraction(math.factorial(int(x)))
    if op == "binom":
        n, k = evaluate(node[1], env), evaluate(node[2], env)
        if not all(isinstance(v, Fraction) and v.denominator == 1 and 0 <= v <= 10_000 for v in (n, k)):
            raise _Fail("binomial of non-integers")
        return Fraction(math.comb(int(n), int(k)))
    if op == "abs":
        x = evaluate(node[1], env)
        return abs(x) if isinstance(x, Fraction) else complex(abs(x))
    if op == "fn":
        x = evaluate(node[2], env)
        if x == 0 and node[1] in ("sin", "tan", "arcsin", "arctan", "sinh", "tanh"):
            return Fraction(0)
        if x == 0 and node[1] in ("cos", "cosh", "exp"):
            return Fraction(1)
        if x == 1 and node[1] in ("ln", "log"):
            return Fraction(0)
        return _FN[node[1]](complex(x))
    if op == "log":
        base, x = evaluate(node[1], env), evaluate(node[2], env)
        if isinstance(base, Fraction) and isinstance(x, Fraction) and base > 1 and x > 0:
            # log_2 8 = 3 exactly: try small integer answers first
            for k in range(-64, 65):
                if _pow(base, Fraction(k)) == x:
                    return Fraction(k)
        lb = cmath.log(complex(base))
        if lb == 0:
            raise ZeroDivisionError
        return cmath.log(complex(x)) / lb
    raise _Fail(f"unknown node {op}")


# --- structure ------------------------------------------------------------------------

_OPEN, _CLOSE = "([{", ")]}"


def _depth_scan(t: str):
    """Yield (index, depth before it, bracket or char) along t; \\{ and \\} count as one
    bracket each, like ( [ { and ) ] }."""
    depth, i = 0, 0
    while i < len(t):
        two = t[i:i + 2]
        if two in ("\\{", "\\}"):
            yield i, depth, two
            depth += 1 if two == "\\{" else -1
            i += 2
            continue
        ch = t[i]
        yield i, depth, ch
        if ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
        i += 1


def split_top(t: str, seps) -> list[str]:
    """Split at separators that sit outside every bracket (intervals mix ( and ], so any
    opener counts against any closer)."""
    parts, start, i = [], 0, 0
    top = {idx for idx, depth, _ in _depth_scan(t) if depth == 0}
    while i < len(t):
        hit = next((s for s in seps if i in top and t.startswith(s, i)
                    and not (s.isalpha() and (i > 0 and t[i - 1].isalnum()
                                              or i + len(s) < len(t) and t[i + len(s)].isalnum()))), None)
        if hit:
            parts.append(t[start:i])
            i += len(hit)
            start = i
        else:
            i += 1
    parts.append(t[start:])
    return [p.strip() for p in parts]


def _wrapped(t: str, opens: str, closes: str) -> bool:
    """t is one bracket pair around everything: "(1, 2]" yes, "(1)(2)" no."""
    if len(t) < 2 or t[0] not in opens or t[-1] not in closes:
        return False
    return all(idx == 0 or depth != 0 for idx, depth, _ in _depth_scan(t))


_REL = re.compile(r"\s*(<=|>=|<|>)\s*")
_LHS = re.compile(r"^\s*(?:[A-Za-z](?:_\{?\w+\}?)?|\\[A-Za-z]+)(?:\s*\([^()]*\))?\s*=(?!=)\s*")


def _is_var(t: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z](?:_\{?\w+\}?)?|\\(?:" + "|".join(_GREEK) + ")", t.strip()))


def structure(text: str, flags: dict):
    """The answer as nested tuples:
    ("scalar", tree, flags) | ("tuple", items, open, close) | ("set", items) | ("matrix", rows)."""
    t = text.strip()
    if not t:
        raise _Fail("empty")
    if t in ("\\emptyset", "\\varnothing", "\\{\\}", "\\{ \\}"):
        return ("set", [])
    if t == "\\reals":
        return _interval("(", "-\\infty", "\\infty", ")", flags)
    m = re.fullmatch(r"\\begin\{([pbBvV]?matrix)\}(.*)\\end\{\1\}", t, re.DOTALL)
    if m:
        rows = [r for r in re.split(r"\\\\", m.group(2)) if r.strip()]
        return ("matrix", [[structure(c, flags) for c in r.split("&")] for r in rows])
    parts = split_top(t, ("\\cup",))
    if len(parts) > 1:
        items = [structure(p, flags) for p in parts]
        if not all(x[0] == "tuple" and len(x[1]) == 2 for x in items):
            raise _Fail("a union of things that are not intervals")
        return ("set", items)
    t = re.sub(r"^\s*[A-Za-z]\s*\\in\s+", "", t)  # x \in (1, 2)
    # alternatives: "1, 2", "x = 1 or x = 2", "1; 2"
    parts = split_top(t, (",", ";", "or", "and"))
    if len(parts) > 1 and not _wrapped(t, "([", ")]"):
        return ("set", [structure(p, flags) for p in parts])
    if t.startswith("\\{") and t.endswith("\\}") and _wrapped(t, "\\", "}"):  # one \{ ... \} around it all
        inner = t[2:-2].strip()
        return ("set", [structure(p, flags) for p in split_top(inner, (",", ";"))] if inner else [])
    if _wrapped(t, "([", ")]"):
        items = split_top(t[1:-1], (",",))
        if len(items) > 1:
            return ("tuple", [structure(p, flags) for p in items], t[0], t[-1])
    # inequalities in one variable: intervals
    pieces = _REL.split(t)
    if len(pieces) == 3:
        a, rel, b = pieces
        if _is_var(a) != _is_var(b):
            if _is_var(b):  # 2 < x  ->  x > 2
                a, b, rel = b, a, {"<": ">", ">": "<", "<=": ">=", ">=": "<="}[rel]
            if rel in ("<", "<="):
                return _interval("(", "-\\infty", b, ")" if rel == "<" else "]", flags)
            return _interval("(" if rel == ">" else "[", b, "\\infty", ")", flags)
    if len(pieces) == 5 and _is_var(pieces[2]) and not _is_var(pieces[0]) and not _is_var(pieces[4]):
        lo, r1, _, r2, hi = pieces
        if r1 in ("<", "<=") and r2 in ("<", "<="):
            return _interval("(" if r1 == "<" else "[", lo, hi, ")" if r2 == "<" else "]", flags)
        if r1 in (">", ">=") and r2 in (">", ">="):
            return _interval("(" if r2 == ">" else "[", hi, lo, ")" if r1 == ">" else "]", flags)
    if len(pieces) > 1:
        raise _Fail("an inequality this reader does not know")
    # "x = 5", "f(x) = 2x": the right-hand side
    stripped = _LHS.sub("", t, count=1)
    if stripped != t:
        return structure(stripped, flags)
    if "=" in t:
        return structure(t.rsplit("=", 1)[1], flags)
    if "\\pm" in t or "\\mp" in t:  # 1 \pm \sqrt{2}: both values, as a set
        i = t.replace("\\mp", "\\pm").index("\\pm")
        return ("set", [structure(t[:i] + "+" + t[i + 3:], flags), structure(t[:i] + "-" + t[i + 3:], flags)])
    tree = parse_expr(t)
    return ("scalar", tree, dict(flags, unit=_literal_unit(tree)))


def _interval(lo_br, lo, hi, hi_br, flags):
    return ("tuple", [structure(lo, flags), structure(hi, flags)], lo_br, hi_br)


def parse(text: str):
    """The structure of an answer, or None when it is not math this reader understands."""
    if text is None or len(str(text)) > MAX_CHARS:
        return None
    t, flags = clean(text)
    try:
        return structure(t, flags)
    except (_Fail, ValueError, ZeroDivisionError, OverflowError, RecursionError, IndexError):
        return None


# --- comparison ----------------------------------------------------------------------

def written_unit(text: str) -> Fraction | None:
    """One in the last place of the first number in text written with a decimal point or an
    exponent ("0.333" -> 1/1000, "2.50 km" -> 1/100, "1.5e3" -> 100); None when there is none:
    an integer or a fraction is exact as written, not rounded."""
    m = re.search(r"\d*\.(\d+)(?:[eE]([-+]?\d+))?|\d+[eE]([-+]?\d+)", str(text))
    if not m:
        return None
    return Fraction(10) ** (int(m.group(2) or m.group(3) or 0) - len(m.group(1) or ""))


def rounds_to(exact, written: Fraction, unit: Fraction | None) -> bool:
    """Is `written`, a decimal written to `unit` (written_unit), the value `exact` rounded there?
    Never for an integer `exact`: an integer gold is its own value however large ("2270751.0" is
    not 2270750 rounded, and a relative tolerance would say it is); and only with MIN_DIGITS
    significant digits written ("0.00" is not 0.004)."""
    if unit is None or isinstance(exact, Fraction) and exact.denominator == 1:
        return False
    return abs(written) >= 10 ** (MIN_DIGITS - 1) * unit and abs(written - exact) <= unit / 2


def _values(node, flags, env):
    """(value, the unit it was written to) and the pairs the decoration also allows: v/100 for
    a percent (degrees are _same_scalar's), or None where the tree has no value at this point."""
    try:
        v = evaluate(node, env)
    except (_Fail, ZeroDivisionError, OverflowError, ValueError):
        return None
    out = [(v, flags["unit"])]
    if flags.get("percent"):
        unit = flags["unit"] and flags["unit"] / 100
        out.append((v / 100 if isinstance(v, Fraction) else complex(v) / 100, unit))
    return out


def _close(a, b) -> bool:
    """Prediction value a against gold value b, each a (value, written unit) pair."""
    (a, a_unit), (b, b_unit) = a, b
    # an exact rational prediction is no rounding of a gold decimal: "\\frac{251}{1000}" is not "0.25"
    if rounds_to(b, a, a_unit) or not isinstance(a, Fraction) and rounds_to(a, b, b_unit):
        return True
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a == b
    a, b = complex(a), complex(b)
    if any(math.isinf(x) or math.isnan(x) for x in (a.real, a.imag, b.real, b.imag)):
        return a == b
    diff = abs(a - b)
    return diff <= REL_EXACT * max(abs(a), abs(b)) or diff <= 1e-12


def _same_scalar(p, g) -> bool:
    (_, pt, pf), (_, gt, gf) = p, g
    vs = variables(pt) - {"e", "i"}
    if vs != variables(gt) - {"e", "i"}:
        return False
    envs = [{}] if not vs else [{v: x + 0.1 * j for j, v in enumerate(sorted(vs))} for x in POINTS]
    agree = 0
    for env in envs:
        pv, gv = _values(pt, pf, env), _values(gt, gf, env)
        if pv is None or gv is None:
            if pv is None and gv is None and vs:
                continue  # both undefined at this point: no evidence either way
            return False
        if pf["degree"] != gf["degree"]:  # 90^\circ against \frac{\pi}{2}, or against 90
            deg, other = (pv, gv) if pf["degree"] else (gv, pv)
            deg = deg + [(complex(x) * math.pi / 180, None) for x, _ in deg]
            pv, gv = (deg, other) if pf["degree"] else (other, deg)
        if not any(_close(a, b) for a in pv for b in gv):
            return False
        agree += 1
    return agree >= (1 if not vs else 2)


def same(p, g) -> bool:
    """Structural equality with scalar values compared as above."""
    if p is None or g is None:
        return False
    if p[0] == "set" and len(p[1]) == 1 and g[0] != "set":
        return same(p[1][0], g)
    if g[0] == "set" and len(g[1]) == 1 and p[0] != "set":
        return same(p, g[1][0])
    if p[0] != g[0]:
        return False
    if p[0] == "scalar":
        return _same_scalar(p, g)
    if p[0] == "tuple":
        if len(p[1]) != len(g[1]):
            return False
        if len(p[1]) == 2 and (p[2], p[3]) != (g[2], g[3]):
            return False  # (1, 2] is not [1, 2]
        return all(same(a, b) for a, b in zip(p[1], g[1]))
    if p[0] == "matrix":
        return (len(p[1]) == len(g[1]) and all(len(r) == len(s) and all(same(a, b) for a, b in zip(r, s))
                                              for r, s in zip(p[1], g[1])))
    if p[0] == "set":
        if len(p[1]) != len(g[1]) or len(p[1]) > 64:
            return False
        left = list(g[1])
        for a in p[1]:  # greedy matching; elements of one answer are distinct in practice
            hit = next((k for k, b in enumerate(left) if same(a, b)), None)
            if hit is None:
                return False
            left.pop(hit)
        return True
    return False


def canonical(text: str) -> str:
    """A LaTeX string with the spelling differences removed, for the last-resort text
    comparison (\\mathbb{Z}_2 == \\mathbb Z_{2})."""
    t, _ = clean(text)
    t = re.sub(r"\s+", "", t)
    t = re.sub(r"_\{(\w)\}", r"_\1", t)
    t = re.sub(r"\^\{(\w)\}", r"^\1", t)
    t = re.sub(r"\\mathbb\{?(\w)\}?", r"\\mathbb\1", t)
    return t


def equivalent(pred: str, gold: str) -> bool:
    """True when the prediction is the same math answer as the gold (see the module
    docstring for what counts)."""
    if pred is None or gold is None:
        return False
    p, g = parse(pred), parse(gold)
    if p is not None and g is not None:
        return same(p, g)
    return bool(canonical(pred)) and canonical(pred) == canonical(gold)
