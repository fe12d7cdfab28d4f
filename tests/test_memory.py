"""Memory: deterministic, bounded, readable; one per trajectory."""

from memory import Memory
from support.text import cut


def filled(budget=1200, result_chars=400) -> Memory:
    m = Memory(budget_chars=budget, result_chars=result_chars)
    m.add("multiply the numbers", "Python_Coder", "print(48213 * 9127)", "440040051")
    m.add("find the founding year", "Local_Search", "Velmora founded", "Velmora: founded in 1843. " * 40)
    m.add("answer", "", "", "", error="planner named no known tool")
    return m


def test_rendering_is_deterministic_and_readable():
    a, b = filled().render(), filled().render()
    assert a == b and a.encode() == b.encode()
    assert "Turn 1: Python_Coder - multiply the numbers" in a
    assert "Command: print(48213 * 9127)" in a and "Result: 440040051" in a
    assert "Error: planner named no known tool" in a
    assert "{" not in a and "'tool'" not in a  # not a dict repr


def test_results_are_cut_with_a_visible_marker():
    m = filled(result_chars=100)
    rec = m.records[1]
    assert len(rec.result) <= 100 and "...[cut " in rec.result
    assert rec.result.startswith("Velmora: founded in 1843.")


def test_budget_is_respected_and_oldest_turns_go_first():
    for budget in (80, 200, 400, 700, 5000):
        text = filled(budget=budget).render()
        assert len(text) <= budget
    text = filled(budget=500).render()
    assert text.startswith("[turns 1-") and "Turn 3" in text and "Turn 1:" not in text


def test_each_trajectory_has_its_own_memory():
    a, b = Memory(1200, 400), Memory(1200, 400)
    a.add("x", "Base_Generator", "q", "r")
    assert b.records == [] and b.render().startswith("(empty")
    assert a.records[0].turn == 1


def test_cut():
    assert cut("short", 10) == "short"
    s = cut("x" * 100, 30)
    assert s == "x" * 12 + "...[cut 88 chars]"  # the marker counts what was really removed
    assert len(cut("y" * 1000, 50)) <= 50
