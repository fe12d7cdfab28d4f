"""Tests for math_answer.py: equivalence of LaTeX math answers, the rule behind the
reward on DeepMath-style questions.

Every rule gets a pair that must match and a near miss that must not: a lenient
judge pays the policy for wrong answers as surely as a strict one starves it.
"""

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from support.math_answer import clean, equivalent, parse  # noqa: E402


@pytest.mark.parametrize("pred, gold", [
    # fractions and LaTeX wrappers
    (r"\dfrac{1}{2}", "0.5"), (r"\frac12", "1/2"), (r"\tfrac{3}{4}", r"\frac{3}{4}"), (r"$\frac{3}{4}$", "0.75"),
    (r"-\frac{1}{2}", r"\frac{-1}{2}"), (r"\left(\frac{1}{2}\right)", "1/2"), (r"\displaystyle \frac{7}{3}", "7/3"),
    # roots: exact when they are rational, floating otherwise
    (r"2\sqrt{3}", r"\sqrt{12}"), (r"\frac{\sqrt{3}}{2}", r"\dfrac{\sqrt3}{2}"), (r"\sqrt{1089}", "33"),
    (r"\sqrt[3]{8}", "2"), (r"2^{1/2}", r"\sqrt{2}"), (r"(-8)^{1/3}", "-2"), (r"\dfrac{3\sqrt{3}}{4}", r"\frac{3}{4}\sqrt{3}"),
    (r"\sqrt{-1}", "i"), ("1+i", "i+1"),
    # pi, e, functions
    (r"\pi/4", r"\frac{\pi}{4}"), (r"\frac{\pi}{4}", r"\arctan 1"), (r"3\pi", r"3 \pi"), (r"\sin(\pi/6)", "1/2"),
    (r"e^{-1}", r"\frac{1}{e}"), (r"\ln 2", r"\log 2"), (r"\log_2 8", "3"), (r"e^{0}", "1"),
    (r"\frac{\pi^2}{6}", r"\dfrac{\pi^{2}}{6}"), (r"\sin^2 x", r"(\sin x)^2"),
    # combinatorics
    (r"\binom{5}{2}", "10"), (r"\dbinom{6}{3}", "20"), ("5!", "120"),
    # scientific notation, powers, percentages, degrees
    (r"3 \times 10^{8}", "300000000"), ("3e8", r"3\times10^8"), (r"10^{-3}", "0.001"), ("2^{10}", "1024"),
    (r"50\%", "0.5"), (r"50\%", "50"), (r"12.5\%", r"\frac{1}{8}"), ("90^\\circ", "90"), ("90°", r"\frac{\pi}{2}"),
    (r"45^{\circ}", r"\frac{\pi}{4}"), ("30 degrees", "30"),
    # a gold written as a rounded decimal takes an exact irrational answer
    (r"\sqrt{2}", "1.41"), (r"e^{-1}", "0.3679"), (r"\frac{\pi^2}{6}", "1.6449"),
    # a prediction written as a decimal: the value rounded at the places written, 3 significant digits at least
    ("1.41421356", r"\sqrt{2}"), ("0.3333333", "1/3"), ("1.41", r"\sqrt{2}"), ("0.333", "1/3"), ("-0.0500", "-1/20"),
    ("0.368", "0.3679"), ("1.23e-2", r"\frac{1}{81}"), (r"33.3\%", "1/3"),
    # variables: compared at fixed points of both signs
    ("2x+2", "2(x+1)"), (r"\frac{1}{2}x", "x/2"), (r"n(n+1)/2", r"\frac{n^2+n}{2}"), ("x^2", "|x|^2"),
    ("a_1 + a_2", "a_2+a_1"), (r"\alpha+1", r"1+\alpha"), ("x^2 + C", "C + x^2"), ("f(x) = x^2", "x^2"),
    ("y = 2x + 1", "1 + 2x"),
    # intervals, tuples, sets, unions
    (r"(-\infty, 2]", r"(-\infty,2]"), (r"\left[0, 1\right)", "[0,1)"), ("(2, 3)", "(2,3)"), ("(1, 2, 3)", "[1,2,3]"),
    (r"\{1, 2, 3\}", r"\{3,2,1\}"), ("x = 1 or x = 2", "1, 2"), (r"x = 1 \text{ or } x = 2", r"\{2, 1\}"),
    ("x=2", r"\{2\}"), (r"(1,2)\cup(3,4)", r"(3,4)\cup(1,2)"), (r"\emptyset", r"\{\}"), (r"1 \pm \sqrt{2}", r"1-\sqrt 2, 1+\sqrt2"),
    (r"x \in [1, 2]", "[1,2]"), (r"\mathbb{R}", r"(-\infty, \infty)"),
    # inequalities in one variable
    ("x > 2", r"(2, \infty)"), (r"x \geq 2", r"[2, \infty)"), (r"1 < x \le 3", "(1, 3]"), ("2 < x", r"(2,\infty)"),
    (r"x \leq -1", r"(-\infty, -1]"),
    # matrices (the bracket style is typography)
    (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", r"\begin{bmatrix}1&2\\3&4\end{bmatrix}"),
    # units and words around a value
    ("12 cm", "12"), (r"12\text{ cm}", "12"), (r"5 \text{ square units}", "5"), (r"\approx 3.14", "3.14"),
    # named objects: compared as cleaned LaTeX
    (r"\mathbb{Z}_2", r"\mathbb Z_{2}"), (r"\text{Yes}", "Yes"),
])
def test_equivalent(pred, gold):
    assert equivalent(pred, gold), (pred, gold, parse(pred), parse(gold))


@pytest.mark.parametrize("pred, gold", [
    ("1.42", r"\sqrt{2}"), ("0.3334", "1/3"),  # the value rounds otherwise at the places written
    ("0.33", "1/3"), ("0.05", "1/21"),  # 2 and 1 significant digits: too few to be the value
    ("0.37", "0.3679"),                 # it rounds the gold, but with 2 significant digits
    ("2270751.0", "2270750"), ("3.0000001", "3"),  # an integer gold is its own value, however large
    (r"\frac{\pi^2}{6}", "1.65"),       # rounds to 1.64, not 1.65
    (r"\frac{251}{1000}", "0.25"),      # rational: no rounding credit
    ("2x+1", "2(x+1)"), ("x", "|x|"), ("2", "2x"), ("-1", "1"), (r"-\infty", r"\infty"),
    (r"(-\infty, 2)", r"(-\infty,2]"), ("[2, 3]", "(2,3)"), ("(1, 2)", "(2, 1)"),  # brackets and order count
    (r"\{1, 2\}", r"\{1, 2, 3\}"), ("33 or 34", "33"), (r"1 + \sqrt{2}", r"1 \pm \sqrt{2}"),
    (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", r"\begin{pmatrix}1&2\\3&5\end{pmatrix}"),
    ("on", "no"),                       # words are not products of letters
    ("0", "0.0000001"), (r"\frac{1}{0}", "1"), ("x/0", "x/0"),
    (r"\sin^2 x + \cos^2 x", "1"),      # an identity across variables: the LLM judge's job
    ("x + C", "x + K"),
])
def test_not_equivalent(pred, gold):
    assert not equivalent(pred, gold), (pred, gold, parse(pred), parse(gold))


@pytest.mark.parametrize("hostile", ["__import__('os').system('echo hi')", "9" * 5000, "2^{99999999}",
                                     "(" * 3000 + "1" + ")" * 3000, "100000!", r"\binom{10^9}{5}",
                                     "10^{10^{10}}", "", None, r"\frac{", "}{", r"\sqrt[0]{2}"])
def test_hostile_input_is_false_fast(hostile):
    t = time.time()
    assert equivalent(hostile, "1") is False
    assert time.time() - t < 1.0


def test_clean_flags_degrees_and_percent():
    assert clean("90^\\circ") == ("90", {"degree": True, "percent": False})
    assert clean(r"$12\%$") == ("12", {"degree": False, "percent": True})
    assert clean(r"1{,}000") == ("1000", {"degree": False, "percent": False})
